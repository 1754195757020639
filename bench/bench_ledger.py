"""The ledger's figures: a long queue for one chat, and recovery after a SIGKILL.

    python -m bench.bench_ledger              # 1000 messages for one chat: rate vs the platform's limit
    python -m bench.bench_ledger --cpu        # ... and the workers' CPU while the messages wait
    python -m bench.bench_ledger --recovery   # a worker SIGKILLed mid-send: seconds until its deliveries are final
    BENCH_QUICK=1 ...                         # shorter windows

Each runs a private redis-server, the Telegram Bot API fake in its own
process and real worker processes (2 workers x 2 processes), all on loopback.

- rate: 1000 texts are queued for one Telegram chat (Telegram's per-chat limit:
  1 message/s); over a window (60 s; quick: 20 s) the messages delivered per
  second, against the limit itself (target >= 0.9).
- cpu: the workers' CPU (main processes and pool children, from /proc) per
  second of that window, against the same workers idle for as long, measured
  just before in the same run (target: within 0.05 of a core of idle).
- recovery: 20 texts to 20 chats, the server answering after 2 s so sends are
  in flight; one worker is SIGKILLed (main process and children) while it
  holds sends; the time from the kill until every receipt is final, against
  the same load with no kill in the same run (limit: 60 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import cpu_s, quick, report, report_limit, start_redis  # noqa: E402

TOKEN = "424242:bench-token"


def _tree(proc) -> list[int]:
    from tests.fixtures.faults import children_of

    return [proc.pid, *children_of(proc.pid)]


class Stack:
    def __init__(self, tmp: Path, latency_ms: float = 0.0) -> None:
        from tests.fixtures.services import free_port, port_open, wait_until

        self.tmp = tmp
        self.redis_srv = start_redis(tmp)
        port = free_port()
        self.fake = subprocess.Popen([sys.executable, "-m", "tests.fixtures.fake_telegram", "--token", TOKEN,
                                      "--port", str(port), "--latency-ms", str(latency_ms)], cwd=str(ROOT),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: port_open(port), timeout_s=30, what="the Bot API fake")
        self.env = {**os.environ, "COURIER_REDIS_URL": self.redis_srv.url, "COURIER_DATA_DIR": str(tmp / "data"),
                    "TELEGRAM_BOT_TOKEN": TOKEN, "COURIER_TELEGRAM_BASE_URL": f"http://127.0.0.1:{port}",
                    "PYTHONPATH": str(ROOT)}
        os.environ.update({k: v for k, v in self.env.items() if k.startswith(("COURIER_", "TELEGRAM_"))})
        from workers.settings import reset_settings

        reset_settings()
        import workers.celery_app  # noqa: F401 - binds the tasks to the bench Redis
        from workers.wiring import redis_client

        self.r = redis_client(self.redis_srv.url)
        self.workers: list = []

    def start_workers(self, n: int = 2) -> None:
        import workers.celery_app as celery_app
        from workers.demo import start_worker, wait_worker

        for i in range(n):
            name = f"bench{len(self.workers)}@localhost"
            w = start_worker(self.env, name, concurrency=2, log_path=str(self.tmp / f"{name}.log"))
            if not wait_worker(celery_app.app, name, w):
                raise SystemExit(f"worker {name} did not start")
            self.workers.append(w)

    def texts(self, targets: list[str], tag: str) -> list[str]:
        from tasks.dispatch import chains

        ids: list[str] = []
        for i, target in enumerate(targets):
            ids += chains.enqueue(self.r, chains.Plan(job_id=chains.new_job_id(tag), target=target,
                                                      text=f"{tag} {i}"), job_kind="send")
        return ids

    def final(self, ids: list[str]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for d in ids:
            pipe.hget(f"courier:delivery:{d}", "state")
        return sum(1 for s in pipe.execute() if s in ("delivered", "failed"))

    def delivered(self, ids: list[str]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for d in ids:
            pipe.hget(f"courier:delivery:{d}", "state")
        return sum(1 for s in pipe.execute() if s == "delivered")

    def close(self) -> None:
        from tests.fixtures.services import stop_process

        for w in self.workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        stop_process(self.fake)
        self.redis_srv.stop()


def _until(cond, timeout_s: float, every_s: float = 0.05) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout_s:
            raise SystemExit("timed out")
        time.sleep(every_s)
    return time.perf_counter()


def lane(cpu: bool) -> None:
    window = 20.0 if quick() else 60.0
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        st = Stack(Path(tmp))
        try:
            st.start_workers(2)
            pids = [p for w in st.workers for p in _tree(w)]
            c0, t0 = cpu_s(pids), time.perf_counter()
            time.sleep(window)  # the idle baseline: the same workers, nothing queued
            idle = (cpu_s(pids) - c0) / (time.perf_counter() - t0)
            ids = st.texts(["telegram:900001"] * 1000, "lane")
            first = _until(lambda: st.delivered(ids) >= 1, 60)
            c0, n0 = cpu_s(pids), st.delivered(ids)
            time.sleep(window)
            dt = time.perf_counter() - first
            busy = (cpu_s(pids) - c0) / dt
            rate = (st.delivered(ids) - n0) / dt
        finally:
            st.close()
    if cpu:
        report_limit("worker CPU while 1000 messages wait for one chat", busy, "cores", limit=idle + 0.05,
                     baseline_name="idle workers", baseline=idle)
    else:
        report("one chat's lane, 1000 queued", rate, "msgs/s", "Telegram's per-chat limit", 1.0, target=0.9,
               extra=f"{window:g} s window; 2 workers x 2 processes; workers' CPU {busy:.3f} cores vs idle {idle:.3f}")


def recovery() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        st = Stack(Path(tmp), latency_ms=2000)
        try:
            st.start_workers(2)
            chats = [f"telegram:{910000 + i}" for i in range(20)]
            ids = st.texts(chats, "calm")
            t0 = _until(lambda: st.r.exists("courier:lease:lane:" + chats[0]) or st.final(ids) > 0, 60)
            calm = _until(lambda: st.final(ids) == len(ids), 300) - t0

            ids = st.texts([c + "0" for c in chats], "kill")

            def victim():
                """A worker whose processes hold at least two lanes' leases (sends in flight)."""
                holders = [st.r.get("courier:lease:lane:" + c + "0") or "" for c in chats]
                for w in st.workers:
                    tree = {str(p) for p in _tree(w)}
                    if sum(1 for h in holders if h.split(":")[1:2] and h.split(":")[1] in tree) >= 2:
                        return w
                return None

            _until(lambda: victim() is not None, 60, every_s=0.01)
            victim = victim()
            for pid in _tree(victim):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            victim.wait()
            t_kill = time.perf_counter()
            done = _until(lambda: st.final(ids) == len(ids), 300) - t_kill
        finally:
            st.close()
    report_limit("recovery after a worker SIGKILL", done, "s", limit=60.0, baseline_name="the same load, no kill",
                 baseline=calm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--recovery", action="store_true")
    a = ap.parse_args()
    if a.recovery:
        recovery()
    else:
        lane(cpu=a.cpu)


if __name__ == "__main__":
    main()
