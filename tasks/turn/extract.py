"""Extracting one sandbox file into storage: plain code, no Celery."""

from __future__ import annotations

import errno
import logging
import posixpath
import time

from redis import Redis
from redis.client import Pipeline

from adapters.errors import ControlInName, CourierError, SandboxError, SandboxStalled, StorageError, TooLarge, \
    UnsafePath, in_chat_words
from adapters.sandboxes.base import SandboxRef, os_error
from tasks.delivery import specs
from tasks.dispatch import chains
from tasks import metrics
from tasks.ledger import events, keys, ledger, receipts, scripts, signing
from tasks.turn import breaker
from tasks.messages import Extracted, ExtractionRun, ExtractSpec
from tasks.turn.reply import has_control
from tasks.runtime import Context
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, DeliveryState


log = logging.getLogger(__name__)

#: what the OS may say about a sandbox path (mapped by base.os_error when a backend lets one through)
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES, errno.EPERM})

#: extractions at least this large publish an `extracted` event as they finish
RECORD_MIN_BYTES = 1024 * 1024
#: the states after which an extraction has nothing to do (extract_begin.lua's last arguments)
_TERMINAL = tuple(sorted(receipts.TERMINAL))


def extract(ctx: Context, spec: ExtractSpec, job_id: str, did: str, *, pipe: Pipeline | None = None) -> Extracted:
    """Extract delivery `did`'s file (of job `job_id`) as `spec` says, recording the result in
    its receipt (a success's on `pipe` when given, for the caller to execute). Returns
    `Extracted(ok=True, ...)`, or `ok=False` with the reason for a permanent problem (unsafe
    path, missing, not a file, too large); transient problems raise for the task to retry."""
    r = ctx.redis
    name = posixpath.basename(spec.path) or "file"
    # no look at the receipt first: a redelivered extraction of a delivered
    # item is rare and harmless (same key, atomic write; its receipt is kept)
    ref = SandboxRef.from_dict(spec.sandbox)
    # the size cap and the roots are this worker's: a spec may only lower or narrow them
    cap = min(int(spec.max_bytes or ctx.max_file_bytes), ctx.max_file_bytes)
    t0, outcome, info = time.monotonic(), "error", None
    failure: Extracted | None = None
    try:
        try:
            if has_control(spec.path):  # a NUL or a newline in a MEDIA path: never read, the chat told
                raise ControlInName("the path holds a control character")
            ref = worker_ref(ctx, ref)
            sandbox = ctx.sandbox(ref)
            # `~/x` (MEDIA:~/x) is the sandbox's own home: the backend knows where that is
            info = sandbox.extract(sandbox.expand_home(spec.path), ctx.store, spec.key, max_bytes=cap)
        except TooLarge as exc:
            failure = Extracted(ok=False, reason=f"too large: {exc}", too_large=True, name=name,
                                size=exc.size_bytes, limit=exc.limit_bytes or cap)
        except CourierError as exc:
            if exc.transient:
                raise
            reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, SandboxError) else exc.reason
            failure = Extracted(ok=False, reason=reason, name=name, notify=in_chat_words(exc))
        except OSError as exc:
            # a backend let the OS's own words through: what they say of the path (missing, a
            # link loop, a name too long, denied) is one clear permanent reason, never the raw error
            if exc.errno not in _PATH_ERRNOS:
                raise
            mapped = os_error(exc, spec.path)
            failure = Extracted(ok=False, reason=f"{type(mapped).__name__}: {mapped}", name=name,
                                notify=in_chat_words(mapped))
        outcome = "ok" if failure is None else "failed"
    finally:
        metrics.record_extraction(ref.kind, time.monotonic() - t0, info.size_bytes if info is not None else None,
                                  outcome)
    if failure is not None:
        return record_failure(r, did, failure)
    assert info is not None  # no failure: the extraction returned
    # the lane reads the result from the receipt (the ledger), whoever drives it
    own = pipe is None
    p = r.pipeline(transaction=False) if pipe is None else pipe
    receipts.update_open_delivery(p, did, state=DeliveryState.EXTRACTED, extraction=EXTRACTION_OK, reason="",
                                  size_bytes=info.size_bytes, sha256=info.sha256, name=name)
    if info.size_bytes >= RECORD_MIN_BYTES:  # a large file shows its progress
        events.publish(r, job_id, {"kind": "delivery", "delivery_id": did, "state": DeliveryState.EXTRACTED,
                                        "name": name, "size_bytes": info.size_bytes}, maxlen=ctx.events_maxlen,
                       pipe=p)
    if own:
        p.execute()
    return Extracted(ok=True, key=spec.key, name=name, size=info.size_bytes, sha256=info.sha256)


def worker_ref(ctx: Context, ref: SandboxRef) -> SandboxRef:
    """`ref` as this worker allows it: each root a spec names must lie inside one the worker
    allows (`ctx.allowed_roots`), else UnsafePath, nothing read; no roots: the backend's defaults."""
    if ctx.allowed_roots is None or not ref.roots:
        return ref
    allowed = [posixpath.normpath(a) for a in ctx.allowed_roots(ref)]
    wider = [r for r in ref.roots if ".." in r.split("/") or not r.startswith("/") or not any(
        posixpath.normpath(r) == a or posixpath.normpath(r).startswith(a.rstrip("/") + "/") for a in allowed)]
    if wider:
        raise UnsafePath(f"the spec names roots this worker does not allow for {ref.kind} sandboxes: "
                         f"{', '.join(wider[:3])}")
    return ref


def record_failure(r: Redis, did: str, result: Extracted) -> Extracted:
    """Record a permanent extraction failure in the receipt (its delivery makes it final, with
    the chat's notice when too large or `notify` holds its words); returns `result`."""
    receipts.update_open_delivery(r, did, state=DeliveryState.EXTRACT_FAILED, extraction=EXTRACTION_FAILED,
                                  reason=result.reason, too_large="1" if result.too_large else None,
                                  notify=result.notify or None, size_bytes=result.size, limit_bytes=result.limit)
    return result


def run(ctx: Context, did: str) -> ExtractionRun:
    """The extraction stage of delivery `did`, from the ledger alone, under the stage's lease: a
    transient failure backs off through the due time (`ledger.gives_up`), then fails the file.
    The caller drives the chat's lane after it."""
    r = ctx.redis
    token = ledger.new_token()
    lease = keys.lease("extract", did)
    what, spec = scripts.run(r, "extract_begin", keys=[keys.delivery(did), lease, keys.due("extract")],
                             args=[did, token, ledger.LEASE_TTL_S, time.time() + ledger.LEASE_TTL_S,
                                   EXTRACTION_OK, EXTRACTION_FAILED, *_TERMINAL])
    if what == "gone":
        return {"delivery": did, "state": "gone"}
    try:
        delivery = specs.open_delivery(did, spec)  # logged and counted when forged
    except signing.Forged as exc:  # nothing of it is read: the stage ends, its lane finds the receipt failed
        record_failure(r, did, Extracted(ok=False, reason=f"refused: {exc.reason}"))
        end = r.pipeline(transaction=False)
        ledger.clear_due(end, "extract", did)
        ledger.release(end, lease, token)
        end.execute()
        return {"delivery": did, "state": "refused"}
    if what in ("done", "busy"):
        return {"delivery": did, "target": delivery.target, "state": what}
    extraction = delivery.extract
    if extraction is None:  # courier publishes extractions of sandbox files only
        raise ValueError(f"delivery {did}: its spec names no file to extract")
    gate = breaker.gate(extraction.sandbox, io_timeout_s=ctx.sandbox_io_timeout_s,
                        max_s=ctx.sandbox_breaker_max_s)
    end = r.pipeline(transaction=False)  # what the stage ends with, in one round trip
    ret: ExtractionRun | None = None
    try:
        with ledger.renewing(r, lease, token, ledger.LEASE_TTL_S):
            try:
                gate.enter(r, did)  # SandboxStalled: its sandbox is not answering, postponed untried
                result = extract(ctx, extraction, delivery.job_id, did, pipe=end)
            except Exception as exc:  # noqa: BLE001 - transient (mapped or not): back off, bounded
                if not isinstance(exc, CourierError):
                    log.exception("extraction %s: unexpected error", did)
                reason = exc.reason if isinstance(exc, CourierError) else f"{type(exc).__name__}: {exc}"
                n, first_s = ledger.count_transient(r, did, attempt=not isinstance(exc, SandboxStalled))
                wait_s = gate.after(r, end, did, exc)  # the breaker's end, when it postponed or opened
                if not ledger.gives_up(exc, n, first_s, max_attempts=ctx.max_transient_attempts,
                                       outage_deadline_s=ctx.outage_deadline_s):
                    delay = ledger.backoff_s(n, storage=isinstance(exc, StorageError)) if wait_s is None else wait_s
                    receipts.update_open_delivery(end, did, state=DeliveryState.RETRYING, reason=reason)
                    ledger.set_due(end, "extract", did, delay)
                    ret = {"delivery": did, "target": delivery.target, "state": DeliveryState.RETRYING,
                           "wait_s": round(delay, 3)}
                else:
                    what = ("storage unavailable" if isinstance(exc, StorageError) else "sandbox unavailable"
                            if isinstance(exc, SandboxStalled) else f"gave up after {n} attempts")
                    result = record_failure(r, did, Extracted(ok=False, reason=f"{what}: {reason}",
                                                              name=delivery.name, notify=in_chat_words(exc)))
            else:
                gate.after(r, end, did, None)
            if ret is None:
                ledger.clear_due(end, "extract", did)
    except BaseException:
        ledger.release_soon(r, lease, token, "extract", did)  # its due time stays (brought forward)
        raise
    # the result (a success's receipt), the due time (cleared, or the backoff's) and the lease released
    ledger.release(end, lease, token)
    end.execute()
    done: ExtractionRun = ret or {"delivery": did, "target": delivery.target,
                                  "state": DeliveryState.EXTRACTED if result.ok else DeliveryState.FAILED}
    if gate.woke:  # a scout's answer closed its sandbox's breaker: what it postponed, for the task to publish
        done["wake"] = {"queue": chains.sandbox_queue(SandboxRef.from_dict(extraction.sandbox)), "ids": gate.woke}
    return done
