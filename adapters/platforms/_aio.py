"""Run async SDK calls (python-telegram-bot, discord.py) from sync code.

Every call runs on the process's one event loop, in a daemon thread (made lazily, and
again after a fork): a threads pool's drives send at once through it, over one SDK
client (and one connection pool) per loop (`PerLoop`), with the process's one TLS
context (`tls`: building one loads the CA bundle, tens of ms of CPU). The caller waits
in slices of `WAIT_SLICE_S`: an exception raised in its thread (a threads pool's soft
time limit, `workers.timelimits`) is seen within one, and the abandoned call's
coroutine is cancelled. A thread that runs a loop of its own (an async web handler) is
served the same way.

Measured (bench/bench_delivery_concurrency.py, docs/benchmarks.md): a delivery
worker's processes with this one loop each send within 10 % as many deliveries a second
as one process whose 16 threads took turns to run Python, each on its own loop (the
run slot, removed in issue 23).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["PerLoop", "WAIT_SLICE_S", "close_all", "run", "tls"]

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
            t = threading.Thread(target=_loop.run_forever, name="courier-aio", daemon=True)
            t.start()
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = 300.0) -> T:
    """Run `coro` on the process's loop and wait for its result (in slices: see the module
    docstring). A `TimeoutError` past `timeout_s`."""
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


def close_all(objs: PerLoop[T], close: Callable[[T], Coroutine[Any, Any, Any]], timeout_s: float = 10.0) -> None:
    """Close `objs`' object on this process's loop (best effort); any other is dropped (a
    loop of the parent process before a fork: its connections close with it)."""
    with _lock:
        mine = _loop if _loop is not None and _pid == os.getpid() and not _loop.is_closed() else None
    obj = objs.pop(mine)
    objs.clear()
    if obj is not None:
        try:
            run(close(obj), timeout_s)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass


_tls: tuple[int, ssl.SSLContext] | None = None


def tls() -> ssl.SSLContext:
    """The process's TLS context for its SDK clients, as httpx would make it (certifi's CA
    bundle, or SSL_CERT_FILE / SSL_CERT_DIR): made once, and again after a fork. Each
    client made with its own costs ~20 ms of CPU (the CA bundle is parsed again), and a
    new loop (after a fork) makes a client (`PerLoop`)."""
    global _tls
    got = _tls
    if got is None or got[0] != os.getpid():
        import httpx

        with _lock:
            got = _tls
            if got is None or got[0] != os.getpid():
                got = _tls = (os.getpid(), httpx.create_ssl_context())
    return got[1]


class PerLoop(Generic[T]):
    """One object per event loop, made on first use on it: an SDK client (its connection
    pool, its locks) belongs to the loop it was made on."""

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

    def pop(self, loop: asyncio.AbstractEventLoop | None) -> T | None:
        """Forget `loop`'s object, and give it back (None: there was none)."""
        if loop is None:
            return None
        with self._lock:
            return self._objs.pop(loop, None)

    def clear(self) -> None:
        with self._lock:
            self._objs.clear()
