"""courier's Prometheus series: each `record_*` is one call where a thing happens, and never
raises (metrics must not fail a delivery). A prefork worker counts across its processes through
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, read by workers/metrics.py).
Labels are bounded: platform, message kind, state, sandbox kind, agent name, outcome.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Histogram

from tasks.states import DeliveryState

log = logging.getLogger(__name__)

#: the failures recorded while a task runs (`failures_noted`), for the task to report
_noted: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("courier_failures_noted",
                                                                                    default=None)

#: False: nothing is counted (bench/no_metrics.py, a baseline)
_ON = True

#: extraction and turn durations (seconds)
EXTRACT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
TURN_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)

DELIVERIES = Counter("courier_deliveries", "Deliveries whose receipt became final, by platform, kind and state",
                     ["platform", "kind", "state"])
RATE_LIMITED = Counter("courier_rate_limited", "429s (retry-after) answered by a platform", ["platform"])
EXTRACTED_BYTES = Counter("courier_extracted_bytes", "Bytes extracted from sandboxes into storage", ["sandbox"])
EXTRACTIONS = Histogram("courier_extract_seconds", "Time of one extraction, by sandbox kind and outcome",
                        ["sandbox", "outcome"], buckets=EXTRACT_BUCKETS)
WEBHOOK_REQUESTS = Counter("courier_webhook_requests", "Webhook requests by platform and outcome "
                           "(ok: 2xx, rejected: 4xx, unavailable: 5xx)", ["platform", "outcome"])
WEBHOOK_TURNS = Counter("courier_webhook_turns", "Webhook updates that were enqueued as a turn or dropped as "
                        "a platform's retry", ["platform", "result"])
FORGED = Counter("courier_forged", "Specs and task messages refused: unsigned, tampered, bound to another id "
                 "or too old (tasks/ledger/signing.py)", ["what"])
BREAKER_EVENTS = Counter("courier_sandbox_breaker_events", "Sandbox circuit breakers by sandbox kind: `opened` "
                         "(an I/O timeout, or a probe that timed out again) and `postponed` (an extraction it "
                         "held back untried: no attempt, no read deadline spent)", ["sandbox", "event"])
TURNS = Histogram("courier_turn_seconds", "Time of one agent turn run, by agent and end state",
                  ["agent", "state"], buckets=TURN_BUCKETS)
WORKER_RESTARTS = Counter("courier_worker_restarts", "Celery workers started again by `courier worker` after "
                          "they exited, by process name and exit code (workers/worker.py)", ["worker", "code"])


def _platform(target: str | None) -> str:
    return (target or "").split(":", 1)[0] or "unknown"


@contextmanager
def failures_noted() -> Iterator[list[tuple[str, str]]]:
    """Collect (delivery id, reason) of every delivery recorded failed while the block runs (this thread)."""
    noted: list[tuple[str, str]] = []
    token = _noted.set(noted)
    try:
        yield noted
    finally:
        _noted.reset(token)


def _safely(update: Callable[[], object]) -> None:
    """Apply one metric update: a few microseconds, never raises (metrics never fail a delivery)."""
    if not _ON:
        return
    try:
        update()
    except Exception as exc:  # noqa: BLE001
        log.debug("metrics: %r", exc)


def record_delivery(did: str, target: str, state: str, kind: str, reason: str | None = None) -> None:
    """Delivery `did`'s receipt was recorded final: `delivered` or `failed`; `kind`: what it was
    sent as (a failure's: what it was to go as, else its spec's type, `text` or `file`)."""
    noted = _noted.get()
    if noted is not None and state == DeliveryState.FAILED:
        noted.append((did, reason or ""))
    _safely(lambda: DELIVERIES.labels(_platform(target), kind, state).inc())


def record_rate_limited(target: str) -> None:
    """A platform answered 429 (courier's own pacing is not counted)."""
    _safely(lambda: RATE_LIMITED.labels(_platform(target)).inc())


def record_extraction(sandbox: str, seconds: float, size_bytes: int | None, outcome: str) -> None:
    """One extraction ended: `ok` (with its size), `failed` (permanent) or `error` (transient)."""

    def update() -> None:
        EXTRACTIONS.labels(sandbox or "unknown", outcome).observe(max(0.0, seconds))
        if size_bytes:
            EXTRACTED_BYTES.labels(sandbox or "unknown").inc(size_bytes)

    _safely(update)


def record_breaker(sandbox: str, event: str) -> None:
    """A sandbox's breaker `opened`, or `postponed` an extraction (tasks/turn/breaker.py)."""
    _safely(lambda: BREAKER_EVENTS.labels(sandbox or "unknown", event).inc())


def record_worker_restart(worker: str, code: int) -> None:
    """`courier worker` restarts its Celery worker process `worker` (`delivery-2`), which exited with `code`."""
    _safely(lambda: WORKER_RESTARTS.labels(worker, str(code)).inc())


def record_webhook(platform: str, status: int) -> None:
    outcome = "unavailable" if status >= 500 else "rejected" if status >= 400 else "ok"
    _safely(lambda: WEBHOOK_REQUESTS.labels(platform, outcome).inc())


def record_webhook_turn(platform: str, duplicate: bool) -> None:
    _safely(lambda: WEBHOOK_TURNS.labels(platform, "duplicate" if duplicate else "enqueued").inc())


def record_turn(agent: str, state: str, seconds: float) -> None:
    _safely(lambda: TURNS.labels(agent or "unknown", state or "unknown").observe(max(0.0, seconds)))


def record_forged(what: str) -> None:
    """A spec (`delivery`, `turn`) or a task `message` was refused: it did not verify."""
    _safely(lambda: FORGED.labels(what or "unknown").inc())
