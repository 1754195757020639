"""Prometheus exposition: the web process's `/metrics` and a worker's exporter.

What is counted is in tasks/metrics.py (deliveries, 429s, extractions,
webhooks, turns). Here:

- `registry()`: in multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set) a
  registry that reads every process's values from that directory (a
  prefork worker's children; uvicorn's workers), else the process's own.
- `LedgerCollector`: gauges read from Redis at scrape time, one pipeline:
  each Celery queue's depth, oldest message's age and consumers
  (`sandbox.<host>` queues included, tasks/queues.py), and the ledger's
  pending entries per stage (`tasks.ledger.pending`), and the sandboxes
  whose circuit breaker is open or half-open (`tasks.breaker.counts`). They
  describe the whole deployment, so the web process exports them; a worker's exporter
  does not (no duplicate series).
- `authorized(header, token)`: the operator's bearer token
  (`COURIER_METRICS_TOKEN`); when it is set, a scrape without it is a 401.
- `start_exporter(port, token)`: a worker's exporter (its main process, a
  thread; `COURIER_METRICS_PORT`).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def registry(redis_client=None):
    """The registry a scrape renders: the counters of this process (or of
    every process sharing PROMETHEUS_MULTIPROC_DIR), plus the Redis gauges
    when `redis_client` is given."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client import multiprocess as mp

    import tasks.metrics  # noqa: F401 - the series exist (at 0) before anything is counted

    if multiprocess():
        reg = CollectorRegistry()
        mp.MultiProcessCollector(reg)
    elif redis_client is None:
        return REGISTRY
    else:
        reg = CollectorRegistry()
        reg.register(_Forward(REGISTRY))
    if redis_client is not None:
        reg.register(LedgerCollector(redis_client))
    return reg


class _Forward:
    """The default registry's metrics inside another registry."""

    def __init__(self, source) -> None:
        self.source = source

    def collect(self):
        return self.source.collect()


class LedgerCollector:
    """Queue and ledger gauges, read from Redis when scraped."""

    def __init__(self, r) -> None:
        self.r = r

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        from tasks import breaker, ledger, queues

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
        depth = GaugeMetricFamily("courier_queue_depth", "Messages waiting in a Celery queue", labels=["queue"])
        age = GaugeMetricFamily("courier_queue_oldest_age_seconds",
                                "Age of the oldest message waiting in a queue (0 when empty)", labels=["queue"])
        cons = GaugeMetricFamily("courier_queue_consumers", "Workers consuming a queue (heartbeat in the last 30 s)",
                                 labels=["queue"])
        for row in rows:
            depth.add_metric([row["queue"]], row["depth"])
            age.add_metric([row["queue"]], row["oldest_age_s"] or 0.0)
            cons.add_metric([row["queue"]], row["consumers"])
        yield depth
        yield age
        yield cons
        led = GaugeMetricFamily("courier_ledger_pending", "Ledger entries waiting or running, per stage",
                                labels=["stage"])
        for stage, n in pending.items():
            led.add_metric([stage], n)
        yield led
        brk = GaugeMetricFamily("courier_sandbox_breakers", "Sandboxes whose circuit breaker is open (their files "
                                "wait, untried) or half-open (one file probes them)", labels=["state"])
        for st, n in breakers.items():
            brk.add_metric([st], n)
        yield brk


def authorized(header: str | None, token) -> bool:
    """No token configured: open (bind to loopback then). Else `Authorization: Bearer <token>`."""
    if token is None:
        return True
    want = token.get_secret_value() if hasattr(token, "get_secret_value") else str(token)
    got = (header or "")
    if got[:7].lower() != "bearer ":
        return False
    return hmac.compare_digest(got[7:].strip().encode(), want.encode())


def render(reg) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(reg)


def start_exporter(port: int, token=None, host: str = "0.0.0.0"):
    """Serve this process's registry (every pool process in multiprocess
    mode) on `host:port` from a daemon thread; returns the server."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

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

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # scrapes are not worth a log line
            pass

    httpd = make_server(host, port, app, server_class=Server, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, name="courier-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics%s", host, httpd.server_port,
             " (multiprocess)" if multiprocess() else "")
    return httpd


def mark_dead(pid: int) -> None:
    """A pool process ended (multiprocess mode): its live gauges go."""
    if multiprocess():
        try:
            from prometheus_client import multiprocess as mp

            mp.mark_process_dead(pid)
        except Exception as exc:  # noqa: BLE001
            log.debug("metrics: %r", exc)
