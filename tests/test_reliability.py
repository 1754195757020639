"""Nothing is lost when a worker dies, and nothing is sent twice."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from adapters.platforms.outbox import read_log
from tasks.ledger import receipts
from tests.fixtures.faults import children_of
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow

AGENT = """
import os, sys, time, json
marker = os.path.join(os.getcwd(), "agent-runs")  # its workspace: the same one when the turn runs again
msg = sys.stdin.read()
first = not os.path.exists(marker)
with open(marker, "a") as f:
    f.write(str(os.getpid()) + "\\n")
if first:
    time.sleep(120)  # the workload: the test kills the worker while this runs
print("done: " + msg)
"""


def _worker_pids(proc) -> list[int]:
    return [proc.pid, *children_of(proc.pid)]


@pytest.mark.parametrize("how", ["pool_child", "whole_worker"])
def test_turn_survives_a_killed_worker(courier_env, tmp_path, redis_client, how):
    agent = tmp_path / "slow_agent.py"
    agent.write_text(AGENT)
    agents = json.dumps({"slow": {"command": [os.sys.executable, str(agent)], "timeout_s": 300}})
    env = courier_env(COURIER_AGENTS=agents)  # the default visibility timeout (1 h): the ledger recovers
    w1 = env.start_worker(queues="turns", concurrency=1)
    res = env.cli("turn", "outbox:rel", "hello", "--agent", "slow", "--json")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["job"]
    marker = env.data_dir / "sandbox" / "slow" / "turns" / job / "agent-runs"
    wait_until(lambda: marker.exists(), timeout_s=60, what="the agent to start")
    # while the turn runs its due time follows its lease: a dead worker's turn runs again when
    # the lease lapses (~LEASE_TTL_S), not at the turn's 60 s grace
    from tasks.ledger import keys, ledger

    assert (redis_client.zscore(keys.due("turn"), job) or 1e18) <= time.time() + ledger.LEASE_TTL_S + 2

    if how == "pool_child":
        # the pool process dies mid-task: the task is rejected and requeued at once
        children = _worker_pids(w1)[1:]
        assert children, "no pool child found"
        for pid in children:
            os.kill(pid, signal.SIGKILL)
    else:
        # the whole worker dies (SIGKILL, no warm shutdown): its message stays unacked
        # for the visibility timeout (1 h), but the turn's lease lapses within 20 s
        # and the reconciler (in the new worker) runs it again
        for pid in _worker_pids(w1):
            os.kill(pid, signal.SIGKILL)
        w1.wait(timeout=10)
        env.start_worker(queues="turns", concurrency=1)
    env.start_worker(queues="delivery,sandbox")

    try:
        wait_until(lambda: (receipts.get_job(redis_client, job) or {}).get("state") == "replied", timeout_s=90,
                   what="the turn to be redelivered and finish")
    except AssertionError as exc:
        logs = "\n".join(f"--- {p.courier_log}\n{p.courier_log.read_text()[-2000:]}" for p in env.workers)
        keys = {k: redis_client.type(k) for k in redis_client.scan_iter("*")}
        raise AssertionError(f"{exc}\njob: {receipts.get_job(redis_client, job)}\nkeys: {keys}\n{logs}") from None
    wait_until(lambda: [d for d in receipts.job_deliveries(redis_client, job) if d.get("state") == "delivered"],
               timeout_s=60, what="the reply delivered")
    log = read_log(env.outbox, "rel")
    assert [r["text"] for r in log] == ["done: hello"]  # delivered exactly once
    assert len(marker.read_text().split()) == 2  # the agent ran again after the crash


def test_redelivered_delivery_is_not_sent_twice(courier_env, redis_client, tmp_path):
    """A delivery task that runs again after success (at-least-once) sends nothing."""
    env = courier_env()
    env.start_worker()
    f = tmp_path / "a.txt"
    f.write_text("hello")
    res = env.cli("send", "outbox:dup", str(f), "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    d = data["deliveries"][0]
    # the very same step once more in the chat's lane (a duplicate message, a redelivery),
    # and the drive of the lane published twice, then a probe behind them
    from tasks.dispatch import chains
    from tasks.ledger import keys

    redis_client.rpush(keys.lane("outbox:dup"), d["id"])
    with env.publishing():
        chains.publish_lane("outbox:dup")
        chains.enqueue(redis_client, chains.Plan(job_id=chains.new_job_id("probe"), target="outbox:dup",
                                                 text="probe"))
    wait_until(lambda: any(r.get("text") == "probe" for r in read_log(env.outbox, "dup")), timeout_s=30,
               what="the probe after the redelivered task")
    names = [r.get("name") for r in read_log(env.outbox, "dup") if r["kind"] != "text"]
    assert names == ["a.txt"]
