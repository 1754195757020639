"""The janitor, run by a real worker: old screenshots, files, spills and turn
workspaces go, fresh ones stay."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from storage.volume import VolumeStore
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow


def test_janitor_expires_by_age_and_prefix(courier_env, tmp_path):
    env = courier_env()
    store = VolumeStore(env.data_dir / "storage")
    now = time.time()
    ages = {
        "screenshots/t1/old.png": 25 * 3600, "screenshots/t1/new.png": 23 * 3600,
        "files/j1/0-old.bin": 8 * 24 * 3600, "files/j2/0-new.bin": 3600,
        "hook_outputs/s1/old.txt": 8 * 24 * 3600, "hook_outputs/s1/new.txt": 60,
    }
    for key, age in ages.items():
        store.put_bytes(key, b"x" * 10)
        os.utime(store.local_path(key), (now - age, now - age))
    turns = env.data_dir / "sandbox" / "demo" / "turns"  # local turn workspaces: 24 h untouched
    for name, age in (("turn_old", 25 * 3600), ("turn_new", 3600)):
        (turns / name / "inbox").mkdir(parents=True)
        (turns / name / "inbox" / "a.txt").write_text("x")
        os.utime(turns / name, (now - age, now - age))
    env.start_worker(queues="janitor")
    from workers.celery_app import make_app

    app = make_app(env.settings())  # courier's app: its messages are signed
    app.send_task("courier.janitor.sweep", queue="janitor", exchange="janitor", routing_key="janitor")
    wait_until(lambda: not store.exists("screenshots/t1/old.png") and not store.exists("files/j1/0-old.bin")
               and not store.exists("hook_outputs/s1/old.txt") and not (turns / "turn_old").exists(),
               timeout_s=60, what="the sweep")
    assert (turns / "turn_new" / "inbox" / "a.txt").exists()
    assert store.exists("screenshots/t1/new.png")
    assert store.exists("files/j2/0-new.bin")
    assert store.exists("hook_outputs/s1/new.txt")


def test_beat_schedules_the_janitor():
    from workers.celery_app import app

    entry = app.conf.beat_schedule["janitor-sweep"]
    assert entry["task"] == "courier.janitor.sweep" and entry["options"]["queue"] == "janitor"
    assert "courier.janitor.sweep" in app.tasks or app.loader.import_default_modules() is not None


def test_sweep_aborts_abandoned_multipart_uploads_and_outbox_partials(s3_server, tmp_path):
    """A worker killed mid-upload leaves an unfinished multipart upload on S3
    (its parts kept, and billed, forever) and a `.part` file in the outbox:
    the janitor's sweep removes both once they are old, and nothing fresh."""
    from adapters.platforms.outbox import OutboxPlatform

    bucket = s3_server.make_bucket()
    store = s3_server.store(bucket, "courier")
    c = s3_server.client()
    up = c.create_multipart_upload(Bucket=bucket, Key="courier/files/j/0-big.bin")
    c.upload_part(Bucket=bucket, Key="courier/files/j/0-big.bin", UploadId=up["UploadId"], PartNumber=1,
                  Body=b"x" * 1024)
    other = c.create_multipart_upload(Bucket=bucket, Key="elsewhere/x.bin")  # not under the store's prefix
    assert len(s3_server.pending_uploads(bucket)) == 2
    assert store.sweep_tmp(older_than_s=3600) == 0  # fresh: a live upload may still be going
    assert store.sweep_tmp(older_than_s=0) == 1
    assert [u["Key"] for u in s3_server.pending_uploads(bucket)] == ["elsewhere/x.bin"]
    c.abort_multipart_upload(Bucket=bucket, Key="elsewhere/x.bin", UploadId=other["UploadId"])

    outbox = OutboxPlatform(tmp_path / "outbox")
    outbox.send_text("chat", "hello", delivery_id="d.0")
    old, fresh = tmp_path / "outbox" / "chat" / ".dead.part", tmp_path / "outbox" / "chat" / ".live.part"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert outbox.sweep_partial(older_than_s=3600) == 1
    assert not old.exists() and fresh.exists()


def _aged(store, ages: dict[str, tuple[float, int]]) -> None:
    now = time.time()
    for key, (age, size) in ages.items():
        store.put_bytes(key, b"x" * size)
        os.utime(store.local_path(key), (now - age, now - age))


def test_two_sweeps_never_run_at_once(courier_env, redis_client):
    """Two beats (or a beat and an operator) used to run two sweeps at once.
    With the lock, the second sweep finds the first one running and leaves."""
    import dataclasses
    import threading

    from tasks.ledger import keys
    from tasks.ops.janitor import sweep
    from workers.wiring import build_context

    env = courier_env()
    ctx = build_context(env.settings())
    store = ctx.store
    _aged(store, {"files/j1/0-old.bin": (8 * 24 * 3600, 100)})
    listing, go_on = threading.Event(), threading.Event()

    class SlowStore:
        """The real store whose listing waits until the test lets it go on."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def list(self, prefix=""):
            listing.set()
            assert go_on.wait(30)
            return self.inner.list(prefix)

    first: list = []
    t = threading.Thread(target=lambda: first.append(sweep(dataclasses.replace(ctx, store=SlowStore(store)))))
    t.start()
    assert listing.wait(30)
    second = sweep(ctx)  # meanwhile
    assert second["skipped"] and second["holder"]
    assert store.exists("files/j1/0-old.bin")  # the second sweep touched nothing
    assert redis_client.ttl(keys.janitor_lock()) > 0  # a dead sweeper's lock lapses
    go_on.set()
    t.join(30)
    assert first[0]["files"] == {"count": 1, "bytes": 100}
    assert not store.exists("files/j1/0-old.bin")
    assert not redis_client.exists(keys.janitor_lock())  # released: the next sweep runs
    assert sweep(ctx)["files"] == {"count": 0, "bytes": 0}


def test_janitor_cli_dry_run_counts_then_sweeps(courier_env):
    env = courier_env()
    store = VolumeStore(env.data_dir / "storage")
    _aged(store, {
        "screenshots/t/old.png": (25 * 3600, 1000), "screenshots/t/new.png": (3600, 7),
        "files/j1/0-a.bin": (8 * 24 * 3600, 2000), "files/j1/1-b.bin": (8 * 24 * 3600, 3000),
        "files/j2/0-c.bin": (3 * 24 * 3600, 500), "files/j3/0-d.bin": (12 * 3600, 40),
    })
    res = env.cli("janitor", "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["dry_run"] is True
    assert got["screenshots"] == {"count": 1, "bytes": 1000}
    assert got["files"] == {"count": 2, "bytes": 5000}
    assert store.exists("files/j1/0-a.bin") and store.exists("screenshots/t/old.png")  # nothing touched
    table = env.cli("janitor", "--dry-run")  # piped: one unwrapped line per row
    assert table.returncode == 0 and re.search(r"files\s+2\s+4\.9 KiB", table.stdout), table.stdout
    assert "nothing deleted" in table.stdout

    for bad in ("10m", "soon", "-3d"):
        res = env.cli("janitor", "--older-than", bad)
        assert res.returncode == 2 and "--older-than" in res.stderr, (bad, res.stderr)
    res = env.cli("janitor", "--json")
    assert json.loads(res.stdout)["files"] == {"count": 2, "bytes": 5000}
    assert not store.exists("files/j1/0-a.bin") and store.exists("files/j2/0-c.bin")
    # --older-than replaces the TTLs: 2 days takes the 3-day-old file, not the 12-hour-old one
    res = env.cli("janitor", "--older-than", "2d", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files"] == {"count": 1, "bytes": 500}
    assert store.exists("files/j3/0-d.bin") and store.exists("screenshots/t/new.png")


def test_janitor_cli_says_when_another_sweep_runs(courier_env, redis_client):
    from tasks.ledger import keys

    env = courier_env()
    redis_client.set(keys.janitor_lock(), "otherhost:123:abc", ex=60)
    res = env.cli("janitor")
    assert res.returncode == 1 and "another sweep is running (otherhost:123:abc)" in res.stderr


def test_a_second_beat_stands_by_until_the_first_is_gone(redis_server, redis_client, tmp_path):
    """Two beat processes: only the one holding the beat lock schedules; the
    other stands by and takes over once the first is gone (killed: its lock
    lapses, here deleted instead of waiting out its 30 s TTL)."""
    import signal
    import subprocess
    import sys

    from tasks.ledger import keys
    from tests.fixtures.services import stop_process, wait_until
    from tests.fixtures.workers import ROOT
    from workers.celery_app import BEAT_LOCK_TTL_S

    env = {**os.environ, "COURIER_REDIS_URL": redis_server.url, "PYTHONPATH": str(ROOT),
           "COURIER_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}

    def beat(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
        return subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.fixtures._beat_app", "beat",
                                 f"--schedule={tmp_path / name}-schedule", "--max-interval=1", "--loglevel=INFO"],
                                env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)

    def origins() -> list[int]:
        out = []
        for raw in redis_client.lrange("beatprobe", 0, -1):
            origin = json.loads(raw)["headers"]["origin"]  # gen<pid>@host: the publishing process
            out.append(int(origin.split("@")[0][3:]))
        return out

    a = beat("a")
    b = None
    try:
        wait_until(lambda: origins().count(a.pid) >= 2, timeout_s=30, what="beat a to schedule")
        assert 0 < redis_client.ttl(keys.beat_lock()) <= BEAT_LOCK_TTL_S
        b = beat("b")
        wait_until(lambda: "standing by" in (tmp_path / "b.log").read_text(), timeout_s=30, what="beat b to wait")
        seen = len(origins())
        wait_until(lambda: len(origins()) >= seen + 5, timeout_s=30, what="five more ticks")
        assert set(origins()) == {a.pid}  # b scheduled nothing
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        redis_client.delete(keys.beat_lock())  # what its TTL does after 30 s
        wait_until(lambda: b.pid in origins(), timeout_s=30, what="beat b to take over")
        assert str(b.pid) in redis_client.get(keys.beat_lock())
    finally:
        for p in (a, b):
            if p is not None:
                stop_process(p)


def _s3_env(srv, bucket: str) -> dict:
    return {"COURIER_STORAGE_URL": f"s3://{bucket}/courier", "AWS_ENDPOINT_URL": srv.endpoint_url,
            "AWS_ACCESS_KEY_ID": srv.access_key, "AWS_SECRET_ACCESS_KEY": srv.secret_key,
            "AWS_DEFAULT_REGION": srv.region}


def _count_requests(store) -> list[str]:
    """Every HTTP request the store's boto3 client sends (retries included), by operation."""
    sent: list[str] = []
    store._client.meta.events.register("before-send.s3", lambda **kw: sent.append(kw["request"].method))
    return sent


def test_s3_lifecycle_rules_replace_the_listing(courier_env, s3_server, monkeypatch):
    """On SeaweedFS (tests/fixtures/s3_server.py), which stores and returns
    lifecycle configurations: `courier janitor --install-lifecycle` puts one
    rule per retention prefix (TTL in whole days, rounded up) and one that
    aborts stale multipart uploads, keeping the bucket's other rules; with
    COURIER_S3_LIFECYCLE a sweep makes one request (the rules are in place)
    and lists nothing. Whether the server then expires objects is its own
    business (days, not testable here)."""
    from tasks.ops.janitor import sweep
    from workers.wiring import build_context

    bucket = s3_server.make_bucket()
    c = s3_server.client()
    other = {"ID": "theirs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 30}}
    c.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [other]})
    env = courier_env(**_s3_env(s3_server, bucket), COURIER_SCREENSHOT_TTL_S="3600", COURIER_S3_LIFECYCLE="1")
    res = env.cli("janitor", "--install-lifecycle", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["changed"] is True and got["kept"] == 1
    rules = {r["ID"]: r for r in c.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert rules["theirs"]["Expiration"]["Days"] == 30
    assert rules["courier:courier/files/"]["Filter"]["Prefix"] == "courier/files/"
    assert rules["courier:courier/files/"]["Expiration"]["Days"] == 7
    assert rules["courier:courier/screenshots/"]["Expiration"]["Days"] == 1  # 1 h: rounded up to a day
    assert rules["courier:courier/hook_outputs/"]["Expiration"]["Days"] == 7
    assert rules["courier:courier/*multipart"]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1
    table = env.cli("janitor", "--install-lifecycle")
    assert table.returncode == 0 and "already in place" in table.stdout and "courier/files/" in table.stdout

    s3 = s3_server.store(bucket, "courier")
    for i in range(30):
        s3.put_bytes(f"files/j/{i}-a.bin", b"x")
    for k, v in _s3_env(s3_server, bucket).items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    ctx = build_context(env.settings())
    sent = _count_requests(ctx.store)
    res = sweep(ctx)
    assert res["files"] is None and res["s3_lifecycle"] == {"rules": 5, "changed": False}
    assert sent == ["GET"]  # the rules are read; nothing listed, nothing deleted
    assert len(list(s3.list("files/"))) == 30
    # a dry run and --older-than still look at every file (the operator asked)
    sent.clear()
    dry = sweep(ctx, dry_run=True)
    assert dry["files"]["count"] == 0 and "GET" in sent and "s3_lifecycle" not in dry

    # a volume has no lifecycle: exit 2
    vol = courier_env()
    res = vol.cli("janitor", "--install-lifecycle")
    assert res.returncode == 2 and "S3 storage" in res.stderr
    s3_server.drop_bucket(bucket)
