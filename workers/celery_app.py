"""The Celery app: queues, routes, reliability settings, the beat schedule.

    celery -A workers.celery_app worker -Q turns,sandbox,delivery,janitor
    celery -A workers.celery_app beat
    celery -A workers.celery_app flower
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

from celery import Celery, Task, concurrency, current_app
from celery.concurrency.thread import TaskPool as ThreadPool
from celery.schedules import crontab
from celery.signals import (after_setup_logger, after_setup_task_logger, beat_init, before_task_publish,
                            task_postrun, task_prerun, task_rejected, worker_init, worker_process_init,
                            worker_process_shutdown, worker_ready, worker_shutdown)
from kombu import Exchange, Queue

from tasks import runtime, task_names
from tasks.ledger import keys, ledger
from tasks.ops import queues, sendorder
from workers import kombu_internals, logformat, logsafe, signed_messages
from workers.metrics import mark_dead, start_exporter
from workers.redis_url import celery_ssl, celery_url
from workers.settings import get_settings
from workers.timelimits import Watchdog
from workers.wiring import agent_sandbox_report, build_context, redis_client

log = logging.getLogger(__name__)

QUEUES = ("turns", "sandbox", "delivery", "janitor")


def task_queue(name: str, args=None, kwargs=None, options=None, task=None, **kw):
    """`courier.<area>.<verb>` goes to the queue of its area. The route names the queue only:
    naming the exchange would make kombu look its bindings up in Redis on every publish."""
    area = name.split(".")[1] if name.startswith("courier.") else None
    return {"queue": area} if area in QUEUES else None


class CourierTask(Task):
    """On the threads pool a task's body runs inside `Watchdog.guard`, so its time limits end
    exactly where the body ends (a soft limit landing after it must not leave the hard one armed)."""

    def __call__(self, *args, **kwargs):
        dog = _watchdog
        if dog is None or self.request.called_directly:  # not run by a threads-pool worker's trace
            return super().__call__(*args, **kwargs)
        return dog.guard(lambda: super(CourierTask, self).__call__(*args, **kwargs))


def make_app(settings=None) -> Celery:
    """courier's Celery app for `settings` (default: the environment's)."""
    signed_messages.install()
    s = settings or get_settings()
    logsafe.install(s)  # every process that loads the app (worker, beat, Flower) logs no secret
    kombu_internals.install()
    url, sentinel_options = celery_url(s.redis_url)
    tls = celery_ssl(s.redis_url)
    app = Celery("courier", include=["tasks.celery_tasks"], task_cls=CourierTask)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        # rediss://: the URL's TLS options, for the broker (kombu, and Flower's broker page) and results
        **({"broker_use_ssl": tls, "redis_backend_use_ssl": tls} if tls else {}),
        # task messages are signed (workers/signed_messages.py): only those are run
        task_serializer=signed_messages.NAME,
        accept_content=[signed_messages.NAME],
        result_accept_content=["json"],
        task_acks_late=True,
        # a stage that hangs (an I/O without a deadline) is cut: the ledger retries it past the soft limit
        task_annotations={name: {"soft_time_limit": soft_s, "time_limit": soft_s + 30} for name, soft_s in (
            (task_names.DRIVE_LANE, s.delivery_time_limit_s), (task_names.EXTRACT_FILE, s.extract_time_limit_s),
            (task_names.AGENT_TURN, s.turn_time_limit_s), (task_names.JANITOR_SWEEP, 1800),
            (task_names.RECONCILE, 60))},
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        # a message reserved by a worker that died comes back after this (above the longest countdown)
        broker_transport_options={
            "visibility_timeout": s.visibility_timeout_s,
            # sweep for abandoned messages often: a killed worker's task comes back promptly
            "unacked_restore_interval": max(1, min(10, s.visibility_timeout_s // 3)),
            "unacked_restore_throttle": 1, "socket_connect_timeout": 5, "socket_timeout": 30,
            "socket_keepalive": True, **sentinel_options,
        },
        result_backend_transport_options={"visibility_timeout": s.visibility_timeout_s, **sentinel_options},
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=4,
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5,
                                   "interval_max": 1.0},
        task_ignore_result=True,
        task_track_started=True,
        worker_send_task_events=True,
        # no task-sent events: one message less per publish; Flower shows tasks from 'received' on
        task_send_sent_event=False,
        task_default_queue="delivery",  # its exchange and routing key too (Celery's default)
        # one direct exchange per queue: a message lands in exactly one queue
        task_queues=[Queue(q, Exchange(q, type="direct"), routing_key=q) for q in QUEUES],
        task_routes=(task_queue,),
        beat_schedule={"janitor-sweep": {"task": task_names.JANITOR_SWEEP, "schedule": crontab(minute="*/15"),
                                         "options": {"queue": "janitor", "expires": 14 * 60}}},
        timezone="UTC",
        worker_hijack_root_logger=False,
        courier_redis_url=s.redis_url,  # courier's own reads and writes (queue registry, beat lock)
    )
    return app


app = make_app()
task_rejected.connect(signed_messages.count_unsigned)
# every thread's app: a `shared_task` called from another thread (Starlette's pool, the
# reconciler) would otherwise find Celery's own default app (amqp://localhost)
app.set_default()


runtime.set_factory(build_context)


# -- logging: no secret and no chat text in any line, at any level (workers/logsafe.py) ----------
@after_setup_logger.connect
@after_setup_task_logger.connect
def _redact_logs(logger=None, **_kw) -> None:
    """Celery has just given the root logger (or its task logger) its handlers: redact and format them."""
    if os.environ.get("COURIER_PROCESS_NAME"):  # one of `courier worker`'s processes (delivery-2): named apart
        multiprocessing.current_process().name = os.environ["COURIER_PROCESS_NAME"]
    logsafe.install()  # the secrets: the app's settings' (make_app)
    logformat.install(get_settings().log_format)


# -- the threads pool (a delivery worker's default): time limits kept by a watchdog ----------------
_watchdog = None
_reconciler = None


@worker_init.connect
def _time_limits_for_threads(sender=None, **_kw) -> None:
    """Celery's threads pool ignores time limits: with it, `workers.timelimits.Watchdog` enforces them."""
    global _watchdog
    try:
        pool = concurrency.get_implementation(getattr(sender, "pool_cls", None) or "prefork")
    except Exception:  # noqa: BLE001 - an unknown pool fails the worker elsewhere
        return
    if isinstance(pool, type) and issubclass(pool, ThreadPool):
        _watchdog = Watchdog()


@task_prerun.connect
def _task_started(task=None, task_id=None, args=None, **_kw) -> None:
    if task is None:
        return
    logformat.task_fields(task.name, task_id or "", args)  # its ids on this thread's log lines
    if _watchdog is None:
        return
    hard, soft = (getattr(task.request, "timelimit", None) or (None, None))[:2]
    conf = task.app.conf
    _watchdog.start_task(task_id or "?", task.name, soft or task.soft_time_limit or conf.task_soft_time_limit,
                         hard or task.time_limit or conf.task_time_limit)


@task_postrun.connect
def _task_ended(**_kw) -> None:
    if _watchdog is not None:  # first: the sooner a finished task drops its deadlines, the better
        _watchdog.end_task()
    logformat.clear_task_fields()


@worker_ready.connect
def _start_reconciler(sender=None, **_kw) -> None:
    """Every worker runs the reconciler (a Redis lock lets one at a time work): no extra process."""
    from tasks.celery_tasks import stages
    from tasks.dispatch.reconcile import Reconciler

    global _reconciler
    _reconciler = Reconciler(runtime.ctx, stages()).start()


STALL_EXIT = 71


def _recycle_on_stall(key: str, idle_s: float) -> None:
    """A drive here made no progress for `idle_s` (a call without a deadline): the process ends, to be
    replaced by its pool or `courier worker`; the ledger re-drives its stages, as after a crash."""
    log.critical("lease %s: no progress for %.0f s: ending this worker process (exit %d) so it is replaced; "
                 "its stages are re-driven by the ledger", key, idle_s, STALL_EXIT)
    logging.shutdown()
    os._exit(STALL_EXIT)


@worker_init.connect
@worker_process_init.connect
def _leases_need_progress(**_kw) -> None:
    ledger.set_stall_handler(_recycle_on_stall, get_settings().lease_stall_s)


@worker_ready.connect
def _check_agent_sandbox(sender=None, **_kw) -> None:
    """Say at start which local agents run unconfined, and whether bwrap can isolate the others here."""
    for level, text in agent_sandbox_report():
        log.log(level, text)


# -- operations: queue registry, consumer heartbeats, metrics exporter ---------------------------
@before_task_publish.connect
def _stamp(sender=None, headers=None, routing_key=None, body=None, **_kw) -> None:
    """Every message carries its publish time (`sent_s`), and its queue is noted in the registry
    (tasks/ops/queues.py) at most once a minute per process, so a queue without a worker is still
    seen. An operator's send carries its number in its chat's order (tasks/ops/sendorder.py)."""
    now = time.time()
    url = _redis_url(current_app)  # the publishing app's Redis
    if headers is not None:
        headers["sent_s"] = round(now, 3)
        if sender == task_names.SEND:
            _number_send(url, headers, body)
    if routing_key and now - _registered.get((url, routing_key), 0.0) > 60:
        _registered[(url, routing_key)] = now
        try:
            queues.register(redis_client(url), routing_key, now=now)
        except Exception as exc:  # noqa: BLE001 - bookkeeping: never fails a publish
            _registered.pop((url, routing_key), None)
            log.debug("queue registry: %r", exc)


def _number_send(url: str, headers: dict, body) -> None:
    """Stamp an operator's send with its number in its chat's order (none when the target cannot be
    read or Redis does not answer: the task then registers when it runs)."""
    try:
        args, kwargs = (body[0], body[1]) if isinstance(body, (tuple, list)) and len(body) >= 2 else ((), {})
        target = kwargs.get("target") if isinstance(kwargs, dict) else None
        target = target if target is not None else (args[0] if args else None)
        if isinstance(target, str) and target and sendorder.HEADER not in headers:
            headers[sendorder.HEADER] = sendorder.stamp(redis_client(url), target)
    except Exception as exc:  # noqa: BLE001 - ordering: never fails a publish
        log.warning("an operator's send goes without its number in the chat's order: %r", exc)


_registered: dict[tuple[str, str], float] = {}
_leave: Callable[[], None] | None = None


def _redis_url(app_) -> str:
    """The Redis of courier's own reads and writes for Celery app `app_` (None: the settings')."""
    return (app_.conf.get("courier_redis_url") if app_ is not None else None) or get_settings().redis_url


@worker_ready.connect
def _start_ops(sender=None, **_kw) -> None:
    """The main process says which queues it consumes, every HEARTBEAT_S; and starts its metrics exporter."""
    global _leave
    url = _redis_url(getattr(sender, "app", None))
    name, stopped = getattr(sender, "hostname", None) or "worker", threading.Event()
    consumed: list[str] = []

    def beat() -> None:
        while not stopped.is_set():
            with contextlib.suppress(AttributeError):
                # read each time: `celery control add_consumer` may add a queue to a running worker
                consumed[:] = [q.name for q in sender.task_consumer.queues]
            try:
                queues.heartbeat(redis_client(url), name, consumed)
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                log.debug("heartbeat: %r", exc)
            stopped.wait(keys.HEARTBEAT_S)

    def leave() -> None:
        stopped.set()
        with contextlib.suppress(Exception):  # it goes stale by itself
            queues.leave(redis_client(url), name, consumed)

    _leave = leave
    threading.Thread(target=beat, name="courier-heartbeat", daemon=True).start()
    s = get_settings()
    if s.metrics_port:
        start_exporter(s.metrics_port, s.metrics_token, host=s.metrics_host)


@worker_shutdown.connect
def _stop_ops(sender=None, **_kw) -> None:
    if _reconciler is not None:
        _reconciler.stop()
    if _leave is not None:
        _leave()


@worker_process_shutdown.connect
def _pool_process_ended(pid=None, **_kw) -> None:
    mark_dead(pid or os.getpid())


# -- beat: one scheduler at a time ---------------------------------------------------------------
#: the beat lock lives this long unless its holder renews it (every third of it)
BEAT_LOCK_TTL_S = 30
#: a standing-by beat tries to take the lock this often
BEAT_STANDBY_POLL_S = 1.0


@beat_init.connect
def _beat_singleton(sender=None, **_kw) -> None:
    """Only the beat holding `keys.beat_lock()` schedules: another waits here, before its first tick,
    until the lock is free (never scheduling without it, Redis unreachable included). The holder
    renews it from a thread, and stops itself (SIGTERM) if it finds it taken by another."""
    beat_log = logging.getLogger("courier.beat")
    url = _redis_url(getattr(sender, "app", None) or app)
    key, token = keys.beat_lock(), ledger.new_token()
    said = False
    while True:
        try:
            r = redis_client(url)
            if ledger.take(r, key, token, BEAT_LOCK_TTL_S):
                break
            why = f"another beat holds {key} ({r.get(key)})"
        except Exception as exc:  # noqa: BLE001 - never schedule without the lock
            why = f"Redis is not reachable ({type(exc).__name__})"
        if not said:
            beat_log.warning("beat: %s: standing by", why)
            said = True
        time.sleep(BEAT_STANDBY_POLL_S)
    beat_log.warning("beat: holding %s: this beat schedules", key)

    def renew() -> None:
        while True:
            time.sleep(BEAT_LOCK_TTL_S / 3)
            try:
                kept = ledger.renew(r, key, token, BEAT_LOCK_TTL_S)
            except Exception:  # noqa: BLE001 - tried again; the lock outlives a short outage
                continue
            if not kept:
                beat_log.error("beat: lost %s to another beat: stopping, so that only one schedules", key)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=renew, name="courier-beat-lock", daemon=True).start()

    def release() -> None:
        with contextlib.suppress(Exception):  # it lapses by itself
            ledger.release(r, key, token)

    atexit.register(release)
