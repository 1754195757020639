"""The ledger's moving parts: who works on a stage and when somebody must look again.

- a **lease** (`keys.lease(stage, id)`): its holder's token with a short TTL, renewed by one heartbeat
  thread per process while the work runs: a dead worker's lease is gone within `LEASE_TTL_S`.
- a **due time** (`keys.due(stage)`): when the reconciler must look at an entry again if nothing else
  has. Every stage not final has one, so a task message that vanished leaves it behind, and the
  reconciler re-drives the stage from the ledger alone.

Stages: `lane` (id = target), `extract` (id = delivery id), `turn` (id = job id).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, cast

from redis import Redis

from adapters.errors import SandboxStalled, StorageError
from tasks.ledger import keys, scripts

#: a lease lives this long unless its holder renews it (every third of it)
LEASE_TTL_S = 20
STAGES = ("lane", "extract", "turn")
#: the reconciler re-drives a stage nobody has looked at for this long (its due time)
LANE_GRACE_S = 10.0
#: a stage's message may be lost with a broker connection (kombu restores it only after the visibility
#: timeout): the chat waits this long. A stage still queued is re-published too (its copy is dropped when it
#: finds the stage done or held); the grace doubles per re-drive behind a backlog (reconcile.grace).
EXTRACT_GRACE_S = 10.0
TURN_GRACE_S = 10.0


#: `<host>:<pid>:` of this process, made once (again in a forked child): no uname and getpid per token
_holder = ""


def _new_holder() -> None:
    global _holder
    _holder = f"{socket.gethostname()}:{os.getpid()}:"


_new_holder()
os.register_at_fork(after_in_child=_new_holder)


def new_token() -> str:
    """A lease holder's token: `<host>:<pid>:<random>` (who holds it, for operators)."""
    return f"{_holder}{uuid.uuid4().hex[:12]}"


def take(r: Redis, key: str, token: str, ttl_s: int = LEASE_TTL_S) -> bool:
    """Take a lease (or a lock) if nobody holds it."""
    return bool(r.set(key, token, nx=True, ex=ttl_s))


def release(r: Redis, key: str, token: str) -> None:
    """Only the holder releases (compare-and-delete). `r` may be a pipeline."""
    scripts.run(r, "lease_release", keys=[key], args=[token])


def renew(r: Redis, key: str, token: str, ttl_s: int = LEASE_TTL_S) -> bool:
    """Extend a lease its holder still holds (False: it lapsed, or another holds it)."""
    return bool(scripts.run(r, "lease_renew", keys=[key], args=[token, ttl_s]))


def held(r: Redis, key: str) -> float:
    """Seconds the lease has left (0.0: not held)."""
    ms = r.pttl(key)
    return max(0.001, ms / 1000) if ms and ms > 0 else 0.0


#: a lease that needs progress (a lane's drive) is no longer renewed once its holder has made none for
#: this long: it lapses, the stage goes to another worker, the holder's process is recycled
STALL_S = 40.0


class _Held:
    __slots__ = ("r", "key", "token", "ttl_s", "thread", "last", "reported")

    def __init__(self, r: Any, key: str, token: str, ttl_s: int, needs_progress: bool) -> None:
        self.r, self.key, self.token, self.ttl_s = r, key, token, ttl_s
        self.thread = threading.get_ident()
        #: monotonic time of the holder's last progress (None: renewed while held, whatever it does)
        self.last: float | None = time.monotonic() if needs_progress else None
        self.reported = False


class _Renewer:
    """One daemon thread per process renews every lease this process holds, in one pipeline each
    third of its life. A missed renewal only shortens the lease: at worst a second worker re-drives
    a stage, which every stage tolerates. A lease held with `needs_progress` is renewed only while
    its holder shows progress (`progress()`, or a `marker()`'s mark, at least every `stall_s`): a
    holder stuck without a deadline stops holding it, and `on_stall` is told once."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        #: leases whose release failed (Redis away): (client, key, token, stage, id, monotonic give-up time)
        self.unreleased: list[tuple[Any, str, str, str, str, float]] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.next = 0
        self.stall_s = STALL_S
        self.on_stall: Callable[[str, float], None] = _log_stall

    def _running(self) -> None:
        """Under the lock: this process's thread is running."""
        if self.thread is None or self.pid != os.getpid() or not self.thread.is_alive():
            self.pid = os.getpid()
            self.thread = threading.Thread(target=self._run, name="courier-lease-renewer", daemon=True)
            self.thread.start()

    def add(self, r: Redis, key: str, token: str, ttl_s: int, needs_progress: bool = False) -> int:
        with self.lock:
            self.next += 1
            ident = self.next
            self.held[ident] = _Held(r, key, token, ttl_s, needs_progress)
            self._running()
        return ident

    def release_later(self, r: Redis, key: str, token: str, stage: str, ident: str, ttl_s: int) -> None:
        with self.lock:
            self.unreleased.append((r, key, token, stage, ident, time.monotonic() + ttl_s))
            self._running()
        self.wake.set()

    def _release_unreleased(self) -> None:
        """Release what could not be released, once Redis answers; the stage's due time, if it has
        one, comes forward to now: the reconciler re-drives it at once, not when the lease lapses."""
        with self.lock:
            now = time.monotonic()
            todo, self.unreleased = [u for u in self.unreleased if u[5] > now], []
        for u in todo:
            r, key, token, stage, ident, _ = u
            try:
                pipe = r.pipeline(transaction=False)
                release(pipe, key, token)
                if stage:
                    pipe.zadd(keys.due(stage), {ident: time.time()}, xx=True, lt=True)
                pipe.execute()
            except Exception:  # noqa: BLE001 - Redis still away: next time
                with self.lock:
                    self.unreleased.append(u)

    def remove(self, ident: int) -> None:
        with self.lock:
            self.held.pop(ident, None)

    def mark(self, idents: list[int] | None = None) -> None:
        """Progress of the leases `idents` (None: those this thread holds)."""
        now = time.monotonic()
        me = threading.get_ident()
        with self.lock:
            for ident, h in self.held.items():
                if h.last is not None and (ident in idents if idents is not None else h.thread == me):
                    h.last = now

    def mine(self) -> list[int]:
        me = threading.get_ident()
        with self.lock:
            return [i for i, h in self.held.items() if h.thread == me]

    def due(self, now: float) -> tuple[list[_Held], list[tuple[_Held, float]]]:
        """(the leases to renew, the stalled ones newly found with how long they have made no progress)."""
        renew, stalled = [], []
        with self.lock:
            for h in self.held.values():
                idle = now - h.last if h.last is not None else 0.0
                if idle <= self.stall_s:
                    renew.append(h)
                elif not h.reported:
                    h.reported = True
                    stalled.append((h, idle))
        return renew, stalled

    def _run(self) -> None:
        while True:
            renew, stalled = self.due(time.monotonic())
            for h, idle in stalled:
                try:
                    self.on_stall(h.key, idle)
                except Exception:  # noqa: BLE001 - a handler's failure must not stop the renewals
                    logging.getLogger(__name__).exception("the stall handler failed")
            period = min([h.ttl_s for h in renew] or [LEASE_TTL_S]) / 3
            by_client: dict[int, list[Any]] = {}
            for h in renew:
                by_client.setdefault(id(h.r), [h.r]).append((h.key, h.token, h.ttl_s))
            for r, *leases in by_client.values():
                with suppress(Exception):  # see the class docstring
                    pipe = r.pipeline(transaction=False)
                    for key, token, ttl in leases:
                        scripts.run(pipe, "lease_renew", keys=[key], args=[token, ttl])
                    pipe.execute()
            if self.unreleased:
                self._release_unreleased()
            self.wake.wait(0.5 if self.unreleased else min(period, max(0.5, self.stall_s / 4)))
            self.wake.clear()


def _log_stall(key: str, idle_s: float) -> None:
    logging.getLogger(__name__).error("lease %s: its holder made no progress for %.0f s; no longer renewed "
                                      "(the stage goes to another worker once it lapses)", key, idle_s)


_renewer = _Renewer()


def set_stall_handler(handler: Callable[[str, float], None] | None, stall_s: float | None = None) -> None:
    """What this process does when a lease that needs progress stalls (a worker recycles its
    process: workers/celery_app.py), and after how long (None: as it is)."""
    _renewer.on_stall = handler or _log_stall
    if stall_s is not None:
        _renewer.stall_s = stall_s


def progress() -> None:
    """The calling thread's stage is making progress (its leases that need it are renewed)."""
    _renewer.mark()


def marker() -> Callable[[], None]:
    """A progress mark for the calling thread's current leases, callable from any thread (an SDK's
    event loop reading the file a drive sends)."""
    idents = _renewer.mine()
    return lambda: _renewer.mark(idents)


@contextmanager
def renewing(r: Redis, key: str, token: str, ttl_s: int = LEASE_TTL_S, *,
             needs_progress: bool = False) -> Iterator[None]:
    """Keep a lease (or a send lock) alive while the block runs (`needs_progress`: see `_Renewer`)."""
    ident = _renewer.add(r, key, token, ttl_s, needs_progress)
    try:
        yield
    finally:
        _renewer.remove(ident)


def release_soon(r: Redis, key: str, token: str, stage: str = "", ident: str = "", ttl_s: int = LEASE_TTL_S) -> None:
    """Release a lease its holder is done with, now or, Redis away, as soon as it answers again (the
    renewer thread tries every half second until the lease would have lapsed): after an outage, a stage
    is not held for the rest of a dead lease's TTL. Released late, its due time (`stage`, `ident`) comes forward."""
    try:
        release(r, key, token)
    except Exception:  # noqa: BLE001 - Redis away: the renewer thread releases it
        _renewer.release_later(r, key, token, stage, ident, ttl_s)


@contextmanager
def leased(r: Redis, stage: str, ident: str, ttl_s: int = LEASE_TTL_S) -> Iterator[str | None]:
    """Hold the stage's lease while the block runs: yields the token, or None
    when another live worker holds it (the block must then leave the stage alone)."""
    key = keys.lease(stage, ident)
    token = new_token()
    if not take(r, key, token, ttl_s):
        yield None
        return
    try:
        with renewing(r, key, token, ttl_s):
            yield token
    finally:
        release_soon(r, key, token, stage, ident, ttl_s)


def set_due(r: Redis, stage: str, ident: str, in_s: float) -> None:
    """The reconciler looks at this entry again in `in_s` seconds unless it is final by then (`r`: or a pipeline)."""
    r.zadd(keys.due(stage), {ident: time.time() + max(0.0, in_s)})


def due_when_free(r: Redis, stage: str, ident: str) -> float:
    """A stage found its lease held: the reconciler looks again as soon as the lease lapses (its due
    time brought in, never pushed out). Returns the seconds until then (0.0: the lease is free)."""
    left_s = held(r, keys.lease(stage, ident))
    if left_s:
        r.zadd(keys.due(stage), {ident: time.time() + left_s + 0.1}, lt=True)
    return left_s


def clear_due(r: Redis, stage: str, ident: str) -> None:
    """The entry is final: the reconciler forgets it. `r` may be a pipeline."""
    r.zrem(keys.due(stage), ident)


def overdue(r: Redis, stage: str, *, now: float | None = None, limit: int = 500) -> list[str]:
    """The entries whose due time has passed, oldest first."""
    now = time.time() if now is None else now
    return cast("list[str]", r.zrangebyscore(keys.due(stage), "-inf", now, start=0, num=limit))


def pending(r: Redis) -> dict[str, int]:
    """How many entries each stage has waiting or running (for status and metrics)."""
    pipe = r.pipeline(transaction=False)
    for stage in STAGES:
        pipe.zcard(keys.due(stage))
    return dict(zip(STAGES, (int(n) for n in pipe.execute())))


# -- the retry policy of a stage that failed for a transient reason ---------------------------
#: courier's own re-drives of a lane wait no longer than this as a countdown task (longer: the reconciler)
COUNTDOWN_MAX_S = 10.0
#: a storage outage is waited out in steps of at most this long (resumes soon after it ends)
STORAGE_BACKOFF_CAP_S = 30.0


def backoff_s(n: int, *, storage: bool = False) -> float:
    """The wait before attempt `n + 1` after `n` transient failures: exponential with jitter."""
    cap = STORAGE_BACKOFF_CAP_S if storage else 120.0
    return min(cap, 2.0 ** max(0, n - 1)) * random.uniform(0.5, 1.0)


def count_transient(r: Redis, delivery_id: str, *, attempt: bool = True) -> tuple[int, float]:
    """Count one transient failure on a receipt; returns (failures so far, when the first of this
    run happened). `attempt` False: a stage postponed untried (its sandbox's breaker) starts (or
    goes on with) the run, counting nothing."""
    now = time.time()
    pipe = r.pipeline(transaction=False)
    pipe.hincrby(keys.delivery(delivery_id), "transient_errors", 1 if attempt else 0)
    pipe.hsetnx(keys.delivery(delivery_id), "first_error_s", f"{now:.3f}")
    pipe.hget(keys.delivery(delivery_id), "first_error_s")
    n, _, first = pipe.execute()
    try:
        first_s = float(first)
    except (TypeError, ValueError):
        first_s = now
    return int(n), first_s


def gives_up(exc: BaseException, n: int, first_s: float, *, max_attempts: int, outage_deadline_s: float) -> bool:
    """Storage errors and a sandbox that stopped answering are an outage to wait out until its
    deadline; any other transient error gives up after `max_attempts`."""
    if isinstance(exc, (StorageError, SandboxStalled)):
        return time.time() - first_s >= outage_deadline_s
    return n >= max_attempts
