"""courier's processes (worker, web, CLI, demo).

Importing this package first puts courier's own root on `sys.path` ahead of
the working directory: courier's top-level packages have common names
(`storage`, `tasks`, ...) and a process started in a directory holding a
folder so named (the data dir holds `storage/`) would otherwise import that
folder as a namespace package when courier is installed by an import hook
(`pip install -e`, whose finder is consulted only after `sys.path`), and
fail with an ImportError. Every entry point (`celery -A workers.celery_app`,
`python -m workers.cli`, `courier`, the web app) imports this package
before any of the others.

So it is here too that every courier process (worker and its pool children,
which fork from it; web; beat; the CLI; Flower through courier's app) makes
itself non-dumpable, before it reads a setting: see `_not_dumpable`.
"""

from __future__ import annotations

import os
import sys

#: prctl(2) option: whether the process may be ptraced and its /proc files read by its own uid
PR_SET_DUMPABLE = 4


def _not_dumpable() -> None:
    """`prctl(PR_SET_DUMPABLE, 0)`: another process of the same uid (an agent
    started by this user, anything else it runs) can no longer read this
    process's /proc/<pid>/environ, mem, fds or maps, nor ptrace it (that takes
    CAP_SYS_PTRACE now): the tokens and the Redis URL a worker holds stay in it.
    It is kept across fork (a prefork pool's children) and reset by execve
    (an agent courier starts is an ordinary process). No core dumps either."""
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
