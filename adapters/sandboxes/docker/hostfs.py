"""The host-side fast paths of a local engine's container (a bind mount's
host path; the container process's root, :mod:`adapters.sandboxes.hostroot`),
both copied from the very descriptor that was checked."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from adapters.errors import SandboxGone, UnsafePath
from adapters.sandboxes.base import _under, store_fd
from adapters.sandboxes.execstream import Resolved
from adapters.sandboxes.hostopen import open_checked
from adapters.sandboxes.hostroot import open_in_container

if TYPE_CHECKING:
    from adapters.sandboxes.docker.sandbox import DockerSandbox

#: files from this size up are read through the container process's root (below: one GET costs less)
HOST_ROOT_MIN_BYTES = 8 * 1024 * 1024


def extract_host_root(sb: DockerSandbox, r: Resolved, path: str, store, key: str, *, max_bytes: int,
                      expect: dict):
    """The checked file through /proc/<pid>/root into `store` (an in-kernel
    copy into a volume); None when that channel cannot be used here."""
    opened = open_in_container(sb._live_pid, r.path, size=r.size, expect=expect)
    if opened is None:
        return None
    fd, before = opened

    def alive() -> None:  # as on the archive channel: a container gone meanwhile fails the same way
        if not sb.alive():
            raise SandboxGone(f"container {sb.ref.target} went away during the transfer")

    try:
        sb.policy_for(sb._home()).check_links(r.path, before.st_nlink, shown=path)
        return store_fd(fd, before, store, key, max_bytes=max_bytes, shown=path, check=alive)
    finally:
        os.close(fd)


def extract_bound(sb: DockerSandbox, bound: tuple[str, str], path: str, store, key: str, *, max_bytes: int,
                  resolved: str):
    """The file at host path `bound[0]`, inside the bind mount source
    `bound[1]`, into `store` (the same version from start to end)."""
    host, src = bound
    policy = sb.policy_for(sb._home())
    fd, st = open_under(host, src, shown=path,
                        check=lambda st: policy.check_links(resolved, st.st_nlink, shown=path))
    try:
        sb.check_size(path, st.st_size, max_bytes)
        return store_fd(fd, st, store, key, max_bytes=max_bytes, shown=path, kernel=False)
    finally:
        os.close(fd)


def open_under(host: str, src: str, *, shown: str,
               check: Callable[[os.stat_result], None] | None = None) -> tuple[int, os.stat_result]:
    """(fd, fstat) of `host` opened for reading, only if it is a regular file
    that resolves (and stays, once opened) inside the bind mount source
    `src`: its real path, type and `check(stat)` are checked on the O_PATH
    descriptor first (:mod:`adapters.sandboxes.hostopen`)."""
    try:
        src_real = os.path.realpath(src)
        real = os.path.realpath(host)
    except OSError as exc:  # a link swapped for a file between realpath's lstat and readlink (EINVAL)
        raise UnsafePath(f"{shown}: changed while resolving on the host ({exc.strerror})") from exc
    if not _under(real, src_real):
        raise UnsafePath(f"{shown}: leaves its bind mount on the host")

    def inside(opened: str, st: os.stat_result) -> None:
        if not _under(opened, src_real):
            raise UnsafePath(f"{shown}: changed while opening")
        if check is not None:
            check(st)

    return open_checked(real, shown=shown, check=inside)
