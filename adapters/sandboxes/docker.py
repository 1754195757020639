"""Docker containers (any engine serving the Docker API: dockerd, podman).

Channels, fastest first:

1. bind mount: when the resolved path lies in a ``type: bind`` mount and the
   engine is on this host (unix socket), the file is read from the host
   path directly. The host path is re-checked with ``realpath`` against the
   mount source, opened with O_NOFOLLOW and checked again through
   ``/proc/self/fd``, so a link inside the mount can never reach the host.
2. host root: a file of at least ``HOST_ROOT_MIN_BYTES`` that the archive
   API would read (engine on this host, container running as root, path
   proved link-free by the engine's stat walk) is opened from the host below
   the root of the container's process (``/proc/<pid>/root``, ``openat2``
   with ``RESOLVE_IN_ROOT`` and no link followed, the pid pinned with a
   pidfd and confirmed by the engine), must be the very file the engine
   stat'ed (type, size, permissions, mtime in ns), and is copied in the
   kernel (:mod:`adapters.sandboxes.hostroot`); else the archive API.
3. archive API: the ``GET .../archive`` body streamed in ~1 MiB pieces
   straight into storage; ``tarfile`` parses the headers from a
   forward-only reader and the archive is checked member by member
   (:func:`iter_single_member`).
4. exec: ``cat`` through exec stdout (:mod:`adapters.sandboxes.execstream`)
   from the descriptor the stream script opened and checked (type, path,
   link count), available as :meth:`DockerSandbox.extract_via_exec`. It is
   the channel whenever the others would read what the agent could not:
   a container not running as root (bind mounts and the archive API read as
   root), a path with glob characters (podman's archive API expands them),
   a path resolved through links (the archive GET would follow a link
   swapped in after the check).

Every exec read has a deadline (``io_timeout_s``): a container whose shell
stalls costs one attempt (ReadTimeout, a SandboxGone), never the worker.

Commands (``Sandbox.exec``): one docker exec under execstream's run script
(working directory resolved and checked first, the image's GNU ``timeout``
as a backstop where it has one), stdout and stderr demultiplexed from the
attach socket as they arrive, the exit code from the engine; on a timeout
one more exec kills every process of the run. Unlike the local backend, a
background job that still holds the output when the command exits keeps
running: the engine ends the exec's stream with the command itself.

Resolving: the engine's lstat of each component (``HEAD .../archive``,
~2 ms each on podman) proves a path link-free, so it is its own
resolution; a path with a link on the way (or one the lexical policy
refuses) is resolved by ONE exec (``readlink -f`` + ``stat``, ~100 ms).

Reads *inside* the container through the archive or exec channels are
scoped to the container's filesystem by the engine; a process in the
container that races a link swap after our resolve can only reach files it
could read (and copy into /workspace) anyway. The host is reachable only
through bind mounts, which is why that channel is checked on the host side.

Every docker / requests / urllib3 error is translated in ONE place
(:meth:`DockerSandbox._errors`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import posixpath
import select
import socket
import struct
import tarfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from adapters.errors import (
    CourierError, FileChanging, FileMissing, NotAFile, SandboxError, SandboxGone, StorageError, TooLarge, UnsafePath,
)
from adapters.sandboxes.base import (
    DEFAULT_IO_TIMEOUT_S, DEFAULT_MAX_BYTES, BoundedOutput, PathPolicy, ReadTimeout, Sandbox, SandboxRef, _under,
    check_lexical, open_regular, unchanged,
)
from adapters.sandboxes.execstream import (
    EXIT_CHANGED, ExecStream, ExecStreamMixin, Resolved, exec_iter_file, exec_put, exec_resolve,
    kill_argv, resolve_put_dest,
)
from adapters.sandboxes.hostroot import open_in_container
from adapters.sandboxes.routing import host_of  # noqa: F401 - re-exported for callers

CHUNK = 1024 * 1024
#: files from this size up are read from the host through the container process's root (a
#: local engine; see hostroot): below it, the archive API's one GET costs less than the two
#: engine inspects that channel takes
HOST_ROOT_MIN_BYTES = 8 * 1024 * 1024
#: a path of more components than this is resolved by one exec, not one engine stat per component
MAX_STAT_WALK = 32
#: default roots inside a container (plus the exec user's $HOME when sane)
DOCKER_DEFAULT_ROOTS = ("/workspace", "/tmp")

# Go os.FileMode type bits, as the engine reports them in the archive stat header
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_DIR = 1 << 31
_GO_MODE_TYPE = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)

#: what Go's filepath.Match treats as pattern syntax: the engine's archive API
#: (podman's copier) expands it, so such a path never goes to that API
GLOB_CHARS = frozenset("*?[]\\")


def has_glob(path: str) -> bool:
    """Whether the archive API could read `path` as a pattern instead of a name."""
    return not GLOB_CHARS.isdisjoint(path)


_FINALIZE_SCRIPT = r"""if [ -L "$2" ] || [ -d "$2" ]; then rm -f -- "$1"; exit 97; fi
mv -f -- "$1" "$2" || { rm -f -- "$1"; exit 3; }
"""


# -- archive member checking (plain functions: testable with crafted tars) ----------
class ForwardReader:
    """A forward-only file over byte chunks: enough of `read/tell/seek` for
    tarfile's plain read mode to parse headers, plus :meth:`read_some`,
    which hands out the chunks themselves (no copy) when aligned."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._cur = b""
        self._off = 0
        self._pos = 0

    @classmethod
    def of(cls, src, block: int = CHUNK) -> "ForwardReader":
        if isinstance(src, ForwardReader):
            return src

        def chunks():
            while data := src.read(block):
                yield data
        return cls(chunks())

    def _fill(self) -> bool:
        while self._off >= len(self._cur):
            try:
                self._cur = next(self._it)
            except StopIteration:
                self._cur, self._off = b"", 0
                return False
            self._off = 0
        return True

    def read_some(self, n: int) -> bytes:
        """Up to `n` bytes (b"" at the end), without joining chunks."""
        if n <= 0 or not self._fill():
            return b""
        cur, off = self._cur, self._off
        if off == 0 and len(cur) <= n:
            out = cur
        else:
            out = cur[off:off + n]
        self._off += len(out)
        self._pos += len(out)
        return out

    def read(self, n: int = -1) -> bytes:
        parts = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            piece = self.read_some(want)
            if not piece:
                break
            parts.append(piece)
            want -= len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0 or pos < self._pos:
            raise io.UnsupportedOperation("forward-only stream")
        while self._pos < pos:
            if not self.read_some(min(CHUNK, pos - self._pos)):
                break
        return self._pos

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return True


def iter_single_member(fileobj, *, expected_name: str | None, expected_size: int | None,
                       max_bytes: int, block: int = CHUNK) -> Iterator[bytes]:
    """Yield the data of the ONE regular file in a tar stream, checked.

    Refuses (UnsafePath) links, devices, directories, absolute or `..`
    names, a name other than `expected_name`, more than one member, and a
    size other than `expected_size`; over `max_bytes` is TooLarge. The
    trailing checks run before the generator ends, so an all-or-nothing
    store keeps nothing when they fail.

    tarfile parses the headers (pax, GNU long names) from a forward-only
    reader; the member's data is then handed out as the received chunks
    (no re-buffering), so a big file costs no extra copies.
    """
    reader = ForwardReader.of(fileobj, block)
    try:
        tar = tarfile.open(fileobj=reader, mode="r:")
    except tarfile.ReadError as exc:
        raise SandboxGone(f"archive stream ended or is corrupt: {exc}") from exc
    try:
        member = tar.next()
    except tarfile.ReadError as exc:
        raise SandboxGone(f"archive stream ended or is corrupt: {exc}") from exc
    if member is None:
        raise FileMissing("the archive is empty")
    check_member(member, expected_name=expected_name, expected_size=expected_size, max_bytes=max_bytes)
    if reader.tell() != member.offset_data:
        raise SandboxGone(f"{member.name}: archive out of step")
    left = member.size
    parts: list[bytes] = []
    have = 0
    while left > 0:
        chunk = reader.read_some(min(block - have, left))
        if not chunk:
            raise SandboxGone(f"{member.name}: archive ended after {member.size - left:,} of {member.size:,} bytes")
        left -= len(chunk)
        parts.append(chunk)
        have += len(chunk)
        if have >= block or left == 0:
            # engines send small HTTP chunks (podman: 32 KiB): hand out ~1 MiB
            # pieces so hashing and writing see few, large calls
            yield parts[0] if len(parts) == 1 else b"".join(parts)
            parts, have = [], 0
    try:
        extra = tar.next()
    except tarfile.ReadError as exc:
        raise SandboxGone(f"archive stream ended early: {exc}") from exc
    if extra is not None:
        raise UnsafePath(f"archive holds more than one member ({member.name!r}, {extra.name!r})")


def check_member(member: tarfile.TarInfo, *, expected_name: str | None, expected_size: int | None,
                 max_bytes: int) -> None:
    name = member.name
    if name.startswith("/") or "\x00" in name or ".." in name.split("/"):
        raise UnsafePath(f"archive member {name!r}: unsafe name")
    if "/" in name.rstrip("/"):
        raise UnsafePath(f"archive member {name!r}: not a single file")
    if member.islnk() or member.issym():
        raise UnsafePath(f"archive member {name!r}: is a link")
    if member.isdir():
        raise NotAFile(f"archive member {name!r}: is a directory")
    if not member.isreg() or member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise NotAFile(f"archive member {name!r}: not a regular file")
    if expected_name is not None and name != expected_name:
        raise UnsafePath(f"archive member {name!r}: expected {expected_name!r}")
    if member.size > max_bytes:
        raise TooLarge(f"{name}: {member.size:,} bytes is over the {max_bytes:,} byte cap",
                       size_bytes=member.size, limit_bytes=max_bytes)
    if expected_size is not None and member.size != expected_size:
        raise SandboxGone(f"{name}: changed ({member.size:,} bytes in the archive, {expected_size:,} at resolve)")


def decode_stat_header(hdr: str) -> dict:
    """The engine's X-Docker-Container-Path-Stat header: base64 of a JSON
    object, standard (dockerd) or URL-safe (podman) alphabet, padding
    optional. Raises ValueError when it is neither."""
    text = hdr.strip().replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"bad stat header: {exc}") from exc
    st = json.loads(raw)
    if not isinstance(st, dict):
        raise ValueError("bad stat header: not an object")
    return st


def check_archive_stat(st: dict, resolved: str, size: int | None, expect: dict | None = None) -> None:
    """The engine's stat of what its archive GET reads (its response header)
    must be the file that was checked: same name and size, where the engine
    says where the path led (`linkTarget`) that very path, and the same
    mode and mtime (nanoseconds) as the stat walk saw (`expect`). A directory
    swapped for a link after the check leads the GET to another file:
    refused here, before a byte is read."""
    if not isinstance(st, dict):
        return
    name = st.get("name")
    if name and name != posixpath.basename(resolved):
        raise UnsafePath(f"{resolved}: the archive reads {name!r} (changed after resolve)")
    target = st.get("linkTarget") or ""
    if target and posixpath.normpath(target) != resolved:
        raise UnsafePath(f"{resolved}: now leads to {target} (changed after resolve)")
    if size is not None and "size" in st and int(st.get("size") or 0) != size:
        raise SandboxGone(f"{resolved}: changed ({st.get('size')} bytes now, {size:,} at resolve)")
    if expect is not None:
        if "mode" in expect and st.get("mode") != expect["mode"]:
            raise UnsafePath(f"{resolved}: the archive reads another file than the one checked (mode differs)")
        if "mtime" in expect and st.get("mtime") != expect["mtime"]:
            # another file, or this one rewritten meanwhile: never delivered, a retry checks again
            raise SandboxGone(f"{resolved}: changed after it was checked (mtime differs)")


def tar_stream(name: str, size: int, chunks: Iterable[bytes], *, uid: int = 0, gid: int = 0,
               mode: int = 0o644) -> Iterator[bytes]:
    """A one-file tar archive as a generator (no temp file, no whole read).
    Raises when `chunks` does not hold exactly `size` bytes."""
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mode = mode
    ti.mtime = int(time.time())
    ti.uid, ti.gid = uid, gid
    ti.type = tarfile.REGTYPE
    yield ti.tobuf(format=tarfile.PAX_FORMAT)
    n = 0
    it = iter(chunks)
    while True:
        try:
            chunk = next(it)
        except StopIteration:
            break
        except CourierError:
            raise
        except Exception as exc:  # the blob store broke mid-read: say so, not "sandbox gone"
            raise StorageError(f"{name}: reading the stored blob failed: {exc}") from exc
        n += len(chunk)
        if n > size:
            raise SandboxError(f"{name}: the stored blob grew while sending")
        yield chunk
    if n != size:
        raise SandboxError(f"{name}: the stored blob shrank while sending ({n} of {size})")
    pad = (-size) % tarfile.BLOCKSIZE
    yield b"\0" * (pad + 2 * tarfile.BLOCKSIZE)


class _DockerExec:
    """The :class:`~adapters.sandboxes.execstream.ExecChannel` of one container."""

    binary_safe = True

    def __init__(self, sandbox: "DockerSandbox") -> None:
        self.sb = sandbox

    def _create(self, argv: Sequence[str]) -> str:
        api = self.sb.client.api
        with self.sb._errors("exec"):
            return api.exec_create(self.sb.container_id, list(argv), stdout=True, stderr=True,
                                   user=self.sb.ref.options.get("user", ""))["Id"]

    def _exit_code(self, exec_id: str) -> int | None:
        api = self.sb.client.api
        with self.sb._errors("exec"):
            info = api.exec_inspect(exec_id)
            start = time.monotonic()
            # the engine may report the end of output a moment before the exit status
            while info.get("Running") and time.monotonic() < start + 5.0:
                if time.monotonic() > start + 0.2 and not self.sb.alive():
                    raise SandboxGone(f"container {self.sb.ref.target} went away during exec")
                time.sleep(0.01)
                info = api.exec_inspect(exec_id)
        if info.get("Running"):
            return None
        code = info.get("ExitCode")
        if code is not None and code >= 128 and not self.sb.alive():
            raise SandboxGone(f"container {self.sb.ref.target} went away during exec")
        return code

    def _start_socket(self, exec_id: str):
        """(closable, raw socket) of a started exec, the raw socket with the
        sandbox's read deadline: a stalled container costs one attempt."""
        with self.sb._errors("exec"):
            sock = self.sb.client.api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.settimeout(self.sb.io_timeout_s)
        return sock, raw

    def _timed_out(self, what: str) -> ReadTimeout:
        return ReadTimeout(f"container {self.sb.ref.target}: nothing received for {self.sb.io_timeout_s:g} s ({what})")

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        exec_id = self._create(argv)
        sock, raw = self._start_socket(exec_id)
        out, err = BoundedOutput(1 << 20), BoundedOutput(1 << 16)
        frames = _Frames()
        try:
            with self.sb._errors("exec"):
                while True:
                    try:
                        data = raw.recv(65536)
                    except socket.timeout:
                        raise self._timed_out(argv[-1] if argv else "exec") from None
                    if not data:
                        break
                    for kind, piece in frames.feed(data):
                        (out if kind == 1 else err).add(piece)
        finally:
            with suppress(Exception):
                sock.close()
        rc = self._exit_code(exec_id)
        if rc is None:
            raise SandboxGone("exec did not finish")
        return rc, out.value(), err.value()

    def exec_stdin(self, argv: Sequence[str], chunks: Iterable[bytes]) -> tuple[int, bytes, bytes]:
        """Run argv with `chunks` streamed on its stdin (then EOF); for
        commands with short output (it is read after stdin is sent)."""
        api = self.sb.client.api
        with self.sb._errors("exec"):
            exec_id = api.exec_create(self.sb.container_id, list(argv), stdin=True, stdout=True, stderr=True,
                                      user=self.sb.ref.options.get("user", ""))["Id"]
        sock, raw = self._start_socket(exec_id)
        out, err = bytearray(), bytearray()
        try:
            with self.sb._errors("exec stdin"), _deadline(self, argv[-1] if argv else "exec stdin"):
                for chunk in _store_chunks(chunks, argv[-1] if argv else "exec stdin"):
                    if chunk:
                        raw.sendall(chunk)
                raw.shutdown(socket.SHUT_WR)
                buf = bytearray()
                while data := raw.recv(65536):
                    buf += data
                    while len(buf) >= 8:
                        kind, size = struct.unpack(">BxxxL", bytes(buf[:8]))
                        if len(buf) < 8 + size:
                            break
                        target = out if kind == 1 else err
                        if len(target) < 65536:
                            target += buf[8:8 + size]
                        del buf[:8 + size]
        finally:
            try:
                sock.close()
            except Exception:  # noqa: BLE001
                pass
        rc = self._exit_code(exec_id)
        if rc is None:
            raise SandboxGone("exec did not finish")
        return rc, bytes(out), bytes(err)

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        exec_id = self._create(argv)
        sock, raw = self._start_socket(exec_id)
        err = bytearray()
        state = {"closed": False}

        def chunks() -> Iterator[bytes]:
            with self.sb._errors("exec stream"), _deadline(self, argv[-2] if len(argv) > 1 else "exec stream"):
                yield from demux_stdout(raw.recv_into, err)

        def close() -> None:
            if not state["closed"]:
                state["closed"] = True
                try:
                    sock.close()
                except Exception:  # noqa: BLE001 - best effort on a dying socket
                    pass

        return ExecStream(chunks=chunks(), exit_code=lambda: self._exit_code(exec_id), stderr=lambda: bytes(err),
                          close=close)


@contextmanager
def _deadline(ch: "_DockerExec", what: str):
    """A socket read past the sandbox's read deadline is a ReadTimeout."""
    try:
        yield
    except socket.timeout:
        raise ch._timed_out(what) from None


def _store_chunks(chunks: Iterable[bytes], what: str) -> Iterator[bytes]:
    """`chunks` with a failure of their source (the blob store) said as such
    (StorageError), not taken for the container going away."""
    it = iter(chunks)
    while True:
        try:
            chunk = next(it)
        except StopIteration:
            return
        except CourierError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised, named
            raise StorageError(f"{what}: reading the stored blob failed: {exc}") from exc
        yield chunk


class _Frames:
    """Splits a multiplexed exec stream (8-byte frame headers: stream id,
    size) fed in arbitrary pieces into (stream id, bytes)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.kind = 0
        self.left = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        pos, n, out = 0, len(self.buf), []
        while pos < n:
            if self.left == 0:
                if n - pos < 8:
                    break
                self.kind, self.left = struct.unpack_from(">BxxxL", self.buf, pos)
                pos += 8
                continue
            take = min(self.left, n - pos)
            out.append((self.kind, bytes(self.buf[pos:pos + take])))
            pos += take
            self.left -= take
        del self.buf[:pos]
        return out


class _DockerRun:
    """One ``Sandbox.exec`` command in a container (an ExecRun for run_exec):
    stdout and stderr demultiplexed from the attach socket as they come, the
    exit code from the engine's exec inspect, killed by run id."""

    def __init__(self, ch: _DockerExec, argv: Sequence[str], run_id: str) -> None:
        self.ch, self.run_id = ch, run_id
        self.exec_id = ch._create(argv)
        with ch.sb._errors("exec"):
            self.sock = ch.sb.client.api.exec_start(self.exec_id, socket=True)
        self.raw = getattr(self.sock, "_sock", self.sock)  # read only when select says so: no deadline needed
        self.frames = _Frames()
        self.ended = False
        self.closed = False

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        if self.ended:
            return False
        pending = getattr(self.raw, "pending", None)  # TLS: bytes already decrypted
        if not (pending and pending()):
            ready, _, _ = select.select([self.raw], [], [], wait_s)
            if not ready:
                return True
        with self.ch.sb._errors("exec output"):
            data = self.raw.recv(CHUNK)
        if not data:
            self.ended = True
            return False
        for kind, piece in self.frames.feed(data):
            if kind == 1:
                out.add(piece)
            elif kind == 2:
                err.add(piece)
        return True

    def poll(self) -> int | None:
        sb = self.ch.sb
        with sb._errors("exec"):
            info = sb.client.api.exec_inspect(self.exec_id)
        if info.get("Running"):
            return None
        code = info.get("ExitCode")
        if code is not None and code >= 128 and not sb.alive():
            raise SandboxGone(f"container {sb.ref.target} went away during exec")
        return code

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
        if not self.closed:
            self.closed = True
            with suppress(Exception):  # best effort on a dying socket
                self.sock.close()


def demux_stdout(recv_into, err: bytearray, *, block: int = CHUNK, err_cap: int = 4096) -> Iterator[bytes]:
    """Stdout of a multiplexed exec stream (8-byte frame headers: stream id,
    size) as ~`block`-sized pieces; stderr goes to `err` (capped).

    Receives up to `block` bytes a call into one reused buffer (the SDK's
    own demuxer polls and reads once per frame: far more calls)."""
    buf = bytearray(block)
    view = memoryview(buf)
    start = 0          # bytes of an unfinished frame header kept at buf[0:start]
    kind, left = 0, 0
    out: list[bytes] = []
    have = 0
    while True:
        got = recv_into(view[start:])
        if not got:
            break
        n = start + got
        pos, start = 0, 0
        while pos < n:
            if left == 0:
                if n - pos < 8:
                    buf[0:n - pos] = buf[pos:n]
                    start = n - pos
                    break
                kind, left = struct.unpack_from(">BxxxL", buf, pos)
                pos += 8
                continue
            take = min(left, n - pos)
            if kind == 1:
                out.append(bytes(view[pos:pos + take]))
                have += take
            elif kind == 2 and len(err) < err_cap:
                err.extend(view[pos:pos + min(take, err_cap - len(err))])
            pos += take
            left -= take
        if have >= block // 2:
            yield out[0] if len(out) == 1 else b"".join(out)
            out, have = [], 0
    if out:
        yield out[0] if len(out) == 1 else b"".join(out)


class DockerSandbox(ExecStreamMixin, Sandbox):
    kind = "docker"
    exec_default_roots = DOCKER_DEFAULT_ROOTS

    def __init__(self, ref: SandboxRef, policy: PathPolicy | None = None, *, base_url: str | None = None,
                 client: Any = None, prefer_bind_mounts: bool = True, timeout_s: int = 120,
                 io_timeout_s: float = DEFAULT_IO_TIMEOUT_S, prefer_host_root: bool = True) -> None:
        """`policy` None: roots from the ref, else /workspace, /tmp and the
        exec user's $HOME (learnt in the first resolve exec), minus the denylist.
        `io_timeout_s`: read deadline of every exec's output (a container
        whose shell stalls costs one attempt, ReadTimeout)."""
        self.ref = ref
        self.policy = policy
        self.io_timeout_s = io_timeout_s
        if not ref.target:
            raise UnsafePath("docker sandbox needs a container name or id")
        if client is None:
            import docker

            try:
                client = (docker.DockerClient(base_url=base_url, timeout=timeout_s) if base_url
                          else docker.from_env(timeout=timeout_s))
            except docker.errors.DockerException as exc:
                raise SandboxGone(f"cannot reach the docker engine: {exc}") from exc
            self._own_client = True
        else:
            self._own_client = False
        self.client = client
        self.prefer_bind_mounts = prefer_bind_mounts
        #: a local engine's container file read from the host (/proc/<pid>/root) instead of the archive API
        self.prefer_host_root = prefer_host_root
        self._attrs_cache: dict | None = None
        self._exec = _DockerExec(self)
        #: which channel moved each file (observability and tests)
        self.stats = {"bind": 0, "archive": 0, "host_root": 0, "exec": 0, "resolve_stat": 0, "resolve_exec": 0}
        self._home_cache: str | None = None
        #: (path, the engine's stat of it) when the last resolve was a link-free stat walk
        self._walk_stat: tuple[str, dict] | None = None

    # -- errors: the ONE place docker/requests errors become courier errors -------------
    @contextmanager
    def _errors(self, what: str, path: str | None = None):
        import docker.errors
        import requests.exceptions
        import urllib3.exceptions

        try:
            yield
        except (SandboxError, TooLarge):
            raise
        except docker.errors.NotFound as exc:
            if path is not None and self.alive():
                raise FileMissing(f"{path}: no such file") from exc
            raise SandboxGone(f"container {self.ref.target} is gone ({what})") from exc
        except docker.errors.APIError as exc:
            status = exc.status_code or 0
            if status in (409,) or status >= 500 or not self.alive():
                raise SandboxGone(f"container {self.ref.target}: {what} failed: {exc.explanation or exc}") from exc
            raise SandboxError(f"container {self.ref.target}: {what} failed: {exc.explanation or exc}") from exc
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, docker.errors.DockerException,
                ConnectionError, TimeoutError) as exc:
            raise SandboxGone(f"container {self.ref.target}: {what} interrupted: {exc}") from exc
        except tarfile.ReadError as exc:
            raise SandboxGone(f"container {self.ref.target}: {what}: archive cut short: {exc}") from exc
        except OSError as exc:
            raise SandboxGone(f"container {self.ref.target}: {what}: {exc}") from exc

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
        return self._attrs()["Id"]

    def exec_channel(self) -> _DockerExec:
        return self._exec

    def runs_as_root(self) -> bool:
        """Whether execs (and so the agent) run as root: the ref's `user`
        option, else the container's configured user. The archive API and
        bind mounts read as root, so only then are they used; any other
        user's reads go through exec as that user (never more than it can read)."""
        user = self.ref.options.get("user")
        if user is None:
            user = (self._attrs().get("Config") or {}).get("User") or ""
        name = user.split(":", 1)[0].strip()
        return name in ("", "0", "root")

    def exec_start(self, argv: list[str], run_id: str, *, backstop_s: int | None = None) -> _DockerRun:
        """A ``Sandbox.exec`` command (ExecStreamMixin.exec): one docker exec."""
        return _DockerRun(self._exec, argv, run_id)

    def _engine_is_local(self) -> bool:
        base = getattr(self.client.api, "base_url", "")
        return base.startswith("http+docker://") and not base.startswith("http+docker://ssh")

    def bind_host_path(self, resolved: str) -> tuple[str, str] | None:
        """(host path, mount source) when `resolved` lies in a bind mount
        whose source exists on this host; the innermost mount wins."""
        best = None
        for m in self._attrs().get("Mounts") or []:
            dest = m.get("Destination") or ""
            if dest.startswith("/") and _under(resolved, dest):
                if best is None or len(dest) > len(best["Destination"]):
                    best = m
        if best is None or best.get("Type") != "bind" or not best.get("Source"):
            return None
        src = best["Source"]
        rel = posixpath.relpath(resolved, best["Destination"])
        host = src if rel == "." else os.path.join(src, rel)
        if not os.path.exists(src):
            return None
        return host, src

    # -- outbound ------------------------------------------------------------------------
    # -- resolving ----------------------------------------------------------------------
    def resolve(self, path: str) -> tuple[str, int]:
        r = self._resolve(path)
        self.policy_for(r.home).check(r.path, shown=path)
        return r.path, r.size

    def _resolve(self, path: str) -> Resolved:
        """Stat walk through the archive API when the path holds no links
        (a few ms), else ONE exec (`readlink -f` + `stat`, ~100 ms on podman)."""
        check_lexical(path)
        self._walk_stat = None
        fast = self._resolve_by_stat(path)
        if fast is not None:
            return fast
        r = exec_resolve(self._exec, path, policy_for=self.policy_for)
        self.stats["resolve_exec"] += 1
        return r

    def _home(self) -> str | None:
        """$HOME of the exec user: the container's env, else one exec, once."""
        if self._home_cache is None:
            env = (self._attrs().get("Config") or {}).get("Env") or []
            home = next((e[5:] for e in env if e.startswith("HOME=")), "")
            if not home:
                rc, out, _err = self._exec.exec_small(["sh", "-c", 'printf %s "$HOME"'])
                home = out.decode("utf-8", "surrogateescape") if rc == 0 else ""
            self._home_cache = home
        return self._home_cache or None

    def home_dir(self) -> str | None:
        """The configured home, else the exec user's $HOME in the container."""
        if self.policy is not None and self.policy.home:
            return self.policy.home
        return self._home()

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

    def _resolve_by_stat(self, path: str) -> Resolved | None:
        """Resolved without an exec when every component is a plain directory
        and the last a regular file (then the path *is* its resolution).
        None: a link on the way, a path the lexical policy refuses (a link may
        still lead somewhere allowed), or an engine without the stat call."""
        api = self.client.api
        if not all(hasattr(api, a) for a in ("head", "_url", "_raise_for_status")):
            return None
        if has_glob(path):  # the engine would expand it: exec resolves it literally
            return None
        if not self.runs_as_root():  # the engine stats as root: exec resolves as the container's user
            return None
        parts = [p for p in path.split("/") if p and p != "."]  # `.` is a no-op lexically (`..` never gets here)
        if not parts or len(parts) > MAX_STAT_WALK:  # a deep path: ONE exec, not a request per component
            return None
        norm = "/" + "/".join(parts)
        home = self._home()
        try:
            self.policy_for(home).check(norm, shown=path)
        except UnsafePath:
            return None
        st: dict | None = None
        for i in range(len(parts)):
            try:
                st = self._stat("/" + "/".join(parts[: i + 1]))
            except SandboxGone:
                if not self.alive():
                    raise
                return None  # the engine failed on this path (a link loop: 500): exec says what it is
            if st is None:
                if not self.alive():
                    raise SandboxGone(f"container {self.ref.target} is gone")
                raise FileMissing(f"{path}: no such file")
            mode = int(st.get("mode", 0))
            if mode & _GO_MODE_SYMLINK:
                return None
            if i < len(parts) - 1 and not mode & _GO_MODE_DIR:
                raise FileMissing(f"{path}: {'/'.join(parts[: i + 1])} is not a directory")
        assert st is not None
        mode = int(st.get("mode", 0))
        if mode & _GO_MODE_DIR:
            raise NotAFile(f"{path}: is a directory")
        if mode & _GO_MODE_TYPE:
            raise NotAFile(f"{path}: not a regular file")
        self.stats["resolve_stat"] += 1
        self._walk_stat = (norm, st)
        return Resolved(path=norm, size=int(st.get("size", 0)), home=home)

    # -- outbound ------------------------------------------------------------------------
    def extract(self, path: str, store, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        r = self._resolve(path)
        self.policy_for(r.home).check(r.path, shown=path)
        if r.size > max_bytes:
            raise TooLarge(f"{path}: {r.size:,} bytes is over the {max_bytes:,} byte cap", size_bytes=r.size,
                           limit_bytes=max_bytes)
        as_root = self.runs_as_root()
        if as_root and self.prefer_bind_mounts and self._engine_is_local():
            bound = self.bind_host_path(r.path)
            if bound is not None:
                info = self._extract_bound(bound, path, store, key, max_bytes=max_bytes, resolved=r.path)
                self.stats["bind"] += 1
                return info
        walked = self._walk_stat if self._walk_stat and self._walk_stat[0] == r.path else None
        if has_glob(r.path) or not as_root or walked is None:
            # the archive API would expand the name / read as root / the path had a
            # link (the GET would follow a swapped one): exec reads the literal name
            # with the container user's own permissions, from the fd it checked
            info = store.put_stream(key, exec_iter_file(self._exec, r.path, expected_size=r.size, max_bytes=max_bytes,
                                                        policy=self.policy_for(r.home)), max_bytes=max_bytes)
            self.stats["exec"] += 1
            return info
        if self.prefer_host_root and r.size >= HOST_ROOT_MIN_BYTES and self._engine_is_local():
            # the same read as the archive API's (as root, of a link-free path), from the
            # host through the container process's root, copied in the kernel (see hostroot)
            info = self._extract_host_root(r, path, store, key, max_bytes=max_bytes, expect=walked[1])
            if info is not None:
                self.stats["host_root"] += 1
                return info
        chunks = self.iter_archive(r.path, r.size, max_bytes=max_bytes, expect=walked[1])
        info = store.put_stream(key, self._links_checked(chunks, r.path, self.policy_for(r.home)), max_bytes=max_bytes)
        self.stats["archive"] += 1
        return info

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

    def _extract_host_root(self, r: Resolved, path: str, store, key: str, *, max_bytes: int, expect: dict):
        """The checked file through /proc/<pid>/root into `store` (an in-kernel
        copy into a volume); None when that channel cannot be used here."""
        opened = open_in_container(self._live_pid, r.path, size=r.size, expect=expect)
        if opened is None:
            return None
        fd, before = opened

        def verdict(copied: int) -> None:
            """The same version of the file, whole, from a container still there; else nothing is kept."""
            after = os.fstat(fd)
            same = (before.st_size == after.st_size == copied and before.st_mtime_ns == after.st_mtime_ns
                    and before.st_ctime_ns == after.st_ctime_ns)
            if not self.alive():  # as on the archive channel: a container gone meanwhile fails the same way
                raise SandboxGone(f"container {self.ref.target} went away during the transfer")
            if not same:
                raise FileChanging(f"{path}: changed while it was read ({before.st_size:,} -> "
                                   f"{after.st_size:,} bytes); read again later")

        try:
            self.policy_for(self._home()).check_links(r.path, before.st_nlink, shown=path)
            put_fd = getattr(store, "put_fd", None)
            info = put_fd(key, fd, max_bytes=max_bytes) if put_fd is not None else None
            if info is not None:
                try:
                    verdict(info.size_bytes)
                except BaseException:
                    with suppress(Exception):
                        store.delete(key)
                    raise
                return info

            def chunks() -> Iterator[bytes]:  # checked before the store publishes the blob
                n = 0
                with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                    while data := f.read(CHUNK):
                        n += len(data)
                        yield data
                verdict(n)

            return store.put_stream(key, chunks(), max_bytes=max_bytes)
        finally:
            os.close(fd)

    def _links_checked(self, chunks: Iterator[bytes], resolved: str, policy: PathPolicy) -> Iterator[bytes]:
        """`chunks` of the archive channel, whose stat carries no link count:
        ONE `stat` exec counts the file's hard links beside the transfer (it
        costs no time on a big file), and the last chunk is held back until
        it says 1, so a hard link to a file outside the roots fails the
        put (all-or-nothing: nothing stored)."""
        if policy.links_allowed(resolved):
            yield from chunks
            return
        box: dict = {}

        def count() -> None:
            try:
                for _ in range(3):  # podman's attach may lose a short exec's output: ask again
                    box["res"] = self._exec.exec_small(["stat", "-c", "%h", "--", resolved])
                    if box["res"][0] != 0 or box["res"][1].strip():
                        break
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                box["exc"] = exc

        t = threading.Thread(target=count, name="courier-docker-nlink", daemon=True)
        t.start()
        held: bytes | None = None
        for chunk in chunks:
            if held is not None:
                yield held
            held = chunk
        t.join(self.io_timeout_s + 5)
        if t.is_alive():
            raise ReadTimeout(f"container {self.ref.target}: counting the links of {resolved} took too long")
        if "exc" in box:
            raise box["exc"]
        rc, out, err = box["res"]
        if rc in (126, 127):
            # an image without `stat` (distroless): nothing counts the links there, and the agent
            # of a root container can read (and copy out) any file in it anyway
            if held is not None:
                yield held
            return
        if rc != 0 or not out.strip().isdigit():
            raise SandboxGone(f"{resolved}: cannot count its links (exit {rc}: {err[:200]!r})")
        policy.check_links(resolved, int(out.strip()), shown=resolved)
        if held is not None:
            yield held

    def _extract_bound(self, bound: tuple[str, str], path: str, store, key: str, *, max_bytes: int,
                       resolved: str):
        host, src = bound
        fd = _open_under(host, src, shown=path)
        try:
            st = os.fstat(fd)
            self.policy_for(self._home()).check_links(resolved, st.st_nlink, shown=path)
            size = st.st_size
            if size > max_bytes:
                raise TooLarge(f"{path}: {size:,} bytes is over the {max_bytes:,} byte cap",
                               size_bytes=size, limit_bytes=max_bytes)
            f = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            info = store.put_stream(key, f, max_bytes=max_bytes)
            unchanged(st, os.fstat(f.fileno()), info.size_bytes, store, key, shown=path)
            return info

    def iter_archive(self, resolved: str, size: int | None, *, max_bytes: int,
                     expect: dict | None = None) -> Iterator[bytes]:
        """The file's bytes through ``get_archive``, member-checked. A path
        with glob characters is refused: the engine would expand them."""
        if has_glob(resolved):
            raise UnsafePath(f"{resolved}: glob characters cannot go to the archive API")
        with self._errors("get_archive", path=resolved):
            body, st, raw = self._open_archive(resolved)
        try:
            mode = int(st.get("mode", 0)) if isinstance(st, dict) else 0
            if mode & _GO_MODE_SYMLINK:
                raise UnsafePath(f"{resolved}: is a link (changed after resolve)")
            if mode & _GO_MODE_TYPE:
                raise NotAFile(f"{resolved}: not a regular file (changed after resolve)")
            check_archive_stat(st, resolved, size, expect)
            with self._errors("archive stream", path=resolved):
                yield from iter_single_member(body, expected_name=posixpath.basename(resolved),
                                              expected_size=size, max_bytes=max_bytes)
            # an engine may finish a copy from a container removed meanwhile (podman
            # does); one cheap inspect makes "gone mid-transfer" fail the same everywhere
            if not self.alive():
                raise SandboxGone(f"container {self.ref.target} went away during the transfer")
        finally:
            raw.close()

    def _open_archive(self, path: str) -> tuple[Any, dict, Any]:
        """(readable body, stat header, closable response) of the engine's
        archive of `path`: the HTTP body as 1 MiB chunks (like the SDK's
        ``get_archive``, with the response at hand to close it) through a
        forward-only reader."""
        api = self.client.api
        if not all(hasattr(api, a) for a in ("_get", "_url", "_raise_for_status")):
            gen, st = api.get_archive(self.container_id, path, chunk_size=CHUNK)
            return ForwardReader(gen), st, gen
        res = api._get(api._url("/containers/{0}/archive", self.container_id), params={"path": path}, stream=True)
        try:
            api._raise_for_status(res)
            hdr = res.headers.get("x-docker-container-path-stat")
            st = decode_stat_header(hdr) if hdr else {}
        except BaseException:
            res.close()
            raise
        return ForwardReader(res.iter_content(CHUNK, False)), st, res

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        if has_glob(resolved) or not self.runs_as_root():
            return exec_iter_file(self._exec, resolved, policy=self.policy)
        return self.iter_archive(resolved, None, max_bytes=DEFAULT_MAX_BYTES * 1000)

    def extract_via_exec(self, path: str, store, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        """The universal fallback (one exec to resolve, one to stream)."""
        info = self.exec_extract_file(path, store, key, max_bytes=max_bytes)
        self.stats["exec"] += 1
        return info

    # -- inbound -------------------------------------------------------------------------
    def put(self, store, key: str, dest_path: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        """Stream a stored blob into the container: ``put_archive`` of a tar
        generated on the fly under a temp name, then one exec renames it; in
        a container not running as root, exec stdin as its user (``put_archive``
        writes as root)."""
        info = store.stat(key)
        if info.size_bytes > max_bytes:
            raise TooLarge(f"{key}: {info.size_bytes:,} bytes is over the {max_bytes:,} byte cap",
                           size_bytes=info.size_bytes, limit_bytes=max_bytes)
        if not self.runs_as_root():
            # put_archive writes as root: a container's own user writes through exec
            # stdin, where it may write and nowhere else
            return exec_put(self._exec, self.policy_for, store, key, dest_path, max_bytes=max_bytes)
        final, uid, gid = resolve_put_dest(self._exec, self.policy_for, dest_path)
        parent, name = posixpath.split(final)
        tmp_name = f".{name[:64]}.{uuid.uuid4().hex[:8]}.courier-part"
        body = tar_stream(tmp_name, info.size_bytes, store.iter_chunks(key), uid=uid, gid=gid)
        try:
            with self._errors("put_archive", path=parent):
                self.client.api.put_archive(self.container_id, parent, body)
        except BaseException:
            # a cut upload may leave a partial temp file: best-effort removal
            try:
                self._exec.exec_small(["rm", "-f", "--", posixpath.join(parent, tmp_name)])
            except Exception:  # noqa: BLE001 - the original error matters
                pass
            raise
        rc, _out, err = self._exec.exec_small(
            ["sh", "-c", _FINALIZE_SCRIPT, "sh", posixpath.join(parent, tmp_name), final])
        if rc == EXIT_CHANGED:
            raise UnsafePath(f"{dest_path}: is a link or a directory")
        if rc != 0:
            raise SandboxError(f"{dest_path}: rename failed (exit {rc}: {err[:300]!r})")
        return final

    def close(self) -> None:
        if self._own_client:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass


def _open_under(host: str, src: str, *, shown: str) -> int:
    """Open `host` for reading only if it resolves (and stays, once opened)
    inside the bind mount source `src`. Returns an fd of a regular file."""
    try:
        src_real = os.path.realpath(src)
        real = os.path.realpath(host)
    except OSError as exc:  # a link swapped for a file between realpath's lstat and readlink (EINVAL)
        raise UnsafePath(f"{shown}: changed while resolving on the host ({exc.strerror})") from exc
    if not (real == src_real or real.startswith(src_real.rstrip("/") + "/")):
        raise UnsafePath(f"{shown}: leaves its bind mount on the host")
    try:
        fd, _st = open_regular(real, shown=shown)
    except FileNotFoundError as exc:
        raise FileMissing(f"{shown}: no such file") from exc
    except OSError as exc:
        raise UnsafePath(f"{shown}: cannot open on the host ({exc.strerror})") from exc
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if not (opened == src_real or opened.startswith(src_real.rstrip("/") + "/")):
            raise UnsafePath(f"{shown}: changed while opening")
    except BaseException:
        os.close(fd)
        raise
    return fd
