"""The operator's retry and cancel (`courier retry`, `courier cancel`): plain code over the
ledger. Retry resets a failed (or cancelled) delivery to `queued` in one script, only if it is
still failed (a delivered one is never sent again), and appends it to its chat's lane as a step
of its own; a file whose extraction failed is extracted again first. The caller publishes; the
due times set here are the safety net. Cancel makes each delivery of a job that has not started
final as `cancelled`, in one script that checks its send lock (one in flight finishes as it
would); a turn is marked `cancel_requested` (`mark_turn`).
"""

from __future__ import annotations

import time

from redis import Redis

from tasks.delivery import specs
from tasks.ledger import events, keys, ledger, receipts, scripts, signing
from tasks.states import DELIVERY_OVER, EXTRACTION_FAILED, TURN_OVER, DeliveryState, JobState

#: a delivery in these states may be retried
RETRYABLE = frozenset({DeliveryState.FAILED, DeliveryState.CANCELLED})


def retry_targets(r: Redis, ident: str) -> tuple[str, list[receipts.Receipt]] | None:
    """What `courier retry ID` means: a delivery id -> that receipt; a job id -> its failed
    or cancelled deliveries. None: no such id."""
    rec = receipts.get_delivery(r, ident)
    if rec is not None:
        return "delivery", [rec]
    if receipts.get_job(r, ident) is not None:
        return "job", [row for row in receipts.job_deliveries(r, ident) if row.get("state") in RETRYABLE]
    return None


def retry(r: Redis, rec: receipts.Receipt) -> dict[str, str]:
    """Re-queue one failed delivery. Returns {id, outcome, ...}: `requeued` (with `target`,
    and `extract`: its queue, when the file is extracted again), or `refused` with its state."""
    did = rec["id"]

    def refused(state: str, reason: str) -> dict[str, str]:
        return {"id": did, "outcome": "refused", "state": state, "reason": reason}

    try:
        spec = specs.open_delivery(did, rec["spec"]) if rec.get("spec") else None
    except signing.Forged as exc:
        return refused(rec.get("state", ""), f"refused: {exc.reason}")
    if spec is None:
        return refused(rec.get("state", ""), "its receipt holds no spec to run it again")
    target = spec.target
    what, was = scripts.run(r, "delivery_retry", keys=[keys.delivery(did), keys.lane(target)],
                            args=[f"{time.time():.3f}", receipts.RETENTION_S, did, DeliveryState.QUEUED,
                                  EXTRACTION_FAILED, *sorted(RETRYABLE)])
    if what == "gone":
        return refused("", "no such delivery (expired?)")
    if what == "refused":
        why = ("already delivered" + (f" (message id {rec.get('message_id')})" if rec.get("message_id") else "")
               if was == DeliveryState.DELIVERED else f"not failed: it is {was}")
        return refused(was, why)
    p = r.pipeline(transaction=False)
    out = {"id": did, "outcome": "requeued", "was": was, "target": target}
    if what == "extract":
        ledger.set_due(p, "extract", did, 60.0)
        out["extract"] = rec.get("queue") or "sandbox"
        out["source"] = spec.extract.path if spec.extract is not None else ""
    ledger.set_due(p, "lane", target, 10.0)
    events.publish(r, spec.job_id,
                   {"kind": "delivery", "delivery_id": did, "state": DeliveryState.QUEUED, "retry": True}, pipe=p)
    p.execute()
    return out


def cancel_delivery(r: Redis, rec: receipts.Receipt) -> dict[str, str]:
    """Cancel one delivery unless it is final or its send is in flight."""
    did = rec["id"]
    lead = rec.get("step") or did
    what, was = scripts.run(r, "delivery_cancel",
                            keys=[keys.delivery(did), keys.delivery_lock(did), keys.delivery_lock(lead)],
                            args=[receipts.CANCEL_REASON, f"{time.time():.3f}", DeliveryState.CANCELLED, *sorted(DELIVERY_OVER)])
    if what == "cancelled":
        p = r.pipeline(transaction=False)
        ledger.clear_due(p, "extract", did)
        events.publish(r, rec.get("job") or did.rsplit(".", 1)[0],
                       {"kind": "delivery", "delivery_id": did, "state": DeliveryState.CANCELLED,
                        "reason": receipts.CANCEL_REASON, "name": rec.get("name")}, pipe=p)
        p.execute()
    return {"id": did, "outcome": what, "state": DeliveryState.CANCELLED if what == "cancelled" else was}


def mark_turn(r: Redis, job_id: str) -> str:
    """Mark a turn cancelled (`cancel_requested`); one not started yet ends now (`cancelled`,
    its terminal event). Returns what it was: queued (ended now), running (marked: it
    delivers nothing), or its final state (nothing to do)."""
    job = receipts.get_job(r, job_id) or {}
    st = job.get("state", "")
    if st in TURN_OVER:
        return st
    r.hset(keys.job(job_id), mapping={"cancel_requested": "1"})
    if st == JobState.QUEUED:
        # a worker taking it now sees the mark before it registers anything
        receipts.set_job(r, job_id, state=JobState.CANCELLED, reason=receipts.CANCEL_REASON)
        ledger.clear_due(r, "turn", job_id)
        events.publish(r, job_id, {"kind": "status", "status": JobState.CANCELLED, "reason": receipts.CANCEL_REASON,
                                   "deliveries": 0})
        return JobState.QUEUED
    return JobState.RUNNING

