"""Album grouping: photos of one step of a chat's lane (grouped by
`tasks.chains.album_groups`) delivered as one album (`deliver_album`),
under one send lock; plain code, no Celery. Each item keeps its own
receipt; what does not go in the album goes one by one through
`tasks.delivery`'s per-item flow.
"""

from __future__ import annotations

from redis import Redis

from adapters.errors import CourierError, Permanent
from adapters.platforms.base import FileRefused, FileSource, Kind, Platform, split_target
from tasks import delivery, keys, parts, receipts, sendlock
from tasks.messages import JsonObject
from tasks.runtime import Context
from tasks.text import fit_caption


def deliver_album(ctx: Context, group: JsonObject) -> JsonObject:
    """Deliver a group of photos (built by `tasks.chains`) as one album.

    `group` holds job, target, caption? and items: the file jobs as
    `deliver` takes them, each with its own delivery id and receipt; a
    sandbox file's item has `extracted` set, its extraction's result being in
    its receipt. Items already done are skipped; a failed extraction is
    recorded failed (with its notice, after what the group sends); photos that fit the photo
    and upload limits go as one album when two or more remain, the rest
    (a photo over the photo limit, a file over the upload limit, a lone
    photo) go after it one by one, as `deliver` sends them. The caption goes
    on the album, else on the first item sent. One send lock, on the first
    item's id, covers the group."""
    lead = group["items"][0]["id"]
    return sendlock.under_send_lock(ctx, lead, lambda rec: None,
                                    lambda session: _deliver_album_locked(ctx, group))


def _deliver_album_locked(ctx: Context, group: JsonObject) -> JsonObject:
    from tasks.delivery import result_of

    r = ctx.redis
    items = group["items"]
    lead = items[0]["id"]
    results: dict[str, JsonObject] = {}
    pending: list[tuple[JsonObject, JsonObject]] = []
    recs = _receipts_of(r, items)
    # the caption goes with the group's first send: an earlier run that sent (or finally failed) one used it
    caption = None if any(rec.get("state") == "delivered" or rec.get("final") == "1" for rec in recs) \
        else group.get("caption")
    for item, rec in zip(items, recs):
        done = delivery.already_done(item["id"], rec)
        if done is None and rec.get("state") == "failed" and rec.get("extraction") == "failed":
            done = {"id": item["id"], "state": "failed", "reason": rec.get("reason"), "skipped": True}
        if done is not None:
            results[item["id"]] = done
        else:
            pending.append((item, rec))

    def summary() -> JsonObject:
        return {"album": lead, "deliveries": [results[i["id"]] for i in items if i["id"] in results]}

    if not pending:
        return summary()
    platform_name, chat = split_target(group["target"])
    try:
        platform = ctx.platform(platform_name)
    except CourierError as exc:
        for item, _ in pending:
            results[item["id"]] = delivery.record_failure(ctx, _job_of(item), exc.reason)
        return summary()

    photos: list[tuple[JsonObject, FileSource]] = []
    singles: list[JsonObject] = []
    unsent: list[tuple[JsonObject, JsonObject]] = []  # failed extractions: recorded, the chat told, after the sends
    for item, rec in pending:
        job = _job_of(item)
        if item.get("extracted"):
            extracted = result_of(rec, item["key"]) or {"ok": False, "name": item.get("name"),
                                                        "reason": "the extraction recorded no result"}
            if not extracted["ok"]:
                unsent.append((job, extracted))
                continue
            job = delivery.with_extraction(job, extracted)
        kind, src, limit = delivery.plan_file(ctx, platform, job)
        try:
            kind = platform.route_file(kind, src)
        except FileRefused:
            kind = Kind.DOCUMENT  # sent alone: refused there, with its notice
        if kind == Kind.PHOTO and 0 < src.size_bytes <= limit:
            photos.append((job, src))
        else:
            singles.append(job)

    size = platform.limits.album_max
    if len(photos) >= 2 and size >= 2:
        album, rest = photos[:size], [job for job, _ in photos[size:]]
        results.update(_send_album(ctx, platform, chat, lead, album, caption))
        caption = None
    else:
        rest = [job for job, _ in photos]
    order = {item["id"]: i for i, item in enumerate(items)}
    for job in sorted(rest + singles, key=lambda j: order[j["id"]]):
        if caption:
            job, caption = {**job, "caption": caption}, None
        results[job["id"]] = delivery.deliver_item(ctx, platform, chat, job, None)
    for job, extracted in unsent:  # the notice after the files that went
        results[job["id"]] = delivery.deliver_item(ctx, platform, chat, job, extracted)
    return summary()


def _job_of(item: JsonObject) -> JsonObject:
    return {k: v for k, v in item.items() if k != "extracted"}


def _receipts_of(r: Redis, items: list[JsonObject]) -> list[JsonObject]:
    pipe = r.pipeline(transaction=False)
    for item in items:
        pipe.hgetall(keys.delivery(item["id"]))
    return [h or {} for h in pipe.execute()]


def _send_album(ctx: Context, platform: Platform, chat: str, lead: str,
                album: list[tuple[JsonObject, FileSource]], caption: str | None) -> dict[str, JsonObject]:
    """Send photos as one album and record each item with its own message id."""
    r = ctx.redis
    part = f"{lead}#album"  # the album's part id: a re-run after it was sent does not send it again
    guarded = parts.guard(r, platform, lead)
    attempts = [receipts.start_attempt(r, job["id"], state="sending", platform=platform.name,
                                       kind=Kind.PHOTO.value, size_bytes=src.size_bytes, name=src.name)
                for job, src in album]
    text, overflow = fit_caption(caption, platform.limits.caption_chars, platform.limits.text_chars)
    try:
        sents = guarded.send_album(chat, [(Kind.PHOTO, src) for _, src in album], caption=text, delivery_id=part)
        delivery.send_overflow(guarded, chat, overflow, part)
    except Permanent as exc:
        out = {}
        for job, _ in album:
            receipts.update_delivery(r, job["id"], final="1")
            out[job["id"]] = delivery.record_failure(ctx, job, exc.reason, kind=Kind.PHOTO.value)
        return out
    for job, _ in album:  # the reply's last file went in it: the notice of the reply's files that could
        if job.get("tell"):  # not go follows (sent once; paced: the step is re-run, the album not sent again)
            delivery.tell_reply(ctx, guarded, chat, job)
    out = {}
    pipe = r.pipeline(transaction=False)
    for i, ((job, src), n) in enumerate(zip(album, attempts)):
        sent = sents[min(i, len(sents) - 1)]
        fid_key = delivery.file_id_key(platform, src.sha256, Kind.PHOTO)
        if fid_key and sent.file_id:
            pipe.set(fid_key, sent.file_id, ex=delivery.FILE_ID_TTL_S)
        out[job["id"]] = delivery.record_delivered(ctx, job, sent.message_id, Kind.PHOTO.value, src.size_bytes, n,
                                                   pipe=pipe)
    pipe.execute()
    return out
