"""Extracting one sandbox file into storage: plain code, no Celery."""

from __future__ import annotations

import posixpath

from adapters.errors import CourierError, SandboxError, TooLarge
from adapters.sandboxes.base import SandboxRef
from tasks import events, receipts
from tasks.runtime import Context


#: extractions at least this large are recorded (receipt + event) as they finish
RECORD_MIN_BYTES = 1024 * 1024


def extract(ctx: Context, spec: dict) -> dict:
    """spec: job, delivery (id), sandbox (ref dict), path, key, max_bytes?

    Returns {"ok": True, key, name, size, sha256} or, for a permanent
    problem (unsafe path, missing, not a file, too large), {"ok": False,
    reason, ...}: the delivery after it records the failure. Transient
    problems raise for the task to retry.

    The result is recorded in the receipt too (`extraction` ok | failed;
    a failure as state `extract_failed` with its reason, and `too_large`,
    `size_bytes`, `limit_bytes` when that was it), where an album's delivery
    reads it."""
    r = ctx.redis
    did = spec["delivery"]
    name = posixpath.basename(spec["path"]) or "file"
    # no look at the receipt first: a redelivered extraction of a delivered
    # item is rare and harmless (same key, atomic write; its receipt is kept)
    ref = SandboxRef.from_dict(spec["sandbox"])
    cap = int(spec.get("max_bytes") or ctx.max_file_bytes)
    try:
        sandbox = ctx.sandbox(ref)
        info = sandbox.extract(spec["path"], ctx.store, spec["key"], max_bytes=cap)
    except TooLarge as exc:
        return record_failure(r, did, {"ok": False, "reason": f"too large: {exc}", "too_large": True, "name": name,
                                       "size": exc.size_bytes, "limit": exc.limit_bytes or cap})
    except SandboxError as exc:
        if exc.transient:
            raise
        return record_failure(r, did, {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "name": name})
    except CourierError as exc:
        if exc.transient:
            raise
        return record_failure(r, did, {"ok": False, "reason": exc.reason, "name": name})
    if spec.get("record") or info.size_bytes >= RECORD_MIN_BYTES:
        # an album reads its members' results from their receipts; a large file shows
        # its progress; a small one's result simply rides the chain to its delivery
        pipe = r.pipeline(transaction=False)
        receipts.update_open_delivery(pipe, did, state="extracted", extraction="ok", reason="",
                                      size_bytes=info.size_bytes, sha256=info.sha256, name=name)
        events.publish(r, spec["job"], {"kind": "delivery", "delivery_id": did, "state": "extracted",
                                        "name": name, "size_bytes": info.size_bytes}, maxlen=ctx.events_maxlen,
                       pipe=pipe)
        pipe.execute()
    return {"ok": True, "key": spec["key"], "name": name, "size": info.size_bytes, "sha256": info.sha256}


def record_failure(r, did: str, result: dict) -> dict:
    """Record a permanent extraction failure in the receipt (the delivery
    after it makes it final: `failed`, with a notice when too large); returns `result`."""
    receipts.update_open_delivery(r, did, state="extract_failed", extraction="failed", reason=result["reason"],
                                  too_large="1" if result.get("too_large") else None, size_bytes=result.get("size"),
                                  limit_bytes=result.get("limit"))
    return result


def result_of(rec: dict, key: str) -> dict | None:
    """An extraction's result as `extract` returned it, read back from the
    receipt (None: not recorded)."""
    name = rec.get("name") or posixpath.basename(key)
    if rec.get("extraction") == "ok":
        return {"ok": True, "key": key, "name": name, "size": int(rec.get("size_bytes") or 0),
                "sha256": rec.get("sha256") or ""}
    if rec.get("extraction") == "failed":
        out = {"ok": False, "reason": rec.get("reason") or "extraction failed", "name": name}
        if rec.get("too_large") == "1":
            out.update(too_large=True, size=rec.get("size_bytes") or None, limit=rec.get("limit_bytes") or None)
        return out
    return None
