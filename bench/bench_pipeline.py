"""Deliveries per second through extract_file -> deliver (1 KB files, local
sandbox -> volume storage -> outbox) with one worker, against a bare Celery
two-task no-op chain on the same broker, same worker, same run.
Then peak worker RSS while one 1 GiB file goes through the pipeline.

    python -m bench.bench_pipeline            (BENCH_QUICK=1 for a smoke run)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import data_dir, proc_status_mb, quick, random_files, report_limit  # noqa: E402
from bench._common import report_rounds, send_each  # noqa: E402


def _children(pid: int) -> list[int]:
    from tests.fixtures.faults import children_of

    return children_of(pid)


def main() -> int:
    from tests.fixtures.redis_server import RedisServer

    n = 100 if quick() else 300
    rounds = 2 if quick() else 5
    big = (64 if quick() else 1024) * 1024 * 1024
    data_tmp, data_where = data_dir("courier-bench-data-", 2 * big + 64 * 1024 * 1024)
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as tmp, data_tmp as data:
        tmpd = Path(tmp)
        redis_dir = tmpd / "redis"
        redis_dir.mkdir()
        srv = RedisServer(redis_dir).start()
        sandbox = tmpd / "sandbox"
        sandbox.mkdir()
        env = {**os.environ, "COURIER_REDIS_URL": srv.url, "COURIER_DATA_DIR": data,
               "COURIER_LOCAL_ROOTS": f'["{sandbox}"]', "COURIER_MAX_FILE_BYTES": str(2 * 1024**3),
               "PYTHONPATH": str(ROOT)}
        os.environ.update({k: v for k, v in env.items() if k.startswith("COURIER_")})
        from workers.settings import reset_settings

        reset_settings()
        import workers.celery_app as celery_app
        import tasks.celery_tasks  # noqa: F401
        from bench import noop_tasks
        from tasks.dispatch import chains
        from tasks.ledger import receipts
        from workers.demo import start_worker, stop_worker, wait_worker
        from workers.wiring import redis_client

        r = redis_client(srv.url)
        name = "bench@localhost"
        cmd_env = dict(env)
        proc = start_worker(cmd_env, name, concurrency=2, log_path=str(tmpd / "worker.log"))
        # the bare tasks live in the same worker
        stop_worker(proc)
        import subprocess

        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q",
             "turns,sandbox,delivery,janitor", "-I", "bench.noop_tasks", "--pool=prefork", "--concurrency=2",
             "-n", name, "--loglevel=WARNING", "--without-mingle", "--without-gossip"],
            env=cmd_env, cwd=str(ROOT), stdout=open(tmpd / "worker.log", "ab"), stderr=subprocess.STDOUT)
        try:
            if not wait_worker(celery_app.app, name, proc):
                print("worker did not start", file=sys.stderr)
                return 1
            from celery import chain

            from adapters.sandboxes.base import SandboxRef

            ref = SandboxRef("local")
            counter = iter(range(10**9))

            def baseline(count: int) -> float:
                key = f"bench:noop:done:{next(counter)}"
                t0 = time.perf_counter()
                for i in range(count):
                    chain(noop_tasks.noop_first.si(i).set(queue="sandbox"),
                          noop_tasks.noop_last.s(key, srv.url).set(queue="delivery")).apply_async()
                while int(r.get(key) or 0) < count:
                    time.sleep(0.005)
                return count / (time.perf_counter() - t0)

            def courier(count: int) -> float:
                files = random_files(sandbox, (f"f{next(counter)}.bin" for _ in range(count)))
                os.sync()
                # poll as the baseline does: one read per poll, the oldest receipt not yet delivered
                # (the work is mostly FIFO), so neither side's waiting loads the machine more
                return send_each(r, ref, files, window=1)

            baseline(30), courier(30)  # warm both paths up (imports, connections, first files)
            base_rates, rates = [], []
            for _ in range(rounds):
                os.sync()  # each round starts with no writeback of the last one pending
                base_rates.append(baseline(n))
                os.sync()
                rates.append(courier(n))
            report_rounds("pipeline_1kb_deliveries", rates, base_rates, "bare 2-task chain", target=0.85, n=n,
                          setup=f"1 worker x2 processes, outbox; storage and outbox on {data_where}, "
                          f"sandbox files on {tempfile.gettempdir()}")

            # -- peak RSS with one big file
            idle = max([proc_status_mb(c, "VmRSS") for c in _children(proc.pid)] + [0.0])
            bigf = sandbox / "big.bin"
            with open(bigf, "wb") as f:
                chunk = os.urandom(1 << 20)
                for _ in range(big >> 20):
                    f.write(chunk)
            job = chains.new_job_id("big")
            receipts.create_job(r, job, kind="send", target="outbox:big")
            chains.enqueue(r, chains.Plan(job_id=job, target="outbox:big",
                                          files=[chains.SandboxFile(ref=ref, path=str(bigf))],
                                          max_bytes=2 * 1024**3))
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                st = r.hget(f"courier:delivery:{chains.delivery_id(job, 0)}", "state")
                if st in ("delivered", "failed"):
                    break
                time.sleep(0.05)
            if st != "delivered":
                print(f"big delivery ended {st!r}", file=sys.stderr)
                return 1
            peak = max([proc_status_mb(c, "VmHWM") for c in _children(proc.pid)] + [proc_status_mb(proc.pid, "VmHWM")])
            report_limit(f"pipeline_peak_worker_rss_{big >> 20}MiB_file", peak, "MB", limit=150,
                         baseline_name="idle worker process", baseline=idle)
        finally:
            stop_worker(proc)
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
