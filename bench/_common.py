"""Shared output for benchmarks: each prints exactly one figure line.

    BENCH <name>: <value> <unit> vs <baseline name> <baseline> <unit> ratio <r> (target <op> <t>) PASS|MISS
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
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


if __name__ == "__main__":
    sys.exit("import me")


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
