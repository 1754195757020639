"""Per-chat lanes: a chat's deliveries go out one step at a time, in enqueue order (plain code, no Celery).

`keys.lane(target)` lists the chat's steps (a delivery id, or an album's first id). `drive` takes the lane's
lease and sends the head step while it is ready: a final step is dropped; one still being extracted waits
(its extraction drives the lane when it ends); courier's own pacing (`Paced`, no attempt) or a platform's
429 waits `retry_after` (a countdown drive, or the reconciler for a long wait); transient errors back off
before the step fails (`_run_step`). Nothing behind a waiting step overtakes it.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from redis import Redis
from redis import exceptions as redis_errors
from redis.client import Pipeline

from adapters.errors import CourierError, RateLimited, StorageError, in_chat_words
from adapters.platforms.base import split_target
from tasks import metrics
from tasks.delivery import album, ratelimit, sendlock, specs
from tasks.delivery import delivery as delivery_mod
from tasks.ledger import keys, ledger, receipts, scripts, signing
from tasks.messages import DeliverySpec, JsonObject
from tasks.runtime import Context
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, DeliveryState

log = logging.getLogger(__name__)

#: how long one drive keeps sending before it hands the lane to a fresh task (other lanes get a turn)
BUDGET_S = 2.0
#: a lane waiting for an extraction is looked at again after this (the extraction's end drives it sooner)
EXTRACT_WAIT_S = 30.0
#: a lane that took this long to drive (a slow platform) makes its drive publish another for the
#: lanes left in the ready set: idle threads take them in parallel (`drive_ready`)
FAN_OUT_S = 0.2
#: platform 429s one step takes before it fails
MAX_RATE_LIMITS = 60

Publish = Callable[[str, float | None], None]

#: how a chat's gate left by a sender that died mid-send begins: the drive taking the lease clears it
DEAD_SEND = "sending:"
_TERMINAL = sorted(receipts.TERMINAL)


@dataclass
class Head:
    """What `_look` found: 'head' (`id`, its receipt, `held`: its send lock when taken), 'extracting'
    (`id`), 'empty' (`id`: the ready set's next lane popped when asked, '' when it was empty) or 'busy'."""

    what: str
    id: str | None = None
    rec: JsonObject | None = None
    held: sendlock.Held | None = None


@dataclass
class Step:
    lead: str
    ids: list[str]
    recs: list[receipts.Receipt]
    #: each delivery's verified spec (None: it had none, or it did not verify: its receipt says failed)
    specs: list[DeliverySpec | None]

    @property
    def done(self) -> bool:
        return all(rec.get("state") in receipts.TERMINAL for rec in self.recs)

    @property
    def ready(self) -> bool:
        """Every sandbox file of the step extracted (or failed to be)."""
        return all(rec.get("extraction") in (EXTRACTION_OK, EXTRACTION_FAILED) or spec is None or spec.extract is None
                   or rec.get("state") in receipts.TERMINAL for rec, spec in zip(self.recs, self.specs))


def load_step(r: Redis, lead: str, rec: receipts.Receipt | None, target: str) -> Step | None:
    """The step `lead` leads (`rec`: its receipt as read) in the lane of `target`. A spec that does
    not verify, or names another chat than the lane's, is never sent: its receipt fails."""
    if not rec:
        return None  # expired or never there: nothing to send
    ids = json.loads(rec["album"]) if rec.get("album") else [lead]
    recs = [rec] + ([receipts.get_delivery(r, d) or {} for d in ids[1:]])
    specs = [_verified(r, did, x, target) for did, x in zip(ids, recs)]
    if len(ids) > 1 and any(x.get("spec") and spec is None for x, spec in zip(recs, specs)):
        # an album with a member that did not verify goes nowhere: none of it is sent
        for did, x in zip(ids, recs):
            if x.get("state") not in receipts.TERMINAL:
                reason = "refused: another photo of its album did not verify"
                receipts.update_open_delivery(r, did, state=DeliveryState.FAILED, reason=reason)
                x["state"], x["reason"] = DeliveryState.FAILED, reason
    return Step(lead, ids, recs, specs)


def _verified(r: Redis, did: str, rec: receipts.Receipt, target: str) -> DeliverySpec | None:
    """The receipt's spec, verified as delivery `did`'s (and of `target`'s lane); a forgery
    makes the receipt final `failed` (in `rec` too) and gives None."""
    raw = rec.get("spec")
    if not raw:
        return None
    try:
        spec = specs.open_delivery(did, raw)  # logged and counted when forged
        if spec.target != target:
            exc = signing.Forged(f"delivery {did} names another chat than its lane's")
            signing.refused("delivery", exc)
            raise exc
    except signing.Forged as exc:
        reason = f"refused: {exc.reason}"
        receipts.update_open_delivery(r, did, state=DeliveryState.FAILED, reason=reason)
        rec["state"], rec["reason"] = DeliveryState.FAILED, reason
        return None
    return spec


def _look(r: Redis, target: str, token: str, *, take: bool = False, last: Step | str | None = None,
          lock: bool = False, gate: str | None = None, pipe: Pipeline | None = None, pop: bool = False) -> Head:
    """A look at the head of `target`'s lane by its lease's holder, in two round trips: `pipe`'s
    queued writes, the lease taken (`take`), `last` popped if final and the head read; then
    lane_forget.lua (no head; `pop`: the ready set's next lane) or lane_head.lua (`lock`: a ready
    head's send lock taken). A script that finds the lane changed makes the look again."""
    lane, lease = keys.lane(target), keys.lease("lane", target)
    last_id = last.lead if isinstance(last, Step) else (last or "")
    last_ids = last.ids if isinstance(last, Step) else ([last] if last else [])
    owner = uuid.uuid4().hex if lock else ""
    fresh = take
    taken_at = -1
    for _ in range(100):
        p = pipe if pipe is not None else r.pipeline(transaction=False)
        pipe = None
        if take:
            p.set(lease, token, nx=True, ex=ledger.LEASE_TTL_S)
            taken_at = len(p) - 1
        if last_ids:
            scripts.run(p, "lane_pop_done", keys=[lane, *[keys.delivery(d) for d in last_ids]],
                        args=[last_id, *_TERMINAL])
        p.lindex(lane, 0)
        res = p.execute()
        if take and not res[taken_at]:
            return Head("busy")
        take, last_ids = False, []
        head = res[-1]
        if head is None:
            got = scripts.run(r, "lane_forget", keys=[lane, keys.due("lane"), lease, keys.lanes_ready()],
                              args=[target, token, "1" if pop else "0"])
            if got[0] == "again":
                continue
            return Head("empty", got[1] if len(got) > 1 else None)
        ks = [lane, keys.due("lane"), lease, keys.delivery(head), keys.delivery_lock(head)]
        if fresh and gate:  # the lease taken by this look: a dead sender's gate is cleared
            ks.append(gate)
        got = scripts.run(r, "lane_head", keys=ks,
                          args=[target, token, head, time.time() + EXTRACT_WAIT_S, owner, sendlock.SEND_LOCK_TTL_S,
                                DEAD_SEND, DeliveryState.SENDING, EXTRACTION_OK, EXTRACTION_FAILED, *_TERMINAL])
        if got[0] == "moved":
            continue
        if got[0] == "extracting":
            return Head("extracting", head)
        flat = got[1]
        rec = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        held = sendlock.Held(owner, rec, int(got[3])) if len(got) > 2 and int(got[2]) else None
        return Head("head", head, rec, held)
    raise RuntimeError(f"lane {target} kept changing under its lease")


def drive_ready(ctx: Context, target: str, publish: Publish, drain: Callable[[], None], *,
                started: str | None = None, backlog: int = 2) -> JsonObject:
    """A drive task's work: `target`'s lane ('': none), then the ready set's lanes until it is empty
    or `BUDGET_S` is spent (then `drain()` publishes a drive for the rest). A lane that took
    `FAN_OUT_S` calls `drain()` too while fewer than `backlog` drives wait to start. Returns the
    first lane's summary, with `drained` and `drained_sent` when lanes of the set were driven."""
    r = ctx.redis
    deadline = time.monotonic() + BUDGET_S
    ready = keys.lanes_ready()

    def fan_out(since: float) -> None:
        if time.monotonic() - since < FAN_OUT_S:
            return
        pipe = r.pipeline(transaction=False)
        pipe.zcard(ready)
        pipe.zcard(keys.drives_waiting())
        left, waiting = pipe.execute()
        if left and waiting < backlog:
            drain()

    if target:
        t0 = time.monotonic()
        out = drive(ctx, target, publish, started=started, pop=True)
        started = None
        fan_out(t0)
    else:
        out = {"lane": "", "state": "drained", "sent": 0}
    nxt = out.pop("next", None)  # popped by the lane's last look ('': the set was empty then)
    lanes = sent = 0
    while nxt != "":
        if nxt is None:
            if time.monotonic() >= deadline:
                if r.exists(ready):
                    drain()
                break
            pipe = r.pipeline(transaction=False)
            if started:  # a drain's own first look: it no longer waits
                pipe.zrem(keys.drives_waiting(), started)
                started = None
            pipe.zpopmin(ready)
            popped = pipe.execute()[-1]
            if not popped:
                break
            nxt = popped[0][0]
        t0 = time.monotonic()
        got = drive(ctx, nxt, publish, budget_s=max(0.05, deadline - time.monotonic()), pop=True)
        nxt = got.pop("next", None)
        fan_out(t0)
        lanes += 1
        sent += int(got.get("sent") or 0)
    if lanes:
        out = {**out, "drained": lanes, "drained_sent": sent}
    return out


def drive(ctx: Context, target: str, publish: Publish, *, started: str | None = None,
          budget_s: float | None = None, pop: bool = False) -> JsonObject:
    """Send what is ready at the head of `target`'s lane, one `_look` per step. `publish(target,
    countdown)` enqueues another drive; `started`: the drive task's id; `budget_s`: how long it
    may send; `pop`: the look finding the lane empty pops the ready set's next lane (`next`)."""
    r = ctx.redis
    lease = keys.lease("lane", target)
    token = ledger.new_token()
    pipe = None
    if started:
        pipe = r.pipeline(transaction=False)
        pipe.zrem(keys.drives_waiting(), started)
    # the chat's gate (None: unpaced). The lease holder is the chat's only sender, so a gate saying `DEAD_SEND`
    # as a drive takes the lease was left by one that died mid-send: the first look clears it (no TTL waited)
    gate: str | None = None
    with suppress(CourierError):  # an unusable target: the step itself reports it
        name, chat = split_target(target)
        gate, _ = ratelimit.gate_of(ctx.platform(name), chat)
    look = _look(r, target, token, take=True, lock=True, gate=gate, pipe=pipe, pop=pop)
    if look.what == "busy":
        return {"lane": target, "state": "busy"}  # a live worker is on it
    if look.what == "empty":  # its lease went with the look
        return _empty(target, 0, look)
    if look.what == "extracting":  # due time set, lease released with the look
        return {"lane": target, "state": "extracting", "head": look.id, "sent": 0}
    try:
        # renewed while the drive makes progress (each look, each step, each chunk of a file it sends)
        with ledger.renewing(r, lease, token, ledger.LEASE_TTL_S, needs_progress=True):
            out = _drive_leased(ctx, target, publish, token, look, BUDGET_S if budget_s is None else budget_s,
                                pop)
    except BaseException:
        ledger.release_soon(r, lease, token, "lane", target)
        raise
    if out["state"] == "empty" or out.pop("released", False):
        return out  # its lease went with the last look
    if out["state"] != "extracting":
        ledger.release_soon(r, lease, token, "lane", target)
        return out
    pipe = r.pipeline(transaction=False)
    ledger.set_due(pipe, "lane", target, EXTRACT_WAIT_S)
    ledger.release(pipe, lease, token)
    # its head read again after the release, in the same round trip: an extraction that ended
    # while this drive held the lease found it busy, so look once more now that it is free
    pipe.hgetall(keys.delivery(out["head"]))
    step = load_step(r, out["head"], pipe.execute()[-1], target)
    if step is not None and (step.ready or step.done):
        publish(target, None)
    return out


def _empty(target: str, sent: int, look: Head) -> JsonObject:
    out: JsonObject = {"lane": target, "state": "empty", "sent": sent}
    if look.id is not None:
        out["next"] = look.id
    return out


def _drive_leased(ctx: Context, target: str, publish: Publish, token: str, first: Head,
                  budget_s: float, pop: bool = False) -> JsonObject:
    r = ctx.redis
    sent = 0
    deadline = time.monotonic() + budget_s
    look = first
    while True:
        ledger.progress()
        held, held_id = look.held, look.id
        try:
            if look.what == "empty":
                return _empty(target, sent, look)
            if look.what == "extracting":  # due time set, lease released with the look
                return {"lane": target, "state": "extracting", "head": look.id, "sent": sent, "released": True}
            head = look.id
            assert head is not None  # a `head` answer names it
            step = load_step(r, head, look.rec, target)
            if step is None or step.done:
                within = time.monotonic() <= deadline
                look = _look(r, target, token, last=step or head, lock=within, pop=pop and within)
                continue
            if not step.ready:  # the caller sets the lane's due time (EXTRACT_WAIT_S) as it releases the lease
                return {"lane": target, "state": "extracting", "head": head, "sent": sent}
            if held is None and time.monotonic() > deadline:  # (a lock taken by the look is used)
                ledger.set_due(r, "lane", target, ledger.LANE_GRACE_S)
                publish(target, None)
                return {"lane": target, "state": "continued", "sent": sent}
            end = r.pipeline(transaction=False)
            wait = _run_step(ctx, step, held, end)
            held = None  # under_send_lock released it
        finally:
            if held is not None:  # taken by the look, not used: free it for the next drive
                sendlock.release_send_lock(r, held_id or "", held.owner)
        if wait is not None:  # a countdown drive for a short wait, the reconciler for a long one
            short = wait <= ledger.COUNTDOWN_MAX_S
            ledger.set_due(r, "lane", target, wait + ledger.LANE_GRACE_S if short else wait)
            if short:
                publish(target, wait)
            return {"lane": target, "state": "waiting", "head": head, "wait_s": round(wait, 3), "sent": sent}
        sent += 1
        # the step's record (on `end`), popped once final, and the next: one round trip
        within = time.monotonic() <= deadline
        look = _look(r, target, token, last=step, lock=within, pipe=end, pop=pop and within)


def _specs(step: Step) -> list[DeliverySpec]:
    """The step's specs (a step whose spec did not verify has its receipts failed: it is done)."""
    missing = [did for did, spec in zip(step.ids, step.specs) if spec is None]
    if missing:
        raise ValueError(f"deliveries {', '.join(missing)} of step {step.lead} have no spec to send")
    return [spec for spec in step.specs if spec is not None]


def _run_step(ctx: Context, step: Step, held: sendlock.Held | None = None, end: Pipeline | None = None
              ) -> float | None:
    """Send one step. Returns None when it is final, else how long to wait before trying again.
    `held`: a single delivery's send lock taken by the look; `end`: where its record is queued."""
    r = ctx.redis
    specs = _specs(step)
    target = specs[0].target
    try:
        if len(step.ids) == 1:
            spec = specs[0]
            extracted = delivery_mod.result_of(step.recs[0], spec.key or "") if spec.extract is not None else None
            delivery_mod.deliver(ctx, spec, extracted, held=held, end=end)
        else:
            # the caption goes with the album (or its first send), not with its first photo alone
            album.deliver_album(ctx, album.Album(target, specs[0].caption,
                                                 [replace(specs[0], caption=None), *specs[1:]]))
        return None
    except ratelimit.Paced as exc:  # courier's own pacing (the ratelimit module says when): no attempt, no give-up
        return exc.retry_after_s
    except RateLimited as exc:
        n = int(r.hincrby(keys.delivery(step.lead), "rate_limited", 1))
        metrics.record_rate_limited(target)
        _mark_open(ctx, step, state=DeliveryState.RATE_LIMITED,
                   reason=f"rate limited, retry after {exc.retry_after_s:g}s")
        if n > MAX_RATE_LIMITS:
            _give_up(ctx, step, f"gave up after {n - 1} rate limits from {target.split(':')[0]}")
            return None
        return min(900.0, exc.retry_after_s) + random.uniform(0.05, 0.5)
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ReadOnlyError):
        # the ledger's own outage, not the delivery's failure (no attempt counted, no backoff): the drive
        # ends, and its lane is re-driven once Redis answers (ledger.release_soon)
        raise
    except sendlock.Busy:
        # a dead worker's send lock: it lapses with the lane's lease; waiting for it is no attempt
        left_s = ledger.held(r, keys.delivery_lock(step.lead))
        return min(left_s, sendlock.SEND_LOCK_TTL_S) + 0.1 if left_s else 0.1
    except Exception as exc:  # noqa: BLE001 - unmapped errors count as transient, bounded
        if isinstance(exc, CourierError) and not exc.transient:
            _give_up(ctx, step, exc.reason)
            return None
        if not isinstance(exc, CourierError):
            log.exception("lane %s: unexpected error sending %s", target, step.lead)
        reason = exc.reason if isinstance(exc, CourierError) else f"{type(exc).__name__}: {exc}"
        # the reason first: a receipt that counts a transient failure already says why
        _mark_open(ctx, step, state=DeliveryState.RETRYING, reason=reason)
        n, first_s = ledger.count_transient(r, step.lead)
        if ledger.gives_up(exc, n, first_s, max_attempts=ctx.max_transient_attempts,
                           outage_deadline_s=ctx.outage_deadline_s):
            what = "storage unavailable" if isinstance(exc, StorageError) else f"gave up after {n} attempts"
            _give_up(ctx, step, f"{what}: {reason}", notice=in_chat_words(exc))
            return None
        return ledger.backoff_s(n, storage=isinstance(exc, StorageError))


def _open(ctx: Context, step: Step) -> list[DeliverySpec]:
    recs = [receipts.get_delivery(ctx.redis, d) or {} for d in step.ids]
    return [spec for spec, rec in zip(_specs(step), recs) if rec.get("state") not in receipts.TERMINAL]


def _mark_open(ctx: Context, step: Step, **fields: Any) -> None:
    for spec in _open(ctx, step):
        receipts.update_delivery(ctx.redis, spec.delivery_id, **fields)


def _give_up(ctx: Context, step: Step, reason: str, *, notice: str | None = None) -> None:
    """Fail the step's open deliveries for good with `reason` (the receipt's); a file's
    chat is told `notice` (the failure in its words, `in_chat_words`) when given."""
    for spec in _open(ctx, step):
        delivery_mod.record_failure(ctx, spec, reason, final=True)
        if notice and spec.type == "file":
            delivery_mod.notice_failed(ctx, spec, notice, reason=reason)
