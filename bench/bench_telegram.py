"""Telegram deliveries per second: the full task chain vs a plain SDK loop.

    python bench/bench_telegram.py        # BENCH_QUICK=1: fewer rounds

Both paths send the same load to the same local Bot API server (the test
fake, in its own process, so it shares no GIL with either side): rounds of
100 distinct 1 KB documents, one to each of 100 chats.

- courier: each document is a job (`chains.enqueue`: receipts, then the
  lane's task) handled by one delivery worker as `courier worker -Q delivery`
  starts it (COURIER_DELIVERY_POOL x COURIER_DELIVERY_CONCURRENCY, threads x
  16 by default; BENCH_POOL / BENCH_CONCURRENCY override, e.g. BENCH_POOL=prefork
  BENCH_CONCURRENCY=2, the old default) against a private redis-server; a round is timed from the first enqueue until every
  receipt says delivered. Every send goes through the shared rate limits
  (per-chat gate, per-bot window), receipts, send locks, file-id lookups.
- baseline: one process, one `telegram.Bot`, a plain `await
  bot.send_document(...)` loop over the same 100 chats.

Rounds alternate between the two, with a pause of over a second between
rounds (not timed), so neither side sends two messages to one chat within a
second: Telegram's per-chat limit holds for both. The per-bot limit is set
to 1000/s (Telegram's paid-broadcast ceiling); with the default ~30/s both
paths would only measure that limit. One warm-up round per side is not
counted.

The headline has the server answer each call after BENCH_TG_LATENCY_MS
(default 25 ms; the real Bot API, or a local telegram-bot-api server
forwarding to it, takes longer), as a remote API does. The bracket also
gives the same measure with a server that answers at once: then both sides
are bound by CPU on the machine, and the chain's work per delivery (enqueue,
Celery, receipts, limits: several times the loop's) shows.

Each side's figure is the median of its rounds' rates (the machine is shared:
a burst of load on one round moves a sum, not a median). Targets: >= 1.5 with
the 25 ms server (courier sends to many chats at once; issue 12); at once, a
bot's ceiling (30/s) at least: the ratio there is shown, no longer a target
(issue 23: targets are what users feel; it was 0.70 with the run slot and two
processes, 0.33 with one process and no slot, at 242/s: 8 bots' worth).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import cpu_s, quick, random_files, start_redis, tree_pids  # noqa: E402

TOKEN = "424242:bench-token"
CHATS = 100
DOC_BYTES = 1024
PAUSE_S = 1.3
#: issue 12: courier over the SDK loop with a server answering after 25 ms, and at once
TARGET_REMOTE = 1.5
#: at once: one process carries at least a bot's ceiling (Telegram's ~30 messages/s)
TARGET_LOCAL_PER_S = 30.0


def _docs(d: Path, n: int, tag: str) -> list[Path]:
    return random_files(d, (f"{tag}-{i:03d}.txt" for i in range(n)), DOC_BYTES)


def main() -> None:
    rounds = 2 if quick() else 6
    with tempfile.TemporaryDirectory(prefix="bench-telegram-") as tmp_s:
        tmp = Path(tmp_s)
        from tests.fixtures.services import free_port, port_open, stop_process, wait_until

        redis_srv = start_redis(tmp)
        port = free_port()
        fake = subprocess.Popen([sys.executable, "-m", "tests.fixtures.fake_telegram", "--token", TOKEN,
                                 "--port", str(port)], cwd=str(ROOT), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        worker = None
        try:
            wait_until(lambda: port_open(port), timeout_s=30, what="the Bot API fake")
            base_url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "COURIER_REDIS_URL": redis_srv.url, "COURIER_DATA_DIR": str(tmp / "data"),
                   "TELEGRAM_BOT_TOKEN": TOKEN, "COURIER_TELEGRAM_BASE_URL": base_url,
                   "COURIER_TELEGRAM_BOT_PER_S": "1000", "PYTHONPATH": str(ROOT)}
            os.environ.update({k: v for k, v in env.items() if k.startswith(("COURIER_", "TELEGRAM_"))})

            import workers.celery_app  # noqa: F401 - binds the tasks to the bench Redis
            import tasks.celery_tasks  # noqa: F401
            from workers.demo import stop_worker, wait_worker
            from workers.settings import get_settings, reset_settings

            reset_settings()
            from workers.wiring import redis_client, store

            # the worker exactly as `courier worker -Q delivery` starts it (BENCH_POOL / BENCH_CONCURRENCY
            # override, e.g. BENCH_POOL=prefork BENCH_CONCURRENCY=2, the old default)
            opts = [f"--pool={os.environ['BENCH_POOL']}"] if os.environ.get("BENCH_POOL") else []
            opts += [f"--concurrency={os.environ['BENCH_CONCURRENCY']}"] if os.environ.get("BENCH_CONCURRENCY") else []
            cmd = [sys.executable, "-m", "workers.worker", "-Q", "delivery", "-n", "bench-tg@localhost", *opts,
                   "--loglevel=WARNING", "--without-mingle", "--without-gossip"]
            from workers.worker import processes_for, worker_argv

            shown = " ".join(a for a in worker_argv(cmd[3:], get_settings()) if a.startswith("--pool")
                             or a.startswith("--concurrency"))
            shown += f" x {processes_for(cmd[3:], get_settings())} processes"
            with open(tmp / "worker.log", "ab") as log:
                worker = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
            if not wait_worker(workers.celery_app.app, "bench-tg@localhost", worker):
                raise SystemExit("the worker did not start:\n" + (tmp / "worker.log").read_text()[-2000:])
            r = redis_client(redis_srv.url)
            st = store()
            chats = [str(700000 + i) for i in range(CHATS)]

            courier_s = _Courier(r, st, chats, tmp)
            baseline_s = _Baseline(base_url, chats, tmp)
            latency_ms = float(os.environ.get("BENCH_TG_LATENCY_MS", "25"))
            pids = {"worker": worker.pid, "redis": redis_srv.proc.pid, "server": fake.pid}
            remote = (_measure(base_url, courier_s, baseline_s, rounds, latency_ms, pids)
                      if not os.environ.get("BENCH_TG_AT_ONCE_ONLY") else (1.0, 1.0))
            local = _measure(base_url, courier_s, baseline_s, rounds, 0.0, pids)
            baseline_s.close()
            local_ratio = local[0] / local[1]
            ok = remote[0] / remote[1] >= TARGET_REMOTE and local[0] >= TARGET_LOCAL_PER_S
            print(f"BENCH telegram deliveries: {remote[0]:.4g} deliveries/s vs plain SDK loop {remote[1]:.4g} "
                  f"deliveries/s ratio {remote[0] / remote[1]:.3g} (target >= {TARGET_REMOTE:g}; at once >= "
                  f"{TARGET_LOCAL_PER_S:g}/s) {'PASS' if ok else 'MISS'} [server answers after {latency_ms:g} ms; "
                  f"server answering at once: {local[0]:.4g} vs {local[1]:.4g}/s, ratio {local_ratio:.2f}; "
                  f"medians of {rounds} alternating rounds x {CHATS} chats x 1 KB documents; 1 worker "
                  f"{shown}; per-bot limit 1000/s]", flush=True)
        finally:
            if worker is not None:
                stop_worker(worker)
            stop_process(fake)
            redis_srv.stop()


def _measure(base_url: str, courier_s: "_Courier", baseline_s: "_Baseline", rounds: int,
             latency_ms: float, pids: dict[str, int] | None = None) -> tuple[float, float]:
    """Deliveries per second of (courier, baseline) with the server answering after `latency_ms`."""
    import httpx

    httpx.post(f"{base_url}/_control/latency_ms/{latency_ms:g}").raise_for_status()
    rates: dict[str, list[float]] = {"courier": [], "baseline": []}
    cpu: dict[str, float] = {}
    sent: dict[str, int] = {"courier": 0, "baseline": 0}
    for rnd in range(rounds + 1):
        for name, side in (("courier", courier_s), ("baseline", baseline_s)):
            before = {k: cpu_s(tree_pids(pid)) for k, pid in (pids or {}).items()}
            own = time.process_time()
            n, dt = side.round(rnd)
            if rnd > 0:  # round 0 warms both sides up
                rates[name].append(n / dt)
                sent[name] += n
                for k, pid in (pids or {}).items():
                    cpu[f"{name}/{k}"] = cpu.get(f"{name}/{k}", 0.0) + cpu_s(tree_pids(pid)) - before[k]
                cpu[f"{name}/bench"] = cpu.get(f"{name}/bench", 0.0) + time.process_time() - own
            time.sleep(PAUSE_S)  # the per-chat limit, for both sides (not timed)
    if os.environ.get("BENCH_DEBUG"):  # each round's rate, and CPU per delivery of each process
        print(f"[{latency_ms:g} ms] rounds/s: " + "; ".join(
            f"{k} " + " ".join(f"{x:.0f}" for x in v) for k, v in rates.items()), file=sys.stderr)
        print(f"[{latency_ms:g} ms] CPU ms per delivery: " + ", ".join(
            f"{k} {1000 * v / max(1, sent[k.split('/')[0]]):.2f}" for k, v in sorted(cpu.items())), file=sys.stderr)
    return statistics.median(rates["courier"]), statistics.median(rates["baseline"])


class _Courier:
    def __init__(self, r, st, chats: list[str], tmp: Path) -> None:
        self.r, self.st, self.chats, self.tmp = r, st, chats, tmp
        self.n = 0

    def round(self, rnd: int) -> tuple[int, float]:
        from tasks.dispatch import chains
        from tasks.ledger import receipts

        self.n += 1
        docs = _docs(self.tmp, len(self.chats), f"c{self.n}")
        plans = []
        for chat, p in zip(self.chats, docs):  # the operator stores the files first (not timed)
            job_id = chains.new_job_id("bench")
            key = chains.storage_key(job_id, 0, p.name)
            with open(p, "rb") as f:
                info = self.st.put_stream(key, f)
            receipts.create_job(self.r, job_id, kind="send", target=f"telegram:{chat}")
            plans.append(chains.Plan(job_id=job_id, target=f"telegram:{chat}", files=[
                chains.StoredFile(key=key, name=p.name, size=info.size_bytes, sha256=info.sha256 or "")]))
        mon = None
        if os.environ.get("BENCH_MONITOR") and rnd == 1:  # every Redis command of one round, for counting
            url = self.r.connection_pool.connection_kwargs
            mon = subprocess.Popen(["redis-cli", "-p", str(url["port"]), "monitor"],
                                   stdout=open(os.environ["BENCH_MONITOR"], "w"))
            time.sleep(0.5)
        t0 = time.perf_counter()
        ids: list[str] = []
        for plan in plans:
            ids += chains.enqueue(self.r, plan)
        if os.environ.get("BENCH_DEBUG"):
            print(f"enqueue {time.perf_counter() - t0:.3f}s", file=sys.stderr)
        from tasks.ledger import keys

        left, failed = list(ids), 0
        while left:  # the oldest not-done receipt every 10 ms: one read per poll, light on Redis and CPU
            state = self.r.hget(keys.delivery(left[0]), "state")
            if state in ("delivered", "failed"):
                failed += state == "failed"
                left.pop(0)
            else:
                time.sleep(0.01)
        dt = time.perf_counter() - t0
        if mon is not None:
            mon.terminate()
        if failed:
            raise SystemExit(f"{failed} deliveries failed: see `courier status`")
        return len(ids), dt


class _Baseline:
    def __init__(self, base_url: str, chats: list[str], tmp: Path) -> None:
        from telegram import Bot

        self.loop = asyncio.new_event_loop()
        self.bot = Bot(TOKEN, base_url=f"{base_url}/bot", base_file_url=f"{base_url}/file/bot")
        self.chats, self.tmp = chats, tmp
        self.n = 0

    def round(self, rnd: int) -> tuple[int, float]:
        self.n += 1
        docs = _docs(self.tmp, len(self.chats), f"b{self.n}")

        async def run() -> None:
            for chat, p in zip(self.chats, docs):
                with open(p, "rb") as f:
                    await self.bot.send_document(chat_id=int(chat), document=f)

        t0 = time.perf_counter()
        self.loop.run_until_complete(run())
        return len(docs), time.perf_counter() - t0

    def close(self) -> None:
        self.loop.run_until_complete(self.bot.shutdown())
        self.loop.close()


if __name__ == "__main__":
    main()
