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
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import data_dir, quick, random_files, report_rounds, send_each  # noqa: E402


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
        files = random_files(sandbox, (f"f{next(counter)}.bin" for _ in range(count)))
        with publishing(s):
            return send_each(s["r"], ref, files)

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
    report_rounds("metrics_cost_1kb_deliveries", on_rates, off_rates, "metrics off", target=0.95, n=n,
                  sides=("on: ", "off: "),
                  setup="1 worker x2 processes each, own redis-server each, both endpoints scraped every second; "
                  f"storage and outbox on {data_where}; counted {counted:g} deliveries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
