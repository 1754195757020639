"""Run async SDK calls (python-telegram-bot, discord.py) from sync code.

Two loops:

- A lane's drive (a thread that holds the process's run slot, `adapters.runslot`) runs
  its calls on its own thread's event loop (made lazily, and again after a fork or after
  an exception from outside the call broke it): no hand-off between threads, and while
  the loop waits on its sockets for more than `HOLD_S` it gives the run slot up, so the
  other drives run. A threads pool's threads live as long as the worker, and each keeps
  its loop and the SDK clients bound to it (`PerLoop`). The clients share the process's
  one TLS context (`tls`): building one loads the CA bundle, tens of ms of CPU.
- Every other caller (a turn's activity thread, the CLI, an adapter that logs in once per
  process: `shared=True`, Discord) runs on the process's one shared loop, in a daemon
  thread, giving up the run slot while it waits (when it holds it).

Either way the caller sees an exception raised in its thread (a threads pool's soft
time limit, `workers.timelimits`) within `WAIT_SLICE_S`, and the abandoned call's
coroutine is cancelled. A thread that runs a loop of its own already (an async web
handler) is served by the shared loop.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import selectors
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from adapters import runslot

__all__ = ["HOLD_S", "PerLoop", "WAIT_SLICE_S", "close_all", "run", "thread_loop", "tls"]

T = TypeVar("T")

#: the caller waits in slices this long: an exception raised in its thread (a threads pool's soft
#: time limit, `workers.timelimits`) is seen within one slice, not only when the call ends
WAIT_SLICE_S = 0.5
#: a wait on the network this short keeps the run slot, while the loop's waits end this soon (`_Selector`)
HOLD_S = 0.002
#: how long an abandoned call's coroutine gets to finish its cancellation
CANCEL_GRACE_S = 5.0


# -- the calling thread's own loop -----------------------------------------------------------
class _Selector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The thread loop's selector: it wakes at least every `WAIT_SLICE_S` (an exception
    raised in the thread is seen at its next bytecode), and gives up the run slot while
    it blocks.

    While the loop's waits end within `HOLD_S` (a platform answering at once: a local Bot
    API server), a wait keeps the slot that long: handing it over and back costs more (four
    context switches). Once one lasts longer (a remote API: tens of ms and more), the next
    waits give the slot up at once, until one ends within HOLD_S again: holding it through
    the first 2 ms of every remote call left the process idle (bench_telegram's 25 ms
    figure: 7.5-7.8 with the hold on every wait, 8.4 without)."""

    def __init__(self) -> None:
        super().__init__()
        #: the last wait ended within HOLD_S
        self.quick = True

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        wait = WAIT_SLICE_S if timeout is None else min(timeout, WAIT_SLICE_S)
        if wait > 0 and runslot.wanted():
            hold = HOLD_S if self.quick else 0.0
            t0 = time.monotonic()
            ready = super().select(min(wait, hold))
            if ready or wait <= hold:
                self.quick = self.quick or bool(ready)
                return ready  # type: ignore[no-any-return]
            with runslot.waiting():
                ready = super().select(wait - hold)
                self.quick = bool(ready) and time.monotonic() - t0 <= HOLD_S  # (the slot's return not counted)
            return ready  # type: ignore[no-any-return]
        return super().select(wait)  # type: ignore[no-any-return]


_local = threading.local()


def thread_loop(*, make: bool = True) -> asyncio.AbstractEventLoop | None:
    """This thread's loop (made on first use and again after a fork; None with `make` False
    when there is none)."""
    got = getattr(_local, "loop", None)
    if got is not None and got[0] == os.getpid() and not got[1].is_closed():
        return got[1]  # type: ignore[no-any-return]
    if not make:
        return None
    loop = asyncio.SelectorEventLoop(_Selector())
    _local.loop = (os.getpid(), loop)
    return loop


def _drop_thread_loop(loop: asyncio.AbstractEventLoop) -> None:
    """After an exception from outside the call (it may have hit the loop mid-step): this
    loop is not used again; the next call makes a new one (and new SDK clients)."""
    if getattr(_local, "loop", (None, None))[1] is loop:
        _local.loop = None
    try:
        loop.close()
    except Exception:  # noqa: BLE001 - a loop that cannot close is dropped anyway
        pass


async def _bounded(coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
    if timeout_s is None:
        return await coro
    async with asyncio.timeout(timeout_s):
        return await coro


def _run_here(coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
    loop = thread_loop()
    assert loop is not None
    task = loop.create_task(_bounded(coro, timeout_s))
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if task.done():
            raise  # the call's own exception (its timeout included): the loop is fine
        # from outside the call (a soft time limit raised in this thread): cancel the call,
        # give its coroutine a moment to unwind, and never use this loop again
        task.cancel()
        try:
            loop.run_until_complete(asyncio.wait([task], timeout=CANCEL_GRACE_S))
        except BaseException:  # noqa: BLE001 - the exception that stopped the call is the one to raise
            pass
        _drop_thread_loop(loop)
        raise


# -- the process's shared loop ------------------------------------------------------------------
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The process's shared loop, in its daemon thread (made lazily, and again after a fork)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _pid = os.getpid()
            t = threading.Thread(target=_loop.run_forever, name="courier-aio", daemon=True)
            t.start()
        return _loop


def _run_shared(coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
    fut = asyncio.run_coroutine_threadsafe(coro, loop())
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        with runslot.waiting():
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


def run(coro: Coroutine[Any, Any, T], timeout_s: float | None = 300.0, *, shared: bool = False) -> T:
    """Run `coro` and wait for its result: in a drive, on its thread's own loop; else (or
    with `shared`) on the process's shared loop. A `TimeoutError` past `timeout_s`."""
    if shared or not runslot.wanted() or asyncio._get_running_loop() is not None:
        return _run_shared(coro, timeout_s)
    return _run_here(coro, timeout_s)


def close_all(objs: PerLoop[T], close: Callable[[T], Coroutine[Any, Any, Any]], timeout_s: float = 10.0) -> None:
    """Close `objs`' objects on the loops that run here: this thread's own and the shared
    one (best effort). The others' loops run in other threads: their objects are dropped
    (their connections close with them)."""
    with _lock:
        shared = _loop if _loop is not None and _pid == os.getpid() and not _loop.is_closed() else None
    own, on_shared = objs.pop(thread_loop(make=False)), objs.pop(shared)
    objs.clear()
    for obj, here in ((own, True), (on_shared, False)):
        if obj is not None:
            try:
                (_run_here if here else _run_shared)(close(obj), timeout_s)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass


_tls: tuple[int, ssl.SSLContext] | None = None


def tls() -> ssl.SSLContext:
    """The process's TLS context for its SDK clients, as httpx would make it (certifi's CA
    bundle, or SSL_CERT_FILE / SSL_CERT_DIR): made once, and again after a fork. Each
    client made with its own costs ~20 ms of CPU (the CA bundle is parsed again), and a
    drive's first send on a thread makes a client (`PerLoop`)."""
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
