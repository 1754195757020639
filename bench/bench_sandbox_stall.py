"""Another chat's file beside 50 files on a stalled container vs alone: its latency.

    python -m bench.bench_sandbox_stall        (BENCH_QUICK=1: 1 round of each)

One private redis-server, one private rootful podman (tests/fixtures/podman.py),
one worker (workers.demo.start_worker: prefork, 2 processes, queues
turns/sandbox/delivery, read deadline COURIER_SANDBOX_IO_TIMEOUT_S=5 s),
delivering to the outbox. The other chat's file is one small file on a
healthy container (uid 1000: every read is an exec); its latency is from its
enqueue to its receipt `delivered`. Alternate rounds, same run:
- quiet: the file alone;
- stalled: 50 files on a container whose shell stalls (`StallingContainer`)
  enqueued first, then the file. After the measure the container is resumed
  and its 50 files are waited for (all must be delivered) before the next
  round, so no round starts with a backlog.
Each round makes a fresh such container first (the quiet round does not use
it), so both sides start from the same engine work.

Lower is better; target: stalled <= 2 x quiet (issue 22: before the breaker
the file waited for the stalled files' read deadlines, 129 s instead of 8-17 s).
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

from bench._common import courier_worker, quick, report, start_redis, wait_final  # noqa: E402

TARGET_RATIO = 2.0
STALLED_FILES = 50
IO_TIMEOUT_S = 5.0


def main() -> int:
    rounds = 1 if quick() else 5
    with tempfile.TemporaryDirectory(prefix="courier-bench-stall-", ignore_cleanup_errors=True) as tmp:
        tmpd = Path(tmp)
        from tests.fixtures.podman import StallingContainer, start_podman

        srv = start_redis(tmpd)
        svc = start_podman(tmpd / "podman")
        _env, app, name, proc = courier_worker(tmpd, srv.url, "stall", docker_host=svc.base_url,
                                               sandbox_io_timeout_s=str(IO_TIMEOUT_S),
                                               sandbox_breaker_max_s=str(2 * IO_TIMEOUT_S))
        from adapters.sandboxes.base import SandboxRef
        from tasks.dispatch import chains
        from workers.demo import stop_worker, wait_worker
        from workers.wiring import redis_client

        r = redis_client(srv.url)
        healthy = StallingContainer(svc, files=1)
        seq = 0

        def enqueue(ctr: StallingContainer, indexes: range, chat: str) -> list[str]:
            nonlocal seq
            seq += 1
            files = [chains.SandboxFile(ref=SandboxRef("docker", ctr.name), path=ctr.path(i)) for i in indexes]
            return chains.enqueue(r, chains.Plan(job_id=f"snd_bench{seq}_{os.getpid()}", target=f"outbox:{chat}",
                                                 files=files), job_kind="send")

        def wait_delivered(ids: list[str], timeout_s: float) -> None:
            failed, left = wait_final(r, ids, poll_s=0.002, timeout_s=timeout_s)
            if failed or left:
                raise SystemExit(f"{failed} failed, {left} not done:\n" + (tmpd / "worker.log").read_text()[-2000:])

        def the_file() -> float:
            t = time.perf_counter()
            wait_delivered(enqueue(healthy, range(1), f"other{seq}"), 300)
            return time.perf_counter() - t

        def quiet() -> float:
            ctr = StallingContainer(svc, files=STALLED_FILES)  # made as in a stalled round, never used
            try:
                ctr.resume()  # the engine's last exec before the measure, as `stall()` in a stalled round
                return the_file()
            finally:
                ctr.remove()

        def stalled() -> float:
            ctr = StallingContainer(svc, files=STALLED_FILES)
            try:
                ctr.stall()
                fifty = enqueue(ctr, range(STALLED_FILES), f"stalled{seq}")
                took = the_file()
                ctr.resume()
                wait_delivered(fifty, 300)
            finally:
                ctr.remove()
            return took

        try:
            if not wait_worker(app, name, proc, timeout_s=60):
                print("worker did not start:\n" + (tmpd / "worker.log").read_text()[-2000:], file=sys.stderr)
                return 1
            # warm-up: both pool processes build their context, the breaker's scripts are loaded, and
            # podman has run an exec beside a stalled one (its first such costs ~0.5 s more, once)
            quiet()
            stalled()
            calm: list[float] = []
            busy: list[float] = []
            for _ in range(rounds):
                busy.append(stalled())
                calm.append(quiet())
        finally:
            stop_worker(proc)
            healthy.remove()
            svc.stop()
            srv.stop()

    a, b = statistics.median(busy), statistics.median(calm)
    report("other chat's file beside 50 on a stalled container", a, "s", "alone", b, target=TARGET_RATIO,
           higher_is_better=False,
           extra=f"medians of {rounds} alternating rounds: {', '.join(f'{x:.3f}' for x in busy)} vs "
                 f"{', '.join(f'{x:.3f}' for x in calm)}; 1 worker x2 processes, read deadline {IO_TIMEOUT_S:g} s, "
                 f"{os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
