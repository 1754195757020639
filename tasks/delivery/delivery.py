"""Delivering one stored file (or a text) to one chat: plain code, no Celery.

The flow above every adapter (adapters only send): idempotency (a receipt checked before sending, under
the send lock), the photo and upload limits (a notice instead of a too-large file), fitting text and
captions, upload-once file ids, receipts and delivery events. `RateLimited` / `Transient` propagate for
the lane to re-schedule; `Permanent` is recorded here and not retried.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import replace
from typing import Any, BinaryIO, cast

from redis.client import Pipeline

from adapters.display import visible
from adapters.errors import CourierError, DeliveryError, Permanent, RateLimited
from adapters.platforms.base import FileRefused, FileSource, Kind, Platform, Sent, split_target
from tasks import metrics
from tasks.delivery import confirm, parts, ratelimit, sendlock
from tasks.delivery.routing import route
from tasks.ledger import events, keys, ledger, receipts
from tasks.messages import DeliveryOutcome, DeliverySpec, Extracted
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, DeliveryState
from tasks.runtime import Context
from tasks.delivery.text import fit_caption, human_bytes, split_text

log = logging.getLogger(__name__)

#: how long a platform file id is remembered for the same bytes
FILE_ID_TTL_S = 30 * 24 * 3600


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def result_of(rec: receipts.Receipt, key: str) -> Extracted | None:
    """An extraction's result as `extract` returned it, read back from the receipt (None: not recorded)."""
    name = rec.get("name") or posixpath.basename(key)
    if rec.get("extraction") == EXTRACTION_OK:
        return Extracted(ok=True, key=key, name=name, size=int(rec.get("size_bytes") or 0),
                         sha256=rec.get("sha256") or "")
    if rec.get("extraction") == EXTRACTION_FAILED:
        notify = rec.get("notify")  # the chat's words ("1": a receipt from before they were kept)
        too_large = rec.get("too_large") == "1"
        return Extracted(ok=False, reason=rec.get("reason") or "extraction failed", name=name,
                         notify=(notify if notify != "1" else CourierError.chat_words) if notify else None,
                         too_large=too_large, size=_int_or_none(rec.get("size_bytes")) if too_large else None,
                         limit=_int_or_none(rec.get("limit_bytes")) if too_large else None)
    return None


def _event(ctx: Context, spec: DeliverySpec, pipe: Pipeline | None = None, **ev: Any) -> None:
    events.publish(ctx.redis, spec.job_id, {"kind": "delivery", "delivery_id": spec.delivery_id, **ev},
                   maxlen=ctx.events_maxlen, pipe=pipe)


def record_failure(ctx: Context, spec: DeliverySpec, reason: str, kind: str | None = None, *,
                   final: bool = False) -> DeliveryOutcome:
    """A failed delivery's receipt and event (`final`: for good, never retried); `kind`: what it
    was sent (or refused) as, when known."""
    pipe = ctx.redis.pipeline(transaction=False)
    receipts.update_delivery(pipe, spec.delivery_id, final="1" if final else None, state=DeliveryState.FAILED,
                             reason=reason, kind=kind or None)
    _event(ctx, spec, pipe=pipe, state=DeliveryState.FAILED, reason=reason, name=spec.name,
           **({"media": kind} if kind else {}))
    pipe.execute()
    metrics.record_delivery(spec.delivery_id, spec.target, DeliveryState.FAILED, spec.type, reason=reason)
    out: DeliveryOutcome = {"id": spec.delivery_id, "state": DeliveryState.FAILED, "reason": reason}
    if kind:
        out["kind"] = kind
    return out


def choose_kind(platform: Platform, name: str, size_bytes: int, *, voice: bool, as_document: bool) -> Kind:
    lim = platform.limits
    kind = route(name, voice=voice, as_document=as_document, animation=Kind.ANIMATION in lim.native_kinds,
                 voice_notes=Kind.VOICE in lim.native_kinds)
    too_big = kind == Kind.PHOTO and lim.photo_bytes is not None and size_bytes > lim.photo_bytes
    return Kind.DOCUMENT if too_big or kind not in lim.native_kinds else kind


def deliver(ctx: Context, spec: DeliverySpec, extracted: Extracted | None = None, *,
            held: sendlock.Held | None = None, end: Pipeline | None = None) -> DeliveryOutcome:
    """Deliver one item (`extracted`: its sandbox file's extraction). `held`: its send lock taken by the
    caller; `end`: a pipeline the delivered record (and the lock's release) is queued on, not executed."""
    did = spec.delivery_id

    def work(session: sendlock.SendSession) -> DeliveryOutcome:
        platform_name, chat = split_target(spec.target)
        try:
            platform = ctx.platform(platform_name)
        except CourierError as exc:
            return record_failure(ctx, spec, exc.reason)
        return deliver_item(ctx, platform, chat, spec, extracted, session, end=end)

    return sendlock.under_send_lock(ctx, did, lambda rec: already_done(did, rec), work, count_attempt=True, held=held)


def already_done(did: str, rec: receipts.Receipt) -> DeliveryOutcome | None:
    state = rec.get("state")
    if state == DeliveryState.DELIVERED:
        return {"id": did, "state": DeliveryState.DELIVERED, "message_id": rec.get("message_id"), "skipped": True}
    if state == DeliveryState.CANCELLED or (state == DeliveryState.FAILED and rec.get("final") == "1"):
        return {"id": did, "state": DeliveryState(state), "reason": rec.get("reason"), "skipped": True}
    return None


def deliver_item(ctx: Context, platform: Platform, chat: str, spec: DeliverySpec, extracted: Extracted | None,
                  session: sendlock.SendSession | None = None, *, end: Pipeline | None = None) -> DeliveryOutcome:
    """One item to `chat` (its send lock held by the caller): a failed extraction recorded (with
    its notice), else sent and recorded (on `end`, not executed, when given)."""
    r = ctx.redis
    did = spec.delivery_id
    fresh = session is not None and session.fresh
    # every send below takes a shared rate-limit slot first, and each part is sent once
    guarded = parts.guard(r, platform, did, defer=True, first_attempt=fresh)
    if extracted is not None and not extracted.ok:
        try:
            return _extraction_failed(ctx, guarded, chat, spec, extracted)
        finally:
            guarded.flush()
    if extracted is not None:
        spec = spec.with_extraction(extracted)
    if session is not None and session.attempts:
        attempts = session.attempts  # counted when the lock was taken
    else:
        attempts = receipts.start_attempt(r, did, state=DeliveryState.SENDING, platform=platform.name)
    failed: Permanent | _Refused | None = None
    try:
        try:
            if spec.is_text:
                sent = _send_text(guarded, chat, spec.text or "", did)
                kind_name, size = Kind.TEXT.value, len((spec.text or "").encode())
            else:
                sent, kind_name, size = _send_file(ctx, guarded, chat, spec, fresh=fresh)
        except (Permanent, _Refused) as exc:
            failed = exc
        if spec.tell:  # the reply's last file: the notice of its files that could not go, after its outcome
            tell_reply(ctx, guarded, chat, spec)
    except BaseException as exc:
        guarded.flush()  # parts already sent stay recorded for the retry
        if isinstance(exc, ratelimit.Paced):  # courier's own pacing: this try never reached the platform
            r.hincrby(keys.delivery(did), "attempts", -1)
        raise
    if failed is not None:
        guarded.flush()
        kind = Kind.TEXT.value if spec.is_text else getattr(failed, "kind", None)
        return record_failure(ctx, spec, failed.reason, kind=kind, final=True)
    pipe = end if end is not None else r.pipeline(transaction=False)
    guarded.flush(pipe, covered=did)  # the receipt below says it was sent
    out = record_delivered(ctx, spec, sent.message_id, kind_name, size, attempts, pipe=pipe)
    if session is not None:
        session.release(pipe)  # after the record: the lock never frees before the receipt says delivered
    if end is None:
        pipe.execute()
    return out


def _extraction_failed(ctx: Context, platform: Platform, chat: str, spec: DeliverySpec, extracted: Extracted
                       ) -> DeliveryOutcome:
    reason = extracted.reason or "extraction failed"
    if spec.tell:  # the reply's last file: one notice for every file of it that could not go
        tell_reply(ctx, platform, chat, spec)
    elif (extracted.too_large or extracted.notify) and not spec.told_by:  # (told_by: its reply's notice names it)
        _notice(ctx, platform, chat, spec, _unsent_item(extracted.name or spec.name or "file", extracted)[0], key=None)
    if extracted.too_large or extracted.notify:
        log.warning("delivery %s to %s failed for good: %s", spec.delivery_id, spec.target, reason)
    return record_failure(ctx, spec, reason, final=True)


#: names one notice lists; the rest are counted
UNSENT_LISTED = 10


def _too_large(name: str, size: int | None, limit: int | None) -> tuple[str, str, str]:
    """A file over the limit in words: its name as shown, its size, the limit."""
    return (visible(name), human_bytes(int(size)) if size else "unknown size",
            human_bytes(int(limit)) if limit else "the limit")


def _unsent_item(name: str, failed: Extracted) -> tuple[str, str]:
    """(the sentence of a notice for one file, its line in a notice for several) of a failed extraction."""
    if failed.too_large:
        name, size_s, limit_s = _too_large(name, failed.size, failed.limit)
        return (f"⚠️ {name} ({size_s}) was not sent: it is over the {limit_s} limit here.",
                f"• {name} ({size_s}): over the {limit_s} limit here")
    name, words = visible(name), failed.notify or CourierError.chat_words
    return f"⚠️ {name} could not be sent: {words}.", f"• {name}: {words}"


def unsent_notice(items: list[tuple[str, str]]) -> str:
    """One notice for a reply's files that could not be sent (`_unsent_item`'s pairs, in reply order)."""
    if len(items) == 1:
        return items[0][0]
    lines = [line for _, line in items[:UNSENT_LISTED]]
    if len(items) > UNSENT_LISTED:
        lines.append(f"• … and {len(items) - UNSENT_LISTED} more")
    return f"⚠️ {len(items)} files could not be sent:\n" + "\n".join(lines)


def tell_reply(ctx: Context, platform: Platform, chat: str, spec: DeliverySpec) -> None:
    """At a reply's last file (its spec's `tell`: the reply's file ids, `tasks.dispatch.chains`), one notice
    of every file of the reply whose extraction failed with words for the chat (`notify`) or as too large;
    the others send none of their own (`told_by`). Sent once (part `<id>#unsent`), names only (`visible`),
    never a path. A RateLimited/Paced notice propagates: the step is re-scheduled and resumes here."""
    pipe = ctx.redis.pipeline(transaction=False)
    for rid in spec.tell or ():
        pipe.hgetall(keys.delivery(rid))
    failed = [result_of(rec, "") for rec in pipe.execute()
              if rec and rec.get("extraction") == EXTRACTION_FAILED
              and rec.get("state") not in (DeliveryState.DELIVERED, DeliveryState.CANCELLED)
              and (rec.get("notify") or rec.get("too_large") == "1")]
    items = [_unsent_item(x.name or "file", x) for x in failed if x is not None]
    if items:
        _notice(ctx, platform, chat, spec, unsent_notice(items), key=None, part="unsent")


def record_delivered(ctx: Context, spec: DeliverySpec, message_id: str, kind_name: str, size: int, attempts: int,
                      pipe: Pipeline | None = None) -> DeliveryOutcome:
    """The receipt and the delivery event of a delivered item (queued on `pipe` when given)."""
    p = pipe if pipe is not None else ctx.redis.pipeline(transaction=False)
    platform_name = spec.target.split(":", 1)[0]
    try:  # whether the platform reports a message's fate after accepting it
        later = bool(getattr(ctx.platform(platform_name), "confirms_later", False))
    except CourierError:
        later = False
    receipts.update_delivery(p, spec.delivery_id, state=DeliveryState.DELIVERED, message_id=message_id, kind=kind_name,
                             size_bytes=size, attempts=attempts, reason="", sha256=spec.sha256 or None,
                             confirmed="accepted" if later else "final at acceptance")
    if later:  # its status webhook names the message: this finds the receipt
        confirm.remember(p, platform_name, message_id, spec.delivery_id)
    _event(ctx, spec, pipe=p, state=DeliveryState.DELIVERED, message_id=message_id, media=kind_name,
           name=spec.name, size_bytes=size)
    if pipe is None:
        p.execute()
    metrics.record_delivery(spec.delivery_id, spec.target, DeliveryState.DELIVERED, kind_name)
    return {"id": spec.delivery_id, "state": DeliveryState.DELIVERED, "message_id": message_id, "kind": kind_name}


class _ProgressReader:
    """A stored file's stream whose every read marks the drive's progress (ledger.marker)."""

    def __init__(self, f: BinaryIO, mark: Callable[[], None]) -> None:
        self._f, self._mark = f, mark

    def read(self, n: int = -1) -> bytes:
        self._mark()
        return self._f.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextmanager
def _progressing(cm: AbstractContextManager[BinaryIO], mark: Callable[[], None]) -> Iterator[BinaryIO]:
    with cm as f:
        yield cast(BinaryIO, _ProgressReader(f, mark))


#: text messages one reply may take in a chat; a longer text goes as `long_reply`
REPLY_MAX_PARTS = 4
REPLY_FILE = "reply.txt"
#: room kept in the first part for the line that says it was cut
_CUT_NOTE_CHARS = 80


def _send_text(platform: Platform, chat: str, text: str, did: str) -> Sent:
    pieces = split_text(text, platform.limits.text_chars) or [""]
    if len(pieces) > REPLY_MAX_PARTS:
        return long_reply(platform, chat, text, did)
    ids = [platform.send_text(chat, part, delivery_id=did if len(pieces) == 1 else f"{did}#{i}").message_id
           for i, part in enumerate(pieces)]
    return Sent(message_id=",".join(ids))


def long_reply(platform: Platform, chat: str, text: str, did: str) -> Sent:
    """A text over `REPLY_MAX_PARTS` messages: its first part, ending in `… (truncated, N more
    characters in reply.txt)`, then the whole text as the document `reply.txt`; only cut (the
    line says so) where the platform cannot take that document. Parts `<id>#0`, `<id>#doc`."""
    text = text.strip()
    body = text.encode()
    src = FileSource(name=REPLY_FILE, size_bytes=len(body), sha256=hashlib.sha256(body).hexdigest(),
                     opener=lambda: nullcontext(cast(BinaryIO, io.BytesIO(body))), mime="text/plain")
    kind: Kind | None
    try:
        kind = platform.route_file(Kind.DOCUMENT, src)
    except FileRefused:
        kind = None
    if kind is not None and len(body) > platform.limits.upload_limit(kind):
        kind = None
    head = split_text(text, max(1, platform.limits.text_chars - _CUT_NOTE_CHARS))[0]
    more = len(text) - len(head)
    where = f"in {REPLY_FILE}" if kind is not None else "not sent: too long for this chat"
    ids = [platform.send_text(chat, f"{head}\n\n… (truncated, {more:,} more characters {where})",
                              delivery_id=f"{did}#0").message_id]
    if kind is not None:
        ids.append(platform.send_file(chat, kind, src, caption=None, delivery_id=f"{did}#doc").message_id)
    return Sent(message_id=",".join(ids))


class _Refused(Exception):
    """A file not sent, the chat told why (too large, empty, a type the platform does not take)."""

    def __init__(self, reason: str, kind: Kind) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind.value


def plan_file(ctx: Context, platform: Platform, spec: DeliverySpec) -> tuple[Kind, FileSource, int]:
    """A stored file's kind on this platform (routing, photo limit), its source and upload limit."""
    store = ctx.store
    key = _key_of(spec)
    size = spec.size if spec.size is not None else store.stat(key).size_bytes
    # the name the chat shows: an agent's right-to-left override or zero-width space escaped
    name = visible(spec.name or os.path.basename(key))
    kind = choose_kind(platform, name, size, voice=bool(spec.voice), as_document=bool(spec.as_document))
    mark = ledger.marker()  # each chunk the platform's SDK reads is progress of the drive's lease
    src = FileSource(name=name, size_bytes=size, sha256=spec.sha256 or "",
                     opener=lambda: _progressing(store.open_read(key), mark), path=store.local_path(key))
    return kind, src, platform.limits.upload_limit(kind)


def _key_of(spec: DeliverySpec) -> str:
    """A file delivery's storage key (every file spec has one: `tasks.dispatch.chains.entries`)."""
    if spec.key is None:
        raise Permanent(f"delivery {spec.delivery_id}: its spec names no stored file")
    return spec.key


def file_id_key(platform: Platform, sha: str, kind: Kind) -> str | None:
    return keys.file_id(platform.name, platform.cache_key, sha, kind.value) if platform.cache_key and sha else None


def send_overflow(platform: Platform, chat: str, overflow: list[str], base_id: str) -> None:
    """What did not fit in a caption, as text messages after the file(s)."""
    for i, part in enumerate(overflow):
        platform.send_text(chat, part, delivery_id=f"{base_id}#c{i}")


def _send_file(ctx: Context, platform: parts.Guarded, chat: str, spec: DeliverySpec, *,
               fresh: bool = False) -> tuple[Sent, str, int]:
    """Send one stored file (`fresh`: the first attempt: no upload or refusal of an earlier run)."""
    kind, src, _ = plan_file(ctx, platform, spec)
    key, size = _key_of(spec), src.size_bytes
    if size == 0 and not platform.takes_empty_files:
        # one rule for every chat platform: nothing is uploaded (the outbox, a directory, keeps it)
        _notice(ctx, platform, chat, spec, f"⚠️ {src.name} was not sent: it is empty (0 bytes).", key=None)
        raise _Refused(f"empty file: {src.name} is 0 bytes", kind)
    try:  # the platform's own type rules (e.g. WhatsApp's supported types)
        kind = platform.route_file(kind, src)
    except FileRefused as exc:
        raise _Refused(_notice_refused(ctx, platform, chat, spec, src, exc, key=key), kind) from None
    limit = platform.limits.upload_limit(kind)
    if size > limit:
        name, size_s, limit_s = _too_large(src.name, size, limit)
        _notice(ctx, platform, chat, spec, f"⚠️ {name} ({size_s}) was not sent: it is over the {limit_s} limit here.",
                key=key)
        raise _Refused(f"too large: {name} is {size_s}, over the {limit_s} limit for {platform.name}", kind)
    if size > 8 * 1024 * 1024:  # a long upload: show its kind and size in `courier status` meanwhile
        receipts.update_delivery(ctx.redis, spec.delivery_id, kind=kind.value, size_bytes=size, name=src.name)
    # the caption room of this file as `kind` (Discord's voice message holds no text)
    caption, overflow = fit_caption(spec.caption, platform.caption_chars_for(kind, src), platform.limits.text_chars)
    if platform.cache_key and not src.sha256:
        # extraction by kernel copy hashes nothing; the file-id cache needs it
        digest = hashlib.sha256()
        for chunk in ctx.store.iter_chunks(key):
            digest.update(chunk)
        src = replace(src, sha256=digest.hexdigest())
    fid_key = file_id_key(platform, src.sha256, kind)
    did = spec.delivery_id
    upload_part = f"{did}#upload"
    # one round trip at most: the cached file id; on a retry also this delivery's own upload (an
    # earlier run uploaded the file, then its send failed) and whether an earlier run had it refused
    pipe = ctx.redis.pipeline(transaction=False)
    if fid_key:
        pipe.get(fid_key)
    if not fresh:
        pipe.hmget(keys.delivery_parts(did), [upload_part, f"{did}#refused"])
    got = pipe.execute()  # (an empty pipeline: [], no round trip)
    uploaded, refused = (None, None) if fresh else got[-1]
    cached = (got[0] if fid_key else None) or uploaded
    if refused:  # refused by the platform before; its notice was re-scheduled (the chat's rate limit)
        rec = json.loads(refused)
        _notice(ctx, platform, chat, spec, rec["text"], key=key)
        raise _Refused(rec["reason"], kind)
    try:
        sent = platform.send_file(chat, kind, src, caption=caption, delivery_id=did, file_id=cached)
    except FileRefused as exc:  # the platform's own refusal (e.g. HTTP 413): the chat is told too
        raise _Refused(_notice_refused(ctx, platform, chat, spec, src, exc, key=key, record=True), kind) from None
    except DeliveryError as exc:
        if isinstance(exc, Permanent):
            exc.kind = kind.value  # type: ignore[attr-defined]  # the failed receipt says what it went as
        # uploaded, then the send failed: remember the upload, the retry sends it without uploading again
        fid = getattr(exc, "file_id", None)
        if fid:
            pipe = ctx.redis.pipeline(transaction=False)
            parts.queue_record(pipe, did, {upload_part: fid})
            if fid_key:  # a reusable id (WhatsApp media): later sends of the same bytes use it too
                pipe.set(fid_key, fid, ex=FILE_ID_TTL_S)
            pipe.execute()
        raise
    if fid_key and sent.file_id:  # with the receipt (or before the overflow's first part)
        file_id = sent.file_id
        platform.after_sent(lambda pipe: pipe.set(fid_key, file_id, ex=FILE_ID_TTL_S))
    send_overflow(platform, chat, overflow, spec.delivery_id)
    return sent, (sent.kind or kind).value, size  # what the chat shows (a refused voice message: audio)


def _notice_refused(ctx: Context, platform: Platform, chat: str, spec: DeliverySpec, src: FileSource, exc: FileRefused,
                    *, key: str | None, record: bool = False) -> str:
    """The chat told why the platform does not take this file; returns the failure's reason. `record`: a
    refusal from sending, recorded first (a part): a retry after a rate-limited notice sends only the notice."""
    size_s = human_bytes(src.size_bytes)
    if exc.too_large:
        reason = f"too large: {src.name} is {size_s}, refused by {platform.name} ({exc.reason})"
        why = exc.notice or f"{platform.name} refused it as too large"
    else:
        reason, why = exc.reason, exc.notice or f"{platform.name} refused it"
    text = f"⚠️ {src.name} ({size_s}) was not sent: {why}."
    if record:
        pipe = ctx.redis.pipeline(transaction=False)
        did = spec.delivery_id
        parts.queue_record(pipe, did, {f"{did}#refused": json.dumps({"reason": reason, "text": text})})
        pipe.execute()
    _notice(ctx, platform, chat, spec, text, key=key)
    return reason


def _notice(ctx: Context, platform: Platform, chat: str, spec: DeliverySpec, text: str, *, key: str | None,
            part: str = "notice") -> None:
    """Tell the chat a file was not sent (`text`), with a download link when
    `key` is given and the store can sign one; sent once (part `<id>#<part>`)."""
    if key is not None:
        with suppress(CourierError):  # no link when the store cannot sign one
            if url := ctx.store.signed_url(key, expires_s=7 * 24 * 3600):
                text += f"\nDownload it here (link valid 7 days): {url}"
    try:
        platform.send_text(chat, text, delivery_id=f"{spec.delivery_id}#{part}")
    except RateLimited:
        raise  # re-scheduled: the notice goes out once its slot is free
    except CourierError:
        pass  # the failure is recorded either way


def notice_failed(ctx: Context, spec: DeliverySpec, words: str, *, reason: str) -> None:
    """Tell the chat a file failed for good, in its `words` (`in_chat_words`), best effort
    (a notice still rate limited is dropped). The `reason`, which may name a bucket, key,
    endpoint or path, goes to the worker's log (and the caller's receipt): never the chat."""
    platform_name, chat = split_target(spec.target)
    log.warning("delivery %s to %s failed for good: %s", spec.delivery_id, spec.target, reason)
    text = f"⚠️ {visible(spec.name or 'a file')} could not be sent: {words}."
    with suppress(CourierError):
        platform = parts.guard(ctx.redis, ctx.platform(platform_name), spec.delivery_id)
        _notice(ctx, platform, chat, spec, text, key=None)
