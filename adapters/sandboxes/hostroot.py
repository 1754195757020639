"""A local container's file opened from the host below the root of its
process (``/proc/<pid>/root``) and copied in the kernel, instead of through
the archive API (the caller's conditions: a local engine, a root container,
a path the engine's stat walk proved link-free). The pid is pinned with a
pidfd and confirmed by the engine after its root is opened; the path is
opened below that root by ``openat2`` (``RESOLVE_IN_ROOT``, no link
followed) as an ``O_PATH`` descriptor (:mod:`adapters.sandboxes.hostopen`:
a device node or FIFO is never opened), and must be the file the engine
stat'ed (regular, size, permission bits, mtime in ns) before it is opened
for reading. Anything else answers None: the caller takes the archive API.
"""

from __future__ import annotations

import os
import select
import stat
import sys
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime

from adapters.sandboxes.hostopen import (
    RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, open_path, reopen_for_reading,
)


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and os.path.isdir("/proc/self")


def engine_mtime_ns(value) -> int | None:
    """The engine's stat `mtime` (RFC 3339 with nanoseconds, as Go prints
    it) in nanoseconds since the epoch; None when it is not one."""
    if not isinstance(value, str) or "T" not in value:
        return None
    text = value.strip()
    frac = 0
    main, sep, rest = text.partition(".")
    if sep:  # digits, then the zone (Z, +hh:mm or -hh:mm)
        digits = len(rest) - len(rest.lstrip("0123456789"))
        if not digits or digits > 9:
            return None
        frac = int(rest[:digits].ljust(9, "0"))
        text = main + rest[digits:]
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    if dt.tzinfo is None:
        return None
    return int(dt.timestamp()) * 1_000_000_000 + frac


def open_in_container(pid_of: Callable[[], int | None], path: str, *, size: int,
                      expect: dict) -> tuple[int, os.stat_result] | None:
    """(read-only fd, fstat) of absolute `path` in the container whose process
    `pid_of()` names (asked before and after the open of its root), when it is
    the file `expect` (the engine's stat) describes; else None, nothing opened."""
    if not available():
        return None
    want_mtime = engine_mtime_ns(expect.get("mtime"))
    want_mode = expect.get("mode")
    if want_mtime is None or not isinstance(want_mode, int):
        return None
    pid = pid_of()
    if not pid or pid <= 0:
        return None
    with ExitStack() as fds:
        try:
            pidfd = os.pidfd_open(pid)
            fds.callback(os.close, pidfd)
            root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.callback(os.close, root)
        except OSError:
            return None
        ended = select.poll()  # readable once the process has ended
        ended.register(pidfd, select.POLLIN)
        if pid_of() != pid or ended.poll(0):  # the pid was not (or no longer) the container's
            return None
        try:
            opath, st = open_path(path.lstrip("/"), dir_fd=root, fallback=False,
                                  resolve=RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
        except OSError:
            return None
        fds.callback(os.close, opath)
        same = (stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == want_mtime
                and stat.S_IMODE(st.st_mode) & 0o777 == want_mode & 0o777)
        if not same:  # not the file the engine stat'ed (a device, a FIFO, another file): never opened
            return None
        try:
            return reopen_for_reading(opath), st
        except OSError:
            return None
