"""The reconciler: re-drives every stage whose due time passed with nobody on it.

Each worker process runs `Reconciler` (a thread, one pass a second); a
Redis lock lets one of them work at a time, so adding workers adds no load.
A pass reads only the due entries of each stage (`ZRANGEBYSCORE` to now):
idle, it costs four small reads a second (the fourth: lanes in the ready
set for longer than `chains.READY_STALE_S`, which get one drain).

For each overdue entry:
- its lease is held: the holder is alive (it renews) - look again later;
- it is final: forget it;
- else publish its task again (ids only, from the ledger) and look again
  after a grace that doubles with each re-drive of a stage that never
  started (a long queue is not a lost message).
A turn that has started `TURN_MAX_RUNS` times and died each time (it kills
its worker) is ended with an error, and its chat told.

Recovery time after a worker dies is therefore the lease's TTL plus a pass:
about `ledger.LEASE_TTL_S` + 1 s, whatever the broker's visibility timeout.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from redis import Redis

from tasks import keys, ledger, receipts, signing
from tasks.runtime import Context
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, JobState

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
#: how long the reconciler's lock outlives a pass that stopped renewing it
LOCK_TTL_S = 5
TURN_MAX_RUNS = 3
#: the longest grace between two re-drives of a stage that never starts
MAX_GRACE_S = 300.0


def _unleased_overdue(r: Redis, stage: str, now: float | None) -> Iterator[str]:
    """The stage's overdue entries nobody holds; one whose lease is held (its
    holder is alive, or was until the lease lapses) is looked at again then."""
    for ident in ledger.overdue(r, stage, now=now):
        left_s = ledger.held(r, keys.lease(stage, ident))
        if left_s:
            ledger.set_due(r, stage, ident, left_s + 0.1)
        else:
            yield ident


def _grace(base_s: float, redrives: int) -> float:
    return min(MAX_GRACE_S, base_s * 2.0 ** min(redrives, 10))


def tick(ctx: Context, *, now: float | None = None) -> dict[str, int]:
    """One pass over the overdue entries of every stage. Returns what it did."""
    from tasks import chains
    from tasks.states import TURN_OVER

    r = ctx.redis
    out = {"lanes": 0, "extractions": 0, "turns": 0, "abandoned": 0, "ready": 0}
    # lanes whose wake-up joined the ready set and no drive has taken for a while
    # (the drives it counted on were lost or are slow): one drain for them
    if r.zrangebyscore(keys.lanes_ready(), "-inf", (now or time.time()) - chains.READY_STALE_S, start=0, num=1):
        chains.publish_drain(r)
        out["ready"] = 1
    for target in _unleased_overdue(r, "lane", now):
        if not r.exists(keys.lane(target)):
            ledger.clear_due(r, "lane", target)
            continue
        ledger.set_due(r, "lane", target, chains.LANE_GRACE_S)
        chains.publish_lane(target)
        out["lanes"] += 1
    for did in _unleased_overdue(r, "extract", now):
        rec = receipts.get_delivery(r, did)
        if rec is None or rec.get("extraction") in (EXTRACTION_OK, EXTRACTION_FAILED) \
                or rec.get("state") in receipts.TERMINAL or not rec.get("queue"):
            ledger.clear_due(r, "extract", did)
            target = _target_of(rec) if rec is not None and rec.get("spec") else ""
            if target:
                chains.publish_lane(target)  # the lane may be waiting for it
            continue
        n = int(r.hincrby(keys.delivery(did), "redrives", 1))
        ledger.set_due(r, "extract", did, _grace(chains.EXTRACT_GRACE_S, n - 1))
        chains.publish_extract(did, rec["queue"], rec.get("source", ""))
        out["extractions"] += 1
    for job_id in _unleased_overdue(r, "turn", now):
        job = receipts.get_job(r, job_id)
        if job is None or job.get("state") in TURN_OVER or not job.get("spec"):
            ledger.clear_due(r, "turn", job_id)
            continue
        if int(job.get("attempts") or 0) >= TURN_MAX_RUNS:
            from tasks.turn import abandon

            abandon(ctx, job_id, f"the agent's worker died {job['attempts']} times during this turn")
            out["abandoned"] += 1
            continue
        n = int(r.hincrby(keys.job(job_id), "redrives", 1))
        ledger.set_due(r, "turn", job_id, _grace(chains.TURN_GRACE_S, n - 1))
        try:
            spec = signing.open_json("turn", job_id, job["spec"])  # logged and counted when forged
        except signing.Forged as exc:
            ledger.clear_due(r, "turn", job_id)
            receipts.set_job(r, job_id, state=JobState.ERROR, reason=f"refused: {exc.reason}")
            continue
        chains.spec_sig(spec).apply_async()
        out["turns"] += 1
    return out


def _target_of(rec: receipts.Receipt) -> str:
    """The lane a receipt's delivery belongs to, from its verified spec ('' when it does not verify)."""
    try:
        return signing.open_delivery(rec.get("id", ""), rec["spec"]).target
    except signing.Forged:
        return ""


class Reconciler:
    """The reconciler's thread in a worker process: every `interval_s` it
    takes (or keeps) the cluster-wide lock and, holding it, runs a pass.
    Redis errors are logged and the next pass tries again."""

    def __init__(self, ctx_factory: Callable[[], Context], interval_s: float = INTERVAL_S) -> None:
        self.ctx_factory = ctx_factory
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
                    done = tick(ctx)
                    if any(done.values()):
                        log.info("reconciler: re-drove %s", done)
                self.failures = 0
            except Exception as exc:  # noqa: BLE001 - Redis away: try again next pass
                self.failures += 1
                if self.failures in (1, 10) or self.failures % 60 == 0:
                    log.warning("reconciler pass failed (%d in a row): %r", self.failures, exc)
        try:
            ctx = self.ctx_factory()
            ledger.release(ctx.redis, keys.reconciler_lock(), self.token)
        except Exception:  # noqa: BLE001 - it expires by itself
            pass
