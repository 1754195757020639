"""A file opened on the worker's host from a path an agent controls: never
anything but a regular file, and never through a link.

An agent that can make a device node (root in a rootful container can
`mknod`) or a FIFO can swap one in for its file between the check of the
path and the open. ``open()`` of a device runs its driver in the host's
context (a watchdog, a tape, a serial line) even when no byte is read;
``O_NONBLOCK`` does not stop that. So the path is first opened with
``O_PATH`` (no driver runs, no permission is asked, nothing can be read
through it), where the kernel has it with ``openat2`` following no link
anywhere on the way (``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``, and
``RESOLVE_BENEATH`` below a directory descriptor); that descriptor is
``fstat``'d, checked, and only a regular file is then opened for reading,
through ``/proc/self/fd/<n>``: the same inode, whatever the path names by
then (a regular file cannot become anything else).

Fallbacks: without ``openat2`` (a kernel before 5.6, a seccomp filter that
refuses it) the path is opened with ``O_PATH | O_NOFOLLOW``: a link at its
last component is refused as before (``ELOOP``); links on the way are
followed, and the callers check the descriptor's real path. Without
``O_PATH`` or ``/proc`` (not Linux), the file is opened non-blocking without
following its last link and the opened descriptor checked: only there can
a special file swapped in be opened (never read).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import sys
from collections.abc import Callable
from typing import Any

from adapters.errors import NotAFile

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

_syscall: Any = None
#: False once the kernel said it has no openat2 (ENOSYS): not asked again
_has_openat2 = sys.platform.startswith("linux")


def _libc_syscall() -> Any:
    global _syscall
    if _syscall is None:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        _syscall = fn
    return _syscall


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


_safe: bool | None = None


def host_open_safe() -> bool:
    """Whether a special file is never opened here (O_PATH and /proc/self/fd exist; asked once)."""
    global _safe
    if _safe is None:
        _safe = _O_PATH is not None and os.path.isdir(_PROC_FD)
    return _safe


def open_path(path: str, *, dir_fd: int | None = None, resolve: int | None = None,
              fallback: bool = True) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of `path` (its last link never followed) and its fstat:
    through ``openat2`` with `resolve` (default: no link anywhere on the
    way, and beneath `dir_fd` when given), else (`fallback`: no openat2 here)
    ``open(O_PATH | O_NOFOLLOW)``, where a link at the last component is
    refused with ELOOP (O_PATH | O_NOFOLLOW would open the link itself).
    Raises OSError."""
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
    """`path` opened for reading if it is a regular file reached through no
    link; returns (fd, its fstat). A non-regular file is refused (NotAFile)
    without ever being opened for reading, whatever was swapped in after
    the caller's check; `check(descriptor, stat)` runs on the O_PATH
    descriptor first (its real path, its link count: raise to refuse), so
    nothing is opened for reading before it passed. OSError as the OS says
    (ENOENT; ELOOP for a link)."""
    shown = shown or path
    if not host_open_safe():
        return _open_nonblocking(path, dir_fd=dir_fd, shown=shown, check=check)
    opath, st = open_path(path, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{shown}: not a regular file")
        if check is not None:
            check(opath, st)
        return reopen_for_reading(opath), st
    finally:
        os.close(opath)


def _open_nonblocking(path: str, *, dir_fd: int | None, shown: str,
                      check: Callable[[int, os.stat_result], None] | None) -> tuple[int, os.stat_result]:
    """Where there is no O_PATH or /proc: opened without blocking (a FIFO
    swapped in is not waited on), then the opened descriptor checked."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC | _O_NOCTTY
    fd = os.open(path, flags, dir_fd=dir_fd)
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
