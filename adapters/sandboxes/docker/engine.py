"""Engine calls of one container: the SDK client, the container's facts
(inspect, user, mounts, pid, the engine's stat of a path), every engine
error translated in ONE place (`_engine_errors`, through
:meth:`Engine._errors`), and the exec channel (:class:`DockerExec`) that
execstream and ``Sandbox.exec`` run on, read through :class:`Hijacked`."""

from __future__ import annotations

import functools
import io
import os
import posixpath
import select
import socket
import tarfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

from adapters.errors import ErrorTable, FileMissing, SandboxError, SandboxGone, translating
from adapters.sandboxes.base import DEFAULT_IO_TIMEOUT_S, BoundedOutput, ReadTimeout, SandboxRef, _under
from adapters.sandboxes.docker.demux import CHUNK, FrameSplitter, demux_stdout, read_all, route
from adapters.sandboxes.docker.tar import decode_stat_header, store_chunks
from adapters.sandboxes.execstream import ExecStream, kill_argv

#: how many times a read-only probe whose answer came back empty is asked (see DockerExec.exec_probe)
PROBE_ATTEMPTS = 3


class Engine:
    """The engine side of a docker sandbox: its client (the caller's, which
    it never closes) and the container's facts."""

    def __init__(self, ref: SandboxRef, *, client: Any, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> None:
        self.ref = ref
        self.io_timeout_s = io_timeout_s
        self.client = client
        self._attrs_cache: dict | None = None

    # -- errors: the ONE place docker/requests errors become courier errors (_engine_errors) ------
    def _errors(self, what: str, path: str | None = None) -> AbstractContextManager[None]:
        return translating(_engine_errors, self, what, path)

    def alive(self) -> bool:
        """Whether the container still exists and runs (never raises)."""
        try:
            info = self.client.api.inspect_container(self.ref.target)
        except Exception:  # noqa: BLE001 - any failure means: not usable
            return False
        return bool(info.get("State", {}).get("Running"))

    # -- container facts -----------------------------------------------------------------
    def _attrs(self) -> dict:
        if self._attrs_cache is None:
            with self._errors("inspect"):
                self._attrs_cache = self.client.api.inspect_container(self.ref.target)
        return self._attrs_cache

    @property
    def container_id(self) -> str:
        return str(self._attrs()["Id"])

    def runs_as_root(self) -> bool:
        """Whether execs (and so the agent) run as root (the ref's `user`, else
        the container's): only then are the archive API and bind mounts, which
        read as root, used."""
        user = self.ref.options.get("user")
        if user is None:
            user = (self._attrs().get("Config") or {}).get("User") or ""
        name = user.split(":", 1)[0].strip()
        return name in ("", "0", "root")

    def _engine_is_local(self) -> bool:
        base = getattr(self.client.api, "base_url", "")
        return base.startswith("http+docker://") and not base.startswith("http+docker://ssh")

    def bind_host_path(self, resolved: str) -> tuple[str, str] | None:
        """(host path, mount source) when `resolved` lies in a bind mount
        whose source exists on this host; the innermost mount wins."""
        mounts = [m for m in self._attrs().get("Mounts") or []
                  if (m.get("Destination") or "").startswith("/") and _under(resolved, m["Destination"])]
        best = max(mounts, key=lambda m: len(m["Destination"]), default=None)
        if best is None or best.get("Type") != "bind" or not best.get("Source"):
            return None
        src = best["Source"]
        if not os.path.exists(src):
            return None
        rel = posixpath.relpath(resolved, best["Destination"])
        return (src if rel == "." else os.path.join(src, rel)), src

    def _live_pid(self) -> int | None:
        """The pid (on this host) of the running container's process, asked of the engine now."""
        try:
            info = self.client.api.inspect_container(self.ref.target)
        except Exception:  # noqa: BLE001 - any failure: this channel is not available
            return None
        state = info.get("State") or {}
        if info.get("Id") != self.container_id or not state.get("Running"):
            return None
        pid = state.get("Pid")
        return pid if isinstance(pid, int) and pid > 0 else None

    def _stat(self, path: str) -> dict | None:
        """The engine's lstat of `path` (HEAD /containers/{id}/archive); None if absent."""
        api = self.client.api
        with self._errors("stat", path=path):
            res = api.head(api._url("/containers/{0}/archive", self.container_id), params={"path": path})
            try:
                if res.status_code == 404:
                    return None
                api._raise_for_status(res)
                hdr = res.headers.get("x-docker-container-path-stat")
            finally:
                res.close()
        try:
            return decode_stat_header(hdr) if hdr else None
        except ValueError:
            return None


class Hijacked:
    """The attach socket of a started exec, the bytes that already arrived
    served first: the SDK hands over the socket *under* http.client's
    buffered reader, and what the engine sent right behind the response
    headers (under CPU load, a quick command's whole output) sits in that
    buffer, never to come out of the socket."""

    def __init__(self, sock: Any) -> None:
        #: what the SDK returned (closing it closes the connection)
        self.sock = sock
        self.raw = getattr(sock, "_sock", sock)
        try:
            self.early = bytearray(_read_ahead(sock, self.raw))
        except BaseException:
            self.close()
            raise

    def __getattr__(self, name: str) -> Any:  # fileno, settimeout, sendall, shutdown: the raw socket's
        return getattr(self.raw, name)

    def pending(self) -> int:
        """Bytes readable without waiting (the early ones, TLS's decrypted ones): select would not see them."""
        if self.early:
            return len(self.early)
        tls = getattr(self.raw, "pending", None)
        return int(tls()) if tls else 0

    def recv(self, size: int) -> bytes:
        if self.early:
            data = bytes(self.early[:size])
            del self.early[:size]
            return data
        return bytes(self.raw.recv(size))

    def recv_into(self, buf: memoryview) -> int:
        if self.early:
            n = min(len(buf), len(self.early))
            buf[:n] = self.early[:n]
            del self.early[:n]
            return n
        return int(self.raw.recv_into(buf))

    def close(self) -> None:
        with suppress(Exception):  # best effort on a dying socket
            self.sock.close()


def _read_ahead(sock: Any, raw: Any) -> bytes:
    """The bytes http.client's reader holds past the response headers of the
    hijacked `sock` (b"" when none, or no such reader). Never waits: the
    socket is non-blocking meanwhile."""
    response = getattr(sock, "_response", None)
    fp = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if not isinstance(fp, io.BufferedReader):
        return b""
    before = raw.gettimeout()
    raw.settimeout(0)
    try:
        held = fp.peek(CHUNK)  # what is buffered: fp.read of it reads nothing more
        return fp.read(len(held)) if held else b""
    except OSError:  # nothing buffered and nothing on the socket yet (a TLS want-read)
        return b""
    finally:
        raw.settimeout(before)


class DockerExec:
    """The :class:`~adapters.sandboxes.execstream.ExecChannel` of one container."""

    binary_safe = True

    def __init__(self, engine: Engine) -> None:
        self.sb = engine

    def _create(self, argv: Sequence[str], *, stdin: bool = False) -> str:
        api = self.sb.client.api
        with self.sb._errors("exec"):
            return str(api.exec_create(self.sb.container_id, list(argv), stdin=stdin, stdout=True, stderr=True,
                                       user=self.sb.ref.options.get("user", ""))["Id"])

    def _inspect(self, exec_id: str) -> int | None:
        """The exit code of a finished exec (None while it runs); a code of a
        signal death from a container gone meanwhile is SandboxGone."""
        with self.sb._errors("exec"):
            info = self.sb.client.api.exec_inspect(exec_id)
        if info.get("Running"):
            return None
        code = info.get("ExitCode")
        if code is not None and code >= 128 and not self.sb.alive():
            raise SandboxGone(f"container {self.sb.ref.target} went away during exec")
        return code

    def _exit_code(self, exec_id: str) -> int | None:
        """The exit code once the output ended: the engine may report the end
        of output a moment before the exit status (waited up to 5 s)."""
        start = time.monotonic()
        while (rc := self._inspect(exec_id)) is None and time.monotonic() < start + 5.0:
            if time.monotonic() > start + 0.2 and not self.sb.alive():
                raise SandboxGone(f"container {self.sb.ref.target} went away during exec")
            time.sleep(0.01)
        return rc

    def _start_socket(self, exec_id: str) -> Hijacked:
        """The socket of a started exec, with the sandbox's read deadline: a
        stalled container costs one attempt."""
        with self.sb._errors("exec"):
            sock = Hijacked(self.sb.client.api.exec_start(exec_id, socket=True))
        sock.settimeout(self.sb.io_timeout_s)
        return sock

    @contextmanager
    def _deadline(self, what: str) -> Iterator[None]:
        """A socket read past the sandbox's read deadline is a ReadTimeout."""
        try:
            yield
        except socket.timeout:
            raise ReadTimeout(f"container {self.sb.ref.target}: nothing received for {self.sb.io_timeout_s:g} s "
                              f"({what})") from None

    def _run_whole(self, argv: Sequence[str], stdin: Iterable[bytes] | None, out_cap: int,
                   err_cap: int) -> tuple[int, bytes, bytes]:
        """Run argv to its end (with `stdin` sent first, then EOF) and read
        its whole output, bounded; (exit code, stdout, stderr)."""
        out, err = BoundedOutput(out_cap), BoundedOutput(err_cap)
        what = argv[-1] if argv else "exec"
        exec_id = self._create(argv, stdin=stdin is not None)
        sock = self._start_socket(exec_id)
        try:
            with self.sb._errors("exec" if stdin is None else "exec stdin"), self._deadline(what):
                if stdin is not None:
                    for chunk in store_chunks(stdin, what):
                        if chunk:
                            sock.sendall(chunk)
                    sock.shutdown(socket.SHUT_WR)
                read_all(sock.recv, out, err)
        finally:
            sock.close()
        rc = self._exit_code(exec_id)
        if rc is None:
            raise SandboxGone("exec did not finish")
        return rc, out.value(), err.value()

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        return self._run_whole(argv, None, 1 << 20, 1 << 16)

    def exec_probe(self, argv: Sequence[str], *, answers: Sequence[int] = (0,)) -> tuple[int, bytes, bytes]:
        """A read-only probe that prints its answer whenever it exits with one
        of `answers`: an empty answer is asked again, up to
        :data:`PROBE_ATTEMPTS` times (a belt to :class:`Hijacked`'s braces;
        never for agent commands nor anything that changes the container)."""
        for _ in range(PROBE_ATTEMPTS):
            rc, out, err = self.exec_small(argv)
            if out or rc not in answers:
                break
        return rc, out, err

    def exec_stdin(self, argv: Sequence[str], chunks: Iterable[bytes]) -> tuple[int, bytes, bytes]:
        """Run argv with `chunks` streamed on its stdin (then EOF); for
        commands with short output (it is read after stdin is sent)."""
        return self._run_whole(argv, chunks, 65536, 65536)

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        exec_id = self._create(argv)
        sock = self._start_socket(exec_id)
        err = bytearray()

        def chunks() -> Iterator[bytes]:
            with self.sb._errors("exec stream"), self._deadline(argv[-2] if len(argv) > 1 else "exec stream"):
                yield from demux_stdout(sock.recv_into, err)

        return ExecStream(chunks=chunks(), exit_code=lambda: self._exit_code(exec_id), stderr=lambda: bytes(err),
                          close=sock.close)  # Hijacked.close: idempotent


class DockerRun:
    """One ``Sandbox.exec`` command in a container (an ExecRun), its output
    demultiplexed as it comes, killed by run id. Never run twice."""

    def __init__(self, ch: DockerExec, argv: Sequence[str], run_id: str) -> None:
        self.ch, self.run_id = ch, run_id
        self.exec_id = ch._create(argv)
        with ch.sb._errors("exec"):
            # read only when select (or pending) says so: no deadline needed
            self.sock = Hijacked(ch.sb.client.api.exec_start(self.exec_id, socket=True))
        self.frames = FrameSplitter()
        self.ended = False

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        if self.ended:
            return False
        if not self.sock.pending():  # bytes already here (early, or decrypted by TLS): select would not see them
            ready, _, _ = select.select([self.sock], [], [], wait_s)
            if not ready:
                return True
        with self.ch.sb._errors("exec output"):
            data = self.sock.recv(CHUNK)
        if not data:
            self.ended = True
            return False
        route(self.frames, data, out, err)
        return True

    def poll(self) -> int | None:
        return self.ch._inspect(self.exec_id)

    def wait(self, timeout_s: float) -> int | None:
        end = time.monotonic() + timeout_s
        while (rc := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.01)  # the engine may report the end of output a moment before the exit
        return rc

    def kill(self) -> None:
        with suppress(Exception):  # best effort; the container's `timeout` is the backstop
            self.ch.exec_small(kill_argv(self.run_id))
        self.close()

    def close(self) -> None:
        self.sock.close()  # idempotent


# -- the ONE table of docker / requests / OS errors (rules take the Engine, what it was doing, the path) --
def _not_found(exc: BaseException, eng: Engine, what: str, path: str | None) -> SandboxError:
    if path is not None and eng.alive():
        return FileMissing(f"{path}: no such file")
    return SandboxGone(f"container {eng.ref.target} is gone ({what})")


def _api_error(exc: Any, eng: Engine, what: str, path: str | None) -> SandboxError:
    status = exc.status_code or 0
    error = SandboxGone if status == 409 or status >= 500 or not eng.alive() else SandboxError
    return error(f"container {eng.ref.target}: {what} failed: {exc.explanation or exc}")


@functools.cache
def _engine_errors() -> ErrorTable[SandboxError]:
    import docker.errors
    import requests.exceptions
    import urllib3.exceptions

    return ErrorTable([
        (docker.errors.NotFound, _not_found),
        (docker.errors.APIError, _api_error),
        ((requests.exceptions.RequestException, urllib3.exceptions.HTTPError, docker.errors.DockerException,
          ConnectionError, TimeoutError), lambda exc, eng, what, path: SandboxGone(
            f"container {eng.ref.target}: {what} interrupted: {exc}")),
        (tarfile.ReadError, lambda exc, eng, what, path: SandboxGone(
            f"container {eng.ref.target}: {what}: archive cut short: {exc}")),
        (OSError, lambda exc, eng, what, path: SandboxGone(f"container {eng.ref.target}: {what}: {exc}")),
    ])
