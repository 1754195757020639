"""The archive channel: the engine's ``GET .../archive`` of one file,
streamed as ~1 MiB pieces, checked member by member and against the
engine's stat before and after the copy; and a one-file tar built on the
fly for ``put_archive`` (:func:`tar_stream`)."""

from __future__ import annotations

import base64
import binascii
import io
import json
import posixpath
import tarfile
import time
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any, cast

from adapters.errors import (
    CourierError, FileChanging, FileMissing, NotAFile, SandboxError, SandboxGone, StorageError, UnsafePath,
)
from adapters.sandboxes.base import check_size
from adapters.sandboxes.docker.demux import CHUNK

if TYPE_CHECKING:
    from adapters.sandboxes.docker.engine import Engine

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


# -- archive member checking (plain functions: testable with crafted tars) ----------
class ForwardReader:
    """A forward-only file over byte chunks: enough of `read/tell/seek` for
    tarfile's "r:" mode, plus :meth:`read_some` (the chunks themselves, no copy)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._cur = b""
        self._off = 0
        self._pos = 0

    @classmethod
    def of(cls, src, block: int = CHUNK) -> "ForwardReader":
        if isinstance(src, ForwardReader):
            return src
        return cls(iter(lambda: src.read(block), b""))

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
        out = cur if off == 0 and len(cur) <= n else cur[off:off + n]
        self._off += len(out)
        self._pos += len(out)
        return out

    def read(self, n: int = -1) -> bytes:
        parts = []
        want = n if n >= 0 else 1 << 62
        while want > 0 and (piece := self.read_some(want)):
            parts.append(piece)
            want -= len(piece)
        return b"".join(parts)  # of one chunk: that very object, no copy

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0 or pos < self._pos:
            raise io.UnsupportedOperation("forward-only stream")
        while self._pos < pos:
            if not self.read_some(min(CHUNK, pos - self._pos)):
                break
        return self._pos


def iter_single_member(fileobj, *, expected_name: str | None, expected_size: int | None,
                       max_bytes: int, block: int = CHUNK) -> Iterator[bytes]:
    """Yield the data of the ONE regular file in a tar stream, checked
    (:func:`check_member`; more than one member is UnsafePath). The trailing
    checks run before the generator ends, so an all-or-nothing store keeps
    nothing when they fail. tarfile parses the headers from a forward-only
    reader; the data is handed out as the received chunks (no copies)."""
    reader = ForwardReader.of(fileobj, block)
    try:
        tar = tarfile.open(fileobj=cast(IO[bytes], reader), mode="r:")  # enough of a file for "r:"
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
            # engines send small HTTP chunks: hashing and writing see few, large ones
            yield b"".join(parts)
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
    check_size(name, member.size, max_bytes)
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
    must be the file that was checked (a directory swapped for a link after
    the check leads the GET to another file): same name, size, link target,
    and the mode and mtime in ns the stat walk saw (`expect`)."""
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
    ti = tarfile.TarInfo(name)  # a regular file
    ti.size, ti.mode, ti.mtime = size, mode, int(time.time())
    ti.uid, ti.gid = uid, gid
    yield ti.tobuf(format=tarfile.PAX_FORMAT)
    n = 0
    for chunk in store_chunks(chunks, name):
        n += len(chunk)
        if n > size:
            raise SandboxError(f"{name}: the stored blob grew while sending")
        yield chunk
    if n != size:
        raise SandboxError(f"{name}: the stored blob shrank while sending ({n} of {size})")
    pad = (-size) % tarfile.BLOCKSIZE
    yield b"\0" * (pad + 2 * tarfile.BLOCKSIZE)


def store_chunks(chunks: Iterable[bytes], what: str) -> Iterator[bytes]:
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


def iter_archive(engine: Engine, resolved: str, size: int | None, *, max_bytes: int,
             expect: dict | None = None) -> Iterator[bytes]:
    """The file's bytes through ``get_archive``, member-checked. A path
    with glob characters is refused: the engine would expand them."""
    if has_glob(resolved):
        raise UnsafePath(f"{resolved}: glob characters cannot go to the archive API")
    with engine._errors("get_archive", path=resolved):
        body, st, raw = open_archive(engine, resolved)
    try:
        mode = int(st.get("mode", 0)) if isinstance(st, dict) else 0
        if mode & _GO_MODE_SYMLINK:
            raise UnsafePath(f"{resolved}: is a link (changed after resolve)")
        if mode & _GO_MODE_TYPE:
            raise NotAFile(f"{resolved}: not a regular file (changed after resolve)")
        check_archive_stat(st, resolved, size, expect)
        with engine._errors("archive stream", path=resolved):
            yield from iter_single_member(body, expected_name=posixpath.basename(resolved),
                                          expected_size=size, max_bytes=max_bytes)
        # an engine (podman) may finish a copy from a container removed meanwhile: fail as elsewhere
        if not engine.alive():
            raise SandboxGone(f"container {engine.ref.target} went away during the transfer")
        check_unchanged_after(engine, resolved, st)
    finally:
        raw.close()


def check_unchanged_after(engine: Engine, resolved: str, st: dict) -> None:
    """The engine's stat after the copy (ONE ``HEAD .../archive``: size, mode
    and mtime in ns) must be the one the GET answered with before its first
    byte, else the file changed while it was read: FileChanging, raised
    before the chunks end, so an all-or-nothing store keeps nothing."""
    if not isinstance(st, dict) or "mtime" not in st or not hasattr(engine.client.api, "head"):
        return  # no stat header, or a client without the engine's stat call: nothing to compare
    after = engine._stat(resolved)
    if after is None:
        raise FileChanging(f"{resolved}: gone after it was read; read again later")
    changed = [k for k in ("size", "mode", "mtime") if after.get(k) != st.get(k)]
    if changed:
        raise FileChanging(f"{resolved}: changed while it was read ({', '.join(changed)}); read again later")


def open_archive(engine: Engine, path: str) -> tuple[Any, dict, Any]:
    """(forward-only reader of the body in 1 MiB chunks, stat header, closable
    response) of the engine's archive of `path`."""
    api = engine.client.api
    if not all(hasattr(api, a) for a in ("_get", "_url", "_raise_for_status")):
        gen, st = api.get_archive(engine.container_id, path, chunk_size=CHUNK)
        return ForwardReader(gen), st, gen
    res = api._get(api._url("/containers/{0}/archive", engine.container_id), params={"path": path}, stream=True)
    try:
        api._raise_for_status(res)
        hdr = res.headers.get("x-docker-container-path-stat")
        st = decode_stat_header(hdr) if hdr else {}
    except BaseException:
        res.close()
        raise
    return ForwardReader(res.iter_content(CHUNK, False)), st, res
