"""A file opened on the worker's host from a path an agent controls: never
anything but a regular file, and never through a link.

An agent that can make a device node (`mknod`, root in a rootful container)
or a FIFO can swap one in between the check and the open, and ``open()`` of
a device runs its driver in the host's context even when no byte is read.
So the path is first opened as an ``O_PATH`` descriptor (no driver runs),
by ``openat2`` following no link anywhere where the kernel has it (else
``O_PATH | O_NOFOLLOW``: the callers check the descriptor's real path);
that descriptor is checked, and only a regular file is then opened for
reading through ``/proc/self/fd/<n>``: the same inode. Without ``O_PATH``
or ``/proc`` (not Linux), a non-blocking open without following the last
link: only there can a special file swapped in be opened (never read).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import struct
import sys
from collections.abc import Callable
from typing import Any

from adapters.errors import FileMissing, NotAFile, UnsafePath

RESOLVE_BENEATH = 0x08
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
#: openat2's number is the same on every Linux architecture (added after the tables were unified)
_SYS_OPENAT2 = 437
#: the default resolution of a host-side open: no link of any kind on the way
NO_LINKS = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS

_O_PATH: int | None = getattr(os, "O_PATH", None)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
#: where an O_PATH descriptor is opened again for reading
_PROC_FD = "/proc/self/fd"

#: False once the kernel said it has no openat2 (ENOSYS): not asked again
_has_openat2 = sys.platform.startswith("linux")


@functools.cache
def _libc_syscall() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """The openat2(2) system call; raises OSError (ENOSYS where the kernel has none)."""
    how = ctypes.create_string_buffer(struct.pack("QQQ", flags, 0, resolve), 24)
    while True:
        fd = _libc_syscall()(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                             how, ctypes.c_size_t(24))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), path)


@functools.cache
def host_open_safe() -> bool:
    """Whether a special file is never opened here (O_PATH and /proc/self/fd exist; asked once)."""
    return _O_PATH is not None and os.path.isdir(_PROC_FD)


def open_path(path: str, *, dir_fd: int | None = None, resolve: int | None = None,
              fallback: bool = True) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of `path` (its last link never followed, ELOOP)
    and its fstat: through ``openat2`` with `resolve` (default: no link
    anywhere, beneath `dir_fd` when given), else (`fallback`: no openat2
    here) ``open(O_PATH | O_NOFOLLOW)``. Raises OSError."""
    global _has_openat2
    assert _O_PATH is not None
    flags = _O_PATH | os.O_NOFOLLOW | _O_CLOEXEC
    if resolve is None:
        resolve = NO_LINKS | (RESOLVE_BENEATH if dir_fd is not None else 0)
    fd: int | None = None
    if _has_openat2:
        try:
            fd = openat2(dir_fd if dir_fd is not None else -100, path, flags, resolve)  # -100: AT_FDCWD
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                _has_openat2 = False
            if exc.errno not in (errno.ENOSYS, errno.EPERM) or not fallback:  # EPERM: a seccomp filter's answer
                raise
    elif not fallback:
        raise OSError(errno.ENOSYS, "openat2 is not available", path)
    if fd is None:
        fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):  # O_PATH | O_NOFOLLOW opens a link at the last component itself
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def reopen_for_reading(opath_fd: int) -> int:
    """The file an O_PATH descriptor names, opened for reading (blocking):
    the same inode, through ``/proc/self/fd``. Only ever for a descriptor
    whose fstat said it is a regular file."""
    return os.open(f"{_PROC_FD}/{opath_fd}", os.O_RDONLY | _O_CLOEXEC | _O_NOCTTY)


def open_regular(path: str, *, dir_fd: int | None = None, shown: str | None = None,
                 check: Callable[[int, os.stat_result], None] | None = None) -> tuple[int, os.stat_result]:
    """(fd, fstat) of `path` opened for reading if it is a regular file reached
    through no link (else NotAFile, never opened for reading; OSError as the
    OS says: ENOENT, ELOOP for a link). `check(descriptor, stat)` runs on the
    O_PATH descriptor first (its real path, its link count: raise to refuse)."""
    shown = shown or path
    if not host_open_safe():  # opened without blocking (a FIFO swapped in is not waited on), then checked
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC | _O_NOCTTY, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAFile(f"{shown}: not a regular file")
            if check is not None:
                check(fd, st)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, st
    opath, st = open_path(path, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{shown}: not a regular file")
        if check is not None:
            check(opath, st)
        return reopen_for_reading(opath), st
    finally:
        os.close(opath)


def open_checked(path: str, *, shown: str, check: Callable[[str, os.stat_result], None]
                 ) -> tuple[int, os.stat_result]:
    """:func:`open_regular` of `path`, `check(real path, stat)` run on the
    O_PATH descriptor first (its real path read back where /proc has it, asked once);
    the OS's refusals as courier errors."""
    def on_fd(fd: int, st: os.stat_result) -> None:
        check(os.readlink(f"{_PROC_FD}/{fd}") if host_open_safe() else path, st)

    try:
        return open_regular(path, shown=shown, check=on_fd)
    except FileNotFoundError as exc:
        raise FileMissing(f"{shown}: no such file") from exc
    except OSError as exc:  # ELOOP: swapped for a link after the check
        raise UnsafePath(f"{shown}: changed while opening ({exc.strerror})") from exc
