"""Shared output for benchmarks: each prints exactly one figure line.

    BENCH <name>: <value> <unit> vs <baseline name> <baseline> <unit> ratio <r> (target <op> <t>) PASS|MISS
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

MiB = 1024 * 1024


def report(name: str, value: float, unit: str, baseline_name: str, baseline: float, *, target: float,
           higher_is_better: bool = True, extra: str = "") -> float:
    ratio = (value / baseline) if baseline else float("inf")
    ok = ratio >= target if higher_is_better else ratio <= target
    op = ">=" if higher_is_better else "<="
    line = (f"BENCH {name}: {value:.4g} {unit} vs {baseline_name} {baseline:.4g} {unit} "
            f"ratio {ratio:.3g} (target {op} {target:g}) {'PASS' if ok else 'MISS'}")
    if extra:
        line += f" [{extra}]"
    print(line, flush=True)
    return ratio


def report_limit(name: str, value: float, unit: str, *, limit: float, baseline_name: str = "", baseline: float = 0.0) -> None:
    """A figure against an absolute limit (peak RSS), with its baseline for context."""
    ok = value <= limit
    ctx = f" vs {baseline_name} {baseline:.4g} {unit} ratio {value / baseline:.3g}" if baseline else ""
    print(f"BENCH {name}: {value:.4g} {unit}{ctx} (limit <= {limit:g} {unit}) {'PASS' if ok else 'MISS'}", flush=True)


def peak_rss_mb_of_children() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def quick() -> bool:
    """BENCH_QUICK=1 shrinks sizes so a bench can run as a smoke test."""
    return os.environ.get("BENCH_QUICK", "") not in ("", "0")


# -- the extraction benches (bench_extract_*, bench_exec_fallback) ------------------------------
def make_file(path: Path, size: int, *, zeros: bool = False) -> None:
    """`size` bytes of /dev/urandom (or /dev/zero) at `path`, written by `head`."""
    with open(path, "wb") as out:
        subprocess.run(["head", "-c", str(size), "/dev/zero" if zeros else "/dev/urandom"], stdout=out, check=True)


def make_file_in(ctr, path: str, size: int, *, zeros: bool = False) -> None:
    """`size` bytes of /dev/urandom (or /dev/zero) at `path` inside a container."""
    src = "/dev/zero" if zeros else "/dev/urandom"
    res = ctr.exec_run(["sh", "-c", f'head -c "$1" {src} > "$2"', "sh", str(size), path])
    if res.exit_code != 0:
        raise SystemExit(f"cannot make {path}: {res.output!r}")


def out_dir() -> str | None:
    """Where both sides of a race write: $BENCH_OUT_DIR, else /dev/shm (RAM) when writable."""
    env = os.environ.get("BENCH_OUT_DIR")
    if env:
        return env
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def extract_vs_copy(runs: int, sb, src: str, store, size: int, out: Path,
                    copy: Callable[[Path], object], *, dest_prefix: str = "cp") -> tuple[list[float], list[float]]:
    """`runs` rounds of `sb.extract(src)` into `store` (then deleted) and
    `copy(dest)` to out/<dest_prefix><i> (then unlinked), which goes first
    alternating round by round (neither side always runs after the other's
    cleanup, nor first after the file was made); both must move `size`
    bytes. Returns (our seconds, the copy's seconds), one per round."""
    ours: list[float] = []
    theirs: list[float] = []

    def extract(i: int) -> None:
        t = time.perf_counter()
        info = sb.extract(src, store, f"files/big{i}", max_bytes=size)
        ours.append(time.perf_counter() - t)
        assert info.size_bytes == size
        store.delete(f"files/big{i}")

    def baseline(i: int) -> None:
        dest = out / f"{dest_prefix}{i}"
        t = time.perf_counter()
        copy(dest)
        theirs.append(time.perf_counter() - t)
        assert dest.stat().st_size == size
        dest.unlink()

    for i in range(runs):
        for step in ((extract, baseline) if i % 2 else (baseline, extract)):
            step(i)
    return ours, theirs


def rss_child(setup: str, *, idle: str = "", after: str = "") -> str:
    """The script of a peak-RSS child: ROOT on sys.path, `setup` (which sets
    `sb`, `store`, `path` and `size` from sys.argv[2:]), then extract `path`
    (or, when path is "-", run `idle`), `after`, and print the peak RSS."""
    idle_part = f"else:\n    {idle}\n" if idle else ""
    after_part = f"{after}\n" if after else ""
    return ("import json, resource, sys\n"
            "sys.path.insert(0, sys.argv[1])\n"
            f"{setup.strip()}\n"
            'if path != "-":\n'
            '    info = sb.extract(path, store, "files/huge", max_bytes=int(size))\n'
            "    assert info.size_bytes == int(size), info\n"
            f"{idle_part}{after_part}"
            'print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))\n')


def child_peak_rss(child: str, *args: str, timeout: float) -> float:
    """Run `python -c child ROOT *args`; the peak RSS (MB) it reports as JSON on its last line."""
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", child, root, *args], check=True, capture_output=True, text=True,
                         timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def data_dir(prefix: str, need_bytes: int):
    """A temporary directory for the files a benchmark's pipeline writes
    (storage, outbox): `BENCH_DATA_DIR` when set, else on a tmpfs
    (/dev/shm) when one has room, else the usual temp dir. On a VM's ext4
    disk, creating inodes right after many were deleted (a test run, an
    earlier round) can cost several times its usual CPU, which would measure
    the disk's state rather than courier. Returns (TemporaryDirectory, where)."""
    import shutil
    import tempfile

    root = os.environ.get("BENCH_DATA_DIR")
    if root is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        if shutil.disk_usage("/dev/shm").free > need_bytes + 512 * MiB:
            root = "/dev/shm"
    tmp = tempfile.TemporaryDirectory(prefix=prefix, dir=root, ignore_cleanup_errors=True)
    return tmp, ("tmpfs" if root == "/dev/shm" else root or tempfile.gettempdir())


def start_redis(tmp: Path):
    """A redis-server of the bench's own, its files in `tmp`/redis (made here), started."""
    from tests.fixtures.redis_server import RedisServer

    (tmp / "redis").mkdir()
    return RedisServer(tmp / "redis").start()


def courier_worker(tmpd: Path, redis_url: str, tag: str, *, queues: str = "turns,sandbox,delivery",
                   concurrency: int = 2, **settings: str):
    """A private courier deployment for a bench: its environment (the Redis at `redis_url`, a data
    dir under `tmpd`, `settings` as COURIER_* variables) made this process's settings too, and
    one worker started on it (logging to tmpd/worker.log; not waited for). Returns (env, the
    Celery app, the worker's name, its process)."""
    env = {**os.environ, "COURIER_REDIS_URL": redis_url, "COURIER_DATA_DIR": str(tmpd / "data"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           **{f"COURIER_{k.upper()}": v for k, v in settings.items()}}
    os.environ.update({k: v for k, v in env.items() if k.startswith("COURIER_")})
    from workers.settings import reset_settings

    reset_settings()
    import workers.celery_app as celery_app
    from workers.demo import start_worker

    name = f"bench-{tag}-{os.getpid()}@localhost"
    proc = start_worker(env, name, queues=queues, concurrency=concurrency, log_path=str(tmpd / "worker.log"))
    return env, celery_app.app, name, proc


# -- the delivery benches: receipts polled until every delivery is final -------------------------
def wait_final(r, delivery_ids: list[str], *, poll_s: float, timeout_s: float | None = None) -> tuple[int, int]:
    """Poll the deliveries' states (only those not final yet, one pipeline a
    poll, every `poll_s`) until each is delivered or failed, or `timeout_s`
    has passed. Returns (failed, still not final)."""
    from tasks.ledger import keys

    left, failed = list(delivery_ids), 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while left and (deadline is None or time.monotonic() < deadline):
        pipe = r.pipeline(transaction=False)
        for d in left:
            pipe.hget(keys.delivery(d), "state")
        states = pipe.execute()
        failed += sum(1 for s in states if s == "failed")
        left = [d for d, s in zip(left, states) if s not in ("delivered", "failed")]
        if left:
            time.sleep(poll_s)
    return failed, len(left)


def random_files(d: Path, names: Iterable[str], size: int = 1000) -> list[Path]:
    """A file of `size` random bytes in `d` for each of `names`."""
    files = []
    for name in names:
        p = d / name
        p.write_bytes(os.urandom(size))
        files.append(p)
    return files


def report_rounds(name: str, ours: list[float], theirs: list[float], baseline_name: str, *, target: float, n: int,
                  setup: str, sides: tuple[str, str] = ("all: ", "")) -> None:
    """Deliveries a second, the medians of alternating rounds against the baseline's (one lucky
    or unlucky round, a noisy neighbour on a VM, moves neither side), with every round's figure."""
    pairs = statistics.median(a / b for a, b in zip(ours, theirs))
    report(name, statistics.median(ours), "deliveries/s", baseline_name, statistics.median(theirs), target=target,
           extra=f"medians of {len(ours)} alternating rounds of n={n} after a warm-up; "
           f"{sides[0]}{', '.join(f'{x:.0f}' for x in ours)} vs {sides[1]}{', '.join(f'{x:.0f}' for x in theirs)}; "
           f"median of the paired ratios {pairs:.3f}; {setup}")


def send_each(r, ref, files: list[Path], *, window: int = 32) -> float:
    """Each of `files` (in sandbox `ref`) sent as its own job to outbox:c<i % 20>;
    the deliveries a second until the last is delivered. Receipts are polled
    cheaply, in enqueue order (the work is mostly FIFO): a window of `window`
    a poll (1: one read a poll, the oldest receipt not yet delivered)."""
    from tasks.dispatch import chains

    jobs = []
    t0 = time.perf_counter()
    for i, p in enumerate(files):
        job = chains.new_job_id("bench")
        chains.enqueue(r, chains.Plan(job_id=job, target=f"outbox:c{i % 20}",
                                      files=[chains.SandboxFile(ref=ref, path=str(p))]), job_kind="send")
        jobs.append(job)
    at = 0
    while at < len(jobs):
        batch = jobs[at:at + window]
        if len(batch) == 1:
            states = [r.hget(f"courier:delivery:{chains.delivery_id(batch[0], 0)}", "state")]
        else:
            pipe = r.pipeline()
            for j in batch:
                pipe.hget(f"courier:delivery:{chains.delivery_id(j, 0)}", "state")
            states = pipe.execute()
        if "failed" in states:
            raise SystemExit("a delivery failed")
        done = 0
        for st in states:
            if st != "delivered":
                break
            done += 1
        at += done
        if done < len(batch):
            time.sleep(0.005)
    return len(files) / (time.perf_counter() - t0)


def proc_status_mb(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory figure (VmRSS, VmHWM) in MB; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- the extraction benches' command line -------------------------------------------------------
def report_rss(name: str, peak: float, idle: float, idle_name: str = "same process idle") -> None:
    """The peak RSS of an extraction child against the 150 MB limit, with its idle figure."""
    report_limit(name, peak, "MB", limit=150, baseline_name=idle_name, baseline=idle)


def extract_main(rss: Callable[[], object], throughput: Callable[..., object], *flags: str) -> None:
    """`--rss`: rss(); else throughput(), each of `flags` (--stream, --openssh) a keyword: given or not."""
    argv = sys.argv[1:]
    if "--rss" in argv:
        rss()
    else:
        throughput(**{f: f"--{f}" in argv for f in flags})


if __name__ == "__main__":
    sys.exit("import me")


class WebPair:
    """courier's web process and a bare Starlette endpoint (`bench.bare_web`), both on a Redis of
    their own, with every platform's webhook secret set (`key`: the Discord signing key): the webhook
    benches measure one against the other. Use as a context manager: `base` maps "courier"/"bare"
    to their URLs once both answer; everything is stopped at the end."""

    def __init__(self, prefix: str) -> None:
        import tempfile

        from nacl.signing import SigningKey

        self.tmp = Path(tempfile.mkdtemp(prefix=prefix))
        self.key = SigningKey.generate()
        self.procs: list[subprocess.Popen] = []
        self.base: dict[str, str] = {}

    def __enter__(self) -> "WebPair":
        import httpx

        from tests.fixtures.redis_server import RedisServer
        from tests.fixtures.services import free_port, wait_until
        from tests.fixtures.webstack import webhook_settings

        root = Path(__file__).resolve().parents[1]
        self.srv = RedisServer(self.tmp).start()
        env = {**os.environ, "PYTHONPATH": str(root), "COURIER_REDIS_URL": self.srv.url,
               "COURIER_DATA_DIR": str(self.tmp / "data"), **webhook_settings(self.key)}
        env.pop("CELERY_BROKER_URL", None)
        ports = {"courier": free_port(), "bare": free_port()}
        log = open(self.tmp / "web.log", "wb")  # noqa: SIM115 - the processes' log, open while they run
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(ports["courier"])],
            env=env, cwd=str(root), stdout=log, stderr=subprocess.STDOUT))
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "bench.bare_web:app", "--host", "127.0.0.1", "--port",
             str(ports["bare"]), "--log-level", "info"], env=env, cwd=str(root), stdout=log, stderr=subprocess.STDOUT))
        self.base = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
        for k in self.base:
            wait_until(lambda k=k: httpx.post(self.base[k] + "/webhooks/telegram", content=b"{}", timeout=1).status_code
                       in (200, 400, 401), timeout_s=30, what=f"the {k} web process")
        return self

    def __exit__(self, *exc: object) -> None:
        from tests.fixtures.services import stop_process

        for p in self.procs:
            stop_process(p)
        self.srv.stop()


def tree_pids(pid: int) -> list[int]:
    """`pid` and its live descendants, now (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of `pids` so far (a process gone counts 0)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")
