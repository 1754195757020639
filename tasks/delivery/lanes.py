"""Per-chat lanes: a chat's deliveries go out one step at a time, in enqueue
order, paced by the shared rate limits (plain code, no Celery).

`keys.lane(target)` lists the chat's steps (a delivery id, or the first id
of an album). `drive(ctx, target)` takes the lane's lease and sends the
steps at its head while they are ready:
- a step whose deliveries are all final is dropped from the lane;
- a step whose files are still being extracted waits: the extraction drives
  the lane when it ends (and the lane's due time is a safety net);
- a slot not free yet (courier's own pacing, `ratelimit.Paced`) or a
  platform's 429 waits `retry_after`: a countdown drive for a short wait,
  the reconciler for a long one; no task polls meanwhile, and the pacing is
  no attempt. Only the platform's own 429s count, and transient errors back
  off (storage outages until their deadline) before the step fails.
The lane keeps its order through all of it: nothing behind a waiting step
overtakes it.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from redis import Redis
from redis.client import Pipeline

from adapters.errors import CourierError, RateLimited, StorageError, in_chat_words
from tasks.delivery import specs
from tasks.delivery import album
from tasks.delivery import delivery as delivery_mod
from tasks import metrics
from tasks.delivery import sendlock
from tasks.ledger import keys, ledger, receipts, scripts, signing
from tasks.delivery.delivery import result_of
from tasks.messages import DeliverySpec, JsonObject
from tasks.delivery.ratelimit import Paced
from tasks.runtime import Context
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, DeliveryState

log = logging.getLogger(__name__)

#: a lane nobody has looked at for this long is driven again by the reconciler (the ledger's)
LANE_GRACE_S = ledger.LANE_GRACE_S
#: how long one drive keeps sending before it hands the lane to a fresh task (other lanes get a turn)
BUDGET_S = 2.0
#: a lane waiting for an extraction is looked at again after this (the extraction's end drives it sooner)
EXTRACT_WAIT_S = 30.0
#: a lane that took this long to drive (a slow platform: its sends wait on I/O, not the CPU) makes
#: its drive publish a drain while lanes are left in the ready set and fewer than the backlog of
#: drives wait to start: idle threads then take the ready lanes in parallel instead of this drive
#: sending to them one after the other
FAN_OUT_S = 0.2
#: platform 429s one step takes before it fails
MAX_RATE_LIMITS = 60

Publish = Callable[[str, float | None], None]

#: how a chat's gate left by a sender that died mid-send begins (a gate of the release before
#: issue 23 said this for 60 s): the drive that takes the lane's lease clears it (`_look`)
DEAD_SEND = "sending:"
_TERMINAL = sorted(receipts.TERMINAL)


@dataclass
class Head:
    """What a look at the lane found (`_look`): 'head' (with `id`, its receipt, and `held`: its
    send lock when taken), 'extracting' (with `id`), 'empty' (with `id`, when asked: the next
    lane popped from the ready set, '' when it was empty) or 'busy'."""

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


def load_step(r: Redis, lead: str, rec: receipts.Receipt | None = None, target: str | None = None
              ) -> Step | None:
    """The step `lead` leads (`rec`: its receipt when already read) in the lane of `target`.
    Each spec is verified (tasks/ledger/signing.py): one that does not, or that names another chat
    than the lane's, is never sent: its receipt is made final `failed` here."""
    rec = rec if rec is not None else receipts.get_delivery(r, lead)
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


def _verified(r: Redis, did: str, rec: receipts.Receipt, target: str | None) -> DeliverySpec | None:
    """The receipt's spec, verified as delivery `did`'s (and of `target`'s lane); a forgery
    makes the receipt final `failed` (in `rec` too) and gives None."""
    raw = rec.get("spec")
    if not raw:
        return None
    try:
        spec = specs.open_delivery(did, raw)  # logged and counted when forged
        if target is not None and spec.target != target:
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
    """A look at the head of `target`'s lane by its lease's holder, in two round trips:
    1. what is queued on `pipe` (the record of the step just sent: the look reads it), the
       lease taken (`take`; held by another: 'busy'), `last` popped when it is still the head
       and final (lane_pop_done.lua), and the head read;
    2. one script decides on it, in one step:
       - no head: the lane forgotten (its due time) and the lease released, unless a step came
         meanwhile (lane_forget.lua; then the look is made again); `pop`: the next lane of the
         ready set popped with it ('empty' with its id, '' when the set was empty);
       - a head (lane_head.lua): 'extracting' when it is a file still being extracted (the
         lane's due time set and the lease released together), else 'head' with its receipt;
         a lease just taken clears `gate`, the chat's gate, when a sender that died mid-send
         left it; `lock`: a single ready head's send lock taken and its attempt counted.
    Only the lease's holder pops a lane: the head the first round trip read is the one the
    second decides on (lane_head.lua checks it, and the look is made again if not)."""
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
        if len(got) > 2 and int(got[2]):
            return Head("head", head, rec, sendlock.Held(owner, rec, int(got[3])))
        return Head("head", head, rec)
    raise RuntimeError(f"lane {target} kept changing under its lease")


def drive_ready(ctx: Context, target: str, publish: Publish, drain: Callable[[], None], *,
                started: str | None = None, backlog: int = 2) -> JsonObject:
    """A drive task's work: `target`'s lane ('': none), then the lanes of the ready set
    (`keys.lanes_ready()`: wake-ups that found enough drives waiting to start, tasks.dispatch.chains
    `wake_lane`), one after the other, until the set is empty or `BUDGET_S` is spent; then
    `drain()` publishes a drive for what is left. `started`: this drive's task id, no longer
    waiting from its first look on. A lane that took `FAN_OUT_S` or more fans out: with
    lanes left in the set and fewer than `backlog` drives waiting to start (chains.WAKE_BACKLOG),
    `drain()` publishes another drive. Returns the first lane's summary, with `drained` (lanes
    driven from the set) and `drained_sent` when there were any."""
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
    """Send what is ready at the head of `target`'s lane. `publish(target,
    countdown)` enqueues another drive of the lane. Returns a small summary.
    `started`: the drive task's id, removed from `keys.drives_waiting()` with the
    first look; `budget_s`: how long it may keep sending before handing the lane on;
    `pop`: the look that finds the lane empty (within the budget) pops the next lane of
    the ready set too, given back as `next` ('': the set was empty).

    A first look (`_look`) takes the lane's lease (clearing a dead sender's chat gate),
    reads its head step and, when it is one delivery ready to send, takes its send lock
    and counts the attempt; per step sent the next look records it (its receipt, event,
    lock released), pops it and looks at the next the same way; the look that finds the
    lane empty forgets it and releases its lease."""
    r = ctx.redis
    lease = keys.lease("lane", target)
    token = ledger.new_token()
    pipe = None
    if started:
        pipe = r.pipeline(transaction=False)
        pipe.zrem(keys.drives_waiting(), started)
    look = _look(r, target, token, take=True, lock=True, gate=_gate(ctx, target), pipe=pipe, pop=pop)
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
        try:
            ledger.release(r, lease, token)
        except Exception:  # noqa: BLE001 - an unreleased lease expires by itself
            pass
        raise
    if out["state"] == "empty" or out.pop("released", False):
        return out  # its lease went with the last look
    # the lease released, with the due time of a lane waiting for an extraction and
    # its head's receipt read again: one round trip
    extracting = out["state"] == "extracting"
    pipe = r.pipeline(transaction=False)
    if extracting:
        ledger.set_due(pipe, "lane", target, EXTRACT_WAIT_S)
    ledger.release(pipe, lease, token)
    if extracting:
        pipe.hgetall(keys.delivery(out["head"]))
    try:
        res = pipe.execute()
    except Exception:  # noqa: BLE001 - an unreleased lease expires by itself; a due time not set raises
        if extracting:
            raise
        return out
    if extracting:
        # an extraction that ended while this drive held the lease found it
        # busy: look once more now that it is free
        rec = res[-1] or {}
        step = load_step(r, out["head"], rec, target) if rec else None
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
                ledger.set_due(r, "lane", target, LANE_GRACE_S)
                publish(target, None)
                return {"lane": target, "state": "continued", "sent": sent}
            end = r.pipeline(transaction=False)
            wait = _run_step(ctx, step, held, end)
            held = None  # under_send_lock released it
        finally:
            if held is not None:  # taken by the look, not used: free it for the next drive
                try:
                    sendlock.release_send_lock(r, held_id or "", held.owner)
                except Exception:  # noqa: BLE001 - an unreleased send lock expires by itself
                    pass
        if wait is not None:
            _wait(r, target, wait, publish)
            return {"lane": target, "state": "waiting", "head": head, "wait_s": round(wait, 3), "sent": sent}
        sent += 1
        # the step's record (on `end`), popped once final, and the next: one round trip
        within = time.monotonic() <= deadline
        look = _look(r, target, token, last=step, lock=within, pipe=end, pop=pop and within)


def _gate(ctx: Context, target: str) -> str | None:
    """The chat's gate (None: its platform paces no chat). The lane's lease is the chat's only
    sender, so a gate still saying "a send is on its way" (`DEAD_SEND`) when a drive takes the
    lease was left by a holder that died mid-send (a live one would still hold the lease).
    The first look (lane_head.lua) clears it as it takes the lease, so the chat does not wait
    out the gate's own TTL."""
    from adapters.platforms.base import split_target
    from tasks.delivery import ratelimit

    try:
        name, chat = split_target(target)
        gate, _ = ratelimit.gate_of(ctx.platform(name), chat)
    except CourierError:
        return None  # the step itself reports an unusable target
    return gate


def _wait(r: Redis, target: str, wait_s: float, publish: Publish) -> None:
    """The lane goes on in `wait_s`: a countdown drive for a short wait (the
    due time after it is the safety net), the reconciler for a long one."""
    if wait_s <= ledger.COUNTDOWN_MAX_S:
        ledger.set_due(r, "lane", target, wait_s + LANE_GRACE_S)
        publish(target, wait_s)
    else:
        ledger.set_due(r, "lane", target, wait_s)


def _specs(step: Step) -> list[DeliverySpec]:
    """The step's specs (a step whose spec did not verify has its receipts failed: it is done)."""
    missing = [did for did, spec in zip(step.ids, step.specs) if spec is None]
    if missing:
        raise ValueError(f"deliveries {', '.join(missing)} of step {step.lead} have no spec to send")
    return [spec for spec in step.specs if spec is not None]


def _run_step(ctx: Context, step: Step, held: sendlock.Held | None = None, end: Pipeline | None = None
              ) -> float | None:
    """Send one step. Returns None when it is final, else how long to wait before trying again.
    `held`: a single delivery's send lock, taken by the look; `end`: where a delivered record is
    queued (the caller executes it with its next look)."""
    r = ctx.redis
    specs = _specs(step)
    target = specs[0].target
    try:
        if len(step.ids) == 1:
            spec = specs[0]
            extracted = result_of(step.recs[0], spec.key or "") if spec.extract is not None else None
            delivery_mod.deliver(ctx, spec, extracted, held=held, end=end)
        else:
            # the caption goes with the album (or its first send), not with its first photo alone
            album.deliver_album(ctx, album.Album(target, specs[0].caption,
                                                 [replace(specs[0], caption=None), *specs[1:]]))
        return None
    except Paced as exc:  # courier's own pacing (`tasks.delivery.ratelimit` says when): no attempt, no give-up
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
        receipts.update_delivery(ctx.redis, spec.delivery_id, final="1")
        delivery_mod.record_failure(ctx, spec, reason)
        if notice and spec.type == "file":
            delivery_mod.notice_failed(ctx, spec, notice, reason=reason)
