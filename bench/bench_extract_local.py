"""Local extraction (LocalSandbox.extract into a VolumeStore) vs `cp`.

    python bench/bench_extract_local.py            # 500 MB, store on the source's filesystem (target ratio >= 1.0)
    python bench/bench_extract_local.py --stream   # 500 MB, store on another filesystem (tmpfs when there is one; >= 1.0)
    python bench/bench_extract_local.py --rss      # peak RSS extracting 1 GiB, in a child process (limit <= 150 MB)

Each prints ONE line. BENCH_QUICK=1 shrinks the sizes. The source lives in a
temp dir under /tmp (the sandbox root; /dev is denylisted); `cp` writes where
the store writes. Our side also computes the sha256 the pipeline keys uploads
by, which `cp` does not: the extra field shows that hash alone (hashlib).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import MiB, child_peak_rss, extract_main, extract_vs_copy  # noqa: E402
from bench._common import make_file, quick, report, report_rss, rss_child  # noqa: E402
from bench._common import out_dir as other_fs_dir  # noqa: E402

#: at least as fast as `cp` of the same file to the same place
TARGET = 1.0


def hash_time(path: Path) -> float:
    t = time.perf_counter()
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(MiB):
            h.update(block)
    return time.perf_counter() - t


def throughput(stream: bool) -> None:
    from adapters.sandboxes.local import LocalSandbox
    from storage.volume import VolumeStore

    size = (50 if quick() else 500) * 1000 * 1000
    runs = 2 if quick() else 5  # a 500 MB copy takes ~0.3 s: five rounds each, best kept
    with tempfile.TemporaryDirectory(prefix="bench-local-", dir="/tmp") as tmp:
        src = Path(tmp) / "src.bin"
        make_file(src, size)
        out_parent = other_fs_dir() if stream else tmp
        if stream and out_parent is None:
            raise SystemExit("--stream needs another filesystem: set BENCH_OUT_DIR")
        out = Path(tempfile.mkdtemp(prefix="bench-local-out-", dir=out_parent))
        try:
            same_fs = os.stat(out).st_dev == os.stat(src).st_dev
            sb = LocalSandbox.with_roots((tmp,))
            store = VolumeStore(out / "store")
            ours, cp = extract_vs_copy(runs, sb, str(src), store, size, out,
                                       lambda dest: subprocess.run(["cp", str(src), str(dest)], check=True))
            sha = hash_time(src)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    mb = size / 1e6
    where = "same fs" if same_fs else "other fs"
    report(f"local extract {size // 1000 // 1000}MB, {where}", mb / min(ours), "MB/s", "cp", mb / min(cp),
           target=TARGET, extra=f"best of {runs}: {min(ours):.2f}s vs {min(cp):.2f}s; sha256 alone {sha:.2f}s")


CHILD = rss_child(r"""
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
root, path, store_dir, size = sys.argv[2:6]
sb = LocalSandbox.with_roots((root,))
store = VolumeStore(store_dir)
""")


def rss() -> None:
    size = (100 if quick() else 1024) * MiB
    with tempfile.TemporaryDirectory(prefix="bench-local-rss-", dir="/tmp") as tmp:
        src = Path(tmp) / "huge.bin"
        make_file(src, size, zeros=True)

        def child(path: str) -> float:
            return child_peak_rss(CHILD, tmp, path, str(Path(tmp) / "store"), str(size), timeout=600)

        idle = child("-")
        peak = child(str(src))
    report_rss(f"local extract {size // MiB} MiB peak RSS", peak, idle)


if __name__ == "__main__":
    extract_main(rss, throughput, "stream")
