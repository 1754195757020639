"""Turn start latency: from enqueueing a turn to its `started` phase event,
with the agent in its namespace sandbox (bubblewrap, the default) against
the same agent unconfined (`"isolation": "host"`, the runtime before the
sandbox), p50 and p99; a bare Celery no-op task (enqueue -> task start) and
each turn's end (enqueue -> `completed`: bwrap's start-up shows there) are
printed beside it.

    python -m bench.bench_turn_latency          (BENCH_QUICK=1: 30 of each)

One private redis-server, one worker (workers.demo.start_worker: prefork,
2 processes, queues turns/sandbox/delivery), both measured in the same run,
interleaved one at a time (each waits for the previous one to finish, so
this is latency, not queueing):
- turn: `receipts.create_job` + `agent_turn.apply_async` (what `courier turn`
  and the webhooks do) with a trivial bridge agent (`echo ok`, reply to the
  outbox) -> the `ts` of the turn's `started` event, written by the worker;
- no-op: `celery.accumulate` (Celery's built-in task that returns its args)
  sent to the same `turns` queue -> the `timestamp` of its `task-started`
  worker event (what Flower shows as "started").
Both ends are wall-clock times on this machine, so the two figures compare.

Lower is better; target: sandboxed / unconfined p50 <= 1.2 (the sandbox is
made after `started`: a turn's start must not wait for it). Against the no-op
the old target holds too (ratio of p50s <= 3). Starting a turn should cost
Celery's own dispatch plus a few Redis round trips (job check, state, one
XADD), well under a millisecond; anything slow done before `started` (a
platform call, sandbox setup, spawning the agent) would show as a multiple,
while 3x leaves room for millisecond jitter on shared busy cores.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import quick, report, start_redis  # noqa: E402

TARGET_RATIO = 1.2
NOOP_TARGET_RATIO = 3.0
WARMUP = 5


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


class TaskEvents:
    """Celery worker events in a thread: task-started timestamps, finished ids."""

    def __init__(self, app) -> None:
        self.app = app
        self.started: dict[str, float] = {}
        self.finished: set[str] = set()
        self.workers: set[str] = set()
        self.cond = threading.Condition()
        self.recv = None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        def on(ev: dict) -> None:
            with self.cond:
                t = ev.get("type", "")
                if t == "task-started":
                    self.started[ev["uuid"]] = ev["timestamp"]
                elif t in ("task-succeeded", "task-failed"):
                    self.finished.add(ev["uuid"])
                elif t.startswith("worker-"):
                    self.workers.add(ev.get("hostname", ""))
                self.cond.notify_all()

        with self.app.connection_for_read() as conn:
            self.recv = self.app.events.Receiver(conn, handlers={"*": on})
            self.recv.capture(limit=None, timeout=None, wakeup=True)

    def wait(self, pred, timeout_s: float = 30.0) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout=timeout_s)


def main() -> int:
    n = 30 if quick() else 200
    with tempfile.TemporaryDirectory(prefix="courier-bench-turn-") as tmp:
        tmpd = Path(tmp)
        srv = start_redis(tmpd)
        agents = {"trivial": {"command": ["/bin/echo", "ok"], "timeout_s": 30},
                  "trivial_host": {"command": ["/bin/echo", "ok"], "timeout_s": 30, "isolation": "host"}}
        env = {**os.environ, "COURIER_REDIS_URL": srv.url, "COURIER_DATA_DIR": str(tmpd / "data"),
               "COURIER_AGENTS": json.dumps(agents), "PYTHONPATH": str(ROOT)}
        os.environ.update({k: v for k, v in env.items() if k.startswith("COURIER_")})
        from workers.settings import reset_settings

        reset_settings()
        import workers.celery_app as celery_app
        from tasks.ledger import events, receipts
        from tasks.dispatch.chains import new_job_id
        from tasks.celery_tasks import agent_turn
        from workers.demo import start_worker, stop_worker, wait_worker
        from workers.wiring import redis_client

        app = celery_app.app
        r = redis_client(srv.url)
        name = f"bench-turn-{os.getpid()}@localhost"
        proc = start_worker(env, name, queues="turns,sandbox,delivery", concurrency=2,
                            log_path=str(tmpd / "worker.log"))
        try:
            if not wait_worker(app, name, proc):
                print("worker did not start:\n" + (tmpd / "worker.log").read_text()[-2000:], file=sys.stderr)
                return 1
            tev = TaskEvents(app)
            if not tev.wait(lambda: bool(tev.workers), 20):
                print("no worker events arrive", file=sys.stderr)
                return 1

            def one_turn(agent: str = "trivial") -> tuple[float, float, float]:
                job = new_job_id("turn")
                t0 = time.time()
                receipts.create_job(r, job, kind="turn", target="outbox:bench", agent=agent)
                agent_turn.apply_async(args=[{"job": job, "target": "outbox:bench", "message": "hi",
                                              "agent": agent}], task_id=job)
                tracker = events.EndTracker()
                started = None
                cursor = "0-0"
                deadline = time.monotonic() + 30
                while not tracker.done:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"turn {job} did not finish")
                    for eid, ev in events.read(r, job, cursor, block_ms=1000):
                        cursor = eid
                        tracker.feed(ev)
                        if started is None and ev.get("status") == "started":
                            started = ev["ts"]
                if not tracker.ok:
                    raise SystemExit(f"turn {job} ended {tracker.terminal}")
                tev.wait(lambda: job in tev.started, 10)
                ended = tracker.terminal.get("ts", math.nan) if tracker.terminal else math.nan
                return started - t0, tev.started.get(job, math.nan) - t0, ended - t0

            def one_noop() -> float:
                t0 = time.time()
                res = app.send_task("celery.accumulate", args=[1], queue="turns")
                if not tev.wait(lambda: res.id in tev.finished and res.id in tev.started, 30):
                    raise SystemExit(f"no-op {res.id} did not run")
                return tev.started[res.id] - t0

            for _ in range(WARMUP):  # each pool process builds its context once
                one_turn()
                one_turn("trivial_host")
                one_noop()
            turn_s: list[float] = []
            turn_task_s: list[float] = []
            turn_end_s: list[float] = []
            host_s: list[float] = []
            host_end_s: list[float] = []
            noop_s: list[float] = []
            for _ in range(n):  # interleaved: both runtimes and the no-op see the same machine
                a, b, c = one_turn()
                turn_s.append(a)
                turn_task_s.append(b)
                turn_end_s.append(c)
                a, _b, c = one_turn("trivial_host")
                host_s.append(a)
                host_end_s.append(c)
                noop_s.append(one_noop())
            if tev.recv is not None:
                tev.recv.should_stop = True
        finally:
            stop_worker(proc)
            srv.stop()

    ms = 1000.0
    t50, t99 = pct(turn_s, 0.5) * ms, pct(turn_s, 0.99) * ms
    n50, n99 = pct(noop_s, 0.5) * ms, pct(noop_s, 0.99) * ms
    h50, h99 = pct(host_s, 0.5) * ms, pct(host_s, 0.99) * ms
    tt50 = pct([x for x in turn_task_s if not math.isnan(x)], 0.5) * ms
    e50 = pct([x for x in turn_end_s if not math.isnan(x)], 0.5) * ms
    he50 = pct([x for x in host_end_s if not math.isnan(x)], 0.5) * ms
    report("turn_enqueue_to_started_p50", t50, "ms", "unconfined (isolation host) p50", h50, target=TARGET_RATIO,
           higher_is_better=False,
           extra=f"p99 {t99:.2f} ms vs {h99:.2f} ms; vs celery no-op p50 {n50:.2f} ms ratio "
                 f"{t50 / n50 if n50 else math.inf:.2f} (target <= {NOOP_TARGET_RATIO:g}), p99 {n99:.2f} ms; "
                 f"turn task-started p50 {tt50:.2f} ms; enqueue->completed p50 sandboxed {e50:.1f} ms vs "
                 f"unconfined {he50:.1f} ms (+{e50 - he50:.1f} ms: bwrap's start-up); "
                 f"n={n} each, 1 worker x2 processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
