"""Delivery concurrency (issue 23, item 6): processes x threads of one delivery worker,
each against the first configuration (the baseline) in the same run.

    python -m bench.bench_delivery_concurrency        # BENCH_QUICK=1: fewer deliveries

One bot (a fake Bot API server process answering after BENCH_POOL_LATENCY_MS, 100
ms), one Redis, 100 chats (BENCH_POOL_PER_CHAT 1 KB documents each, 3; quick: 1),
the shared rate limits at their defaults (1 a second per chat; the per-bot limit
BENCH_CONC_PER_BOT, default 30/s: Telegram's). Each configuration is one worker
started as `courier worker -Q delivery` starts it, with
COURIER_DELIVERY_PROCESSES x COURIER_DELIVERY_CONCURRENCY from
BENCH_CONC_CONFIGS (comma separated `<processes>x<threads>`), the first the
baseline; default `1x16,2x8,4x4,8x2`. (Issue 23 measured these against 1 x 16
with the run slot, removed since: docs/benchmarks.md.)

A round measures every configuration once (a fresh worker each, warmed up with
40 other chats, not timed), in an order rotated round by round (neither side
always runs first on a machine whose load drifts); BENCH_CONC_ROUNDS rounds
(default 2). Each measure: deliveries a second from the first enqueue until
every receipt says delivered, and the worker's CPU (user + sys of the
supervisor and all its processes over that window) as % of one core. The
figure line: the best other configuration (by median deliveries/s, then CPU)
against the baseline's median deliveries/s, target >= 0.9 (issue 23: within 10
%), every configuration's medians and rounds, and the machine's load average.
Issue 23's bench: one delivery worker >= 30 deliveries/s (the per-bot ceiling)
using <= 50 % of one core.
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

from bench._common import cpu_s, quick, report, start_redis, tree_pids  # noqa: E402
from bench.bench_delivery_pool import CHATS, Deployment  # noqa: E402

WARM_CHATS = 40
TARGET_RATIO = 0.9
TARGET_PER_S = 30.0
TARGET_CPU_PCT = 50.0


class Config:
    def __init__(self, spec: str) -> None:
        procs, threads = spec.split("x")
        self.processes, self.threads = int(procs), int(threads)
        self.label = f"{self.processes}x{self.threads}"
        self.rates: list[float] = []
        self.cpus: list[float] = []

    def env(self) -> dict[str, str]:
        return {"COURIER_DELIVERY_POOL": "threads", "COURIER_DELIVERY_PROCESSES": str(self.processes),
                "COURIER_DELIVERY_CONCURRENCY": str(self.threads)}


def start(dep: Deployment, cfg: Config) -> None:
    from workers.demo import wait_worker
    from workers.worker import node_argv

    dep.env.env.update(cfg.env())
    dep.start_worker([sys.executable, "-m", "workers.worker", "-Q", "delivery"])
    name = f"bench-pool{dep.i}-{dep.n}@localhost"
    app = dep.env.celery_app()
    for i in range(1, cfg.processes):  # every process is its own node: all up before the clock starts
        other = node_argv(["-n", name], i)[1]
        assert dep.worker is not None
        if not wait_worker(app, other, dep.worker, timeout_s=120):
            raise SystemExit(f"worker process {other} did not start (see the logs in {dep.env.tmp})")


def measure(dep: Deployment, cfg: Config, per_chat: int) -> tuple[float, float]:
    """(deliveries/s, CPU % of one core) of one fresh worker of `cfg`."""
    start(dep, cfg)
    try:
        out: dict = {}
        dep.send(dep.prepare([str(800000 + i) for i in range(WARM_CHATS)], 1), out)
        if out["failed"]:
            raise SystemExit(f"{out['failed']} warm-up deliveries failed (see the worker log in {dep.env.tmp})")
        plans = dep.prepare([str(700000 + i) for i in range(CHATS)], per_chat)
        time.sleep(1.1)  # the per-chat limit: the previous measure's last sends are over a second old
        assert dep.worker is not None
        pids = tree_pids(dep.worker.pid)
        c0, t0 = cpu_s(pids), time.perf_counter()
        dep.send(plans, out)
        c1, t1 = cpu_s(pids), time.perf_counter()
        if out["failed"]:
            raise SystemExit(f"{out['failed']} deliveries failed (see the worker log in {dep.env.tmp})")
        return out["n"] / out["s"], 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        dep.stop_worker()


def main() -> None:
    per_chat = int(os.environ.get("BENCH_POOL_PER_CHAT", "1" if quick() else "3"))
    latency_ms = float(os.environ.get("BENCH_POOL_LATENCY_MS", "100"))
    rounds = int(os.environ.get("BENCH_CONC_ROUNDS", "2"))
    per_bot = os.environ.get("BENCH_CONC_PER_BOT", "30")
    configs = [Config(s.strip()) for s in os.environ.get("BENCH_CONC_CONFIGS", "1x16,2x8,4x4,8x2").split(",")]
    debug = os.environ.get("BENCH_DEBUG", "") not in ("", "0")
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-conc-") as tmp_s:
        tmp = Path(tmp_s)
        redis_srv = start_redis(tmp)
        dep = None
        try:
            dep = Deployment(0, tmp, redis_srv.url, latency_ms)
            dep.env.env["COURIER_TELEGRAM_BOT_PER_S"] = per_bot
            for rnd in range(rounds):
                k = rnd % len(configs)
                for cfg in configs[k:] + configs[:k]:
                    loads.append(os.getloadavg()[0])
                    rate, cpu = measure(dep, cfg, per_chat)
                    cfg.rates.append(rate)
                    cfg.cpus.append(cpu)
                    if debug:
                        print(f"round {rnd + 1} {cfg.label}: {rate:.1f} deliveries/s, CPU {cpu:.0f} % "
                              f"(load {loads[-1]:.2f})", file=sys.stderr, flush=True)
        finally:
            if dep is not None:
                dep.close()
            redis_srv.stop()

    def med(cfg: Config) -> tuple[float, float]:
        return statistics.median(cfg.rates), statistics.median(cfg.cpus)

    base, others = configs[0], configs[1:] or configs[:1]
    best = max(others, key=lambda c: (round(med(c)[0], 0), -med(c)[1]))
    rate, cpu = med(best)
    each = "; ".join(f"{c.label}: {med(c)[0]:.1f}/s {med(c)[1]:.0f} % CPU ("
                     f"{', '.join(f'{r:.1f}' for r in c.rates)}/s; {', '.join(f'{x:.0f}' for x in c.cpus)} %)"
                     for c in configs)
    ok = rate >= TARGET_PER_S * 0.95 and cpu <= TARGET_CPU_PCT
    report(f"delivery concurrency {best.label}", rate, "deliveries/s", base.label, med(base)[0], target=TARGET_RATIO,
           extra=f"its CPU {cpu:.0f} % of one core vs {med(base)[1]:.0f} %; issue 23: >= {TARGET_PER_S:g}/s (the "
           f"per-bot limit, {per_bot}/s here) within <= {TARGET_CPU_PCT:g} % {'met' if ok else 'not met'}; "
           f"medians of {rounds} rotated rounds: {each}; server answers after {latency_ms:g} ms; {CHATS} chats x "
           f"{per_chat} 1 KB documents; load average {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
