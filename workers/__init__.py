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
"""

from __future__ import annotations

import os
import sys


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
