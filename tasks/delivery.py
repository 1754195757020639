"""Delivering one stored file (or a text) to one chat: plain code, no Celery.

The shared flow above every adapter: idempotency (a delivery id recorded on
success and checked before sending, a send lock against two workers at
once), routing by extension, the photo and upload limits (a notice instead
of a too-large file), fitting text and captions, upload-once-send-many file
ids, receipts and delivery events. Adapters only send.

Rate limits and transient errors propagate as `RateLimited` / `Transient`
for the task to re-schedule; `Permanent` is recorded here and not retried.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from adapters.errors import CourierError, Permanent, RateLimited
from adapters.platforms.base import FileSource, Kind, Platform, Sent, split_target
from tasks import events, keys, ratelimit, receipts
from tasks.runtime import Context
from tasks.text import fit_caption, human_bytes, split_text


class Busy(CourierError):
    """Another worker holds this delivery's send lock: try again shortly."""

    transient = True


def _event(ctx: Context, job: dict, pipe=None, **ev: Any) -> None:
    events.publish(ctx.redis, job["job"], {"kind": "delivery", "delivery_id": job["id"], **ev},
                   maxlen=ctx.events_maxlen, pipe=pipe)


def record_failure(ctx: Context, job: dict, reason: str) -> dict:
    pipe = ctx.redis.pipeline(transaction=False)
    receipts.update_delivery(pipe, job["id"], state="failed", reason=reason)
    _event(ctx, job, pipe=pipe, state="failed", reason=reason, name=job.get("name"))
    pipe.execute()
    return {"id": job["id"], "state": "failed", "reason": reason}


def choose_kind(platform: Platform, name: str, size_bytes: int, *, voice: bool, as_document: bool) -> Kind:
    from tasks.reply import route

    lim = platform.limits
    kind = route(
        name, voice=voice, as_document=as_document,
        animation=Kind.ANIMATION in lim.native_kinds, voice_notes=Kind.VOICE in lim.native_kinds,
    )
    if kind == Kind.PHOTO and lim.photo_bytes is not None and size_bytes > lim.photo_bytes:
        kind = Kind.DOCUMENT
    if kind not in lim.native_kinds:
        kind = Kind.DOCUMENT
    return kind


def deliver(ctx: Context, job: dict, extracted: dict | None = None) -> dict:
    """Deliver one item. `job` holds: id, job, target, type ('text'|'file'),
    and text | (key, name, caption, voice, as_document). `extracted` is the
    result of the extraction before it in the chain (file items from a sandbox)."""
    r = ctx.redis
    did = job["id"]
    owner = uuid.uuid4().hex
    locked, rec = receipts.begin_send(r, did, owner, ttl_s=receipts.SEND_LOCK_TTL_S)
    done = _already_done(did, rec)
    if done is not None or not locked:
        if locked:
            receipts.release_send_lock(r, did, owner)
        if done is not None:
            return done
        raise Busy(f"delivery {did} is being sent by another worker")
    # the lock is short and renewed while this process works: a worker that
    # dies frees its deliveries within SEND_LOCK_TTL_S (well inside Discord's
    # nonce memory), while a long upload keeps its lock
    with receipts.renewing(r, did, owner):
        try:
            return _deliver_locked(ctx, job, extracted, owner)
        finally:
            receipts.release_send_lock(r, did, owner)


def _already_done(did: str, rec: dict) -> dict | None:
    if rec.get("state") == "delivered":
        return {"id": did, "state": "delivered", "message_id": rec.get("message_id"), "skipped": True}
    if rec.get("state") == "failed" and rec.get("final") == "1":
        return {"id": did, "state": "failed", "reason": rec.get("reason"), "skipped": True}
    return None


def _deliver_locked(ctx: Context, job: dict, extracted: dict | None, owner: str) -> dict:
    r = ctx.redis
    did = job["id"]
    platform_name, chat = split_target(job["target"])
    try:
        platform = ctx.platform(platform_name)
    except CourierError as exc:
        return record_failure(ctx, job, exc.reason)
    # every send below takes a shared rate-limit slot first, and each part is sent once
    platform = ratelimit.guard(r, platform, did)

    if extracted is not None and not extracted.get("ok", False):
        reason = extracted.get("reason") or "extraction failed"
        if extracted.get("too_large"):
            _notice_too_large(ctx, platform, chat, job, extracted.get("name") or job.get("name") or "file",
                              extracted.get("size"), extracted.get("limit"), key=None)
        return record_failure(ctx, job, reason)
    if extracted:
        job = {**job, **{k: extracted[k] for k in ("key", "name", "size", "sha256") if k in extracted}}

    attempts = receipts.start_attempt(r, did, state="sending", platform=platform_name)
    try:
        if job.get("type") == "text":
            sent = _send_text(platform, chat, job.get("text") or "", did)
            kind_name, size = Kind.TEXT.value, len((job.get("text") or "").encode())
        else:
            sent, kind_name, size = _send_file(ctx, platform, chat, job)
    except Permanent as exc:
        receipts.update_delivery(r, did, final="1")
        return record_failure(ctx, job, exc.reason)
    except _TooLargeNotice as notice:
        receipts.update_delivery(r, did, final="1")
        return record_failure(ctx, job, notice.reason)
    pipe = r.pipeline(transaction=False)
    receipts.update_delivery(pipe, did, state="delivered", message_id=sent.message_id, kind=kind_name,
                             size_bytes=size, attempts=attempts, reason="")
    _event(ctx, job, pipe=pipe, state="delivered", message_id=sent.message_id, media=kind_name,
           name=job.get("name"), size_bytes=size)
    pipe.execute()
    return {"id": did, "state": "delivered", "message_id": sent.message_id, "kind": kind_name}


def _send_text(platform: Platform, chat: str, text: str, did: str) -> Sent:
    parts = split_text(text, platform.limits.text_chars) or [""]
    ids = []
    for i, part in enumerate(parts):
        sub_id = did if len(parts) == 1 else f"{did}#{i}"
        ids.append(platform.send_text(chat, part, delivery_id=sub_id).message_id)
    return Sent(message_id=",".join(ids))


class _TooLargeNotice(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _send_file(ctx: Context, platform: Platform, chat: str, job: dict) -> tuple[Sent, str, int]:
    store = ctx.store
    key = job["key"]
    info = store.stat(key)
    size = info.size_bytes
    name = job.get("name") or os.path.basename(key)
    kind = choose_kind(platform, name, size, voice=bool(job.get("voice")), as_document=bool(job.get("as_document")))
    limit = platform.limits.upload_limit(kind)
    if size > limit:
        reason = _notice_too_large(ctx, platform, chat, job, name, size, limit, key=key)
        raise _TooLargeNotice(reason)
    receipts.update_delivery(ctx.redis, job["id"], kind=kind.value, size_bytes=size, name=name)
    caption, overflow = fit_caption(job.get("caption"), platform.limits.caption_chars)
    sha = job.get("sha256") or ""
    fid_key = None
    cached = None
    bot = getattr(platform, "cache_key", None)
    if bot and not sha:
        sha = _sha256_of(store, key)  # extraction by kernel copy hashes nothing; the file-id cache needs it
    if bot and sha:
        fid_key = keys.file_id(platform.name, bot, sha, kind.value)
        raw = ctx.redis.get(fid_key)
        cached = raw.decode() if isinstance(raw, bytes) else raw
    src = FileSource(name=name, size_bytes=size, sha256=sha, opener=lambda: store.open_read(key),
                     path=store.local_path(key))
    sent = platform.send_file(chat, kind, src, caption=caption, delivery_id=job["id"], file_id=cached)
    if fid_key and sent.file_id:
        ctx.redis.set(fid_key, sent.file_id, ex=30 * 24 * 3600)
    for i, part in enumerate(overflow):
        platform.send_text(chat, part, delivery_id=f"{job['id']}#c{i}")
    return sent, kind.value, size


def _sha256_of(store, key: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    for chunk in store.iter_chunks(key):
        digest.update(chunk)
    return digest.hexdigest()


def _notice_too_large(ctx: Context, platform: Platform, chat: str, job: dict, name: str, size: Any, limit: Any,
                      *, key: str | None) -> str:
    size_s = human_bytes(int(size)) if size else "unknown size"
    limit_s = human_bytes(int(limit)) if limit else "the limit"
    reason = f"too large: {name} is {size_s}, over the {limit_s} limit for {platform.name}"
    text = f"⚠️ {name} ({size_s}) was not sent: it is over the {limit_s} limit here."
    if key is not None:
        try:
            url = ctx.store.signed_url(key, expires_s=7 * 24 * 3600)
        except CourierError:
            url = None
        if url:
            text += f"\nDownload it here (link valid 7 days): {url}"
    try:
        platform.send_text(chat, text, delivery_id=f"{job['id']}#notice")
    except RateLimited:
        raise  # re-scheduled: the notice goes out once its slot is free
    except CourierError:
        pass  # the failure is recorded either way
    return reason
