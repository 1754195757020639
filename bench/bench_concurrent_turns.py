"""Ten demo turns at once vs one at a time: turns per second.

    python -m bench.bench_concurrent_turns        (BENCH_QUICK=1: 1 round)

One private redis-server, one worker (workers.demo.start_worker: prefork,
10 processes, queues turns/sandbox/delivery), the bundled demo agent (draws
a PNG chart, writes a CSV, replies with both) delivering to the outbox; each
turn is done when its three deliveries (text, photo, document) are in its
chat's outbox. Measured in the same run, alternating rounds:
- one at a time: 10 turns, each enqueued when the previous one is done;
- concurrent: 10 turns enqueued together (each in its own workspace).
Each turn of a round goes to its own chat and counts only when its chat got
exactly text, photo and document.

Higher is better; target: concurrent turns/s >= 1.5 x one-at-a-time on 2
cores (the agent's work is CPU: the ceiling is the number of cores).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import quick, report, start_redis  # noqa: E402

TARGET_RATIO = 1.5
TURNS = 10


def main() -> int:
    rounds = 1 if quick() else 3
    # the data dir (agent sandboxes included) on the disk: /dev/shm is under /dev, never a sandbox root
    with tempfile.TemporaryDirectory(prefix="courier-bench-conc-") as tmp, \
            tempfile.TemporaryDirectory(prefix="courier-bench-conc-data-") as data:
        tmpd = Path(tmp)
        srv = start_redis(tmpd)
        env = {**os.environ, "COURIER_REDIS_URL": srv.url, "COURIER_DATA_DIR": str(Path(data) / "data"),
               "PYTHONPATH": str(ROOT)}
        os.environ.update({k: v for k, v in env.items() if k.startswith("COURIER_")})
        from workers.settings import reset_settings

        reset_settings()
        import workers.celery_app as celery_app
        from adapters.platforms.outbox import read_log
        from tasks.dispatch.chains import enqueue_turn
        from workers.demo import start_worker, stop_worker, wait_worker
        from workers.wiring import redis_client

        app = celery_app.app
        r = redis_client(srv.url)
        outbox = Path(data) / "data" / "outbox"
        name = f"bench-conc-{os.getpid()}@localhost"
        proc = start_worker(env, name, queues="turns,sandbox,delivery", concurrency=TURNS,
                            log_path=str(tmpd / "worker.log"))
        seq = 0
        jobs: dict[str, str] = {}

        def done(chat: str) -> bool:
            log = read_log(str(outbox), chat)
            return len(log) >= 3

        def wait_all(chats: list[str], timeout_s: float = 120) -> None:
            deadline = time.monotonic() + timeout_s
            left = list(chats)
            while left:
                left = [c for c in left if not done(c)]
                if left and time.monotonic() > deadline:
                    from tasks.ledger import receipts

                    info = [(c, receipts.get_job(r, jobs[c]), receipts.job_deliveries(r, jobs[c])) for c in left[:2]]
                    raise SystemExit(f"turns did not finish: {info}\n" + (tmpd / "worker.log").read_text()[-2000:])
                if left:
                    time.sleep(0.01)
            for c in chats:
                kinds = [x["kind"] for x in read_log(str(outbox), c)]
                if kinds != ["text", "photo", "document"]:
                    raise SystemExit(f"chat {c} got {kinds}")

        def new_chats() -> list[str]:
            nonlocal seq
            seq += 1
            return [f"r{seq}_{i}" for i in range(TURNS)]

        def one_at_a_time() -> float:
            chats = new_chats()
            t = time.perf_counter()
            for c in chats:
                jobs[c] = enqueue_turn(r, f"outbox:{c}", "make a chart of x^2", agent="demo")
                wait_all([c])
            return TURNS / (time.perf_counter() - t)

        def concurrent() -> float:
            chats = new_chats()
            t = time.perf_counter()
            for c in chats:
                jobs[c] = enqueue_turn(r, f"outbox:{c}", "make a chart of x^2", agent="demo")
            wait_all(chats)
            return TURNS / (time.perf_counter() - t)

        try:
            if not wait_worker(app, name, proc, timeout_s=60):
                print("worker did not start:\n" + (tmpd / "worker.log").read_text()[-2000:], file=sys.stderr)
                return 1
            concurrent()  # warm-up: every pool process builds its context once
            ones: list[float] = []
            conc: list[float] = []
            for _ in range(rounds):
                ones.append(one_at_a_time())
                conc.append(concurrent())
        finally:
            stop_worker(proc)
            srv.stop()

    a, b = statistics.median(conc), statistics.median(ones)
    report("concurrent_demo_turns", a, "turns/s", "one at a time", b, target=TARGET_RATIO,
           extra=f"{TURNS} demo turns per round, median of {rounds} alternating rounds, 1 worker x{TURNS} "
                 f"processes, {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
