"""Webhook accept -> enqueued latency at a steady 200 req/s (16 connections),
against a bare Starlette endpoint answering 200 at the same rate.

    python -m bench.bench_webhook_latency     (BENCH_QUICK=1: 5 s instead of 20 s)

One private redis-server; two uvicorn processes on loopback (as in
bench/bench_webhooks.py): `courier web` with every platform's secret, and
`bench/bare_web.py`. Each request is a signed update (Telegram, Slack,
Discord, WhatsApp in turn, each unique), sent at its scheduled time
(`t0 + i / RATE`; a request that cannot go out on time is late and its
lateness counts). A courier answer 200 means the turn's job is recorded and
its `agent_turn` was handed to Celery; the figure is the p99 of (answer -
scheduled time), and the run checks that every turn is in the `turns` list
afterwards. Target: p99 <= 50 ms, 0 errors (a user-facing limit, not a ratio:
the bare endpoint's p99 is printed for context).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import WebPair, quick  # noqa: E402

RATE = 200.0
CONCURRENCY = 16
LIMIT_MS = 50.0


def paced(base_url: str, requests: list[tuple[str, bytes, dict]]) -> tuple[list[float], list[int]]:
    """Send each request at t0 + i / RATE over CONCURRENCY keep-alive connections:
    (latency in seconds from its scheduled time to its answer, status) per request."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(base_url)
    lat = [0.0] * len(requests)
    status = [0] * len(requests)
    it = iter(range(len(requests)))
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.2

    def run() -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            while True:
                with lock:
                    k = next(it, None)
                if k is None:
                    return
                at = t0 + k / RATE
                wait = at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)  # pacing the client, not waiting for a condition
                path, body, headers = requests[k]
                try:
                    conn.request("POST", path, body=body, headers=headers)
                    resp = conn.getresponse()
                    resp.read()
                    status[k] = resp.status
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
                lat[k] = time.perf_counter() - at
        finally:
            conn.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, status


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def main() -> None:
    from tests.fixtures.services import wait_until
    from tests.fixtures.webstack import PLATFORMS, signed_update

    seconds = 5 if quick() else 20
    n = int(RATE * seconds)
    with WebPair("bench-webhook-latency-") as pair:
        r, base, key = pair.srv.client(), pair.base, pair.key
        out = {}
        for side in ("bare", "courier", "bare", "courier"):
            warm = side not in out  # the first round of each side warms it up (imports, connections)
            tag = f"{side}{os.urandom(3).hex()}"
            count = 200 if warm else n
            reqs = []
            for i in range(count):
                path, body, headers, _seen, _text = signed_update(PLATFORMS[i % 4], i, tag, key)
                reqs.append((path, body, headers))
            r.delete("turns")
            lat, status = paced(base[side], reqs)
            errors = sum(1 for s in status if s != 200)
            if side == "courier":
                wait_until(lambda count=count: r.llen("turns") >= count, timeout_s=30, interval_s=0.01,
                           what="every turn queued")
                queued = r.llen("turns")
                if queued != count:
                    errors += abs(queued - count)
            out[side] = (p99(lat) * 1000, errors, sorted(lat)[len(lat) // 2] * 1000)
        ours, errors, median = out["courier"]
        bare, bare_errors, _ = out["bare"]
        ok = ours <= LIMIT_MS and errors == 0 and bare_errors == 0
        print(f"BENCH webhook_accept_to_enqueued_p99_at_{RATE:g}rps: {ours:.4g} ms vs bare starlette 200 "
              f"{bare:.4g} ms ratio {ours / bare:.3g} (limit <= {LIMIT_MS:g} ms, 0 errors) "
              f"{'PASS' if ok else 'MISS'} [{n} signed updates in {seconds} s, {CONCURRENCY} connections, "
              f"median {median:.3g} ms, {errors} errors]", flush=True)


if __name__ == "__main__":
    main()
