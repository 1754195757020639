"""courier's Prometheus series, counted where things happen (plain code, no Celery).

The metric objects live here; each `record_*` function is a single call at
the place it counts (a receipt becoming final, a platform's 429, an
extraction, a webhook, a turn). They cost a few microseconds and never
raise: metrics must not fail a delivery.

Processes: Celery's prefork pool runs tasks in child processes, so a worker
counts across processes through prometheus_client's multiprocess mode: set
`PROMETHEUS_MULTIPROC_DIR` (an empty directory private to the host or
container) before the process starts, and every process writes its values
there; the worker's exporter and the web process's `/metrics` read them all
(workers/metrics.py). Without it each process counts for itself (fine for
the web process alone, a single-process worker, tests).

Labels are bounded: platform (the five platforms), kind (a delivered
message's kind: text, photo, video, voice, audio, animation, document; a
failed one's item type: text or file), state (delivered, failed), sandbox
kind, agent name (the configured agents), webhook outcome.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from tasks.states import DeliveryState

log = logging.getLogger(__name__)

#: the failures recorded while a task runs (`failures_noted`), for the task to report
_noted: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("courier_failures_noted",
                                                                                    default=None)

try:
    from prometheus_client import Counter, Histogram
except ImportError:  # pragma: no cover - prometheus_client is a dependency; a stripped install still runs
    Counter = Histogram = None  # type: ignore[assignment,misc]  # a stripped install: no metrics

_ON = Counter is not None

#: extraction and turn durations (seconds)
EXTRACT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
TURN_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)

if _ON:
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
    """Collect (delivery id, reason) of every delivery recorded failed while
    the block runs (in this thread): a task reports them as its outcome."""
    noted: list[tuple[str, str]] = []
    token = _noted.set(noted)
    try:
        yield noted
    finally:
        _noted.reset(token)


def record_delivery(did: str, target: str, state: str, kind: str, reason: str | None = None) -> None:
    """Delivery `did`'s receipt was recorded final: `delivered` or `failed`; `kind`: what it was
    sent as (a failure's: what it was to go as, else its spec's type, `text` or `file`)."""
    noted = _noted.get()
    if noted is not None and state == DeliveryState.FAILED:
        noted.append((did, reason or ""))
    if not _ON:
        return
    try:
        DELIVERIES.labels(_platform(target), kind, state).inc()
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        log.debug("metrics: %r", exc)


def record_rate_limited(target: str) -> None:
    """A platform answered 429 (courier's own pacing is not counted)."""
    if _ON:
        try:
            RATE_LIMITED.labels(_platform(target)).inc()
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)


def record_extraction(sandbox: str, seconds: float, size_bytes: int | None, outcome: str) -> None:
    """One extraction ended: `ok` (with its size), `failed` (permanent) or `error` (transient)."""
    if not _ON:
        return
    try:
        EXTRACTIONS.labels(sandbox or "unknown", outcome).observe(max(0.0, seconds))
        if size_bytes:
            EXTRACTED_BYTES.labels(sandbox or "unknown").inc(size_bytes)
    except Exception as exc:  # noqa: BLE001
        log.debug("metrics: %r", exc)


def record_breaker(sandbox: str, event: str) -> None:
    """A sandbox's breaker `opened`, or `postponed` an extraction (tasks/turn/breaker.py)."""
    if _ON:
        try:
            BREAKER_EVENTS.labels(sandbox or "unknown", event).inc()
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)


def record_worker_restart(worker: str, code: int) -> None:
    """`courier worker` restarts its Celery worker process `worker` (`delivery-2`), which exited with `code`."""
    if _ON:
        try:
            WORKER_RESTARTS.labels(worker, str(code)).inc()
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)


def record_webhook(platform: str, status: int) -> None:
    if not _ON:
        return
    outcome = "unavailable" if status >= 500 else "rejected" if status >= 400 else "ok"
    try:
        WEBHOOK_REQUESTS.labels(platform, outcome).inc()
    except Exception as exc:  # noqa: BLE001
        log.debug("metrics: %r", exc)


def record_webhook_turn(platform: str, duplicate: bool) -> None:
    if _ON:
        try:
            WEBHOOK_TURNS.labels(platform, "duplicate" if duplicate else "enqueued").inc()
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)


def record_turn(agent: str, state: str, seconds: float) -> None:
    if _ON:
        try:
            TURNS.labels(agent or "unknown", state or "unknown").observe(max(0.0, seconds))
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)


def record_forged(what: str) -> None:
    """A spec (`delivery`, `turn`) or a task `message` was refused: it did not verify."""
    if _ON:
        try:
            FORGED.labels(what or "unknown").inc()
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)
