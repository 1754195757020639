"""Modal sandboxes (`modal://sb-id/abs/path`), on the modal SDK (imported
lazily; credentials are the SDK's own): resolve, put and ``Sandbox.exec``
through execstream; reads through the SDK's file API (``sandbox.open``; its
version asked again after the last byte) where it has one, else execstream.
Reads happen inside the sandbox: a process racing a link swap after the
resolve can only reach what it could read itself. SDK errors are translated
in ONE place (`_modal_errors`, through :meth:`ModalSandbox._errors`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from adapters.errors import (
    ConfigError, CourierError, ErrorTable, FileChanging, FileMissing, NotAFile, SandboxError, SandboxGone,
    UnsafePath, translating,
)
from adapters.sandboxes.base import (
    DEFAULT_IO_TIMEOUT_S, BoundedOutput, PathPolicy, Sandbox, SandboxRef, call_with_deadline, grew_over_cap,
    with_deadline,
)
from adapters.sandboxes.execstream import (
    VERSION_FORMAT, ExecStream, ExecStreamMixin, exec_iter_file, exec_put, kill_argv,
)

CHUNK = 1024 * 1024
MODAL_DEFAULT_ROOTS = ("/workspace", "/tmp")
INSTALL_HINT = "modal sandboxes need the modal SDK: pip install 'courier[modal]' (or: pip install modal)"

def _modal():
    try:
        import modal
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    return modal


# one SDK sandbox object per id and process (from_id is a network call)
_handles: OrderedDict[str, Any] = OrderedDict()
_handles_lock = threading.Lock()


def forget_handles() -> None:
    with _handles_lock:
        _handles.clear()


class _ModalExec:
    """execstream's ExecChannel over ``Sandbox.exec`` (argv, binary stdout)."""

    binary_safe = True

    def __init__(self, sandbox: "ModalSandbox") -> None:
        self.msb = sandbox

    def _exec(self, argv: Sequence[str]):
        with self.msb._errors(argv[-1] if argv else "exec"):
            return self.msb.handle().exec(*argv, text=False)

    def _timed(self, stream, what: str) -> Iterator[bytes]:
        """An SDK output stream with the sandbox's read deadline (the SDK's
        iterators block without one)."""
        return with_deadline(stream, self.msb.io_timeout_s, f"modal sandbox {self.msb.ref.target}: {what}")

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        p = self._exec(argv)
        with self.msb._errors(argv[-1]):
            out = _bounded(self._timed(p.stdout, "exec output"))
            err = _bounded(self._timed(p.stderr, "exec output"))
            rc = p.wait()
        return (rc if rc is not None else p.returncode), out, err

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        p = self._exec(argv)
        state: dict[str, Any] = {"rc": None}

        def chunks() -> Iterator[bytes]:
            with self.msb._errors(argv[-2] if len(argv) > 1 else "exec"):
                for chunk in self._timed(p.stdout, "exec stream"):
                    yield _as_bytes(chunk)
                rc = p.wait()
                state["rc"] = rc if rc is not None else p.returncode

        def stderr() -> bytes:
            with contextlib.suppress(Exception):
                return _bounded(p.stderr)
            return b""

        return ExecStream(chunks=chunks(), exit_code=lambda: state["rc"], stderr=stderr)

    def exec_stdin(self, argv: Sequence[str], chunks: Iterable[bytes]) -> tuple[int, bytes, bytes]:
        p = self._exec(argv)
        what = f"modal sandbox {self.msb.ref.target}: exec stdin"
        idle = self.msb.io_timeout_s

        def send(chunk: bytes) -> None:
            p.stdin.write(chunk)
            p.stdin.drain()

        def eof() -> None:
            p.stdin.write_eof()
            p.stdin.drain()

        with self.msb._errors(argv[-1]):
            for chunk in chunks:  # each write has a deadline: a sandbox that stops reading costs one attempt
                call_with_deadline(functools.partial(send, chunk), idle, what)
            call_with_deadline(eof, idle, what)
            err = _bounded(self._timed(p.stderr, "exec stdin"))
            rc = p.wait()
        return (rc if rc is not None else p.returncode), b"", err


class _ModalRun:
    """One ``Sandbox.exec`` command (an ExecRun): the SDK's stdout and stderr
    iterators block, so a helper thread reads each into a shared queue."""

    def __init__(self, ch: _ModalExec, argv: Sequence[str], run_id: str, backstop_s: int | None) -> None:
        self.ch, self.run_id = ch, run_id
        with ch.msb._errors("exec"):
            self.p = ch.msb.handle().exec(*argv, text=False, timeout=backstop_s)
            self.p.stdin.write_eof()  # stdin: empty
            self.p.stdin.drain()
        self.cond = threading.Condition()
        self.chunks: list[tuple[str, bytes]] = []
        self.open_streams = 2
        self.failed: BaseException | None = None
        for name, stream in (("out", self.p.stdout), ("err", self.p.stderr)):
            threading.Thread(target=self._read, args=(name, stream), name=f"courier-modal-exec-{name}",
                             daemon=True).start()

    def _read(self, name: str, stream) -> None:
        try:
            for chunk in stream:
                if chunk:
                    with self.cond:
                        self.chunks.append((name, _as_bytes(chunk)))
                        self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to pump
            with self.cond:
                self.failed = self.failed or exc
        finally:
            with self.cond:
                self.open_streams -= 1
                self.cond.notify_all()

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        with self.cond:
            if not self.chunks and self.open_streams and self.failed is None:
                self.cond.wait(wait_s)
            chunks, self.chunks = self.chunks, []
            failed, left = self.failed, self.open_streams
        for name, chunk in chunks:
            (out if name == "out" else err).add(chunk)
        if failed is not None:
            with self.ch.msb._errors("exec output"):
                raise failed
        return left > 0

    def poll(self) -> int | None:
        with self.ch.msb._errors("exec"):
            return self.p.poll()

    def wait(self, timeout_s: float) -> int | None:
        end = time.monotonic() + timeout_s
        while (rc := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.02)  # the SDK's wait() has no timeout
        return rc

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the exec timeout is the backstop
            self.ch.exec_small(kill_argv(self.run_id))
        with contextlib.suppress(Exception):
            self.wait(2.0)  # the run ends with its processes

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.p.poll() is not None:
                self.p.wait()  # reaps and releases the streams


def _as_bytes(chunk) -> bytes:
    return chunk.encode("utf-8", "surrogateescape") if isinstance(chunk, str) else bytes(chunk)


def _bounded(stream, limit: int = 1 << 20) -> bytes:
    out = bytearray()
    for chunk in stream:
        if len(out) < limit:
            out += _as_bytes(chunk)
    return bytes(out[:limit])


# the mixin's policy may be None until the first resolve learns $HOME (Sandbox's never is)
class ModalSandbox(ExecStreamMixin, Sandbox):  # type: ignore[misc]
    kind = "modal"
    exec_default_roots = MODAL_DEFAULT_ROOTS

    def __init__(self, ref: SandboxRef, policy: PathPolicy | None = None, *, client: Any = None,
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S) -> None:
        super().__init__(ref, policy)  # type: ignore[arg-type]
        if not ref.target:
            raise ConfigError("modal sandbox needs an id: modal://sb-.../abs/path")
        self.client = client
        #: read deadline of every exec output and file read (a stalled sandbox costs one attempt)
        self.io_timeout_s = io_timeout_s
        self._handle: Any = None

    def handle(self):
        """The SDK's Sandbox object (``modal.Sandbox.from_id``), shared per id."""
        if self._handle is None:
            key = self.ref.target
            with _handles_lock:
                h = _handles.get(key)
            if h is None:
                modal = _modal()
                with self._errors("from_id"):
                    h = modal.Sandbox.from_id(key, client=self.client) if self.client else modal.Sandbox.from_id(key)
                with _handles_lock:
                    _handles[key] = h
                    while len(_handles) > 64:
                        _handles.popitem(last=False)
            self._handle = h
        return self._handle

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """SDK errors translated by `_modal_errors`; a sandbox gone drops its cached handle."""
        return translating(_modal_errors, self, what,
                           then=lambda err: self._drop_handle() if isinstance(err, SandboxGone) else None)

    def _map(self, exc: Exception, what: str) -> CourierError | None:
        return _modal_errors().map(exc, self, what)

    def _drop_handle(self) -> None:
        with _handles_lock:
            if _handles.get(self.ref.target) is self._handle:
                _handles.pop(self.ref.target, None)
        self._handle = None

    def exec_channel(self) -> _ModalExec:
        return _ModalExec(self)

    def exec_start(self, argv: list[str], run_id: str, *, backstop_s: int | None = None) -> _ModalRun:
        """A ``Sandbox.exec`` command (ExecStreamMixin.exec): one ``sandbox.exec``,
        which the SDK ends after `backstop_s` should the worker not."""
        return _ModalRun(self.exec_channel(), argv, run_id, backstop_s)

    def _iter_file_api(self, resolved: str) -> Iterator[bytes] | None:
        """Chunks through ``sandbox.open``; None when the SDK has no usable file API."""
        opener = getattr(self.handle(), "open", None)
        if opener is None:
            return None
        try:  # the open too has a deadline (a FIFO swapped in after resolve may block it)
            f = call_with_deadline(lambda: opener(resolved, "rb"), self.io_timeout_s,
                                   f"modal sandbox {self.ref.target}: opening {resolved}")
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise self._map(exc, resolved) from exc  # type: ignore[misc]
        except _modal().exception.Error as exc:
            mapped = self._map(exc, resolved)
            if isinstance(mapped, (SandboxGone, ConfigError, FileMissing, NotAFile, UnsafePath)):
                raise mapped from exc
            return None  # the file API failed: use exec

        def chunks() -> Iterator[bytes]:
            try:
                with self._errors(resolved):
                    reads = iter(lambda: _as_bytes(f.read(CHUNK) or b""), b"")
                    yield from with_deadline(reads, self.io_timeout_s, f"modal sandbox {self.ref.target}: {resolved}")
            finally:
                with contextlib.suppress(Exception):
                    f.close()

        return chunks()

    def _stream(self, resolved: str, size: int | None, max_bytes: int | None, nlink: int = 1,
                version: str = "") -> Iterator[bytes]:
        """The file's chunks: the file API where the SDK has one, else exec.
        `version`: the resolve's (Resolved.version), compared after the read."""
        policy = self.policy_for(None)
        chunks = self._iter_file_api(resolved)
        if chunks is None:  # exec: the stream script checks the opened file's links and version itself
            yield from exec_iter_file(self.exec_channel(), resolved, expected_size=size, max_bytes=max_bytes,
                                      policy=policy)
            return
        policy.check_links(resolved, nlink)  # the file API cannot say: the resolve's count
        before = version or self._version(resolved)  # taken before the first byte
        n = 0
        for chunk in chunks:
            n += len(chunk)
            if max_bytes is not None and n > max_bytes:
                raise grew_over_cap(resolved, n, max_bytes)
            yield chunk
        if size is not None and n != size:
            raise SandboxGone(f"{resolved}: changed during transfer ({n:,} bytes read, {size:,} expected)")
        if self._version(resolved) != before:
            raise FileChanging(f"{resolved}: changed while it was read (written meanwhile); read again later")

    def _version(self, resolved: str) -> str:
        """The file's version (size, links, mtime and ctime in ns, inode) by
        ONE exec: the file API's read is one version of the file only if this
        is the same after its last byte as before its first."""
        rc, out, err = self.exec_channel().exec_small(["stat", "-L", "-c", VERSION_FORMAT, "--", resolved])
        if rc != 0:
            raise FileChanging(f"{resolved}: cannot stat it (exit {rc}: {err[:200]!r}); read again later")
        return out.decode("utf-8", "surrogateescape").rstrip("\n")

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        again, _ = self.resolve(resolved)  # also learns $HOME for the default policy
        if again != resolved:
            raise UnsafePath(f"{resolved}: resolves to {again}")
        return self._stream(resolved, None, None)

    def _copy_out(self, path: str, store, key: str, *, max_bytes: int):
        r = self._resolve(path)
        self.check_size(path, r.size, max_bytes)
        return store.put_stream(key, self._stream(r.path, r.size, max_bytes, r.nlink, r.version), max_bytes=max_bytes)

    def _copy_in(self, store, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """Through the file API where the SDK has one, else `cat` fed through exec stdin (exec_put)."""
        self._deny_lexical(dest_path)
        return exec_put(self.exec_channel(), self.policy_for, store, key, dest_path, max_bytes=max_bytes,
                        write=functools.partial(self._write_file_api, dest_path))

    def _write_file_api(self, dest_path: str, tmp: str, chunks: Iterator[bytes], uid: int, gid: int) -> bool:
        """`chunks` written at `tmp` through ``sandbox.open``, each write with a
        deadline; False when the SDK has no usable file API (nothing written)."""
        opener = getattr(self.handle(), "open", None)
        if opener is None:
            return False
        try:
            f = opener(tmp, "wb")
        except _modal().exception.Error as exc:
            mapped = self._map(exc, dest_path)
            if isinstance(mapped, (SandboxGone, ConfigError)):
                raise mapped from exc
            return False
        what = f"modal sandbox {self.ref.target}: writing {tmp}"
        try:
            with self._errors(dest_path):
                for chunk in chunks:
                    call_with_deadline(functools.partial(f.write, chunk), self.io_timeout_s, what)
                call_with_deadline(f.flush, self.io_timeout_s, what)
                call_with_deadline(f.close, self.io_timeout_s, what)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(Exception):  # best effort: the sandbox may be gone
                self.exec_channel().exec_small(["rm", "-f", "--", tmp])
            raise
        return True


# -- the ONE table of modal SDK / OS errors (rules take the ModalSandbox and what it was doing) --
def _modal_errors() -> ErrorTable[CourierError]:
    """Built per error, not cached: without the SDK (or another SDK loaded) only its OS rows. The
    file rows take the SDK's errors and the OS's alike (no SDK error is an OSError)."""
    try:
        me = _modal().exception
    except ConfigError:
        me = None

    def sdk(*names: str) -> tuple[type, ...]:
        return tuple(getattr(me, n) for n in names if hasattr(me, n))

    def gone(exc: BaseException, sb: ModalSandbox, what: str) -> CourierError:
        return SandboxGone(f"modal sandbox {sb.ref.target} is gone or unreachable ({what}): {exc}")

    return ErrorTable([
        (sdk("AuthError"), lambda exc, sb, what: ConfigError(
            f"modal sandbox {sb.ref.target}: authentication failed (MODAL_TOKEN_ID / MODAL_TOKEN_SECRET): {exc}")),
        (sdk("PermissionDeniedError"), lambda exc, sb, what: ConfigError(
            f"modal sandbox {sb.ref.target}: permission denied by Modal: {exc}")),
        ((*sdk("SandboxFilesystemNotFoundError"), FileNotFoundError), _missing),
        ((*sdk("SandboxFilesystemIsADirectoryError"), IsADirectoryError), _a_directory),
        ((*sdk("SandboxFilesystemPermissionError"), PermissionError), _denied),
        (sdk("NotFoundError", "SandboxTerminatedError", "SandboxTimeoutError", "ConnectionError", "ClientClosed",
             "TimeoutError", "ExecTimeoutError", "InternalFailure", "ServiceError"), gone),
        (sdk("Error"), lambda exc, sb, what: SandboxError(f"{what}: modal sandbox {sb.ref.target}: {exc}")),
        ((ConnectionError, TimeoutError), lambda exc, sb, what: SandboxGone(
            f"modal sandbox {sb.ref.target}: connection lost ({what}): {exc}")),
    ])


def _missing(exc: BaseException, sb: ModalSandbox, what: str) -> CourierError:
    return FileMissing(f"{what}: no such file in modal sandbox {sb.ref.target}")


def _a_directory(exc: BaseException, sb: ModalSandbox, what: str) -> CourierError:
    return NotAFile(f"{what}: is a directory")


def _denied(exc: BaseException, sb: ModalSandbox, what: str) -> CourierError:
    return UnsafePath(f"{what}: permission denied in modal sandbox {sb.ref.target}")
