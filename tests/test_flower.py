"""Flower, the operators' view, sees courier's tasks (real worker, real Flower)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow


def test_flower_lists_courier_tasks_behind_basic_auth(courier_env, tmp_path):
    env = courier_env()
    env.start_worker()
    with env.flower("--basic_auth=ops:pw") as base:
        assert httpx.get(f"{base}/api/tasks", timeout=10).status_code == 401
        f = tmp_path / "x.txt"
        f.write_text("hi")
        res = env.cli("send", "outbox:fl", str(f), "--wait", "--timeout", "60")
        assert res.returncode == 0, res.stderr

        def seen():
            r = httpx.get(f"{base}/api/tasks", auth=("ops", "pw"), timeout=10)
            r.raise_for_status()
            return [t for t in r.json().values()
                    if t.get("name") == "courier.delivery.drive_lane" and t.get("state") == "SUCCESS"]

        tasks = wait_until(seen, timeout_s=60, what="flower to show the delivery task")
        assert tasks[0]["worker"].startswith("t")


#: the tasks that drive a lane: drive_lane, and an extraction in a worker that serves the delivery queue too
LANE_DRIVERS = ("courier.delivery.drive_lane", "courier.sandbox.extract_file")


def test_a_failed_delivery_is_a_failure_in_flower(courier_env, tmp_path):
    """A delivery that failed for good was a SUCCESS task in Flower: the task that
    drove the lane now ends FAILURE, naming the delivery and its reason (here the
    extraction's own: the worker serves every queue, so it drove the lane itself)."""
    env = courier_env()
    gone = env.sandbox / "gone.csv"
    gone.write_text("x")
    res = env.cli("send", "outbox:ff", f"local://{gone}", "--json")
    assert res.returncode == 0, res.stderr
    did = json.loads(res.stdout)["deliveries"][0]
    gone.unlink()  # gone before any worker looks: fails for good
    login = tmp_path / "flower_basic_auth"
    login.write_text("ops:pw\n")  # the login from a secret file, as compose mounts it
    with env.flower(env={"FLOWER_BASIC_AUTH_FILE": str(login)}) as base:
        assert httpx.get(f"{base}/api/tasks", timeout=10).status_code == 401
        env.start_worker()

        def failed():
            r = httpx.get(f"{base}/api/tasks", auth=("ops", "pw"), timeout=10)
            r.raise_for_status()
            return [t for t in r.json().values()
                    if t.get("name") in LANE_DRIVERS and t.get("state") == "FAILURE"]

        (task,) = wait_until(failed, timeout_s=60, what="flower to show the lane's task failed")
        assert did in task["exception"] and "gone.csv" in task["exception"]
    rows = json.loads(env.cli("status", did, "--json").stdout)
    assert rows["state"] == "failed"
