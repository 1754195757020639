"""The reconciler's re-drivers of the delivery side's stages (a chat's lane, a file's
extraction, the lanes left in the ready set); the turn's is `tasks/turn/turn.py:STAGE`."""

from __future__ import annotations

import time

from tasks.delivery import specs
from tasks.dispatch import chains
from tasks.ledger import keys, ledger, receipts, signing
from tasks.dispatch.reconcile import Stage, grace, queue_load
from tasks.runtime import Context
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK


def _stale_ready(ctx: Context, now: float | None) -> str:
    """Lanes whose wake-up joined the ready set and no drive has taken for a while
    (the drives it counted on were lost or are slow): one drain for them."""
    r = ctx.redis
    if r.zrangebyscore(keys.lanes_ready(), "-inf", (now or time.time()) - chains.READY_STALE_S, start=0, num=1):
        chains.publish_drain(r)
        return "ready"
    return ""


def _lane(ctx: Context, target: str) -> str:
    r = ctx.redis
    if not r.exists(keys.lane(target)):
        ledger.clear_due(r, "lane", target)
        return ""
    ledger.set_due(r, "lane", target, ledger.LANE_GRACE_S)
    chains.publish_lane(target)
    return "lanes"


def _extraction(ctx: Context, did: str) -> str:
    r = ctx.redis
    rec = receipts.get_delivery(r, did)
    if rec is None or rec.get("extraction") in (EXTRACTION_OK, EXTRACTION_FAILED) or rec.get("state") in receipts.TERMINAL \
            or not rec.get("queue"):
        ledger.clear_due(r, "extract", did)
        target = _target_of(rec) if rec is not None and rec.get("spec") else ""
        if target:
            chains.publish_lane(target)  # the lane may be waiting for it
        return ""
    depth, consumers = queue_load(r, rec["queue"])
    if depth and not consumers:  # its message waits in a queue nobody consumes: looked at again, no copy
        ledger.set_due(r, "extract", did, ledger.EXTRACT_GRACE_S)
        return ""
    n = int(r.hincrby(keys.delivery(did), "redrives", 1))
    ledger.set_due(r, "extract", did, grace(ledger.EXTRACT_GRACE_S, n - 1, depth))
    chains.publish_extract(did, rec["queue"], rec.get("source", ""))
    return "extractions"


def _target_of(rec: receipts.Receipt) -> str:
    """The lane a receipt's delivery belongs to, from its verified spec ('' when it does not verify)."""
    try:
        return specs.open_delivery(rec.get("id", ""), rec["spec"]).target
    except signing.Forged:
        return ""


LANE = Stage("lane", _lane, ("lanes", "ready"), first=_stale_ready)
EXTRACT = Stage("extract", _extraction, ("extractions",))
