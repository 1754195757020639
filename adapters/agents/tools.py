"""Tools of the built-in OpenAI-compatible runtime (SCHEMAS), acting in the turn's sandbox.

``terminal`` runs ``sh -c`` through ``Sandbox.exec``; on a local sandbox in the
turn's jail and under the agents' guard, so what it starts (``setsid`` too) ends
with it. ``browser_screenshot`` drives headless Chromium whose every connection
passes the egress guard (:mod:`adapters.agents.egress`). A marked file
(``send_file``, every screenshot) comes back to the model as its ``MEDIA:<path>``
tag and the runtime adds it to the reply; screenshots are delivered from their
blob (:attr:`Toolbox.stored`, filled here, never from an agent's text). A tool's
failure is a result starting with ``error:``; the turn goes on.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from adapters.defaults import CHROMIUM_PATH
from adapters.agents.bridge import GUARD
from adapters.agents.egress import ALLOW_SETTING, EgressPolicy, EgressProxy, Refusal
from adapters.agents.jail import Jail, Network
from adapters.errors import CourierError
from adapters.sandboxes.base import Sandbox, check_lexical
from storage import prefixes
from storage.spill import SpillConfig, spill_if_needed

__all__ = ["CHROMIUM_ARGS", "EGRESS_ARGS", "ToolResult", "Toolbox", "media_tag", "take_screenshot"]

log = logging.getLogger(__name__)

TERMINAL_DEFAULT_TIMEOUT_S = 60.0
#: the local exec's own timeout, past the guard's deadline (the guard kills first, and cleans up)
GUARD_BACKSTOP_S = 5.0
TERMINAL_MAX_TIMEOUT_S = 600.0
#: bytes kept per output stream of one command (before the spill cap applies)
TERMINAL_MAX_OUTPUT_BYTES = 1024 * 1024
READ_MAX_BYTES = 1024 * 1024
WRITE_MAX_CHARS = 10 * 1000 * 1000
SCREENSHOT_TIMEOUT_S = 45.0
SCREENSHOT_VIEWPORT = {"width": 1280, "height": 800}
SCREENSHOT_MAX_BYTES = 20 * 1000 * 1000

CHROMIUM_ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class ToolResult:
    text: str
    ok: bool = True


def media_tag(path: str) -> str:
    """`MEDIA:<path>`, quoted when the path holds whitespace or quotes."""
    if not re.search(r"[\s\"'`]", path):
        return f"MEDIA:{path}"
    if '"' not in path:
        return f'MEDIA:"{path}"'
    return f"MEDIA:`{path}`"


def _schema(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required, "additionalProperties": False},
    }}


SCHEMAS: list[dict] = [
    _schema("terminal", "Run a shell command (sh -c) in the working directory of your sandbox. "
            "Returns stdout, stderr and the exit code; long output is truncated to a preview.",
            {"command": {"type": "string", "description": "the shell command"},
             "timeout_s": {"type": "number", "description": f"seconds before it is killed "
                           f"(default {TERMINAL_DEFAULT_TIMEOUT_S:g}, at most {TERMINAL_MAX_TIMEOUT_S:g})"}},
            ["command"]),
    _schema("read_file", "Read a text file from your sandbox (absolute, or relative to the working directory). "
            "offset and limit read a range of lines (a long output saved to a file is read this way).",
            {"path": {"type": "string"},
             "offset": {"type": "integer", "description": "first line to read, from 1 (default 1)"},
             "limit": {"type": "integer", "description": "how many lines (default: to the end)"}}, ["path"]),
    _schema("write_file", "Write text to a file in your sandbox, replacing it; parent directories are made.",
            {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
    _schema("browser_screenshot", "Take a PNG screenshot of a web page (http or https) in a headless browser. "
            "The screenshot is sent to the chat with your reply; returns its MEDIA tag.",
            {"url": {"type": "string"},
             "full_page": {"type": "boolean", "description": "the whole scrollable page (default: the viewport)"}},
            ["url"]),
    _schema("send_file", "Send a file from your sandbox to the chat with your reply; returns its MEDIA tag.",
            {"path": {"type": "string"}}, ["path"]),
]


@dataclass
class Toolbox:
    """The tools of one turn. `marked` lists the paths to deliver, in order;
    `stored` maps a screenshot's sandbox path to its blob (key, name, size, sha256)."""

    sandbox: Sandbox
    workdir: str
    store: Any
    job_id: str
    spill: SpillConfig = field(default_factory=SpillConfig)
    chromium_path: str = CHROMIUM_PATH
    #: destinations the browser may reach even though they are not public (COURIER_BROWSER_ALLOWED_HOSTS)
    browser_allowed_hosts: tuple[str, ...] = ()
    #: monotonic deadline of the turn (tools never run past it)
    deadline: float | None = None
    #: puts a spilled output where this turn's agent can read it (storage.spill.spill_if_needed's `place`)
    place: Callable[[str], str] | None = None
    #: the turn's namespace sandbox on this host (a local sandbox): terminal commands run in it
    jail: Jail | None = None
    #: the network of a terminal command in the sandbox: "none" or "proxy"
    tool_network: Network = "none"
    marked: list[str] = field(default_factory=list)
    stored: dict[str, dict] = field(default_factory=dict)
    schemas = SCHEMAS  # not a field: no annotation

    def call(self, name: str, args: Any) -> ToolResult:
        """Run one tool call; never raises (a failure is an `error:` result)."""
        fn: Callable[..., ToolResult] | None = getattr(self, f"_tool_{name}", None) if name in _NAMES else None
        if fn is None:
            return ToolResult(f"error: unknown tool {name!r}; tools: {', '.join(sorted(_NAMES))}", ok=False)
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                return ToolResult("error: the arguments are not valid JSON", ok=False)
        if not isinstance(args, dict):
            return ToolResult("error: the arguments must be a JSON object", ok=False)
        try:
            return fn(**args)
        except TypeError as exc:
            return ToolResult(f"error: bad arguments for {name}: {exc}", ok=False)
        except CourierError as exc:
            return ToolResult(f"error: {exc.reason}", ok=False)
        except Exception as exc:  # noqa: BLE001 - the model sees the failure, the turn goes on
            log.exception("tool %s failed (job %s)", name, self.job_id)
            return ToolResult(f"error: {name} failed: {type(exc).__name__}: {exc}"[:500], ok=False)

    def _path(self, path: Any) -> str:
        if not isinstance(path, str) or not path.strip():
            raise ToolInputError("a path is required")
        p = path.strip()
        if not p.startswith("/"):
            p = posixpath.join(self.workdir, p)
        return check_lexical(posixpath.normpath(p))

    def _spilled(self, source: str, text: str) -> str:
        return spill_if_needed(text, source=source, session_id=self.job_id, store=self.store, config=self.spill,
                               place=self.place)

    def _bounded(self, t: float) -> float:
        """`t` seconds, but never past the turn's deadline."""
        return t if self.deadline is None else min(t, max(0.0, self.deadline - time.monotonic()))

    def _tool_terminal(self, command: str, timeout_s: float | None = None) -> ToolResult:
        if not isinstance(command, str) or not command.strip():
            return ToolResult("error: command is empty", ok=False)
        t = float(timeout_s) if isinstance(timeout_s, (int, float)) and timeout_s > 0 else TERMINAL_DEFAULT_TIMEOUT_S
        t = self._bounded(min(t, TERMINAL_MAX_TIMEOUT_S))
        argv, exec_t = ["sh", "-c", command], t
        if self.jail is not None and self.sandbox.kind == "local":
            base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb"}
            argv = self.jail.argv(argv, base, network=self.tool_network, cwd=self.workdir)
        if self.sandbox.kind == "local":
            # on the worker's host the command runs under the agents' guard (a subreaper): whatever it
            # starts, a setsid daemon included, ends with the command; the guard keeps the deadline
            argv = [sys.executable, "-I", "-S", GUARD, f"{os.getpid()}:{t:g}", *argv]
            exec_t = t + GUARD_BACKSTOP_S
        rc, out, err = self.sandbox.exec(argv, timeout_s=exec_t, cwd=self.workdir,
                                         max_output_bytes=TERMINAL_MAX_OUTPUT_BYTES)
        parts = [out.decode("utf-8", "replace").rstrip("\n")] if out else []
        if err:
            parts.append("[stderr]\n" + err.decode("utf-8", "replace").rstrip("\n"))
        parts.append(f"[exit code {rc}]")
        return ToolResult(self._spilled("terminal", "\n".join(parts)), ok=rc == 0)

    def _tool_read_file(self, path: str, offset: int | None = None, limit: int | None = None) -> ToolResult:
        p = self._path(path)
        if offset is not None and (not isinstance(offset, int) or offset < 1):
            return ToolResult("error: offset is a line number from 1", ok=False)
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            return ToolResult("error: limit is a number of lines, at least 1", ok=False)
        first = offset or 1
        resolved, size = self.sandbox.resolve(p)
        buf, skip = bytearray(), first - 1  # the lines before `first` are skipped as they stream by
        stream = self.sandbox.open_stream(resolved)
        try:
            for chunk in stream:
                start = 0
                while skip and (i := chunk.find(b"\n", start)) >= 0:
                    start, skip = i + 1, skip - 1
                if skip:
                    continue
                buf += chunk[start:]
                if len(buf) >= READ_MAX_BYTES or (limit and buf.count(b"\n") >= limit):
                    break
        finally:
            getattr(stream, "close", lambda: None)()
        data = bytes(buf[:READ_MAX_BYTES])
        if b"\x00" in data[:8192]:
            return ToolResult(f"error: {p} is a binary file ({size:,} bytes); use terminal to inspect it", ok=False)
        if offset is not None or limit is not None:
            lines = data.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            lines = lines[:limit]
            text = b"\n".join(lines).decode("utf-8", "replace")
            return ToolResult(self._spilled("read_file", f"[lines {first}-{first + len(lines) - 1} of {p}]\n{text}"))
        text = data.decode("utf-8", "replace")
        if size > len(data):
            text += f"\n[read the first {len(data):,} of {size:,} bytes]"
        return ToolResult(self._spilled("read_file", text))

    def _tool_write_file(self, path: str, content: str) -> ToolResult:
        if not isinstance(content, str):
            return ToolResult("error: content must be a string", ok=False)
        if len(content) > WRITE_MAX_CHARS:
            return ToolResult(f"error: content is over {WRITE_MAX_CHARS:,} characters", ok=False)
        p = self._path(path)
        data = content.encode("utf-8", "replace")
        key = f"{prefixes.FILES}{_SAFE.sub('_', self.job_id)}/write-{uuid.uuid4().hex}"
        self.store.put_bytes(key, data, private=True)
        try:
            dest = self.sandbox.put(self.store, key, p, max_bytes=len(data) + 1)
            if self.jail is not None:
                self.jail.own(dest)
        except NotImplementedError as exc:
            return ToolResult(f"error: {exc}", ok=False)
        finally:
            try:
                self.store.delete(key)
            except Exception:  # noqa: BLE001 - a leftover expires with files/
                log.warning("could not delete temporary blob %s", key)
        return ToolResult(f"wrote {len(data):,} bytes to {dest}")

    def _tool_send_file(self, path: str) -> ToolResult:
        p = self._path(path)
        if p not in self.stored:
            self.sandbox.resolve(p)  # exists, a regular file, inside the allowed roots
        if p not in self.marked:
            self.marked.append(p)
        return ToolResult(f"{media_tag(p)} (will be sent with your reply)")

    def _tool_browser_screenshot(self, url: str, full_page: bool = False) -> ToolResult:
        if not isinstance(url, str) or urlparse(url.strip()).scheme.lower() not in ("http", "https"):
            return ToolResult("error: only http:// and https:// URLs can be screenshotted", ok=False)
        url = url.strip()
        refused: list[Refusal] = []
        png = take_screenshot(url, chromium_path=self.chromium_path, full_page=bool(full_page),
                              timeout_s=self._bounded(SCREENSHOT_TIMEOUT_S),
                              allowed_hosts=self.browser_allowed_hosts, refused=refused)
        name = f"{uuid.uuid4().hex}.png"
        key = f"{prefixes.SCREENSHOTS}{_SAFE.sub('_', self.job_id)}/{name}"
        info = self.store.put_stream(key, [png], max_bytes=SCREENSHOT_MAX_BYTES)
        dest = posixpath.join(self.workdir, "screenshots", name)
        try:
            dest = self.sandbox.put(self.store, key, dest, max_bytes=SCREENSHOT_MAX_BYTES)
            if self.jail is not None:
                self.jail.own(dest)
        except Exception as exc:  # noqa: BLE001 - delivery comes from storage anyway
            log.info("screenshot %s not copied into the sandbox: %s", key, exc)
        self.stored[dest] = {"key": key, "name": name, "size": info.size_bytes, "sha256": info.sha256}
        if dest not in self.marked:
            self.marked.append(dest)
        blocked = sorted({f"{r.host}:{r.port}" for r in refused if r.status == 403})
        note = f"; blocked (not public): {', '.join(blocked[:5])}{' ...' if len(blocked) > 5 else ''}" if blocked else ""
        return ToolResult(f"{media_tag(dest)} (screenshot of {url}, {info.size_bytes:,} bytes; "
                          f"will be sent with your reply{note})")


_NAMES = frozenset(s["function"]["name"] for s in SCHEMAS)


class ToolInputError(CourierError):
    """The model called a tool with unusable arguments."""


class ScreenshotError(CourierError):
    pass


def take_screenshot(url: str, *, chromium_path: str, full_page: bool = False,
                    timeout_s: float = SCREENSHOT_TIMEOUT_S, allowed_hosts: tuple[str, ...] | list[str] = (),
                    refused: list[Refusal] | None = None) -> bytes:
    """PNG bytes of `url` in the system's headless Chromium; raises ScreenshotError with a short reason.
    Every connection (the page, its redirects, its subresources) goes through an :class:`EgressProxy`:
    a refused page is an error naming the reason, a refused subresource does not load; the refusals
    are appended to `refused`."""
    try:
        from playwright.sync_api import Error as PlaywrightError, sync_playwright
    except ImportError:
        raise ScreenshotError("screenshots need playwright: pip install 'courier[browser]'") from None
    if not os.access(chromium_path, os.X_OK):
        raise ScreenshotError(f"no Chromium at {chromium_path} (install the chromium package "
                              "or set COURIER_CHROMIUM_PATH)")
    try:
        policy = EgressPolicy(allowed_hosts)
    except ValueError as exc:
        raise ScreenshotError(f"{exc} (fix {ALLOW_SETTING})") from None
    ms = max(1000.0, timeout_s * 1000)
    proxy = EgressProxy(policy).start()
    try:
        args = [*CHROMIUM_ARGS, f"--proxy-server={proxy.url}", *EGRESS_ARGS]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path, headless=True, args=args, timeout=ms)
            try:
                page = browser.new_page(viewport=SCREENSHOT_VIEWPORT)  # type: ignore[arg-type]
                navigations: list[str] = []
                page.on("request", lambda req: navigations.append(req.url)
                        if req.is_navigation_request() and req.frame == page.main_frame else None)
                try:
                    response = page.goto(url, wait_until="load", timeout=ms)
                except PlaywrightError:
                    refusal = _navigation_refusal(proxy, navigations[-1] if navigations else url)
                    if refusal is None:
                        raise
                    raise ScreenshotError(_refusal_text(url, refusal)) from None
                # a refused plain-http page is the proxy's own 403, which Chromium shows as the page
                refusal = proxy.refusal_marked(response.headers) if response is not None else None
                if refusal is not None:
                    raise ScreenshotError(_refusal_text(url, refusal))
                return page.screenshot(full_page=full_page, type="png", timeout=ms)
            finally:
                browser.close()
    except PlaywrightError as exc:
        first = (str(exc).strip().splitlines() or ["browser error"])[0]
        raise ScreenshotError(f"screenshot of {url} failed: {first[:200]}") from None
    finally:
        proxy.stop()
        if refused is not None:
            refused.extend(proxy.refusals)


#: Chromium sends every connection through the proxy: `<-loopback>` removes the
#: implicit bypass of localhost, 127/8, [::1] and link-local; WebRTC may not use
#: UDP outside the proxy
EGRESS_ARGS = ("--proxy-bypass-list=<-loopback>", "--force-webrtc-ip-handling-policy=disable_non_proxied_udp")


def _navigation_refusal(proxy: EgressProxy, nav_url: str) -> Refusal | None:
    try:
        u = urlparse(nav_url)
        host, port = u.hostname or "", u.port or (443 if u.scheme in ("https", "wss") else 80)
    except ValueError:
        return None
    return proxy.refusal_for(host, port) if host else None


def _refusal_text(url: str, refusal: Refusal) -> str:
    verb = "refused" if refusal.status == 403 else "failed"
    return f"screenshot of {url} {verb}: {refusal.reason}"
