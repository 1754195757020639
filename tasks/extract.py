"""Extracting one sandbox file into storage: plain code, no Celery."""

from __future__ import annotations

import errno
import logging
import posixpath
import time

from adapters.errors import CourierError, SandboxError, StorageError, TooLarge
from adapters.sandboxes.base import SandboxRef, os_error
from tasks import events, metrics, receipts
from tasks.runtime import Context


log = logging.getLogger(__name__)

#: what the OS may say about a sandbox path (mapped by base.os_error when a backend lets one through)
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES, errno.EPERM})

#: extractions at least this large publish an `extracted` event as they finish
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
    t0, outcome, info = time.monotonic(), "error", None
    try:
        try:
            sandbox = ctx.sandbox(ref)
            # `~/x` (MEDIA:~/x) is the sandbox's own home: the backend knows where that is
            info = sandbox.extract(sandbox.expand_home(spec["path"]), ctx.store, spec["key"], max_bytes=cap)
        except TooLarge as exc:
            outcome = "failed"
            return record_failure(r, did, {"ok": False, "reason": f"too large: {exc}", "too_large": True, "name": name,
                                           "size": exc.size_bytes, "limit": exc.limit_bytes or cap})
        except SandboxError as exc:
            if exc.transient:
                raise
            outcome = "failed"
            return record_failure(r, did, {"ok": False, "reason": f"{type(exc).__name__}: {exc}", "name": name})
        except CourierError as exc:
            if exc.transient:
                raise
            outcome = "failed"
            return record_failure(r, did, {"ok": False, "reason": exc.reason, "name": name})
        except OSError as exc:
            # a backend let the OS's own words through: what they say of the path (missing, a
            # link loop, a name too long, denied) is one clear permanent reason, never the raw error
            if exc.errno not in _PATH_ERRNOS:
                raise
            mapped = os_error(exc, spec["path"])
            outcome = "failed"
            return record_failure(r, did, {"ok": False, "reason": f"{type(mapped).__name__}: {mapped}", "name": name})
        outcome = "ok"
    finally:
        metrics.record_extraction(ref.kind, time.monotonic() - t0, info.size_bytes if info is not None else None,
                                  outcome)
    # the lane reads the result from the receipt (the ledger), whoever drives it
    pipe = r.pipeline(transaction=False)
    receipts.update_open_delivery(pipe, did, state="extracted", extraction="ok", reason="",
                                  size_bytes=info.size_bytes, sha256=info.sha256, name=name)
    if info.size_bytes >= RECORD_MIN_BYTES:  # a large file shows its progress
        events.publish(r, spec["job"], {"kind": "delivery", "delivery_id": did, "state": "extracted",
                                        "name": name, "size_bytes": info.size_bytes}, maxlen=ctx.events_maxlen,
                       pipe=pipe)
    pipe.execute()
    return {"ok": True, "key": spec["key"], "name": name, "size": info.size_bytes, "sha256": info.sha256}


def record_failure(r, did: str, result: dict) -> dict:
    """Record a permanent extraction failure in the receipt (the delivery
    after it makes it final: `failed`, with a notice when too large); returns `result`."""
    receipts.update_open_delivery(r, did, state="extract_failed", extraction="failed", reason=result["reason"],
                                  too_large="1" if result.get("too_large") else None,
                                  notify="1" if result.get("notify") else None, size_bytes=result.get("size"),
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
        if rec.get("notify") == "1":
            out["notify"] = True
        if rec.get("too_large") == "1":
            out.update(too_large=True, size=rec.get("size_bytes") or None, limit=rec.get("limit_bytes") or None)
        return out
    return None


def run(ctx: Context, did: str) -> dict:
    """The extraction stage of delivery `did`, from the ledger alone: its
    spec is in the receipt. Holds the stage's lease while it works (a second
    message for it finds the lease and leaves); a transient failure backs
    off through the stage's due time (storage outages until their deadline,
    other errors up to `max_transient_attempts`), then fails the file. Ends
    by recording the result and clearing the due time; the caller drives the
    chat's lane after it."""
    import json

    from tasks import ledger

    r = ctx.redis
    rec = receipts.get_delivery(r, did)
    if rec is None or not rec.get("spec"):
        ledger.clear_due(r, "extract", did)
        return {"delivery": did, "state": "gone"}
    job = json.loads(rec["spec"])
    out = {"delivery": did, "target": job["target"]}
    if rec.get("extraction") in ("ok", "failed") or rec.get("state") in receipts.TERMINAL:
        ledger.clear_due(r, "extract", did)
        return {**out, "state": "done"}
    with ledger.leased(r, "extract", did) as token:
        if token is None:
            return {**out, "state": "busy"}
        ledger.set_due(r, "extract", did, ledger.LEASE_TTL_S)
        spec = {**job["extract"], "job": job["job"], "delivery": did}
        try:
            result = extract(ctx, spec)
        except Exception as exc:  # noqa: BLE001 - transient (mapped or not): back off, bounded
            if not isinstance(exc, CourierError):
                log.exception("extraction %s: unexpected error", did)
            reason = exc.reason if isinstance(exc, CourierError) else f"{type(exc).__name__}: {exc}"
            n, first_s = ledger.count_transient(r, did)
            if not ledger.gives_up(exc, n, first_s, max_attempts=ctx.max_transient_attempts,
                                   outage_deadline_s=ctx.outage_deadline_s):
                delay = ledger.backoff_s(n, storage=isinstance(exc, StorageError))
                receipts.update_open_delivery(r, did, state="retrying", reason=reason)
                ledger.set_due(r, "extract", did, delay)
                return {**out, "state": "retrying", "wait_s": round(delay, 3)}
            what = "storage unavailable" if isinstance(exc, StorageError) else f"gave up after {n} attempts"
            result = record_failure(r, did, {"ok": False, "reason": f"{what}: {reason}", "name": job.get("name"),
                                             "notify": True})
        ledger.clear_due(r, "extract", did)
    return {**out, "state": "extracted" if result.get("ok") else "failed"}
