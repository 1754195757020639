"""Run async SDK calls (python-telegram-bot, discord.py) from sync code.

One event loop per process, in a daemon thread, created lazily and again
after a fork (Celery's prefork children each get their own). Adapters call
`run(coro, timeout_s)`; the SDK's sessions stay bound to that one loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def loop() -> asyncio.AbstractEventLoop:
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _pid = os.getpid()
            t = threading.Thread(target=_loop.run_forever, name="courier-aio", daemon=True)
            t.start()
        return _loop


#: the caller waits in slices this long: an exception raised in its thread (a threads pool's soft
#: time limit, `workers.timelimits`) is seen within one slice, not only when the call ends
WAIT_SLICE_S = 0.5


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = 300.0) -> T:
    """Run `coro` on the process's loop and wait for its result (any thread may call it:
    a threads pool's tasks share the one loop, and its SDK sessions)."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop())
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
            try:
                return fut.result(timeout=max(0.0, left))
            except TimeoutError:
                if fut.done() or (deadline is not None and time.monotonic() >= deadline):
                    raise  # the coroutine's own TimeoutError, or the call's deadline
    except BaseException:
        fut.cancel()  # (nothing when it is done) the call is abandoned: its coroutine is cancelled
        raise
