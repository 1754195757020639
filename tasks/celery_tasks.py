"""The Celery tasks: thin. Decode args, call plain code, return a small dict.

A message carries ids only; what to do is read from the ledger, so any worker
can run any stage again (the reconciler re-drives lost ones). Retries are the
ledger's due times, never a sleeping worker. Tasks are at-least-once (late ack,
reject on worker lost); effects are idempotent through delivery ids and leases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from celery import Task, shared_task

from tasks.turn import extract as extract_mod
from tasks import metrics, runtime, task_names
from tasks.ledger import ledger
from tasks.turn import turn as turn_mod
from tasks.ledger.events import Event, describe
from tasks.messages import ExtractionRun, JsonObject, SendResult, TurnResult, TurnSpec
from tasks.dispatch.reconcile import Stage
from tasks.states import DeliveryState

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _task(**opts: Any) -> Callable[[_F], _F]:
    """Celery's `shared_task`, typed for mypy: the task keeps its function's signature."""
    return cast("Callable[[_F], _F]", shared_task(**opts))


def progress_meta(job_id: str, ev: Event) -> dict[str, str] | None:
    """The custom `PROGRESS` state's meta for a phase event (None: not shown), for Flower."""
    kind = ev.get("kind")
    if not (kind in ("tool_start", "tool_result")
            or (kind == "status" and ev.get("status") in ("started", "thinking", "processing"))):
        return None
    meta = {"job": job_id, "phase": str(ev.get("status") if kind == "status" else kind),
            "activity": describe(ev)[:80]}
    if ev.get("tool_name"):
        meta["tool"] = str(ev["tool_name"])
    return meta


# a turn's result is kept (`courier turn --wait`, Flower's PROGRESS); the other tasks' are not
@_task(bind=True, name=task_names.AGENT_TURN, acks_late=True, reject_on_worker_lost=True, ignore_result=False)
def agent_turn(self: Task, spec: TurnSpec) -> TurnResult:
    """One agent turn. While it runs, its state is the custom `PROGRESS` with meta {job, phase,
    activity, tool?} (`AsyncResult(job).info`), each change sent as a `task-progress` event for
    Flower; the chat shows typing and a progress message (tasks.turn.activity)."""
    from tasks.dispatch import chains
    from tasks.turn.activity import TurnActivity

    ctx = runtime.ctx()
    last: list[str] = []

    def show(ev: Event) -> None:
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

    with ledger.leased(ctx.redis, "turn", spec["job"]) as token:
        if token is None:  # another worker (live, or dead until its lease lapses) holds the turn
            ledger.due_when_free(ctx.redis, "turn", spec["job"])
            return {"job": spec["job"], "state": "busy"}
        # its due time follows its lease: if this worker dies, the turn runs again once the lease lapses
        ledger.set_due(ctx.redis, "turn", spec["job"], ledger.LEASE_TTL_S + 1.0)
        t0 = time.monotonic()
        with TurnActivity(ctx, spec["target"], spec["job"]) as native:
            outcome = turn_mod.run_turn(ctx, spec, on_activity=show)
            out = turn_mod.finish(ctx, outcome, chains.enqueue, on_activity=show)
        if not out.get("skipped"):
            metrics.record_turn(spec.get("agent") or "demo", out["state"], time.monotonic() - t0)
        return out


class DeliveryFailed(Exception):
    """A drive recorded deliveries failed for good: the task ends FAILURE once its lane's work is
    recorded; Celery retries nothing (the ledger owns retries)."""


@_task(name=task_names.EXTRACT_FILE, acks_late=True, reject_on_worker_lost=True, throws=(DeliveryFailed,))
def extract_file(delivery_id: str) -> ExtractionRun:
    """Extract one sandbox file, then drive its chat's lane: here when this worker consumes the
    delivery queue too (the default all-queues worker: one message less per file), else by a
    `drive_lane` message."""
    from celery import current_app

    from tasks.dispatch import chains

    ctx = runtime.ctx()
    try:
        inline = "delivery" in (current_app.amqp.queues.consume_from or {})
    except Exception:  # noqa: BLE001 - not in a worker: publish
        inline = False
    out = extract_mod.run(ctx, delivery_id)
    wake = out.pop("wake", None)
    if wake is not None:  # its sandbox answers again: what its breaker postponed goes now
        for did in wake["ids"]:
            chains.publish_extract(did, wake["queue"])
    if out["state"] in (DeliveryState.EXTRACTED, DeliveryState.FAILED, "done"):
        if inline:
            out["lane"] = {k: v for k, v in _drive_lanes(ctx, out["target"]).items() if k != "lane"}
        else:
            chains.wake_lane(ctx.redis, out["target"])
    return out


@_task(bind=True, name=task_names.DRIVE_LANE, acks_late=True, reject_on_worker_lost=True, throws=(DeliveryFailed,))
def drive_lane(self: Task, target: str) -> JsonObject:
    """Send what is ready at the head of one chat's lane ('': none), then of the ready set's
    lanes. A delivery failed during the drive makes the task a FAILURE naming its id and reason
    (never chat text)."""
    return _drive_lanes(runtime.ctx(), target, started=self.request.id)


def _drive_lanes(ctx: runtime.Context, target: str, *, started: str | None = None) -> JsonObject:
    """`target`'s lane, then the ready set's; DeliveryFailed after, naming the failed deliveries."""
    from tasks.delivery import lanes
    from tasks.dispatch import chains

    with metrics.failures_noted() as failed:
        out = lanes.drive_ready(ctx, target, chains.publish_lane, lambda: chains.publish_drain(ctx.redis),
                                started=started, backlog=chains.WAKE_BACKLOG)
    if failed:
        raise DeliveryFailed("; ".join(f"{did}: {reason[:200]}" for did, reason in failed[:10])
                             + (f"; and {len(failed) - 10} more" if len(failed) > 10 else ""))
    return out


@_task(bind=True, name=task_names.SEND, acks_late=True)
def send(self: Task, target: str, text: str | None = None, files: list[str] | None = None, caption: str | None = None,
         voice: bool = False, as_document: bool = False) -> SendResult:
    """An operator's send (Flower's async-apply; args: tasks/ops/send.py), registered like
    `courier send`; bad input fails the task, nothing enqueued. The job id is the task id's,
    so a redelivered message registers the same job. Sends to one chat keep their publish
    order (tasks/ops/sendorder.py)."""
    from tasks.ops import send as send_mod
    from tasks.ops import sendorder

    job_id = f"snd_{self.request.id.replace('-', '')}" if self.request.id else None
    ctx = runtime.ctx()
    stamped = self.request.get(sendorder.HEADER) if isinstance(target, str) else None
    try:  # the number its publisher stamped (sendorder.stamp); none, or not a number: no wait
        seq = int(str(stamped)) if stamped is not None else None
    except ValueError:
        seq = None
    if seq is not None:
        sendorder.wait_turn(ctx.redis, target, seq)
    try:
        return send_mod.send(ctx, target, text=text, files=files, caption=caption, voice=voice,
                             as_document=as_document, job_id=job_id)
    finally:
        if seq is not None:
            sendorder.done(ctx.redis, target, seq)


@_task(name=task_names.JANITOR_SWEEP, acks_late=True)
def janitor_sweep() -> JsonObject:
    from tasks.ops.janitor import sweep

    return sweep(runtime.ctx())


def stages() -> tuple[Stage, ...]:
    """The stages the reconciler watches, each with its owner's re-driver (tasks/dispatch/reconcile.py)."""
    from tasks.dispatch import redrive

    return (redrive.LANE, redrive.EXTRACT, turn_mod.STAGE)


@_task(name=task_names.RECONCILE, acks_late=True)
def reconcile() -> dict[str, int]:
    """One reconciler pass (workers run one every second themselves; this lets beat or an operator)."""
    from tasks.dispatch import reconcile as reconcile_mod

    return reconcile_mod.tick(runtime.ctx(), stages())
