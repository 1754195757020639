"""courier's processes (worker, web, CLI, demo). Every entry point imports this package first.

It puts courier's root on `sys.path` ahead of the working directory (courier's top-level packages have
common names, and a data dir holding `storage/` would otherwise be imported as a namespace package under
an editable install), and makes the process non-dumpable before it reads a setting (`_not_dumpable`).
"""

from __future__ import annotations

import os
import sys

#: prctl(2) option: whether the process may be ptraced and its /proc files read by its own uid
PR_SET_DUMPABLE = 4


def _not_dumpable() -> None:
    """`prctl(PR_SET_DUMPABLE, 0)`: another process of the same uid (an agent) can no longer read this
    process's /proc/<pid>/environ, mem or fds, nor ptrace it, so the tokens and Redis URL stay in it; no
    core dumps either. Kept across fork (pool children), reset by execve (an agent courier starts)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    except (OSError, AttributeError) as exc:  # a seccomp filter may refuse it: say so, run on
        print(f"courier: could not make this process non-dumpable ({exc}): processes of the same "
              f"user can read its environment", file=sys.stderr)


def _root_ahead_of_cwd() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted: nothing there can shadow us
        return
    for i, entry in enumerate(sys.path):
        here = os.path.abspath(entry or os.curdir)
        if here == root:
            return  # the root comes first already
        if here == cwd:
            sys.path.insert(i, root)
            return


_root_ahead_of_cwd()
_not_dumpable()
