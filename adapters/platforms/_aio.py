"""Run async SDK calls (python-telegram-bot, discord.py) from sync code.

One event loop per process, in a daemon thread, created lazily and again
after a fork (Celery's prefork children each get their own). Adapters call
`run(coro, timeout_s)`; the SDK's sessions stay bound to that one loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
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


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = 300.0) -> T:
    """Run `coro` on the process's loop and wait for its result."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        return fut.result(timeout=timeout_s)
    except TimeoutError:
        fut.cancel()
        raise
