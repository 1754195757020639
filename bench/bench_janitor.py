"""The janitor expiring files on a volume: 100 000 files of 1 KB under
`files/` (1 000 job directories), all past their TTL, swept by
`tasks.janitor.sweep` (its lock, listing, deletes in batches, empty job
directories pruned), against `find <dir> -type f -mmin +N -delete` on an
identical tree, same run. Target: <= 10 s, and the ratio to find reported.

    python -m bench.bench_janitor            (BENCH_QUICK=1: 10 000 files)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import data_dir, quick  # noqa: E402


def _tree(root: Path, n: int, per_dir: int = 100) -> None:
    old = time.time() - 30 * 24 * 3600
    blob = b"x" * 1000
    for i in range(n):
        d = root / "files" / f"job{i // per_dir:05d}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        p = d / f"{i % per_dir}-f.bin"
        p.write_bytes(blob)
        os.utime(p, (old, old))
    for d in (root / "files").iterdir():
        os.utime(d, (old, old))


def main() -> int:
    from tests.fixtures.redis_server import RedisServer

    n = 10_000 if quick() else 100_000
    data_tmp, where = data_dir("courier-bench-janitor-", 3 * n * 8192)
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as tmp, data_tmp as data:
        rdir = Path(tmp) / "redis"
        rdir.mkdir()
        srv = RedisServer(rdir).start()
        try:
            os.environ.update(COURIER_REDIS_URL=srv.url, COURIER_DATA_DIR=f"{data}/courier")
            from tasks.janitor import sweep
            from workers.settings import reset_settings
            from workers.wiring import build_context

            reset_settings()
            ctx = build_context()
            store_root = Path(data) / "courier" / "storage"
            _tree(store_root, n)
            t0 = time.perf_counter()
            res = sweep(ctx)
            took = time.perf_counter() - t0
            if res["files"]["count"] != n:
                print(f"swept {res['files']} of {n}", file=sys.stderr)
                return 1
            left = sum(len(fs) for _, _, fs in os.walk(store_root / "files"))
            base_root = Path(data) / "find"
            _tree(base_root, n)
            t0 = time.perf_counter()
            subprocess.run(["find", str(base_root / "files"), "-type", "f", "-mmin", "+60", "-delete"], check=True)
            base = time.perf_counter() - t0
        finally:
            srv.stop()
    ok = took <= 10.0
    print(f"BENCH janitor_volume_{n}_files: {took:.3g} s vs find -delete {base:.3g} s ratio {took / base:.3g} "
          f"(limit <= 10 s) {'PASS' if ok else 'MISS'} [{res['files']['bytes']} bytes, {left} files left, "
          f"whole sweep {res['took_s']} s incl. the other prefixes and workspaces; on {where}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
