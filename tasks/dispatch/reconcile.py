"""The reconciler: re-drives every stage whose due time passed with nobody on it.

Each worker process runs a `Reconciler` thread (one pass a second); a Redis lock lets one of them work at
a time. A pass reads only each stage's due entries. An overdue entry whose lease is held is looked at
again when it lapses; else its stage's re-driver (a `Stage`, given by the stage's owner) forgets it if
final, or publishes its task again (ids only) and looks again after a `grace`. This module knows the
ledger only. Recovery after a worker dies: about `ledger.LEASE_TTL_S` + 1 s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass

from redis import Redis

from tasks.ledger import keys, ledger
from tasks.runtime import Context

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
#: how long the reconciler's lock outlives a pass that stopped renewing it
LOCK_TTL_S = 5
#: the longest grace between two re-drives of a stage that never starts
MAX_GRACE_S = 300.0


@dataclass(frozen=True)
class Stage:
    """A stage the reconciler watches, from its owner (`tasks/dispatch/redrive.py`: lanes, extractions;
    `tasks/turn/turn.py`: turns; listed by `tasks/celery_tasks.py:stages`).

    name     the ledger's stage (its due times and leases)
    redrive  an overdue, unleased entry: publish it again, forget it or end it; returns what it did,
             counted in a pass's result ("": nothing counted) under one of `counts` (0 when none)
    first    a look before its entries, given the pass's `now` (a name to count, or "")"""

    name: str
    redrive: Callable[[Context, str], str]
    counts: tuple[str, ...]
    first: Callable[[Context, float | None], str] | None = None


def _unleased_overdue(r: Redis, stage: str, now: float | None) -> Iterator[str]:
    """The stage's overdue entries nobody holds; one whose lease is held is looked at again when it lapses."""
    for ident in ledger.overdue(r, stage, now=now):
        left_s = ledger.held(r, keys.lease(stage, ident))
        if left_s:
            ledger.set_due(r, stage, ident, left_s + 0.1)
        else:
            yield ident


def grace(base_s: float, redrives: int, depth: int) -> float:
    """The wait before the next look at an entry re-driven `redrives` times before, whose queue holds `depth`
    messages. Behind a backlog, `base_s` doubling with each re-drive (at most `MAX_GRACE_S`): a long queue is
    not a lost message. With it empty, `base_s`: the message is waiting nowhere (a worker that lost its
    broker connection drops what it had prefetched; kombu restores it only after the visibility timeout)."""
    return min(MAX_GRACE_S, base_s * 2.0 ** min(redrives, 10)) if depth else base_s


def queue_load(r: Redis, queue: str) -> tuple[int, int]:
    """(messages in `queue`, workers that said they consume it within `keys.CONSUMER_STALE_S`), in one
    round trip. Celery's queue on Redis is a list named after it (tasks/ops/queues.py)."""
    pipe = r.pipeline(transaction=False)
    pipe.llen(queue)
    keys.count_consumers(pipe, queue, time.time())
    depth, consumers = pipe.execute()
    return int(depth), int(consumers)


def tick(ctx: Context, stages: Sequence[Stage], *, now: float | None = None) -> dict[str, int]:
    """One pass over the overdue entries of every stage. Returns what it did."""
    out = {name: 0 for stage in stages for name in stage.counts}
    for stage in stages:
        done = [stage.first(ctx, now)] if stage.first is not None else []
        done += [stage.redrive(ctx, ident) for ident in _unleased_overdue(ctx.redis, stage.name, now)]
        for name in filter(None, done):
            out[name] = out.get(name, 0) + 1
    return out


class Reconciler:
    """The reconciler's thread in a worker process: every `interval_s`, holding the cluster-wide
    lock, it runs a pass. Redis errors are logged and the next pass tries again."""

    def __init__(self, ctx_factory: Callable[[], Context], stages: Sequence[Stage],
                 interval_s: float = INTERVAL_S) -> None:
        self.ctx_factory = ctx_factory
        self.stages = tuple(stages)
        self.interval_s = interval_s
        self.token = f"{os.getpid()}:{ledger.new_token()}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="courier-reconciler", daemon=True)
        self.failures = 0

    def start(self) -> "Reconciler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _holds_lock(self, r: Redis) -> bool:
        key = keys.reconciler_lock()
        return ledger.take(r, key, self.token, LOCK_TTL_S) or ledger.renew(r, key, self.token, LOCK_TTL_S)

    def _run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                ctx = self.ctx_factory()
                if self._holds_lock(ctx.redis):
                    done = tick(ctx, self.stages)
                    if any(done.values()):
                        log.info("reconciler: re-drove %s", done)
                self.failures = 0
            except Exception as exc:  # noqa: BLE001 - Redis away: try again next pass
                self.failures += 1
                if self.failures in (1, 10) or self.failures % 60 == 0:
                    log.warning("reconciler pass failed (%d in a row): %r", self.failures, exc)
        with suppress(Exception):  # else it expires by itself
            ledger.release(self.ctx_factory().redis, keys.reconciler_lock(), self.token)
