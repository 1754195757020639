"""Photos of one lane step (`tasks.dispatch.chains.album_groups`) delivered as one album
under one send lock; plain code, no Celery. Each item keeps its own receipt; what does
not go in the album goes one by one through `delivery.deliver_item`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from adapters.errors import CourierError, Permanent
from adapters.platforms.base import FileRefused, FileSource, Kind, Platform, split_target
from tasks.delivery import delivery, parts, sendlock
from tasks.ledger import keys, receipts
from tasks.messages import AlbumOutcome, DeliveryOutcome, DeliverySpec, Extracted
from tasks.states import EXTRACTION_FAILED, DeliveryState
from tasks.runtime import Context
from tasks.delivery.text import fit_caption


@dataclass(frozen=True)
class Album:
    """One lane step of photos: the chat, the caption (of the album, else of the first item
    sent) and the items' specs in order (the first's caption moved to `caption`)."""

    target: str
    caption: str | None
    items: list[DeliverySpec] = field(hash=False)


def deliver_album(ctx: Context, group: Album) -> AlbumOutcome:
    """Deliver a group of photos under one send lock (the first item's): those within the limits as
    one album when two or more remain, the rest one by one after it, failed extractions' notices last."""
    return sendlock.under_send_lock(ctx, group.items[0].delivery_id, lambda rec: None,
                                    lambda session: _deliver_album_locked(ctx, group))


def _deliver_album_locked(ctx: Context, group: Album) -> AlbumOutcome:
    r = ctx.redis
    items = group.items
    lead = items[0].delivery_id
    results: dict[str, DeliveryOutcome] = {}
    pending: list[tuple[DeliverySpec, receipts.Receipt]] = []
    pipe = r.pipeline(transaction=False)
    for spec in items:
        pipe.hgetall(keys.delivery(spec.delivery_id))
    recs = [h or {} for h in pipe.execute()]
    # the caption goes with the group's first send: an earlier run that sent (or finally failed) one used it
    caption = None if any(rec.get("state") == DeliveryState.DELIVERED or rec.get("final") == "1" for rec in recs) \
        else group.caption
    for spec, rec in zip(items, recs):
        done = delivery.already_done(spec.delivery_id, rec)
        if done is None and rec.get("state") == DeliveryState.FAILED and rec.get("extraction") == EXTRACTION_FAILED:
            done = {"id": spec.delivery_id, "state": DeliveryState.FAILED, "reason": rec.get("reason"), "skipped": True}
        if done is not None:
            results[spec.delivery_id] = done
        else:
            pending.append((spec, rec))

    def summary() -> AlbumOutcome:
        return {"album": lead, "deliveries": [results[s.delivery_id] for s in items if s.delivery_id in results]}

    if not pending:
        return summary()
    platform_name, chat = split_target(group.target)
    try:
        platform = ctx.platform(platform_name)
    except CourierError as exc:
        for spec, _ in pending:
            results[spec.delivery_id] = delivery.record_failure(ctx, spec, exc.reason)
        return summary()

    photos: list[tuple[DeliverySpec, FileSource]] = []
    singles: list[DeliverySpec] = []
    unsent: list[tuple[DeliverySpec, Extracted]] = []  # failed extractions: recorded, the chat told, after the sends
    for spec, rec in pending:
        if spec.extract is not None:
            extracted = delivery.result_of(rec, spec.key or "") or Extracted(
                ok=False, name=spec.name, reason="the extraction recorded no result")
            if not extracted.ok:
                unsent.append((spec, extracted))
                continue
            spec = spec.with_extraction(extracted)
        kind, src, limit = delivery.plan_file(ctx, platform, spec)
        try:
            kind = platform.route_file(kind, src)
        except FileRefused:
            kind = Kind.DOCUMENT  # sent alone: refused there, with its notice
        if kind == Kind.PHOTO and 0 < src.size_bytes <= limit:
            photos.append((spec, src))
        else:
            singles.append(spec)

    size = platform.limits.album_max
    rest = [spec for spec, _ in photos]
    if len(photos) >= 2 and size >= 2:
        results.update(_send_album(ctx, platform, chat, lead, photos[:size], caption))
        rest, caption = rest[size:], None
    order = {spec.delivery_id: i for i, spec in enumerate(items)}
    for spec in sorted(rest + singles, key=lambda s: order[s.delivery_id]):
        if caption:
            spec, caption = replace(spec, caption=caption), None
        results[spec.delivery_id] = delivery.deliver_item(ctx, platform, chat, spec, None)
    for spec, extracted in unsent:  # the notice after the files that went
        results[spec.delivery_id] = delivery.deliver_item(ctx, platform, chat, spec, extracted)
    return summary()


def _send_album(ctx: Context, platform: Platform, chat: str, lead: str,
                album: list[tuple[DeliverySpec, FileSource]], caption: str | None) -> dict[str, DeliveryOutcome]:
    """Send photos as one album and record each item with its own message id."""
    r = ctx.redis
    part = f"{lead}#album"  # the album's part id: a re-run after it was sent does not send it again
    guarded = parts.guard(r, platform, lead)
    attempts = [receipts.start_attempt(r, spec.delivery_id, state=DeliveryState.SENDING, platform=platform.name,
                                       kind=Kind.PHOTO.value, size_bytes=src.size_bytes, name=src.name)
                for spec, src in album]
    text, overflow = fit_caption(caption, platform.limits.caption_chars, platform.limits.text_chars)
    try:
        sents = guarded.send_album(chat, [(Kind.PHOTO, src) for _, src in album], caption=text, delivery_id=part)
        delivery.send_overflow(guarded, chat, overflow, part)
    except Permanent as exc:
        return {spec.delivery_id: delivery.record_failure(ctx, spec, exc.reason, kind=Kind.PHOTO.value, final=True)
                for spec, _ in album}
    for spec, _ in album:  # the reply's last file went in it: the notice of the reply's files that could
        if spec.tell:  # not go follows (sent once; paced: the step is re-run, the album not sent again)
            delivery.tell_reply(ctx, guarded, chat, spec)
    out = {}
    pipe = r.pipeline(transaction=False)
    for i, ((spec, src), n) in enumerate(zip(album, attempts)):
        sent = sents[min(i, len(sents) - 1)]
        fid_key = delivery.file_id_key(platform, src.sha256, Kind.PHOTO)
        if fid_key and sent.file_id:
            pipe.set(fid_key, sent.file_id, ex=delivery.FILE_ID_TTL_S)
        out[spec.delivery_id] = delivery.record_delivered(ctx, spec, sent.message_id, Kind.PHOTO.value,
                                                          src.size_bytes, n, pipe=pipe)
    pipe.execute()
    return out
