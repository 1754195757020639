"""The agent bridge runtime: any agent as a subprocess.

The user's message goes on stdin (and in `COURIER_MESSAGE`). A stdout line
`AX_GATEWAY_EVENT <json object>` is an event; every other stdout line is part of
the final reply; stderr never is (its tail is kept for the logs). Events (`kind`,
or `type` as an alias), normalised by `EventNormaliser`:

- `status`: `status` in started, thinking, processing, completed, error,
  no_reply (declined, skipped, not_responding: end without a reply); optional
  `message`, `activity`, `detail`, `reason`. Terminal statuses are not passed
  on: the caller publishes exactly one terminal event from `BridgeResult`.
- `tool_start` / `tool_result`: `tool_name`, `tool_call_id` (made up when
  missing; a result without one closes the last open call of the same tool),
  `activity` (`activity_for(tool_name, args)` when the agent gives none),
  `status` (tool_call; tool_complete or error).

A malformed event line is dropped and logged, never put in the reply. A non-zero
exit, a crash or a timeout (`runtime_timeout`) ends as one `error` result with a
reason; a timeout or the worker's death, even by SIGKILL, kills the agent and all
it started, `setsid` daemons too (`_guard.py`). The reply and every line are bounded.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import selectors
import signal
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from adapters.defaults import AGENT_TIMEOUT_S
from adapters.agents.activity import MAX_ACTIVITY_CHARS, activity_for, cut
from adapters.agents.jail import Jail, Network

__all__ = ["ACTIVITY_MAX_CHARS", "BASE_ENV", "EVENT_PREFIX", "NO_REPLY_STATUSES",
           "BridgeResult", "EventNormaliser", "activity_for", "agent_base_env", "event_sink",
           "normalise_activity", "parse_event_line", "run_bridge"]

log = logging.getLogger(__name__)

EVENT_PREFIX = "AX_GATEWAY_EVENT"
ACTIVITY_MAX_CHARS = MAX_ACTIVITY_CHARS
NO_REPLY_STATUSES = frozenset({"no_reply", "declined", "skipped", "not_responding"})
PROGRESS_STATUSES = frozenset({"started", "thinking", "processing"})
TERMINAL_STATUSES = frozenset({"completed", "error"}) | NO_REPLY_STATUSES

MAX_REPLY_CHARS = 200_000
MAX_EVENT_LINE_CHARS = 64 * 1024
MAX_TEXT_FIELD_CHARS = 500
STDERR_TAIL_CHARS = 4000
READ_BYTES = 64 * 1024
#: after the agent exits, how long its leftover children may keep stdout open
DRAIN_GRACE_S = 2.0
#: SIGTERM first; the guard kills everything the agent started after this
KILL_GRACE_S = 2.0
#: how long the guard may take to kill and reap what is left before the group gets SIGKILL
GUARD_CLEANUP_S = 3.0
#: how often a sandboxed agent's workspace is measured against its limit
WORKSPACE_CHECK_S = 1.0
REPLY_CUT_NOTE = "\n… [reply cut at {n:,} characters]"
#: runs every agent command courier starts on its own host (a bridge agent, a local terminal command)
GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")

normalise_activity = cut  # one short human line


def parse_event_line(line: str) -> dict | None:
    """The event dict of a protocol line (one starting with EVENT_PREFIX); None when it is malformed."""
    rest = line.strip()[len(EVENT_PREFIX):]
    try:
        ev = json.loads(rest) if rest[:1].isspace() else None
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _text(v: Any, max_chars: int = MAX_TEXT_FIELD_CHARS) -> str | None:
    if v is None:
        return None
    s = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    s = _CONTROL.sub(" ", s).strip()
    if not s:
        return None
    return s if len(s) <= max_chars else s[: max_chars - 1] + "…"


def mapped_strings(v: Any, fn: Callable[[str], str]) -> Any:
    """`v` with `fn` applied to every string in it (in dicts and lists too)."""
    if isinstance(v, str):
        return fn(v)
    if isinstance(v, dict):
        return {k: mapped_strings(x, fn) for k, x in v.items()}
    if isinstance(v, list):
        return [mapped_strings(x, fn) for x in v]
    return v


def event_sink(on_event: Callable[[dict], None] | None) -> Callable[[dict], None]:
    """`on_event` (or nothing) that logs its failure: a failing sink must not kill the turn."""
    def emit(ev: dict) -> None:
        try:
            if on_event is not None:
                on_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("event sink failed")

    return emit


class EventNormaliser:
    """Raw agent events to courier's phase events: `feed(raw)` returns the event to publish, or None
    (dropped, or a terminal status, kept in `terminal` for the caller to end the turn with)."""

    def __init__(self, shown: Callable[[str], str] | None = None) -> None:
        #: how the turn's texts are shown (its paths relative to its workspace), applied to every
        #: string of a raw event before anything is cut to length
        self.shown = shown
        self.terminal: dict[str, Any] | None = None
        self._n = 0
        #: open calls, oldest first: id -> (tool, activity, started monotonic)
        self._open: dict[str, tuple[str, str, float]] = {}
        self.dropped = 0

    def _new_id(self) -> str:
        self._n += 1
        return f"auto_{self._n}"

    def drop(self, why: str) -> None:
        self.dropped += 1
        log.warning("dropped an agent event: %s", why)

    def feed(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        if self.shown is not None:
            raw = mapped_strings(raw, self.shown)
        kind = raw.get("kind", raw.get("type"))
        handler = {"status": self._status, "tool_start": self.tool_start,
                   "tool_result": self.tool_result}.get(_word(kind))
        if handler is None:
            self.drop(f"unknown kind {_word(kind)[:40]!r}" if isinstance(kind, str) else "no kind")
            return None
        return handler(raw)

    def _status(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        st = _word(raw.get("status"))
        if st not in PROGRESS_STATUSES and st not in TERMINAL_STATUSES:
            self.drop(f"unknown status {st[:40]!r}")
            return None
        ev: dict[str, Any] = {"kind": "status", "status": st, **_texts(raw, ("message", "detail", "reason"))}
        act = normalise_activity(raw.get("activity"))
        if act:
            ev["activity"] = act
        if st in TERMINAL_STATUSES:
            if self.terminal is None:
                self.terminal = ev
            return None
        if st == "started":
            # courier has published `started` itself; the agent's own start is progress
            ev["status"] = "processing"
        return ev

    def tool_start(self, raw: dict[str, Any]) -> dict[str, Any]:
        tool, call_id = _tool_ids(raw)
        tool, call_id = tool or "tool", call_id or self._new_id()
        act = normalise_activity(raw.get("activity")) or activity_for(
            tool, raw.get("args", raw.get("arguments", raw.get("input"))))
        self._open.pop(call_id, None)  # a reopened id moves to the end
        self._open[call_id] = (tool, act, time.monotonic())
        return {"kind": "tool_start", "tool_name": tool, "tool_call_id": call_id, "activity": act,
                "status": "tool_call", **_texts(raw, ("message",))}

    def tool_result(self, raw: dict[str, Any]) -> dict[str, Any]:
        tool, call_id = _tool_ids(raw)
        if not call_id:
            call_id = next((c for c in reversed(self._open) if not tool or self._open[c][0] == tool), "")
        opened = self._open.pop(call_id, None)  # no open call has the id ""
        call_id = call_id or self._new_id()
        tool = tool or (opened[0] if opened else "tool")
        st = _word(raw.get("status"))
        failed = st in ("error", "failed", "failure") or (raw.get("error") not in (None, False, "") and st != "tool_complete")
        ev: dict[str, Any] = {"kind": "tool_result", "tool_name": tool, "tool_call_id": call_id,
                              "status": "error" if failed else "tool_complete"}
        act = normalise_activity(raw.get("activity")) or (opened[1] if opened else "")
        if act:
            ev["activity"] = act
        if opened is not None:
            ev["duration_ms"] = round((time.monotonic() - opened[2]) * 1000)
        ev.update(_texts({k: v for k, v in raw.items() if v is not True}, ("message", "error")))
        return ev


def _texts(raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, str]:
    """`raw`'s `keys` that hold some text, as one bounded line each."""
    return {k: v for k in keys if (v := _text(raw.get(k))) is not None}


def _word(v: Any) -> str:
    return v.strip().lower() if isinstance(v, str) else ""


def _tool_ids(raw: dict[str, Any]) -> tuple[str, str]:
    """A raw tool event's (tool name, call id), "" when missing."""
    return (normalise_activity(raw.get("tool_name") or raw.get("name") or raw.get("tool"), 64),
            normalise_activity(raw.get("tool_call_id") or raw.get("id"), 128))


@dataclass
class BridgeResult:
    status: str  # completed | error | no_reply
    reply: str = ""
    reason: str = ""
    exit_code: int | None = None
    stderr_tail: str = ""
    events: int = 0
    extra: dict = field(default_factory=dict)


class _Lines:
    """Incremental UTF-8 lines from byte chunks; a line longer than
    `max_chars` comes out in pieces (`complete=False` for all but the last)."""

    def __init__(self, max_chars: int) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._max = max_chars

    def feed(self, data: bytes, final: bool = False) -> list[tuple[str, bool]]:
        self._buf += self._dec.decode(data, final)
        *lines, self._buf = self._buf.split("\n")
        out = [(line, True) for line in lines]
        while len(self._buf) > self._max:
            out.append((self._buf[: self._max], False))
            self._buf = self._buf[self._max:]
        if final and self._buf:
            out.append((self._buf, True))
            self._buf = ""
        return out


class _Stdout:
    """Splits the agent's stdout into events (to `emit`) and reply text (bounded)."""

    def __init__(self, emit: Callable[[dict], None], shown: Callable[[str], str] | None = None) -> None:
        self.lines = _Lines(MAX_EVENT_LINE_CHARS)
        self.norm = EventNormaliser(shown)
        self.emit = emit
        self.reply: list[str] = []
        self.reply_chars = 0
        self.cut = 0
        self.events = 0
        self._mid: str | None = None  # "reply" | "event" | "skip" while inside a long line
        self._pending = ""

    def feed(self, data: bytes, final: bool = False) -> None:
        for piece, complete in self.lines.feed(data, final):
            self._piece(piece, complete)

    def _piece(self, piece: str, complete: bool) -> None:
        if self._mid is None:
            self._mid = "event" if piece.lstrip().startswith(EVENT_PREFIX) else "reply"
        if self._mid == "reply":
            self._add_reply(piece + ("\n" if complete else ""))
        elif self._mid == "event":
            if complete:
                self._event_line(self._pending + piece)
                self._pending = ""
            elif len(self._pending) + len(piece) > MAX_EVENT_LINE_CHARS:
                self.norm.drop(f"event line over {MAX_EVENT_LINE_CHARS:,} characters")
                self._pending = ""
                self._mid = "skip"
            else:
                self._pending += piece
        if complete:
            self._mid = None

    def _add_reply(self, s: str) -> None:
        kept = s[:max(0, MAX_REPLY_CHARS - self.reply_chars)]
        self.cut += len(s) - len(kept)
        if kept:
            self.reply.append(kept)
            self.reply_chars += len(kept)

    def _event_line(self, line: str) -> None:
        raw = parse_event_line(line)
        if raw is None:
            self.norm.drop(f"malformed event line ({len(line)} chars)")
            return
        ev = self.norm.feed(raw)
        if ev is not None:
            self.events += 1
            self.emit(ev)

    def text(self) -> str:
        s = "".join(self.reply).strip("\r\n")
        if self.cut:
            s += REPLY_CUT_NOTE.format(n=MAX_REPLY_CHARS)
        return s


def run_bridge(
    command: list[str],
    message: str,
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = AGENT_TIMEOUT_S,
    on_event: Callable[[dict], None] | None = None,
    passthrough: tuple[str, ...] | list[str] = (),
    jail: Jail | None = None,
    network: Network = "proxy",
    shown: Callable[[str], str] | None = None,
) -> BridgeResult:
    """Run one agent turn; never raises for the agent's misbehaviour. `on_event` gets each normalised
    non-terminal event, in order, from this thread (`shown` applied to the raw event's texts first).
    The agent's environment is an allowlist, never the worker's own (tokens, the API key, the Redis
    URL): :data:`BASE_ENV` and `passthrough`, then `env`, then ``COURIER_MESSAGE``. With `jail` it
    runs in that sandbox with `network`; a limit it hits ends the turn with a reason naming it."""
    if not command:
        return BridgeResult("error", reason="agent has no command")
    full_env = {**agent_base_env(passthrough), **(env or {}), "COURIER_MESSAGE": message}
    started = time.monotonic()
    if jail is not None:
        missing = jail.runnable(command[0], full_env.get("PATH"))
        argv = jail.argv(command, full_env, network=network, cwd=cwd)
        popen_env = {"PATH": os.environ.get("PATH") or os.defpath}  # bwrap's own; the agent's is in argv
    else:
        missing = _not_runnable(command[0], cwd, full_env.get("PATH"))
        argv, popen_env = list(command), full_env
    if missing:
        return BridgeResult("error", reason=f"agent could not start: {missing}")
    try:
        # the guard leads the agent's new session and takes the group down if this worker dies
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", GUARD, str(os.getpid()), *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, env=popen_env, start_new_session=True,
        )
    except OSError as exc:
        return BridgeResult("error", reason=f"agent could not start: {exc.strerror or exc}")

    out = _Stdout(event_sink(on_event), shown)
    err_lines = _Lines(STDERR_TAIL_CHARS)
    err_tail = ""

    def feed_stdin() -> None:
        assert proc.stdin is not None
        with suppress(OSError, ValueError):
            proc.stdin.write(message.encode("utf-8", "replace"))
        with suppress(OSError):
            proc.stdin.close()

    threading.Thread(target=feed_stdin, name="bridge-stdin", daemon=True).start()
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    deadline = started + timeout_s
    exited_at: float | None = None
    stray_output = False
    stop: str | None = None  # why the agent is killed: runtime_timeout, or the workspace limit it passed
    next_measure = started + WORKSPACE_CHECK_S
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                stop = "runtime_timeout"
                break
            if jail is not None and now >= next_measure:
                stop = jail.over_workspace()
                if stop is not None:
                    break
                next_measure = time.monotonic() + WORKSPACE_CHECK_S
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_GRACE_S:
                stray_output = True  # the agent is gone but a child of it holds the pipes
                break
            wait = min(deadline - now, 0.5 if exited_at is None else 0.1)
            for key, _ in sel.select(timeout=wait):
                data = os.read(key.fileobj.fileno(), READ_BYTES)  # type: ignore[union-attr]
                if not data:
                    sel.unregister(key.fileobj)
                    if key.data == "out":
                        out.feed(b"", final=True)
                    continue
                if key.data == "out":
                    out.feed(data)
                else:
                    for piece, _c in err_lines.feed(data):
                        err_tail = (err_tail + piece + "\n")[-STDERR_TAIL_CHARS:]
        if stop is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop = "runtime_timeout"
        if stop is not None:
            _kill_group(proc)
    finally:
        sel.close()
        _reap_group(proc)
        for f in (proc.stdout, proc.stderr):
            with suppress(OSError):
                f.close()
    for piece, _c in err_lines.feed(b"", final=True):
        err_tail = (err_tail + piece)[-STDERR_TAIL_CHARS:]

    tail = err_tail.strip()
    rc = proc.returncode
    extra: dict[str, Any] = {"duration_s": round(time.monotonic() - started, 3), "dropped_events": out.norm.dropped}
    if out.cut:
        extra["reply_cut_chars"] = out.cut
        log.warning("agent reply cut at %d characters (%d more dropped)", MAX_REPLY_CHARS, out.cut)
    if stray_output:
        extra["stray_children"] = True
    common: dict[str, Any] = {"exit_code": rc, "stderr_tail": tail, "events": out.events, "extra": extra}
    if stop is not None:
        what = f" timed out after {timeout_s:g}s" if stop == "runtime_timeout" else f": {stop}"
        log.warning("agent %s%s; process group killed", os.path.basename(command[0]), what)
        return BridgeResult("error", reason=stop, **common)
    if rc != 0:
        why = f"agent exited with code {rc}" if rc > 0 else f"agent was killed by signal {_signame(-rc)}"
        hit = jail.limit_hit(rc, tail) if jail is not None else None
        log.warning("%s; stderr tail: %s", f"{hit} ({why})" if hit else why, tail[-500:])
        return BridgeResult("error", reason=hit or why, **common)
    term = out.norm.terminal
    if term is not None and term["status"] == "error":
        return BridgeResult("error", reason=term.get("reason") or term.get("message") or "agent reported an error",
                            **common)
    if term is not None and term["status"] in NO_REPLY_STATUSES:
        return BridgeResult("no_reply", reason=term.get("reason") or term["status"], **common)
    return BridgeResult("completed", reply=out.text(), **common)


#: what every agent inherits from the worker's environment (nothing secret)
BASE_ENV = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "TERM", "USER",
            "LOGNAME", "SHELL", "TMPDIR")


def agent_base_env(passthrough: tuple[str, ...] | list[str] = ()) -> dict[str, str]:
    """The worker's variables an agent gets: :data:`BASE_ENV` plus `passthrough` (those set)."""
    return {k: os.environ[k] for k in (*BASE_ENV, *passthrough) if k in os.environ}


def _not_runnable(program: str, cwd: str | None, path: str | None) -> str | None:
    """Why `program` cannot be started (None: it can), checked before the
    guard starts it, so a bad command is a clean error, not an exit code."""
    if "/" in program:
        full = os.path.join(cwd or os.getcwd(), program)
        if not os.path.isfile(full):
            return f"{program}: no such file"
        if not os.access(full, os.X_OK):
            return f"{program}: not executable"
        return None
    if shutil.which(program, path=path if path is not None else os.defpath) is None:
        return f"{program}: not found on PATH"
    return None


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return str(n)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the agent's whole process group; the guard SIGKILLs every
    descendant (setsid ones too) after its grace (`_guard.TERM_GRACE_S`) and
    exits; the group gets SIGKILL if the guard has not gone by then."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S + GUARD_CLEANUP_S)
    _reap_group(proc)


def _reap_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left in the agent's process group (its children
    end with the turn), and reap the agent."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("agent process %d did not die after SIGKILL", proc.pid)
