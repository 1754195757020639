"""The local sandbox: paths on the worker's own host.

Fast path: a hard link into a volume store on the same filesystem (no bytes
copied); else a streamed copy. Links are resolved with `realpath` and the
resolved path is checked; the opened file descriptor is checked again
(`/proc/self/fd`) so a link swapped between check and open cannot escape.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from adapters.errors import FileMissing, NotAFile, TooLarge, UnsafePath
from adapters.sandboxes.base import DEFAULT_MAX_BYTES, PathPolicy, Sandbox, SandboxRef, check_lexical

CHUNK = 1024 * 1024


class LocalSandbox(Sandbox):
    kind = "local"

    def __init__(self, ref: SandboxRef, policy: PathPolicy) -> None:
        super().__init__(ref, policy)

    @classmethod
    def with_roots(cls, roots: tuple[str, ...], home: str | None = None) -> "LocalSandbox":
        resolved = tuple(os.path.realpath(r) for r in roots)
        return cls(SandboxRef("local", roots=resolved), PathPolicy(roots=resolved, home=home))

    def resolve(self, path: str) -> tuple[str, int]:
        check_lexical(path)
        real = os.path.realpath(path)
        self.policy.check(real, shown=path)
        try:
            st = os.stat(real)
        except FileNotFoundError as exc:
            raise FileMissing(f"{path}: no such file") from exc
        except PermissionError as exc:
            raise UnsafePath(f"{path}: permission denied") from exc
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{path}: not a regular file")
        return real, st.st_size

    def _open_checked(self, resolved: str) -> int:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            real = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else resolved
            self.policy.check(real, shown=resolved)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotAFile(f"{resolved}: not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        try:
            fd = self._open_checked(resolved)
        except FileNotFoundError as exc:
            raise FileMissing(f"{resolved}: no such file") from exc
        except OSError as exc:  # ELOOP: swapped for a link after resolve
            raise UnsafePath(f"{resolved}: changed while opening ({exc.strerror})") from exc
        with os.fdopen(fd, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def extract(self, path: str, store, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        check_lexical(path)
        resolved, size = self.resolve(path)
        if size > max_bytes:
            raise TooLarge(
                f"{path}: {size:,} bytes is over the {max_bytes:,} byte cap", size_bytes=size, limit_bytes=max_bytes
            )
        return store.put_stream(key, self.open_stream(resolved), max_bytes=max_bytes)

    def put(self, store, key: str, dest_path: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        check_lexical(dest_path)
        parent = os.path.realpath(os.path.dirname(dest_path))
        dest = os.path.join(parent, os.path.basename(dest_path))
        self.policy.check(dest, shown=dest_path)
        if os.path.islink(dest):
            raise UnsafePath(f"{dest_path}: is a symbolic link")
        info = store.stat(key)
        if info.size_bytes > max_bytes:
            raise TooLarge(f"{key}: {info.size_bytes:,} bytes is over the {max_bytes:,} byte cap")
        Path(parent).mkdir(parents=True, exist_ok=True)
        tmp = f"{dest}.courier-part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in store.iter_chunks(key):
                    out.write(chunk)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return dest
