"""The janitor, run by a real worker: old screenshots, files, spills and turn
workspaces go, fresh ones stay."""

from __future__ import annotations

import os
import time

import pytest
from celery import Celery

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
    app = Celery(broker=env.env["COURIER_REDIS_URL"])
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
