"""Delivery confirmations: a platform that reports a message's fate after accepting it
(WhatsApp's status webhook) moves its receipt on. Plain code, no Celery.

Such a receipt is written `delivered` with `confirmed: accepted` and its message id
remembered (`remember`); a status then sets `confirmed` to `delivered` or `read` (never
backwards), or makes the receipt `failed` (`accepted, then failed: …`), with its event
and metric. Other platforms' receipts are `confirmed: final at acceptance`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline

from tasks import metrics
from tasks.ledger import events, keys, receipts, scripts
from tasks.states import DeliveryState

#: a confirmation's order: a status never moves a receipt back
RANK = {"accepted": 0, "sent": 1, "delivered": 2, "read": 3}
_RANK_ARGS = [x for status, rank in RANK.items() for x in (status, rank)]


@dataclass(frozen=True)
class Status:
    """One status a platform reported for one of its message ids."""

    platform: str
    message_id: str
    status: str  # sent | delivered | read | failed
    #: why, for `failed` (the platform's own words and code)
    reason: str = ""


def remember(pipe: Pipeline | Redis, platform: str, message_id: str, did: str) -> None:
    """The delivery `did` is the platform's message `message_id` (queued on `pipe`)."""
    if message_id:
        pipe.set(keys.sent_message(platform, message_id), did, ex=receipts.RETENTION_S)


def apply(r: Redis, statuses: list[Status], *, events_maxlen: int = 1000) -> list[tuple[str, str]]:
    """Each status on its receipt, in order. Returns (message id, what it did) for each: failed,
    confirmed, stale, not_delivered, ignored (an unknown status), unknown (no receipt of it)."""
    out: list[tuple[str, str]] = []
    for s in statuses:
        if s.status not in RANK and s.status != "failed":
            out.append((s.message_id, "ignored"))
            continue
        did = r.get(keys.sent_message(s.platform, s.message_id))
        if not did:
            out.append((s.message_id, "unknown"))
            continue
        did = str(did)
        reason = f"accepted, then failed: {s.reason or 'the platform gave no reason'}"[:500]
        what = str(scripts.run(r, "confirm_status", keys=[keys.delivery(did)],
                               args=[s.status, RANK.get(s.status, 0), f"{time.time():.3f}", reason,
                                     DeliveryState.DELIVERED, DeliveryState.FAILED, *_RANK_ARGS]))
        out.append((s.message_id, what))
        if what in ("failed", "confirmed"):
            rec = receipts.get_delivery(r, did) or {}
            job = rec.get("job") or did.rsplit(".", 1)[0]
            state = DeliveryState.FAILED if what == "failed" else DeliveryState.DELIVERED
            ev = {"kind": "delivery", "delivery_id": did, "state": state, "confirmed": s.status}
            if what == "failed":
                ev["reason"] = reason
                metrics.record_delivery(did, f"{s.platform}:", DeliveryState.FAILED, rec.get("type") or "file",
                                        reason=reason)
            events.publish(r, job, ev, maxlen=events_maxlen)
    return out
