"""The run slot: in a threads-pool worker process, one drive at a time runs Python; the
others wait for the slot, off the GIL, and a drive gives the slot up where it waits on
a platform.

Why: a delivery worker process runs 16 drives in threads that share one GIL. While a
platform answers at once, most of them are runnable, and every socket call (each Redis
round trip, each HTTP read) hands the GIL to another runnable thread. Measured on one
process driving 300 Telegram deliveries against a server that answers at once: 16
threads cost 3.6-4.1 ms of CPU per delivery and ~90 voluntary context switches, where
one thread costs 1.8-2.1 ms and ~7. With the slot, 16 threads cost 2.0-2.2 ms and ~10:
the process runs like one thread, yet sends as many requests at once as it has threads.

- A lane's drive holds the slot (`holding`, tasks/celery_tasks.py), Redis round trips
  included: they are short, and a waiting thread would only take the GIL from it.
- It gives the slot up while it waits on a platform (`waiting`): the adapters' event
  loop while it blocks on its sockets (while its waits end within `_aio.HOLD_S`, 2 ms, a
  platform answering that soon is waited for in place, cheaper than two hand-overs), a sync
  adapter's HTTP call (Slack, WhatsApp). Hand-overs go in turn (`_Slot`).
- A thread that cannot get the slot within `HANDOVER_WAIT_S` runs without it: a holder
  stuck in a slow call (Redis timing out, a slow storage read) must never stall the
  process; it only costs the GIL contention the slot saves, and the thread asks for
  the slot again after its next wait.

A process with one thread (prefork's children, solo) takes a slot nobody else wants.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HANDOVER_WAIT_S", "held", "holding", "waiting"]

#: how long a thread waits for the slot before it runs without it
HANDOVER_WAIT_S = 0.25
#: COURIER_RUNSLOT=0 (for measuring, bench/bench_delivery_concurrency.py): no block holds the slot, so
#: a drive's adapter calls run on the process's shared loop
_ENABLED = os.environ.get("COURIER_RUNSLOT", "1") != "0"

class _Slot:
    """A lock handed over in turn: a release gives the slot to the thread that has waited
    longest (a semaphore lets the releasing thread take it straight back, and at once a
    platform answers before a woken waiter runs: the others starved past HANDOVER_WAIT_S)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._waiters: deque[threading.Lock] = deque()

    def acquire(self, timeout: float) -> bool:
        with self._lock:
            if not self._busy:
                self._busy = True
                return True
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append(turn)
        if turn.acquire(timeout=timeout):
            return True  # handed over
        with self._lock:
            try:
                self._waiters.remove(turn)
            except ValueError:
                return True  # handed over as the wait ended
        return False

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().release()  # the slot stays busy: it is that thread's now
            else:
                self._busy = False


_lock = threading.Lock()
_slot: tuple[int, _Slot] | None = None
_local = threading.local()


def _process_slot() -> _Slot:
    """This process's slot (a forked child makes its own: a thread of the parent may have held it)."""
    global _slot
    got = _slot
    pid = os.getpid()
    if got is None or got[0] != pid:
        with _lock:
            if _slot is None or _slot[0] != pid:
                _slot = (pid, _Slot())
            got = _slot
    return got[1]


def held() -> bool:
    """Whether this thread holds the slot now."""
    return getattr(_local, "slot", None) is not None


def wanted() -> bool:
    """Whether this thread runs a block that holds the slot (`holding`), held now or not
    (it ran on without it past `HANDOVER_WAIT_S`: it asks again after its next wait)."""
    return getattr(_local, "depth", 0) > 0


def _take() -> None:
    slot = _process_slot()
    _local.slot = slot if slot.acquire(timeout=HANDOVER_WAIT_S) else None


def _give() -> None:
    slot, _local.slot = getattr(_local, "slot", None), None
    if slot is not None:
        slot.release()


@contextmanager
def holding() -> Iterator[None]:
    """Run the block with the slot (within `HANDOVER_WAIT_S`, else without it until its next
    wait). Nested: the outer one holds it."""
    if not _ENABLED:
        yield
        return
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth:
        try:
            yield
        finally:
            _local.depth = depth
        return
    _take()
    try:
        yield
    finally:
        _local.depth = 0
        _give()


@contextmanager
def waiting() -> Iterator[None]:
    """Give the slot up while the block waits (on a platform's answer), then take it back
    (or, when this thread ran on without it, ask for it again)."""
    if not wanted():
        yield
        return
    _give()
    try:
        yield
    finally:
        _take()
