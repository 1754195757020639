"""The Celery tasks: thin. Decode args, call plain code, return a small dict.

Retry policy (DESIGN.md reliability rules):
- RateLimited: re-scheduled after the platform's retry_after plus jitter;
  the worker never sleeps.
- Transient (and a busy send lock): exponential backoff with jitter, bounded.
- Permanent: recorded by the plain code, never retried.
All tasks are at-least-once (late ack, reject on worker lost); effects are
idempotent through delivery ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import random

from celery import shared_task
from celery.exceptions import Retry

from adapters.errors import CourierError, RateLimited
from adapters.platforms.base import split_target
from tasks import delivery as delivery_mod
from tasks import extract as extract_mod
from tasks import keys, receipts, runtime
from tasks import turn as turn_mod

log = logging.getLogger(__name__)

#: countdowns stay well under the broker's visibility timeout
MAX_COUNTDOWN_S = 900.0
MAX_RATE_LIMIT_RETRIES = 60


def platform_of(target: str) -> str:
    return split_target(target)[0]


def backoff_s(retries: int, base_s: float = 1.0, cap_s: float = 120.0) -> float:
    return min(cap_s, base_s * 2 ** retries) * random.uniform(0.5, 1.0)


def progress_meta(job_id: str, ev: dict) -> dict | None:
    """The custom `PROGRESS` state's meta for a phase event (None: not shown):
    what the turn is doing now, for the result backend and Flower."""
    kind = ev.get("kind")
    if kind == "status" and ev.get("status") in ("started", "thinking", "processing"):
        activity = ev.get("activity") or ev.get("message") or ev["status"]
    elif kind == "tool_start":
        activity = ev.get("activity") or f"using {ev.get('tool_name', 'a tool')}"
    elif kind == "tool_result":
        activity = f"{ev.get('activity') or ev.get('tool_name', 'tool')} ({ev.get('status', 'tool_complete')})"
    else:
        return None
    meta = {"job": job_id, "phase": ev.get("status") if kind == "status" else kind, "activity": str(activity)[:80]}
    if ev.get("tool_name"):
        meta["tool"] = ev["tool_name"]
    return meta


@shared_task(bind=True, name="courier.turns.agent_turn", acks_late=True, reject_on_worker_lost=True,
             ignore_result=False)
def agent_turn(self, spec: dict) -> dict:
    """One agent turn. While it runs, the task's state is the custom
    `PROGRESS` with meta {job, phase, activity, tool?} in the result backend
    (`AsyncResult(job).info`), and each change is sent as a `task-progress`
    event, so Flower shows the state and the activity live. The chat shows
    typing / a progress message (tasks.activity)."""
    from tasks.activity import TurnActivity

    ctx = runtime.ctx()
    last: list[str] = []

    def show(ev: dict) -> None:
        native.on_event(ev)
        meta = progress_meta(spec["job"], ev)
        if meta is None or last == [meta["activity"]]:
            return
        last[:] = [meta["activity"]]
        try:
            self.update_state(state="PROGRESS", meta=meta)
            self.send_event("task-progress", activity=meta["activity"], result=repr(meta))
        except Exception as exc:  # noqa: BLE001 - display only, never fails the turn
            log.debug("progress state of %s not recorded: %r", spec["job"], exc)

    with TurnActivity(ctx, spec["target"], spec["job"]) as native:
        return turn_mod.run_turn(ctx, spec, on_activity=show)


@shared_task(bind=True, name="courier.sandbox.extract_file", acks_late=True, reject_on_worker_lost=True,
             max_retries=None)
def extract_file(self, spec: dict) -> dict:
    ctx = runtime.ctx()
    try:
        return extract_mod.extract(ctx, spec)
    except Retry:
        raise
    except Exception as exc:  # noqa: BLE001 - unmapped errors retry (bounded), then fail cleanly
        transient = exc.transient if isinstance(exc, CourierError) else True
        if not transient or self.request.retries + 1 >= ctx.max_transient_attempts:
            log.warning("extraction %s failed: %r", spec.get("delivery"), exc)
            return extract_mod.record_failure(ctx.redis, spec["delivery"], {
                "ok": False, "reason": f"{type(exc).__name__}: {exc}", "name": spec["path"].rsplit("/", 1)[-1]})
        raise self.retry(exc=exc, countdown=backoff_s(self.request.retries))


def _with_retries(task, ctx, lead: str, run: Callable[[], dict], *, mark: Callable[..., None],
                  give_up: Callable[[str], dict], what: str) -> dict:
    """The delivery retry policy, one place for `deliver` and `deliver_album`:
    rate limits re-schedule after retry_after (+ jitter, bounded count);
    transient and unexpected errors back off exponentially (bounded by
    max_transient_attempts); a busy send lock retries shortly without
    touching the receipt; permanent errors give up at once. Counters live
    on the receipt of `lead`."""
    try:
        return run()
    except Retry:
        raise
    except RateLimited as exc:
        n = int(ctx.redis.hincrby(keys.delivery(lead), "rate_limited", 1))
        mark(state="rate_limited", reason=f"rate limited, retry after {exc.retry_after_s:g}s")
        if n > MAX_RATE_LIMIT_RETRIES:
            return give_up(f"gave up after {n - 1} rate limits")
        countdown = min(MAX_COUNTDOWN_S, exc.retry_after_s + random.uniform(0.05, 0.5))
        raise task.retry(exc=exc, countdown=countdown)
    except Exception as exc:  # noqa: BLE001 - unmapped errors count as transient, bounded
        if isinstance(exc, CourierError) and not exc.transient:
            return give_up(exc.reason)
        if not isinstance(exc, CourierError):
            log.exception("%s: unexpected error", what)
            exc = CourierError(f"{type(exc).__name__}: {exc}")
        n = int(ctx.redis.hincrby(keys.delivery(lead), "transient_errors", 1))
        busy = isinstance(exc, delivery_mod.Busy)
        if not busy:
            mark(state="retrying", reason=exc.reason)
        if not busy and n >= ctx.max_transient_attempts:
            return give_up(f"gave up after {n} attempts: {exc.reason}")
        raise task.retry(exc=exc, countdown=2.0 if busy else backoff_s(n - 1))


@shared_task(bind=True, name="courier.delivery.deliver", acks_late=True, reject_on_worker_lost=True,
             max_retries=None)
def deliver(self, extracted: dict | None, job: dict) -> dict:
    ctx = runtime.ctx()
    return _with_retries(
        self, ctx, job["id"], lambda: delivery_mod.deliver(ctx, job, extracted),
        mark=lambda **f: receipts.update_delivery(ctx.redis, job["id"], **f),
        give_up=lambda reason: delivery_mod.record_failure(ctx, job, reason), what=f"delivery {job['id']}")


@shared_task(bind=True, name="courier.delivery.deliver_album", acks_late=True, reject_on_worker_lost=True,
             max_retries=None)
def deliver_album(self, group: dict) -> dict:
    """A group of photos as one album (tasks.chains builds the group); the
    retry policy of `deliver`, its counters on the group's first receipt."""
    ctx = runtime.ctx()
    lead = group["items"][0]["id"]

    def give_up(reason: str) -> dict:
        return {"album": lead, "deliveries": [delivery_mod.record_failure(ctx, job, reason)
                                              for job in delivery_mod.album_items_open(ctx, group)]}

    def mark(**fields) -> None:
        for job in delivery_mod.album_items_open(ctx, group):
            receipts.update_delivery(ctx.redis, job["id"], **fields)

    return _with_retries(self, ctx, lead, lambda: delivery_mod.deliver_album(ctx, group), mark=mark,
                         give_up=give_up, what=f"album {lead}")


@shared_task(name="courier.janitor.sweep", acks_late=True)
def janitor_sweep() -> dict:
    from tasks.janitor import sweep

    return sweep(runtime.ctx())
