"""Prometheus exposition: the web process's `/metrics` and a worker's exporter (what is counted is in
tasks/metrics.py). In multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`) a scrape reads every process's values
from that directory. The Redis gauges (`LedgerCollector`) describe the whole deployment, so only the web
process exports them (no duplicate series).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def registry(redis_client=None, workers_dir: Path | None = None):
    """The registry a scrape renders: this process's counters (or every process's sharing
    PROMETHEUS_MULTIPROC_DIR), plus the Redis gauges when `redis_client` is given, plus, outside
    multiprocess mode, the counts of the worker processes that write to `workers_dir`."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client import multiprocess as mp

    import tasks.metrics  # noqa: F401 - the series exist (at 0) before anything is counted

    if not multiprocess() and redis_client is None and workers_dir is None:
        return REGISTRY
    reg = CollectorRegistry()
    if multiprocess():
        mp.MultiProcessCollector(reg)
    else:
        reg.register(_WithWorkers(REGISTRY, workers_dir))
    if redis_client is not None:
        reg.register(LedgerCollector(redis_client))
    return reg


class _WithWorkers:
    """The default registry's metrics, with the counts in a multiprocess directory (if any) added:
    samples of the same name and labels are summed (a `_created` time is left out where the
    directory counts too)."""

    def __init__(self, source, path: Path | None) -> None:
        self.source, self.path = source, path

    def collect(self) -> Iterator[Any]:
        from prometheus_client.multiprocess import MultiProcessCollector

        try:
            files = sorted(str(p) for p in self.path.glob("*.db")) if self.path else []
            theirs = {m.name: m for m in MultiProcessCollector.merge(files, accumulate=True)} if files else {}
        except Exception as exc:  # noqa: BLE001 - a scrape never fails: this process's own counts still show
            log.warning("metrics: the workers' counts in %s are not readable: %r", self.path, exc)
            theirs = {}
        for family in self.source.collect():
            other = theirs.pop(family.name, None)
            if other is None:
                yield family
                continue
            totals: dict[tuple, Any] = {}
            for sample in (*other.samples, *family.samples):
                if not sample.name.endswith("_created"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    got = totals.get(key)
                    totals[key] = sample._replace(value=sample.value + got.value) if got else sample
            family.samples = list(totals.values())
            yield family
        yield from theirs.values()


class LedgerCollector:
    """Queue and ledger gauges, read from Redis when scraped."""

    def __init__(self, r) -> None:
        self.r = r

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from tasks.ledger import ledger
        from tasks.ops import queues
        from tasks.turn import breaker

        up = GaugeMetricFamily("courier_redis_up", "1 when the scrape could read Redis")
        try:
            rows = queues.stats(self.r)
            pending = ledger.pending(self.r)
            breakers = breaker.counts(self.r)
        except Exception as exc:  # noqa: BLE001 - a scrape never fails: it says Redis is down
            log.warning("metrics: Redis not readable: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for name, doc, label, values in (
            ("courier_queue_depth", "Messages waiting in a Celery queue", "queue",
             [(r["queue"], r["depth"]) for r in rows]),
            ("courier_queue_oldest_age_seconds", "Age of the oldest message waiting in a queue (0 when empty)",
             "queue", [(r["queue"], r["oldest_age_s"] or 0.0) for r in rows]),
            ("courier_queue_consumers", "Workers consuming a queue (heartbeat in the last 30 s)", "queue",
             [(r["queue"], r["consumers"]) for r in rows]),
            ("courier_ledger_pending", "Ledger entries waiting or running, per stage", "stage", pending.items()),
            ("courier_sandbox_breakers", "Sandboxes whose circuit breaker is open (their files wait, untried) or "
             "half-open (one file probes them)", "state", breakers.items()),
        ):
            family = GaugeMetricFamily(name, doc, labels=[label])
            for key, value in values:
                family.add_metric([key], value)
            yield family


def authorized(header: str | None, token) -> bool:
    """No token configured: open (bind to loopback then). Else `Authorization: Bearer <token>`."""
    if token is None:
        return True
    want = token.get_secret_value() if hasattr(token, "get_secret_value") else str(token)
    got = header or ""
    return got[:7].lower() == "bearer " and hmac.compare_digest(got[7:].strip().encode(), want.encode())


def render(reg) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(reg)


def start_exporter(port: int, token=None, host: str = "0.0.0.0"):
    """Serve this process's registry (every pool process in multiprocess
    mode) on `host:port` from a daemon thread; returns the server."""
    from prometheus_client.exposition import ThreadingWSGIServer  # daemon threads, one per request

    reg = registry()

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        if not authorized(environ.get("HTTP_AUTHORIZATION"), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"metrics need the operator token: Authorization: Bearer\n"]
        body = render(reg)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))])
        return [body]

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # scrapes are not worth a log line
            pass

    httpd = make_server(host, port, app, server_class=ThreadingWSGIServer, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, name="courier-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics%s", host, httpd.server_port,
             " (multiprocess)" if multiprocess() else "")
    return httpd


def default_multiproc_dir(settings) -> Path:
    """Where `courier worker`'s processes count together by default: one directory per host
    (a data dir shared between hosts must not mix process ids)."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "localhost"
    return Path(settings.data_dir) / "metrics" / host


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def prepare_multiproc_dir(settings) -> tuple[Path, str | None]:
    """(the multiprocess directory for `courier worker`'s processes, a warning to print or None):
    PROMETHEUS_MULTIPROC_DIR (created if missing), else `default_multiproc_dir`, where the files of
    processes no longer running are removed first (another `courier worker` of this host keeps its)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    if given:
        path = Path(given)
        warning = None
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            warning = f"PROMETHEUS_MULTIPROC_DIR {path} did not exist: created (it must be empty at start)"
        if not os.access(path, os.W_OK | os.X_OK):
            warning = (f"WARNING: PROMETHEUS_MULTIPROC_DIR {path} is not writable: the worker's processes cannot "
                       f"count; unset it (courier then uses a private directory) or fix its permissions")
        return path, warning
    path = default_multiproc_dir(settings)
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.db"):
        pid = f.stem.rsplit("_", 1)[-1]  # counter_<pid>.db, gauge_livesum_<pid>.db
        if not pid.isdigit() or not _running(int(pid)):
            f.unlink(missing_ok=True)
    return path, None


def mark_dead(pid: int) -> None:
    """A pool process ended (multiprocess mode): its live gauges go."""
    if multiprocess():
        try:
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(pid)
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)
