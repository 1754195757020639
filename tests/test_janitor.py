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
