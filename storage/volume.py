"""A blob store on a shared filesystem volume (`file:///abs/dir`)."""

from __future__ import annotations

import errno
import io
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from adapters.errors import BlobMissing, ConfigError, StorageError, TooLarge
from storage.base import BlobInfo, BlobStore, check_key

_TMP = ".tmp"
COPY_CHUNK = 64 * 1024 * 1024
#: most bytes one splice() moves from a pipe (a pipe holds at most its size anyway)
SPLICE_CHUNK = 1024 * 1024


class VolumeStore(BlobStore):
    can_sign = False

    def __init__(self, root: str | os.PathLike[str], *, links=None) -> None:
        """`links`: a `storage.links.LinkSigner` (the web process serves the
        links it signs); without one the volume cannot sign links."""
        self.root = Path(root).absolute()
        self.links = links
        self.can_sign = links is not None
        self._root_s = str(self.root)
        self._tmp_s = str(self.root / _TMP)
        self.url = self.root.as_uri()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / _TMP).mkdir(exist_ok=True)
        except OSError as exc:
            raise StorageError(f"storage volume {self.root} is not writable: {exc.strerror}") from exc

    def _file(self, key: str) -> str:
        """The path of `key`'s file, as a string (a checked key joined to the root: the
        same path `root / key` names, without a Path object per call)."""
        check_key(key)
        if key.split("/", 1)[0] == _TMP:  # the store's own scratch directory
            raise ConfigError(f"invalid storage key: {key!r} ({_TMP}/ is reserved)")
        return f"{self._root_s}/{key}"

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def local_path(self, key: str) -> Path | None:
        p = self._file(key)
        return Path(p) if os.path.isfile(p) else None

    @contextmanager
    def open_write(self, key: str, *, private: bool = False):
        dest = self._path(key)
        tmp = f"{self._tmp_s}/{unique_name()}.part"
        try:
            if private:
                _mkdirs_private(self.root, dest.parent)
            else:
                _make_parent(str(dest))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
        except OSError as exc:
            raise StorageError(f"cannot write {key}: {exc.strerror or exc}") from exc
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                yield f
            os.replace(tmp, dest)
        except OSError as exc:
            _unlink(tmp)
            raise StorageError(f"cannot write {key}: {exc.strerror or exc}") from exc
        except BaseException:
            _unlink(tmp)
            raise

    def _open_part(self, key: str, dest: str) -> tuple[str, int]:
        """A new temp file for `key` (its directory made), open for writing: (path, fd)."""
        tmp = f"{self._tmp_s}/{unique_name()}.part"
        try:
            _make_parent(dest)
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot write {key}: {exc.strerror or exc}") from exc

    def put_fd(self, key: str, fd: int, *, max_bytes: int | None = None) -> BlobInfo | None:
        """Copy an open file into `key` inside the kernel (`copy_file_range`:
        a reflink on filesystems that share extents, else an in-kernel copy;
        `sendfile` across filesystems; no bytes pass through this process). The cap holds during the copy.
        No sha256 is computed (None in the result). Returns None when the
        kernel cannot copy between these files; callers then stream."""
        dest = self._file(key)
        if not hasattr(os, "copy_file_range"):
            return None
        use_sendfile = False

        def move(out: int, want: int, done: int) -> int:
            nonlocal use_sendfile
            try:
                if not use_sendfile:
                    try:
                        return os.copy_file_range(fd, out, want, done, None)
                    except OSError as exc:
                        # across filesystems: sendfile, still in the kernel
                        if done != 0 or exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
                            raise
                        use_sendfile = True
                return os.sendfile(out, fd, done, want)
            except OSError as exc:
                if done == 0 and exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                                               errno.EBADF):
                    raise _NoKernelMove from exc  # not supported here: the caller streams
                raise

        return self._kernel_move(key, move, COPY_CHUNK, max_bytes, dest=dest)

    def put_pipe(self, key: str, fd: int, *, max_bytes: int | None = None, wait=None,
                 finish=None) -> BlobInfo | None:
        """Move a pipe's bytes into `key` inside the kernel (`splice`: no copy
        through this process, no hash; see BlobStore.put_pipe). The cap holds
        during the move: at most `max_bytes` + 1 bytes are taken, and one more
        is TooLarge. None when the kernel cannot splice here (before any byte
        was read)."""
        if not hasattr(os, "splice"):
            return None

        def move(out: int, want: int, done: int) -> int:
            if wait is not None:
                wait()
            try:
                return os.splice(fd, out, want)
            except OSError as exc:
                if done == 0 and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    # not a pipe, or a filesystem without splice: the caller streams
                    raise _NoKernelMove from exc
                raise

        return self._kernel_move(key, move, SPLICE_CHUNK, max_bytes, finish)

    def _kernel_move(self, key: str, move: Callable[[int, int, int], int], chunk: int, max_bytes: int | None,
                     finish: Callable[[int], object] | None = None, *, dest: str | None = None) -> BlobInfo | None:
        """Fill `key` through a temp file by `move(out_fd, want, done)` calls,
        each moving up to `want` bytes inside the kernel and saying how many (0:
        the end), until the end or `max_bytes` + 1 bytes (one more than the cap
        is TooLarge); `finish(size)` before the file is published. None when
        `move` finds the kernel cannot (_NoKernelMove, before any byte moved).
        `dest`: `key`'s file when the caller has it already."""
        dest = dest or self._file(key)
        tmp, out = self._open_part(key, dest)
        limit = None if max_bytes is None else max_bytes + 1
        size = 0
        try:
            try:
                while True:
                    want = chunk if limit is None else min(chunk, limit - size)
                    if want <= 0:
                        break
                    n = move(out, want, size)
                    if n == 0:
                        break
                    size += n
            except _NoKernelMove:
                _unlink(tmp)
                return None
            except OSError as exc:
                raise StorageError(f"cannot write {key}: {exc.strerror or exc}") from exc
            finally:
                os.close(out)
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(f"file is larger than the {max_bytes:,} byte cap", size_bytes=size,
                               limit_bytes=max_bytes)
            if finish is not None:
                finish(size)
            os.replace(tmp, dest)
        except BaseException:
            _unlink(tmp)
            raise
        return BlobInfo(key=key, size_bytes=size, modified_s=time.time())

    @contextmanager
    def open_read(self, key: str):
        try:
            # a buffer size given: no isatty() probe (an ioctl) of a file that is never a terminal
            f: BinaryIO = open(self._file(key), "rb", buffering=io.DEFAULT_BUFFER_SIZE)  # noqa: SIM115
        except FileNotFoundError as exc:
            raise BlobMissing(f"no blob {key!r} in {self.url}") from exc
        except OSError as exc:
            raise StorageError(f"cannot read {key}: {exc.strerror}") from exc
        with f:
            yield f

    def stat(self, key: str) -> BlobInfo:
        try:
            st = os.stat(self._file(key))
        except FileNotFoundError as exc:
            raise BlobMissing(f"no blob {key!r} in {self.url}") from exc
        return BlobInfo(key=key, size_bytes=st.st_size, modified_s=st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        base = self.root
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, base)
            if rel_dir == _TMP:
                dirnames[:] = []
                continue
            dirnames.sort()
            for name in sorted(filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                rel = rel.replace(os.sep, "/")
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                yield BlobInfo(key=rel, size_bytes=st.st_size, modified_s=st.st_mtime)

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        for key in keys:
            try:
                self._path(key).unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n

    def signed_url(self, key: str, expires_s: int = 3600) -> str | None:
        """A link to `GET /files/<key>` on the web process, when it has a public URL."""
        return self.links.url(check_key(key), expires_s) if self.links is not None else None

    def sweep_tmp(self, older_than_s: float = 3600) -> int:
        """Remove partial writes left by killed processes."""
        return sweep_stale((self.root / _TMP).iterdir(), older_than_s)


#: temp names: this process's prefix (its pid and a random part, made again in a forked
#: child) and a counter; no syscall per name (a uuid4 reads the kernel's random source)
_seq = itertools.count()
_prefix = ""


def _new_prefix() -> None:
    global _prefix
    _prefix = f"{os.getpid():x}-{os.urandom(6).hex()}-"


_new_prefix()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_prefix)


def unique_name() -> str:
    """A file name no other process or thread makes (temp files: each is opened with O_EXCL anyway)."""
    return f"{_prefix}{next(_seq):x}"


def sweep_stale(paths: Iterable[Path], older_than_s: float) -> int:
    """Unlink those of `paths` last modified more than `older_than_s` ago (one
    already gone is skipped); how many were removed."""
    cutoff = time.time() - older_than_s
    n = 0
    for p in paths:
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
                n += 1
        except FileNotFoundError:
            pass
    return n


def _mkdirs_private(root: Path, d: Path) -> None:
    parts = d.relative_to(root).parts
    cur = root
    for part in parts:
        cur = cur / part
        try:
            cur.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _make_parent(path: str) -> None:
    """The directory a key's file goes in: one mkdir when it is new or there
    already (the usual cases), every missing level otherwise."""
    parent = os.path.dirname(path)
    try:
        os.mkdir(parent)
    except FileExistsError:
        if not os.path.isdir(parent):
            raise NotADirectoryError(errno.ENOTDIR, "a file stands where the key's directory goes", parent) from None
    except FileNotFoundError:
        os.makedirs(parent, exist_ok=True)


class _NoKernelMove(Exception):
    """The kernel cannot move these bytes here (found before any was moved): the caller streams."""


def _unlink(p: str | Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
