"""The send lock: one worker at a time sends a delivery.

`under_send_lock` runs a piece of work (one item, or an album locked on its first item)
holding it: another worker holding it is `Busy`, a receipt that says the delivery is
done skips the work. The lock is short and renewed while its holder works, so a worker
that dies frees its deliveries within `SEND_LOCK_TTL_S`; only its owner releases it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

from redis import Redis
from redis.client import Pipeline

from adapters.errors import CourierError
from tasks.ledger import keys, ledger, scripts
from tasks.runtime import Context
from tasks.states import DELIVERY_UNTRIED, DeliveryState

#: a send lock lives this long unless its holder renews it (every third of it): as
#: long as the lease of the lane that takes it, so both lapse together when a worker dies
SEND_LOCK_TTL_S = 20


class Busy(CourierError):
    """Another worker holds this delivery's send lock: try again shortly."""

    transient = True


_BEGIN_FIELDS = ("state", "final", "message_id", "reason")


def begin_send(r: Redis, delivery_id: str, owner: str, ttl_s: int = 600, *, count_attempt: bool = False
               ) -> tuple[bool, dict[str, str], int]:
    """One round trip: take the send lock, read the receipt and (`count_attempt`, the lock taken,
    the delivery not done) count an attempt and mark it sending. Returns (locked, the receipt's
    fields that say whether it is done as they were, attempt number or 0)."""
    locked, values, attempts = scripts.run(
        r, "send_begin", keys=[keys.delivery_lock(delivery_id), keys.delivery(delivery_id)],
        args=[owner, ttl_s, "1" if count_attempt else "0", DeliveryState.SENDING, DeliveryState.DELIVERED,
              DeliveryState.CANCELLED, DeliveryState.FAILED])
    rec = {k: v for k, v in zip(_BEGIN_FIELDS, cast("list[str | None]", values)) if v is not None}
    return bool(locked), rec, int(attempts)


@dataclass
class Held:
    """A send lock its caller already took, with the attempt counted and the receipt read in the
    same step (`tasks.delivery.lanes`, in its head script: one round trip less per delivery)."""

    owner: str
    rec: dict[str, str]  # the receipt as it was before the attempt was counted
    attempts: int


def release_send_lock(r: Redis, delivery_id: str, owner: str) -> None:
    """Only the owner releases (compare-and-delete; Redis away: as soon as it answers). `r` may be a pipeline."""
    ledger.release_soon(r, keys.delivery_lock(delivery_id), owner, ttl_s=SEND_LOCK_TTL_S)


class SendSession:
    """What holding a delivery's send lock gives the work done under it."""

    def __init__(self, ctx: Context, did: str, owner: str, attempts: int, *, fresh: bool = False) -> None:
        self.ctx, self.did, self.owner, self.attempts = ctx, did, owner, attempts
        #: no earlier attempt can have sent a part (the receipt was still queued or just extracted):
        #: nothing to look up. Not the attempt count: courier's own pacing gives an attempt back.
        self.fresh = fresh
        self.released = False

    def release(self, pipe: Pipeline | None = None) -> None:
        """Release the lock (queued on `pipe` when given: one round trip less)."""
        if not self.released:
            release_send_lock(pipe if pipe is not None else self.ctx.redis, self.did, self.owner)
            self.released = True


#: what a piece of work under a send lock returns (`tasks.delivery.delivery`'s outcome, an album's)
Outcome = TypeVar("Outcome")


def under_send_lock(ctx: Context, did: str, done: Callable[[dict[str, str]], Outcome | None],
                    work: Callable[[SendSession], Outcome], *, count_attempt: bool = False,
                    held: Held | None = None) -> Outcome:
    """Run `work` holding the send lock of `did`, unless `done(receipt)` says there is nothing left
    to do; another worker holding it: `Busy`. `held`: the lock already taken by the caller."""
    r = ctx.redis
    if held is not None:
        owner, locked, rec, attempts = held.owner, True, held.rec, held.attempts
    else:
        owner = uuid.uuid4().hex
        locked, rec, attempts = begin_send(r, did, owner, ttl_s=SEND_LOCK_TTL_S, count_attempt=count_attempt)
    result = done(rec)
    if result is not None or not locked:
        if locked:
            release_send_lock(r, did, owner)
        if result is not None:
            return result
        raise Busy(f"delivery {did} is being sent by another worker")
    # renewed while this process works: a dead worker's lock lapses well inside Discord's nonce memory
    session = SendSession(ctx, did, owner, attempts, fresh=rec.get("state") in DELIVERY_UNTRIED)
    with ledger.renewing(r, keys.delivery_lock(did), owner, SEND_LOCK_TTL_S):
        try:
            return work(session)
        finally:
            session.release()
