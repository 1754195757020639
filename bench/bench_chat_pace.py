"""One chat's pace: messages a second to one Telegram chat vs its limit of 1 a second.

    python bench/bench_chat_pace.py        # BENCH_PACE_N=60 (or BENCH_QUICK=1): fewer messages

A Telegram Bot API server (the test fake, in a thread of this process)
answers each call after BENCH_PACE_LATENCY_MS (default 250 ms, as the real
API does from afar) and records when each request arrived. BENCH_PACE_N
(default 300) text messages, each its own job, are enqueued at once to one
chat and sent by one delivery worker as `courier worker -Q delivery` starts
it, against a private redis-server.

The figure is the chat's rate at the server: (N - 1) / (last arrival - first
arrival), against Telegram's per-chat limit of 1 message a second (the ratio:
how much of the allowed pace a user gets). The bracket gives the smallest
gap between two arrivals (the limit: no two closer than 0.9 s) and the
server's 429s (none expected: the server refuses nothing, courier's pacing
must not need it). Target (issue 23): >= 0.95 of 1 msg/s, 0 gaps under
0.9 s, 0 429s.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import quick, start_redis, wait_final  # noqa: E402

TOKEN = "424242:bench-token"
CHAT = "880001"
LIMIT_PER_S = 1.0
TARGET = 0.95
MIN_GAP_S = 0.9


def main() -> None:
    n = int(os.environ.get("BENCH_PACE_N") or (60 if quick() else 300))
    latency_ms = float(os.environ.get("BENCH_PACE_LATENCY_MS", "250"))
    from tests.fixtures.fake_telegram import FakeTelegram

    with tempfile.TemporaryDirectory(prefix="bench-pace-") as tmp_s:
        tmp = Path(tmp_s)
        redis_srv = start_redis(tmp)
        fake = FakeTelegram(TOKEN, latency_s=latency_ms / 1000).start()
        worker = None
        try:
            env = {**os.environ, "COURIER_REDIS_URL": redis_srv.url, "COURIER_DATA_DIR": str(tmp / "data"),
                   "TELEGRAM_BOT_TOKEN": TOKEN, "COURIER_TELEGRAM_BASE_URL": fake.url, "PYTHONPATH": str(ROOT)}
            os.environ.update({k: v for k, v in env.items() if k.startswith(("COURIER_", "TELEGRAM_"))})
            import workers.celery_app  # noqa: F401 - binds the tasks to the bench Redis
            import tasks.celery_tasks  # noqa: F401
            from workers.demo import stop_worker, wait_worker
            from workers.settings import reset_settings

            reset_settings()
            from tasks.dispatch import chains
            from tasks.ledger import receipts
            from workers.wiring import redis_client

            name = f"bench-pace-{os.getpid()}@localhost"
            cmd = [sys.executable, "-m", "workers.worker", "-Q", "delivery", "-n", name, "--loglevel=WARNING",
                   "--without-mingle", "--without-gossip"]
            with open(tmp / "worker.log", "ab") as log:
                worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
            if not wait_worker(workers.celery_app.app, name, worker):
                raise SystemExit("the worker did not start:\n" + (tmp / "worker.log").read_text()[-2000:])
            r = redis_client(redis_srv.url)
            ids: list[str] = []
            for i in range(n):
                job_id = chains.new_job_id("pace")
                receipts.create_job(r, job_id, kind="send", target=f"telegram:{CHAT}")
                ids += chains.enqueue(r, chains.Plan(job_id=job_id, target=f"telegram:{CHAT}", text=f"m {i}"))
            failed, left = wait_final(r, ids, poll_s=0.25, timeout_s=n * 3.0 + 60)
            if failed or left:
                raise SystemExit(f"{failed} deliveries failed, {left} not final: see {tmp}/worker.log")
            calls = sorted(fake.calls_for("sendMessage", chat=CHAT), key=lambda c: c.t)
            ok = [c for c in calls if c.ok]
            refused = sum(1 for c in calls if c.status == 429)
            gaps = [b.t - a.t for a, b in zip(calls, calls[1:])]
            rate = (len(ok) - 1) / (ok[-1].t - ok[0].t)
            close = sum(1 for g in gaps if g < MIN_GAP_S)
            ratio = rate / LIMIT_PER_S
            good = ratio >= TARGET and close == 0 and refused == 0 and len(ok) == n
            if os.environ.get("BENCH_DEBUG"):
                print("gaps: " + " ".join(f"{g:.3f}" for g in gaps), file=sys.stderr)
            print(f"BENCH chat pace: {rate:.4g} msg/s vs Telegram's per-chat limit {LIMIT_PER_S:g} msg/s "
                  f"ratio {ratio:.3g} (target >= {TARGET:g}) {'PASS' if good else 'MISS'} "
                  f"[min gap {min(gaps):.3f} s, median {statistics.median(gaps):.3f} s, {close} gaps < "
                  f"{MIN_GAP_S:g} s, {refused} 429s, {len(ok)}/{n} messages, server answers after "
                  f"{latency_ms:g} ms, 1 worker]", flush=True)
        finally:
            if worker is not None:
                stop_worker(worker)
            fake.stop()
            redis_srv.stop()


if __name__ == "__main__":
    main()
