"""What metrics cost: deliveries per second through extract_file -> deliver
(1 KB files, local sandbox -> volume storage -> outbox), one worker with
metrics on (PROMETHEUS_MULTIPROC_DIR, its exporter scraped every second,
the web process's Redis gauges rendered every second, every message stamped
and its queue registered) against the same worker with metrics off
(`-I bench.no_metrics`), same run, alternating rounds, each worker on its
own redis-server. Target: ratio >= 0.95 (metrics cost at most 5%).

    python -m bench.bench_metrics            (BENCH_QUICK=1 for a smoke run)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import data_dir, quick, report  # noqa: E402


def main() -> int:
    import httpx

    from tests.fixtures.redis_server import RedisServer
    from tests.fixtures.services import free_port

    n = 100 if quick() else 300
    rounds = 2 if quick() else 7
    data_tmp, data_where = data_dir("courier-bench-metrics-", 256 * 1024 * 1024)
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as tmp, data_tmp as data:
        tmpd = Path(tmp)
        sandbox = tmpd / "sandbox"
        sandbox.mkdir()
        setups = {}
        procs = []
        try:
            for label in ("off", "on"):
                rdir = tmpd / f"redis-{label}"
                rdir.mkdir()
                srv = RedisServer(rdir).start()
                env = {**os.environ, "COURIER_REDIS_URL": srv.url, "COURIER_DATA_DIR": f"{data}/{label}",
                       "COURIER_LOCAL_ROOTS": f'["{sandbox}"]', "PYTHONPATH": str(ROOT)}
                extra = ["-I", "bench.no_metrics"] if label == "off" else []
                port = None
                if label == "on":
                    mp = tmpd / "prom"
                    mp.mkdir()
                    port = free_port()
                    env.update(PROMETHEUS_MULTIPROC_DIR=str(mp), COURIER_METRICS_PORT=str(port))
                name = f"bench-{label}@localhost"
                proc = subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q",
                     "turns,sandbox,delivery,janitor", *extra, "--pool=prefork", "--concurrency=2", "-n", name,
                     "--loglevel=WARNING", "--without-mingle", "--without-gossip"],
                    env=env, cwd=str(ROOT), stdout=open(tmpd / f"worker-{label}.log", "ab"),  # noqa: SIM115
                    stderr=subprocess.STDOUT)
                procs.append((proc, srv))
                setups[label] = {"srv": srv, "env": env, "proc": proc, "name": name, "port": port}
            return _run(setups, sandbox, n, rounds, data_where, httpx)
        finally:
            from workers.demo import stop_worker

            for proc, srv in procs:
                stop_worker(proc)
                srv.stop()


def _run(setups: dict, sandbox: Path, n: int, rounds: int, data_where: str, httpx) -> int:
    from celery import _state
    from celery.signals import before_task_publish

    import tasks.celery_tasks  # noqa: F401
    import workers.celery_app as celery_app
    from adapters.sandboxes.base import SandboxRef
    from tasks import chains
    from workers.celery_app import make_app
    from workers.demo import wait_worker
    from workers.metrics import registry, render
    from workers.settings import Settings
    from workers.wiring import redis_client

    for s in setups.values():
        s["app"] = make_app(Settings(redis_url=s["srv"].url))
        s["r"] = redis_client(s["srv"].url)
        if not wait_worker(s["app"], s["name"], s["proc"]):
            print(f"worker {s['name']} did not start", file=sys.stderr)
            return 1
    on = setups["on"]
    gauges = registry(on["r"])
    stop = threading.Event()

    def scraper() -> None:  # a pessimistic Prometheus: both endpoints every second
        while not stop.wait(1.0):
            try:
                httpx.get(f"http://127.0.0.1:{on['port']}/metrics", timeout=5)
                render(gauges)
            except Exception:  # noqa: BLE001 - a missed scrape only lowers the cost
                pass

    ref = SandboxRef("local")
    counter = iter(range(10**9))

    @contextmanager
    def publishing(s):
        prev = getattr(_state._tls, "current_app", None)
        s["app"].set_current()
        stamped = s is on
        if not stamped:
            before_task_publish.disconnect(celery_app._stamp)
        try:
            yield
        finally:
            if not stamped:
                before_task_publish.connect(celery_app._stamp)
            _state._tls.current_app = prev

    def run(s, count: int) -> float:
        r = s["r"]
        files = []
        for _ in range(count):
            p = sandbox / f"f{next(counter)}.bin"
            p.write_bytes(os.urandom(1000))
            files.append(p)
        jobs = []
        with publishing(s):
            t0 = time.perf_counter()
            for i, p in enumerate(files):
                job = chains.new_job_id("bench")
                chains.enqueue(r, chains.Plan(job_id=job, target=f"outbox:c{i % 20}",
                                              files=[chains.SandboxFile(ref=ref, path=str(p))]), job_kind="send")
                jobs.append(job)
            at = 0
            while at < len(jobs):
                pipe = r.pipeline()
                window = jobs[at:at + 32]
                for j in window:
                    pipe.hget(f"courier:delivery:{chains.delivery_id(j, 0)}", "state")
                states = pipe.execute()
                if b"failed" in states:
                    raise SystemExit("a delivery failed")
                done = 0
                for st in states:
                    if st != b"delivered":
                        break
                    done += 1
                at += done
                if done < len(window):
                    time.sleep(0.005)
            return count / (time.perf_counter() - t0)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    try:
        run(setups["off"], 30), run(on, 30)  # warm up
        off_rates, on_rates = [], []
        for _ in range(rounds):
            os.sync()
            off_rates.append(run(setups["off"], n))
            os.sync()
            on_rates.append(run(on, n))
    finally:
        stop.set()
    text = httpx.get(f"http://127.0.0.1:{on['port']}/metrics", timeout=5).text
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("courier_deliveries_total{"))
    expected = 30 + rounds * n
    if counted != expected:
        print(f"the worker's metrics counted {counted:g} deliveries, not {expected}", file=sys.stderr)
        return 1
    pairs = statistics.median(a / b for a, b in zip(on_rates, off_rates))
    report("metrics_cost_1kb_deliveries", statistics.median(on_rates), "deliveries/s", "metrics off",
           statistics.median(off_rates), target=0.95,
           extra=f"medians of {rounds} alternating rounds of n={n} after a warm-up; "
           f"on: {', '.join(f'{x:.0f}' for x in on_rates)} vs off: {', '.join(f'{x:.0f}' for x in off_rates)}; "
           f"median of the paired ratios {pairs:.3f}; 1 worker x2 processes each, own redis-server each, "
           f"both endpoints scraped every second; storage and outbox on {data_where}; "
           f"counted {counted:g} deliveries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
