"""The janitor expiring files on a volume: 100 000 files of 1 KB under
`files/` (1 000 job directories), all past their TTL, swept by
`tasks.ops.janitor.sweep` (its lock, listing, deletes in batches, empty job
directories pruned), against `find <dir> -type f -mmin +N -delete` on an
identical tree, same run. Target: <= 10 s, and the ratio to find reported.

    python -m bench.bench_janitor            (BENCH_QUICK=1: 10 000 files)

`--s3`: the janitor's S3 requests for 10 000 expired objects under `files/`
(1 KB each, 100 job prefixes) on a SeaweedFS server
(tests/fixtures/s3_server.py), counted at the boto3 client (every HTTP
request it sends, retries included): a sweep with COURIER_S3_LIFECYCLE (the
bucket's lifecycle rules expire them server-side: the sweep reads, and the
first time puts, the rules) against the listing sweep (ListObjectsV2 pages of
1000 per prefix, DeleteObjects batches of 1000, the multipart-upload listing),
same run. Target: <= 12 requests.

    python -m bench.bench_janitor --s3       (BENCH_QUICK=1: 2 000 objects)
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
            from tasks.ops.janitor import sweep
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


def _query(url: str) -> str:
    """What a request was, from its URL: `?lifecycle`, `?list-type=2`, `?delete`, `?uploads`..."""
    from urllib.parse import urlsplit

    q = urlsplit(url).query
    return "?" + q.split("&")[0].split("=")[0] if q else urlsplit(url).path.rsplit("/", 1)[-1][:20]


def _s3_sweep(n_expected: int | None, **env: str) -> tuple[dict, list[str], float]:
    """One janitor sweep with `env` set; returns its result, the HTTP requests
    its S3 client sent (method and operation), and the time it took."""
    from tasks.ops.janitor import sweep
    from workers.settings import reset_settings
    from workers.wiring import build_context

    os.environ.update(env)
    reset_settings()
    ctx = build_context()
    sent: list[str] = []
    events = ctx.store._client.meta.events  # one client per store URL and process: unregistered after
    events.register("before-send.s3", lambda **kw: sent.append(f"{kw['request'].method} {_query(kw['request'].url)}"),
                    unique_id="bench-janitor")
    try:
        t0 = time.perf_counter()
        res = sweep(ctx)
        took = time.perf_counter() - t0
    finally:
        events.unregister("before-send.s3", unique_id="bench-janitor")
    if n_expected is not None and res["files"]["count"] != n_expected:
        raise SystemExit(f"the listing sweep deleted {res['files']} of {n_expected}")
    return res, sent, took


def main_s3() -> int:
    from concurrent.futures import ThreadPoolExecutor

    from tests.fixtures.redis_server import RedisServer
    from tests.fixtures.s3_server import SeaweedS3

    n = 2_000 if quick() else 10_000
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as tmp:
        rdir, sdir = Path(tmp) / "redis", Path(tmp) / "s3"
        rdir.mkdir()
        sdir.mkdir()
        srv = RedisServer(rdir).start()
        s3 = SeaweedS3(sdir).start()
        try:
            bucket = s3.make_bucket()
            c = s3.client()
            blob = b"x" * 1000
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: c.put_object(Bucket=bucket, Key=f"courier/files/job{i // 100:05d}/{i}-f.bin",
                                                      Body=blob), range(n)))
            os.environ.update(COURIER_REDIS_URL=srv.url, COURIER_DATA_DIR=f"{tmp}/courier",
                              COURIER_STORAGE_URL=f"s3://{bucket}/courier", AWS_ENDPOINT_URL=s3.endpoint_url,
                              AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
                              AWS_DEFAULT_REGION=s3.region)
            ttl0 = {k: "0" for k in ("COURIER_FILE_TTL_S", "COURIER_SCREENSHOT_TTL_S", "COURIER_SPILL_TTL_S")}
            _, first, _ = _s3_sweep(None, COURIER_S3_LIFECYCLE="1", **ttl0)
            res, steady, lc_took = _s3_sweep(None, COURIER_S3_LIFECYCLE="1", **ttl0)
            left = sum(1 for _ in s3.store(bucket, "courier").list("files/"))
            _, listing, took = _s3_sweep(n, COURIER_S3_LIFECYCLE="0", **ttl0)
        finally:
            s3.stop()
            srv.stop()
    value, base = len(first), len(listing)
    ok = value <= 12
    ops = ", ".join(f"{op} x{listing.count(op)}" for op in dict.fromkeys(listing))
    print(f"BENCH janitor_s3_{n}_objects: {value} requests vs listing+delete_objects {base} requests ratio "
          f"{value / base:.3g} (limit <= 12 requests) {'PASS' if ok else 'MISS'} [lifecycle sweep: first "
          f"{'; '.join(first)}, then {len(steady)} ({'; '.join(steady)}) in {lc_took:.3g} s, {left} objects left for "
          f"the bucket's rules; listing sweep: {ops}, {took:.3g} s; SeaweedFS]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main_s3() if "--s3" in sys.argv[1:] else main())
