"""`courier retry` and `courier cancel` against a real Redis and real worker
processes (the outbox platform: a directory), and the ledger scripts under
them (tasks/ops/operations.py)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.services import wait_until
from tests.fixtures.workers import ROOT

pytestmark = pytest.mark.slow


def _status(env, ident: str) -> dict:
    return json.loads(env.cli("status", ident, "--json").stdout)


def _final(env, job: str, timeout_s: float = 60) -> dict:
    def done():
        got = _status(env, job)
        rows = got["deliveries"]
        return got if rows and all(r["state"] in ("delivered", "failed", "cancelled") for r in rows) else None

    return wait_until(done, timeout_s=timeout_s, what=f"{job}'s deliveries to be final")


def _arrived(env, chat: str) -> list[str]:
    """The files the outbox wrote for `chat` (its log of messages aside)."""
    from adapters.platforms.outbox import LOG_NAME

    d = env.outbox / chat
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".") and p.name != LOG_NAME) \
        if d.exists() else []


def _texts(env, chat: str) -> list[str]:
    from adapters.platforms.outbox import LOG_NAME

    log = env.outbox / chat / LOG_NAME
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(x)["text"] for x in lines if json.loads(x).get("kind") == "text"]


def test_retry_requeues_a_failed_extraction_and_refuses_a_delivered_one(courier_env):
    env = courier_env()
    f = env.sandbox / "late.csv"
    f.write_text("a,b\n")
    res = env.cli("send", "outbox:rt", f"local://{f}", "--text", "first", "--json")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["job"]
    f.unlink()  # gone before any worker looks: the extraction fails for good
    env.start_worker()
    got = _final(env, job)
    assert [d["state"] for d in got["deliveries"]] == ["delivered", "failed"]
    text_id, file_id = (d["id"] for d in got["deliveries"])

    # refused, nothing re-queued: a delivered one (with a clear message), an unknown id
    res = env.cli("retry", text_id, file_id)
    assert res.returncode == 2 and f"{text_id}: already delivered" in res.stderr and "nothing was re-queued" in res.stderr
    assert _status(env, file_id)["state"] == "failed"
    res = env.cli("retry", "snd_nosuch.0", "--json")
    assert res.returncode == 2 and json.loads(res.stdout)["refused"][0]["reason"] == "no such delivery or job"

    f.write_text("a,b\n1,2\n")  # the file is back: the retry extracts it again, then the lane sends it
    res = env.cli("retry", job, "--wait", "--json", "--timeout", "60")  # a job id: its failed deliveries
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert [(d["id"], d["state"]) for d in got["deliveries"]] == [(file_id, "delivered")]
    rec = _status(env, file_id)
    assert rec["retries"] == 1 and not rec.get("reason") and rec["size_bytes"] == 8
    assert sum(n.endswith("late.csv") for n in _arrived(env, "rt")) == 1
    # the text was not sent again; the chat was told of the missing file (the operator's send too)
    assert _texts(env, "rt") == ["first", "⚠️ late.csv could not be sent: it is not in the agent's workspace."]
    res = env.cli("retry", file_id)
    assert res.returncode == 2 and "already delivered" in res.stderr
    table = env.cli("retry", text_id)  # piped: data is never read as markup, one line per row
    assert any(text_id in ln and "already delivered (message id" in ln for ln in table.stdout.splitlines()), table.stdout


def test_cancel_pending_deliveries_are_never_sent_and_the_lane_goes_on(courier_env, tmp_path):
    env = courier_env()
    a = tmp_path / "a [b]x.txt"
    a.write_text("a")
    res = env.cli("send", "outbox:cx", str(a), "--text", "never", "--json")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["job"]
    res = env.cli("cancel", job, "--json")  # no worker yet: nothing was sent
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert [d["outcome"] for d in got["deliveries"]] == ["cancelled", "cancelled"]
    table = env.cli("cancel", job)  # again: already final; piped, one line per row
    assert table.returncode == 0 and "0 deliveries cancelled" in table.stdout
    assert any(f"{job}.1" in ln and "already final" in ln for ln in table.stdout.splitlines()), table.stdout
    res = env.cli("send", "outbox:cx", "--text", "after", "--json")
    later = json.loads(res.stdout)["job"]
    env.start_worker()
    assert [d["state"] for d in _final(env, later)["deliveries"]] == ["delivered"]
    st = _status(env, job)
    assert st["job"]["state"] == "cancelled"
    assert [(d["state"], d["reason"]) for d in st["deliveries"]] == [("cancelled", "cancelled by the operator")] * 2
    assert _texts(env, "cx") == ["after"] and _arrived(env, "cx") == []  # only the later text
    # a cancelled delivery can be retried
    res = env.cli("retry", f"{job}.1", "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    assert any(n.endswith("x.txt") for n in _arrived(env, "cx"))
    res = env.cli("cancel", "snd_nosuch")
    assert res.returncode == 2 and "no send or turn" in res.stderr


def test_cancel_leaves_a_send_in_flight_to_finish(courier_env, redis_client):
    """The send lock held (as a worker holds it while it uploads): cancel
    leaves that delivery alone and waits, up to --timeout, for it to end."""
    from tasks.delivery import sendlock
    from tasks.ledger import receipts
    from tasks.ops import operations

    env = courier_env()
    res = env.cli("send", "outbox:fl", "--text", "one", "--json")
    job = json.loads(res.stdout)["job"]
    did = f"{job}.0"
    locked, _rec, n = sendlock.begin_send(redis_client, did, "test-owner", ttl_s=60, count_attempt=True)
    assert locked and n == 1
    res = env.cli("cancel", job, "--timeout", "1", "--json")
    assert res.returncode == 4 and "in flight" in res.stderr
    assert json.loads(res.stdout)["deliveries"][0]["outcome"] == "in_flight"
    assert _status(env, did)["state"] == "sending"
    receipts.update_delivery(redis_client, did, state="delivered", message_id="m1")
    sendlock.release_send_lock(redis_client, did, "test-owner")
    assert operations.cancel_delivery(redis_client, receipts.get_delivery(redis_client, did))["outcome"] == "final"
    res = env.cli("cancel", job, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["deliveries"][0]["state"] == "delivered"
    # and the other way round: cancelled first, a worker's begin_send finds nothing to send
    res = env.cli("send", "outbox:fl", "--text", "two", "--json")
    job2 = json.loads(res.stdout)["job"]
    assert env.cli("cancel", job2).returncode == 0
    locked, rec, n = sendlock.begin_send(redis_client, f"{job2}.0", "w", ttl_s=60, count_attempt=True)
    assert rec["state"] == "cancelled" and n == 0
    sendlock.release_send_lock(redis_client, f"{job2}.0", "w")


AGENT = """
import pathlib, sys, time
go = pathlib.Path(sys.argv[1]) / "go"
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
print("the answer")
"""


def test_cancel_a_running_turn_and_a_queued_one(courier_env, tmp_path):
    script = tmp_path / "slow_agent.py"
    script.write_text(AGENT)
    gate = tmp_path / "gate"  # named on the agent's command: its sandbox sees it
    gate.mkdir()
    go = gate / "go"
    agents = {"slow": {"command": [sys.executable, str(script), str(gate)], "timeout_s": 300}}
    env = courier_env(COURIER_AGENTS=json.dumps(agents))
    queued = env.cli("turn", "outbox:tc", "hello", "--agent", "slow").stdout.strip()
    res = env.cli("cancel", queued, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["turn"] == "queued"
    assert _status(env, queued)["job"]["state"] == "cancelled"
    env.start_worker()
    running = env.cli("turn", "outbox:tc", "hello", "--agent", "slow").stdout.strip()
    wait_until(lambda: _status(env, running)["job"]["state"] == "running", timeout_s=60, what="the turn to run")
    res = env.cli("cancel", running)
    assert res.returncode == 0 and "marked, it delivers nothing" in res.stdout
    go.write_text("")
    wait_until(lambda: _status(env, running)["job"]["state"] == "cancelled", timeout_s=60, what="the turn to end")
    res = env.cli("watch", running, "--json", "--timeout", "10")
    assert '"status": "cancelled"' in res.stdout
    later = json.loads(env.cli("send", "outbox:tc", "--text", "after", "--json").stdout)["job"]
    _final(env, later)
    assert _status(env, running)["deliveries"] == [] and _status(env, queued)["deliveries"] == []
    assert _texts(env, "tc") == ["after"]  # the later text only: neither turn's reply


def _blocked_on_xread(redis_client, proc) -> str:
    """The id of the CLI's connection once it blocks on XREAD (its wait on the job's event stream)."""
    def blocked():
        assert proc.poll() is None, proc.communicate()
        return next((c["id"] for c in redis_client.client_list()
                     if c.get("cmd") == "xread" and "b" in c.get("flags", "")), None)

    return wait_until(blocked, timeout_s=60, what="the CLI to block on XREAD")


def _mostly_blocked(redis_client, cid: str) -> None:
    """Sampled for a second, the connection is almost always blocked on XREAD: between looks it
    waits for an event, it does not poll (a poll would be seen running, or idle in a sleep)."""
    import time

    seen = []
    for _ in range(20):
        c = next(c for c in redis_client.client_list() if c["id"] == cid)
        seen.append(c.get("cmd") == "xread" and "b" in c.get("flags", ""))
        time.sleep(0.05)  # the sampling interval: not a wait for a condition
    assert sum(seen) >= 14, seen


def _finish(redis_client, job: str, did: str) -> float:
    """What a worker does when its send ends: the receipt and its event in one round trip."""
    import time

    from tasks.ledger import events, receipts

    p = redis_client.pipeline(transaction=False)
    receipts.update_delivery(p, did, state="delivered", message_id="m1")
    events.publish(redis_client, job, {"kind": "delivery", "delivery_id": did, "state": "delivered"}, pipe=p)
    p.execute()
    return time.monotonic()


def _woken(env, redis_client, job: str, did: str, *args: str) -> tuple[str, float]:
    """Run the CLI (`args`), see it block on XREAD, end the delivery as a
    worker does: its stdout, and how long it took to exit after the event."""
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], env=env.env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        _mostly_blocked(redis_client, _blocked_on_xread(redis_client, proc))
        t0 = _finish(redis_client, job, did)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    return stdout, took


def test_cancel_and_retry_waits_wake_on_the_delivery_event(courier_env, redis_client):
    """`cancel` waiting for a send in flight and `retry --wait` block on the
    job's event stream: the delivery's final event ends the wait at once."""
    from tasks.delivery import sendlock

    env = courier_env()
    job = json.loads(env.cli("send", "outbox:ev", "--text", "one", "--json").stdout)["job"]
    did = f"{job}.0"
    assert sendlock.begin_send(redis_client, did, "test-owner", ttl_s=60, count_attempt=True)[0]
    stdout, took = _woken(env, redis_client, job, did, "cancel", job, "--timeout", "120", "--json")
    row = json.loads(stdout)["deliveries"][0]
    assert (row["outcome"], row["state"], row["note"]) == ("final", "delivered", "was in flight: it finished")
    assert took < 3, took
    sendlock.release_send_lock(redis_client, did, "test-owner")

    # retry --wait: no worker runs; the test plays the worker's final event
    job = json.loads(env.cli("send", "outbox:ev", "--text", "two", "--json").stdout)["job"]
    did = f"{job}.0"
    assert env.cli("cancel", job).returncode == 0
    stdout, took = _woken(env, redis_client, job, did, "retry", did, "--wait", "--timeout", "120", "--json")
    got = json.loads(stdout)
    assert got["done"] and [(d["id"], d["state"]) for d in got["deliveries"]] == [(did, "delivered")]
    assert took < 3, took
