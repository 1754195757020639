"""Writes that must outlive a Redis failover: what `courier send`, `courier turn` and a webhook
answer "queued" for.

Redis replicates asynchronously: a master that has just been deposed (its replica promoted, the
Sentinel not yet announcing it, or a client still connected to it) accepts writes that are dropped when
it becomes the new master's replica. A send recorded there would be answered with a job id and then be
gone. So an accepting write is one MULTI/EXEC followed, on the same connection and in the same round trip,
by `WAIT <replicas> <ms>`: a deposed master has no replica left and answers 0. Unconfirmed, the
client's connections are dropped (a Sentinel-managed pool asks the Sentinel again) and the write,
idempotent, is made again, until a replica confirms it or `within_s` ends (the master's replica may be
down: the write then stands on the master, and the caller is told).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.client import Pipeline


@dataclass(frozen=True)
class Durability:
    """How an accepting write is confirmed. `replicas` 0: not at all (one Redis, no replica)."""

    replicas: int = 0
    #: one WAIT's bound
    wait_s: float = 1.0
    #: how long the write is made again before it is accepted unconfirmed
    within_s: float = 10.0


def transaction(r: Redis, fill: Callable[[Any], None], replicas: int = 0, wait_s: float = 1.0) -> int | None:
    """`fill(pipe)`'s commands as one MULTI/EXEC; with `replicas`, then `WAIT` on that connection in the
    same round trip. Returns how many replicas acknowledged the write (None: none were asked)."""
    if replicas <= 0:
        t = r.pipeline(transaction=True)
        fill(t)
        t.execute()
        return None
    # a plain pipeline (one connection, one round trip, sent again whole if the connection drops) that
    # spells MULTI/EXEC itself, so that WAIT can follow EXEC; no reply callbacks: queued commands answer QUEUED
    p: Any = Pipeline(r.connection_pool, {}, False, None)
    p.execute_command("MULTI")
    fill(p)
    p.execute_command("EXEC")
    p.execute_command("WAIT", replicas, _ms(wait_s))
    replies = p.execute()
    for reply in replies[-2] or ():
        if isinstance(reply, Exception):
            raise reply
    return int(replies[-1])


async def write_async(r: AsyncRedis, fill: Callable[[Any], Awaitable[Any]], d: Durability) -> tuple[Any, bool]:
    """The asyncio twin of `write`, for one atomic command (a script) that `fill(pipe)` queues: its reply,
    and whether `d.replicas` confirmed it. Made again until then, or until `d.within_s` ends."""
    deadline = time.monotonic() + d.within_s
    while True:
        p: Any = r.pipeline(transaction=False)
        await fill(p)
        p.execute_command("WAIT", d.replicas, _ms(_bound(d, deadline)))
        reply, acked = await p.execute()
        if int(acked) >= d.replicas or time.monotonic() >= deadline:
            return reply, int(acked) >= d.replicas
        await r.connection_pool.disconnect()


def write(r: Redis, fill: Callable[[Any], None], d: Durability | None) -> bool:
    """`transaction(r, fill)` until `d.replicas` replicas confirm it (True), or `d.within_s` ends (False:
    the write stands on the master the client last reached). `fill` must be idempotent."""
    if d is None or d.replicas <= 0:
        transaction(r, fill)
        return True
    deadline = time.monotonic() + d.within_s
    while True:
        acked = transaction(r, fill, d.replicas, _bound(d, deadline))
        if acked is not None and acked >= d.replicas:
            return True
        if time.monotonic() >= deadline:
            return False
        # maybe a deposed master: the next connection asks the Sentinel where the master is now
        r.connection_pool.disconnect()


def _bound(d: Durability, deadline: float) -> float:
    """One WAIT's bound: `d.wait_s`, or what is left of `d.within_s`."""
    return min(d.wait_s, max(0.001, deadline - time.monotonic()))


def _ms(seconds: float) -> int:
    """WAIT's milliseconds (at least 1: WAIT 0 would wait for ever)."""
    return max(1, int(seconds * 1000))
