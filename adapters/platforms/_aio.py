"""Run async SDK calls (python-telegram-bot, discord.py) from sync code: every call runs on the process's
one event loop, in a daemon thread (made lazily, and again after a fork), over one SDK client per loop
(`PerLoop`) and the process's one TLS context (`tls`); the caller waits in slices (`WAIT_SLICE_S`) and
cancels the call it abandons."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["PerLoop", "WAIT_SLICE_S", "run", "tls"]

T = TypeVar("T")

#: the caller waits in slices this long: an exception raised in its thread (a threads pool's soft
#: time limit, `workers.timelimits`) is seen within one slice, not only when the call ends
WAIT_SLICE_S = 0.5


# -- the process's loop ------------------------------------------------------------------------
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, in its daemon thread (made lazily, and again after a fork)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _pid = os.getpid()
            threading.Thread(target=_loop.run_forever, name="courier-aio", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = 300.0) -> T:
    """Run `coro` on the process's loop and wait for its result, in slices; a `TimeoutError` past `timeout_s`."""
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


_tls: tuple[int, ssl.SSLContext] | None = None


def tls() -> ssl.SSLContext:
    """The TLS context for the process's SDK clients, as httpx makes it: made once per process (a parse of
    the CA bundle costs CPU)."""
    global _tls
    with _lock:  # (taken once per new SDK client, not per call)
        if _tls is None or _tls[0] != os.getpid():
            import httpx

            _tls = (os.getpid(), httpx.create_ssl_context())
        return _tls[1]


class PerLoop(Generic[T]):
    """One object per event loop, made on first use: an SDK client (its pool, its locks) belongs to its loop."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._objs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        """The running loop's object (call it on the loop)."""
        loop = asyncio.get_running_loop()
        obj = self._objs.get(loop)  # (a send's path: the lock only for the first on a loop)
        if obj is not None:
            return obj
        with self._lock:
            obj = self._objs.get(loop)
            if obj is None:
                obj = self._objs[loop] = self._make()
            return obj

    def close(self, close: Callable[[T], Coroutine[Any, Any, Any]], timeout_s: float = 10.0) -> None:
        """Forget every loop's object; close the one of this process's loop (best effort). Any other is
        dropped (a loop of the parent process before a fork: its connections close with it)."""
        with _lock:
            mine = _loop if _loop is not None and _pid == os.getpid() and not _loop.is_closed() else None
        with self._lock:
            obj = self._objs.pop(mine, None) if mine is not None else None
            self._objs.clear()
        if obj is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                run(close(obj), timeout_s)
