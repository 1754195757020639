"""Deliveries as an operator lists them (`courier deliveries`): plain code. Jobs are found by
scanning `courier:job:*` hashes (no index on the hot path), newest first; receipts are shown
without their `spec` (it holds chat text).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from typing import cast

from redis import Redis

from tasks.ledger import keys, receipts
from tasks.states import DeliveryState

HIDDEN = frozenset({"spec"})
SCAN_COUNT = 1000
#: receipt and job fields that are counts (shown as numbers); fields ending in `_s` are times (seconds)
COUNTS = frozenset({"attempts", "retries", "size_bytes", "limit_bytes", "transient_errors", "rate_limited", "redrives",
                    "deliveries", "parts", "events"})


def shown(rec: Mapping[str, str | None] | None) -> dict[str, object]:
    """A receipt or job as an operator's JSON shows it: no spec or message (chat text), counts
    and times as numbers (a field that is not a number stays as it is)."""
    out: dict[str, object] = {}
    for k, v in (rec or {}).items():
        if k in HIDDEN or k == "message":
            continue
        out[k] = v
        if v is not None and (k in COUNTS or k.endswith("_s")):
            with suppress(TypeError, ValueError):
                out[k] = int(v) if k in COUNTS else float(v)
    return out


def jobs(r: Redis, *, chat: str | None = None, since_s: float | None = None) -> list[dict[str, str | None]]:
    """Every job for target `chat` (when given) created at or after `since_s` (epoch), newest first."""
    names = [k for k in r.scan_iter(match=f"{keys.PREFIX}job:*", count=SCAN_COUNT, _type="hash")]
    out: list[dict[str, str | None]] = []
    for i in range(0, len(names), 500):
        pipe = r.pipeline(transaction=False)
        for k in names[i:i + 500]:
            pipe.hmget(k, "id", "kind", "target", "state", "created_s")
        for vals in pipe.execute():
            job = dict(zip(("id", "kind", "target", "state", "created_s"), cast("list[str | None]", vals)))
            if job["id"] and (chat is None or job["target"] == chat) \
                    and (since_s is None or float(job["created_s"] or 0) >= since_s):
                out.append(job)
    out.sort(key=lambda j: float(j["created_s"] or 0), reverse=True)
    return out


def deliveries(r: Redis, *, failed: bool = False, chat: str | None = None, since_s: float | None = None,
               limit: int = 50) -> list[dict[str, str | None]]:
    """The newest `limit` deliveries (newest job first, each job's in order); with `failed` only failed ones."""
    out: list[dict[str, str | None]] = []
    for job in jobs(r, chat=chat, since_s=since_s):
        for rec in receipts.job_deliveries(r, str(job["id"])):  # `jobs` gives only those with an id
            if failed and rec.get("state") != DeliveryState.FAILED:
                continue
            row: dict[str, str | None] = {k: v for k, v in rec.items() if k not in HIDDEN}
            row.setdefault("target", job["target"])
            row.update(job_kind=job["kind"], created_s=job["created_s"])
            out.append(row)
            if len(out) >= limit:
                return out
    return out
