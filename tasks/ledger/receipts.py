"""Jobs and delivery receipts in Redis: what `courier status` shows. A job (a send or a turn)
has an ordered list of deliveries; a receipt moves queued -> (sending) -> delivered | failed."""

from __future__ import annotations

import time
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from tasks.ledger import keys, scripts
from tasks.states import DELIVERY_OVER, DeliveryState, JobState

RETENTION_S = 30 * 24 * 3600
TERMINAL = DELIVERY_OVER


#: a receipt or a job record as read back: every field a string (courier's clients decode replies)
Receipt = dict[str, str]


def _text(v: object) -> str:
    """A field's value as written: its text (None: "")."""
    return "" if v is None else str(v)


def create_job(r: Redis | None, job_id: str, *, kind: str, target: str, pipe: Pipeline | None = None,
               **meta: Any) -> None:
    """Record a job (a send or a turn); queued on `pipe` when given."""
    p = pipe if pipe is not None else cast(Redis, r).pipeline()
    p.hset(keys.job(job_id), mapping={k: v for k, v in job_fields(job_id, kind=kind, target=target, **meta).items()})
    p.expire(keys.job(job_id), RETENTION_S)
    if pipe is None:
        p.execute()


def job_fields(job_id: str, *, kind: str, target: str, **meta: Any) -> dict[str, str]:
    """A new job record's fields (`create_job` writes them at `keys.job(job_id)`, kept RETENTION_S)."""
    fields = {"id": job_id, "kind": kind, "target": target, "state": JobState.QUEUED,
              "created_s": f"{time.time():.3f}"}
    fields.update({k: _text(v) for k, v in meta.items() if v is not None})
    return fields


def set_job(r: Redis, job_id: str, **fields: Any) -> None:
    r.hset(keys.job(job_id), mapping={k: _text(v) for k, v in fields.items()})


def get_job(r: Redis, job_id: str) -> dict[str, str] | None:
    return cast(Receipt, r.hgetall(keys.job(job_id))) or None


#: what a turn or a delivery that `courier cancel` ended says (tasks/ops/operations.py)
CANCEL_REASON = "cancelled by the operator"


def cancel_requested(r: Redis, job_id: str) -> bool:
    """Whether `courier cancel` marked this job's turn (`cancel_requested` on its job)."""
    return r.hget(keys.job(job_id), "cancel_requested") == "1"


def add_delivery(r: Redis, job_id: str, delivery_id: str, *, lane: str | None = None, **meta: Any) -> None:
    """Register a delivery as queued (idempotent: an existing receipt is kept), appending it to the
    chat lane `lane` (a target) when given. `r` may be a pipeline (one round trip for a plan)."""
    fields = {"id": delivery_id, "job": job_id, "state": DeliveryState.QUEUED, "attempts": "0",
              "queued_s": f"{time.time():.3f}"}
    fields.update({kk: _text(v) for kk, v in meta.items() if v is not None})
    flat = [x for kv in fields.items() for x in kv]
    scripts.run(r, "delivery_add",
                keys=[keys.delivery(delivery_id), keys.job_deliveries(job_id), keys.lane(lane or "")],
                args=[RETENTION_S, "1" if lane else "0", *flat])


def update_open_delivery(r: Redis, delivery_id: str, **fields: Any) -> None:
    """Set receipt fields unless the delivery is already delivered or
    cancelled (a redelivered extraction must not touch a finished receipt). `r` may be a pipeline."""
    flat = [x for k, v in fields.items() if v is not None for x in (k, _text(v))]
    if flat:
        scripts.run(r, "delivery_update_open", keys=[keys.delivery(delivery_id)],
                    args=[DeliveryState.DELIVERED, DeliveryState.CANCELLED, *flat])


def update_delivery(r: Redis, delivery_id: str, **fields: Any) -> None:
    """Set receipt fields (None values are skipped). `r` may be a pipeline."""
    r.hset(keys.delivery(delivery_id), mapping={k: _text(v) for k, v in fields.items() if v is not None})


def get_delivery(r: Redis, delivery_id: str) -> dict[str, str] | None:
    return cast(Receipt, r.hgetall(keys.delivery(delivery_id))) or None


def job_deliveries(r: Redis, job_id: str) -> list[dict[str, str]]:
    pipe = r.pipeline()  # (no ids: nothing sent, [])
    for d in cast("list[str]", r.lrange(keys.job_deliveries(job_id), 0, -1)):
        pipe.hgetall(keys.delivery(d))
    return [h for h in cast("list[Receipt]", pipe.execute()) if h]


def start_attempt(r: Redis, delivery_id: str, **fields: Any) -> int:
    """Count an attempt and set fields in one round trip; returns the attempt number."""
    pipe = r.pipeline(transaction=False)
    pipe.hincrby(keys.delivery(delivery_id), "attempts", 1)
    pipe.hset(keys.delivery(delivery_id), mapping={k: _text(v) for k, v in fields.items()})
    return int(pipe.execute()[0])
