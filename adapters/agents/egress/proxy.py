"""The egress relay: a filtering forward proxy that lets a connection through
only when the address policy (adapters/agents/egress/policy.py) allows it.

Every address a host resolves to is checked and the proxy connects to a checked
address (never the name again: a second DNS answer cannot rebind it). ``CONNECT``
(https, wss) is answered ``200`` and piped both ways; absolute-form plain http
goes upstream in origin-form with ``Connection: close`` and no hop-by-hop or
``Proxy-*`` headers, streamed, one request per client connection. A refused
destination gets ``403`` with a one-line reason, one that does not resolve or
answer ``502``; each is kept in :attr:`EgressProxy.refusals` and logged at INFO
with the host, never a URL.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import threading
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from adapters.agents.egress.policy import EgressPolicy, Refused

__all__ = ["MARK_HEADER", "EgressProxy", "Refusal"]

log = logging.getLogger("adapters.agents.egress")

#: bytes read from a socket at once (the most a pipe holds per direction)
CHUNK = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 200
#: seconds a closing client connection is drained before it is closed
LINGER_S = 2.0
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 64
#: response header carrying a refusal's token and index, so the caller can tell a
#: proxy refusal (shown by Chromium as the page for plain http) from an origin's 403
MARK_HEADER = "X-Courier-Egress-Refused"

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect",
                         "proxy-authorization", "proxy-authenticate", "host"})


@dataclass(frozen=True)
class Refusal:
    """One connection the proxy refused: 403 by the policy, 502 unreachable."""

    host: str
    port: int
    reason: str
    status: int = 403


class _BadRequest(Exception):
    """(status, reason) of a request the proxy answers itself."""


class _Reader:
    """Buffered reads from a socket: lines of a head, then raw bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(CHUNK)
        if not data:
            raise EOFError
        self.buf += data

    def readline(self, limit: int) -> bytes:
        while True:
            i = self.buf.find(b"\n", 0, limit)
            if i >= 0:
                line = bytes(self.buf[:i + 1])
                del self.buf[:i + 1]
                return line
            if len(self.buf) >= limit:
                raise _BadRequest(431, "request head too large")
            self._fill()

    def read_some(self, n: int) -> bytes:
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _read_head(r: _Reader) -> tuple[str, list[tuple[str, str]]]:
    budget = MAX_HEAD_BYTES
    line = r.readline(budget)
    while line in (b"\r\n", b"\n"):  # tolerated blank lines before a request (RFC 9112 2.2)
        line = r.readline(budget)
    budget -= len(line)
    headers: list[tuple[str, str]] = []
    while True:
        raw = r.readline(max(1, budget))
        budget -= len(raw)
        if raw in (b"\r\n", b"\n"):
            break
        if budget <= 0 or len(headers) >= MAX_HEADERS:
            raise _BadRequest(431, "request head too large")
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip() or name[0] in " \t":
            raise _BadRequest(400, "malformed header")
        headers.append((name, value.strip()))
    return line.decode("latin-1").rstrip("\r\n"), headers


def _split_authority(authority: str) -> tuple[str, int]:
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = authority.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _BadRequest(400, "CONNECT needs host:port")
    return host, int(port)


def _filtered(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` without hop-by-hop ones (those `Connection` names too) and `Proxy-*`."""
    drop = _HOP_BY_HOP | {t.strip().lower() for n, v in headers if n.lower() == "connection" for t in v.split(",")}
    return [(n, v) for n, v in headers if n.lower() not in drop and not n.lower().startswith("proxy-")]


class EgressProxy:
    """The filtering forward proxy for one browser session or one sandboxed turn."""

    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.refusals: list[Refusal] = []
        self.token = secrets.token_hex(8)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def start(self, unix_path: str | None = None) -> "EgressProxy":
        """Listen on 127.0.0.1 and a free port, or on the unix socket
        `unix_path` (made connectable by anyone who can reach the path: an
        agent's sandbox sees it bound in, nothing else)."""
        if unix_path is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(unix_path)
            os.chmod(unix_path, 0o666)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
        s.listen(128)
        self._listener = s
        self.port = s.getsockname()[1] if unix_path is None else 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"egress-proxy-{self.port or 'unix'}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            with suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self._listener.close()
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in socks:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            _close(s)
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def refusal_for(self, host: str, port: int) -> Refusal | None:
        """The latest refusal of (host, port)."""
        name = host.strip("[]").lower().rstrip(".")
        with self._lock:
            return next((r for r in reversed(self.refusals) if r.host.lower().rstrip(".") == name and r.port == port),
                        None)

    def refusal_marked(self, headers: dict[str, str]) -> Refusal | None:
        """The refusal a response's headers carry (the proxy's own 403/502 to
        a plain http request), or None for an origin's response."""
        token, _, index = (headers.get(MARK_HEADER.lower()) or headers.get(MARK_HEADER) or "").partition(" ")
        if token != self.token or not index.isdigit():
            return None
        with self._lock:
            return self.refusals[int(index)] if int(index) < len(self.refusals) else None

    def _track(self, s: socket.socket) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            self._open.add(s)
            return True

    def _untrack(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        _close(s)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _close(client)  # over the cap: Chromium retries on another connection
                continue
            if not self._track(client):
                self._slots.release()
                _close(client)
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True,
                             name=f"egress-proxy-{self.port}-conn").start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            client.settimeout(IDLE_TIMEOUT_S)
            r = _Reader(client)
            line, headers = _read_head(r)  # EOFError (nothing sent) ends quietly below
            parts = line.split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                raise _BadRequest(400, "malformed request line")
            method, target, _version = parts
            if method.upper() == "CONNECT":
                host, port = _split_authority(target)
                upstream = self._dial(host, port)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                upstream.sendall(r.buf)  # what the client sent after the head
                self._pipe(client, upstream)
            else:
                upstream = self._forward(client, r, method, target, headers)
        except Refused as exc:
            self._refuse(client, exc)
        except _BadRequest as exc:
            self._respond(client, *exc.args)
        except (OSError, EOFError, ValueError):
            pass  # a side went away or timed out: nothing to tell anyone
        except Exception:  # noqa: BLE001 - one connection's bug must not end the proxy
            log.warning("browser egress proxy: connection failed", exc_info=True)
        finally:
            if upstream is not None:
                self._untrack(upstream)
            self._untrack(client)
            self._slots.release()

    def _dial(self, host: str, port: int) -> socket.socket:
        last: OSError | None = None
        for family, sockaddr in self.policy.check(host, port):
            s = socket.socket(family, socket.SOCK_STREAM)
            if not self._track(s):
                _close(s)
                raise OSError("proxy stopping")
            s.settimeout(CONNECT_TIMEOUT_S)
            try:
                s.connect(sockaddr)  # the checked address, not the name
            except OSError as exc:
                last = exc
                self._untrack(s)
                continue
            s.settimeout(IDLE_TIMEOUT_S)
            return s
        why = getattr(last, "strerror", None) or type(last).__name__
        raise Refused(host, port, f"{host}:{port} does not answer ({why})", 502)

    def _refuse(self, client: socket.socket, exc: Refused) -> None:
        with self._lock:
            index = len(self.refusals)
            self.refusals.append(Refusal(exc.host, exc.port, exc.reason, exc.status))
        verb = "refused" if exc.status == 403 else "failed"
        log.info("browser egress %s %s:%s: %s", verb, exc.host, exc.port, exc.reason)
        self._respond(client, exc.status, exc.reason, mark=f"{self.token} {index}")

    def _respond(self, client: socket.socket, status: int, reason: str, mark: str | None = None) -> None:
        phrase = HTTPStatus(status).phrase
        body = (reason.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
        head = [f"HTTP/1.1 {status} {phrase}", "Content-Type: text/plain; charset=utf-8",
                f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store"]
        if mark:
            head.append(f"{MARK_HEADER}: {mark}")
        try:
            client.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        except OSError:
            return
        self._linger(client)

    def _forward(self, client: socket.socket, r: _Reader, method: str, target: str,
                 headers: list[tuple[str, str]]) -> socket.socket:
        """One plain-http request: checked, sent upstream in origin-form, its
        body and the response streamed. Returns the upstream socket."""
        if not target.lower().startswith("http://"):
            raise _BadRequest(400, "only absolute http:// requests and CONNECT are proxied")
        try:
            u = urlsplit(target)
            host, port = u.hostname or "", u.port or 80
        except ValueError:
            raise _BadRequest(400, "malformed request target") from None
        if not host:
            raise _BadRequest(400, "malformed request target")
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        lowered = {n.lower(): v for n, v in headers}
        te = lowered.get("transfer-encoding", "").lower()
        chunked = te.rsplit(",", 1)[-1].strip() == "chunked"
        if te and not chunked:
            raise _BadRequest(400, "unsupported transfer-encoding")
        length = 0
        if "content-length" in lowered:
            if te:
                raise _BadRequest(400, "both transfer-encoding and content-length")
            values = {v.strip() for n, v in headers if n.lower() == "content-length"}
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise _BadRequest(400, "bad content-length")
            length = int(values.pop())
        upstream = self._dial(host, port)
        shown = f"[{host}]" if ":" in host else host
        authority = shown if port == 80 else f"{shown}:{port}"
        head = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
        head += [f"{n}: {v}" for n, v in _filtered(headers)]
        head.append("Connection: close")
        upstream.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if lowered.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if chunked:
            self._copy_chunked(r, upstream)
        else:
            self._copy_exact(r, upstream, length)
        # the response; nothing more is read from the client, which is closed after it
        ur = _Reader(upstream)
        while True:
            try:
                status_line, rheaders = _read_head(ur)
            except EOFError:
                raise Refused(host, port, f"{host}:{port} sent no response", 502) from None
            code = status_line.split(" ", 2)[1] if status_line.count(" ") >= 1 else ""
            out = [status_line] + [f"{n}: {v}" for n, v in _filtered(rheaders)]
            informational = code.startswith("1") and code != "101"
            if not informational:
                out.append("Connection: close")
            client.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
            if not informational:
                break
        rlower = {n.lower(): v.strip() for n, v in rheaders}
        if method.upper() == "HEAD" or code in ("204", "304"):
            pass
        elif rlower.get("transfer-encoding", "").lower().rsplit(",", 1)[-1].strip() == "chunked":
            self._copy_chunked(ur, client)
        elif rlower.get("content-length", "").isdigit() and "transfer-encoding" not in rlower:
            self._copy_exact(ur, client, int(rlower["content-length"]))
        else:  # delimited by the upstream's close
            with suppress(EOFError):
                while True:
                    client.sendall(ur.read_some(CHUNK))
        self._linger(client)
        return upstream

    def _linger(self, client: socket.socket) -> None:
        """Close after the one response: FIN first, then discard what the
        client still sends (a pipelined request goes nowhere) until it closes,
        so the close is not a reset that could cut the response short."""
        with suppress(OSError):
            client.shutdown(socket.SHUT_WR)
            client.settimeout(LINGER_S)
            budget = CHUNK * 4
            while budget > 0 and (data := client.recv(CHUNK)):
                budget -= len(data)

    @staticmethod
    def _copy_exact(r: _Reader, dest: socket.socket, length: int) -> None:
        while length > 0:
            data = r.read_some(min(CHUNK, length))
            dest.sendall(data)
            length -= len(data)

    @classmethod
    def _copy_chunked(cls, r: _Reader, dest: socket.socket) -> None:
        """One chunked body, as it is (sizes, extensions, trailers), chunk by chunk."""
        while True:
            line = r.readline(4096)
            dest.sendall(line)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _BadRequest(400, "malformed chunk") from None
            if size == 0:
                while True:  # trailers, then the blank line
                    t = r.readline(4096)
                    dest.sendall(t)
                    if t in (b"\r\n", b"\n"):
                        return
            cls._copy_exact(r, dest, size + 2)  # the chunk and its CRLF

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        """Bytes both ways, one chunk at a time, until both sides have closed
        (a side's close is passed on as a half-close) or nothing moves for
        IDLE_TIMEOUT_S."""
        peer = {a: b, b: a}
        with selectors.DefaultSelector() as sel:
            for s in (a, b):
                sel.register(s, selectors.EVENT_READ)
            live = 2
            while live:
                ready = sel.select(IDLE_TIMEOUT_S)
                if not ready:
                    return
                for key, _ in ready:
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(CHUNK)
                    if data:
                        peer[src].sendall(data)
                        continue
                    sel.unregister(src)
                    live -= 1
                    try:
                        peer[src].shutdown(socket.SHUT_WR)
                    except OSError:
                        return


def _close(s: socket.socket) -> None:
    with suppress(OSError):
        s.close()
