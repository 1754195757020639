"""Cancel and purge (issue 24): a cancelled send whose file waits on a `sandbox.<host>` queue no
worker consumes left its message there (the critical "queue has no consumer" alert kept firing) and
no command removed it. The real CLI against a real Redis: `courier cancel` drops the job's queued
messages; `courier queues --purge-orphans` lists (dry run) then drops messages whose ledger entry is
final or gone, and leaves live ones."""

from __future__ import annotations

import json

import pytest

from tasks.ledger import receipts
from tasks.ops import operations
from tests.fixtures.workers import CourierEnv


def _depth(env: CourierEnv, queue: str) -> int:
    res = env.cli("queues", "--json")
    assert res.returncode == 0, res.stderr
    rows = {q["queue"]: q for q in json.loads(res.stdout)["queues"]}
    return rows[queue]["depth"] if queue in rows else 0


def _send(env: CourierEnv, chat: str, host: str) -> str:
    res = env.cli("send", f"outbox:{chat}", f"docker://ctr-{host}/workspace/a.txt?host={host}", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["job"]

pytestmark = pytest.mark.usefixtures("redis_emptied")  # these sends have no worker: nothing left queued after


def test_cancel_drops_the_jobs_queued_messages(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    job = _send(env, "c", "h1")
    assert _depth(env, "sandbox.h1") == 1  # no worker consumes sandbox.h1
    res = env.cli("cancel", job, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["messages_dropped"] == 1 and got["deliveries"][0]["outcome"] == "cancelled", got
    assert _depth(env, "sandbox.h1") == 0


def test_purge_orphans_is_a_dry_run_first_and_leaves_live_messages(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    r = redis_server.client()
    dead, live = _send(env, "d", "h2"), _send(env, "l", "h3")
    (rec,) = receipts.job_deliveries(r, dead)
    operations.cancel_delivery(r, rec)  # cancelled by other means: its message is an orphan now
    res = env.cli("queues", "--purge-orphans", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["dry_run"] and got["removed"] == 0
    assert [(o["queue"], o["subject"], o["why"]) for o in got["orphans"]] == [
        ("sandbox.h2", rec["id"], "its delivery is cancelled")]
    assert _depth(env, "sandbox.h2") == 1  # a dry run drops nothing
    res = env.cli("queues", "--purge-orphans", "--yes", "--json")
    assert json.loads(res.stdout)["removed"] == 1
    assert _depth(env, "sandbox.h2") == 0 and _depth(env, "sandbox.h3") == 1  # the live one stays
    assert receipts.job_deliveries(r, live)[0]["state"] == "queued"
    res = env.cli("queues", "--yes")
    assert res.returncode == 2 and "--yes goes with --purge-orphans" in res.stderr
