"""Webhook throughput: signed updates accepted and enqueued per second at 16
concurrent connections, against a bare Starlette endpoint answering 200.

    python -m bench.bench_webhooks          (BENCH_QUICK=1: 200 per round)

One private redis-server; two uvicorn processes on loopback, started the
same way (`--log-level info`, access log on):
- courier: `courier web` with every platform's secret. Each request is a
  signed update (Telegram, Slack, Discord, WhatsApp in turn, each unique):
  secret or signature checked, the body parsed, the de-dup key set, the job
  recorded and its `agent_turn` published to the `turns` queue. A round
  counts from its first request until every answer is in AND every turn is
  in the `turns` list in Redis (no worker consumes it; it is emptied between
  rounds);
- bare: `bench/bare_web.py`, the same four paths answering 200 at once
  without reading the body, with the same requests.
The client is the same for both (16 threads, one keep-alive http.client
connection each, tests/fixtures/webstack.py `fire`). Rounds alternate, the
best of each side counts. Higher is better; target: ratio >= 0.5.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import WebPair, quick, report  # noqa: E402

TARGET_RATIO = 0.5
CONCURRENCY = 16


def main() -> None:
    from tests.fixtures.services import wait_until
    from tests.fixtures.webstack import PLATFORMS, fire, signed_update

    n = 200 if quick() else 2000
    rounds = 2 if quick() else 3
    with WebPair("bench-webhooks-") as pair:
        r, base, key = pair.srv.client(), pair.base, pair.key
        best = {"courier": 0.0, "bare": 0.0}
        for rnd in range(rounds):
            for side in ("bare", "courier"):
                tag = f"{side}{rnd}{os.urandom(2).hex()}"
                reqs = []
                for i in range(n):
                    path, body, headers, _seen, _text = signed_update(PLATFORMS[i % 4], i, tag, key)
                    reqs.append(("POST", path, body, headers))
                r.delete("turns")
                t0 = time.perf_counter()
                res = fire(base[side], reqs, concurrency=CONCURRENCY, timeout_s=30)
                if side == "courier":
                    wait_until(lambda: r.llen("turns") >= n, timeout_s=30, interval_s=0.005, what="every turn queued")
                took = time.perf_counter() - t0
                bad = [st for st, _ in res if st != 200]
                if bad:
                    raise SystemExit(f"{side}: {len(bad)} of {n} answers were not 200 (e.g. {bad[0]})")
                if side == "courier" and r.llen("turns") != n:
                    raise SystemExit(f"{r.llen('turns')} turns queued for {n} updates")
                best[side] = max(best[side], n / took)
        report("webhooks accepted and enqueued at 16 concurrent", best["courier"], "req/s",
               "bare starlette 200", best["bare"], target=TARGET_RATIO,
               extra=f"{n} signed updates per round, 4 platforms, best of {rounds}")


if __name__ == "__main__":
    main()
