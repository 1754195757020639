"""Leases need progress (issue 24): after a Sentinel failover a pool child stopped working while its
heartbeat kept renewing its lane's lease, and 9 deliveries waited 12.5 minutes. A lane's drive now
keeps its lease only while it makes progress: a holder stuck in a call without a deadline loses it
within a minute and its process is recycled; the chat moves on."""

from __future__ import annotations

import json
import threading

from tasks.ledger import keys, ledger, receipts
from tests.fixtures.faults import children_of
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv


def test_a_lease_that_needs_progress_is_renewed_only_while_its_holder_makes_some():
    r = ledger._Renewer()
    r.stall_s = 10.0
    stalled: list[str] = []
    r.on_stall = lambda key, idle: stalled.append(key)
    a = r.add(None, "lease:a", "t", 20, needs_progress=True)
    r.add(None, "lease:b", "t", 20)  # a turn's: renewed whatever it does
    t0 = r.held[a].last
    renew, found = r.due(t0 + 5)
    assert {h.key for h in renew} == {"lease:a", "lease:b"} and not found
    renew, found = r.due(t0 + 11)
    assert {h.key for h in renew} == {"lease:b"} and [h.key for h, _ in found] == ["lease:a"]
    assert r.due(t0 + 12)[1] == []  # told once
    # a mark from another thread (an SDK's event loop reading the file a drive sends) is progress too
    threading.Thread(target=r.mark, args=([a],)).start()
    wait_until(lambda: r.held[a].last > t0, 10, what="the mark")
    assert "lease:a" in {h.key for h in r.due(r.held[a].last + 1)[0]}


def test_a_stuck_drive_loses_its_lane_and_its_process_is_recycled(tmp_path, redis_server, redis_client,
                                                                  fake_telegram):
    """A platform that stops answering mid-send (its SDK would wait a minute): the drive makes no
    progress, its lease lapses, the pool process is replaced and the chat moves on as soon as the
    platform answers again (e82a350: the lease was renewed until the soft time limit, 30 minutes)."""
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_LEASE_STALL_S="3",
                     TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    try:
        w = env.start_worker(queues="delivery", concurrency=1)
        (child,) = children_of(w.pid)
        fake_telegram.latency_s = 50.0  # under the SDK's 60 s read timeout: the send just waits
        res = env.cli("send", "telegram:4242", "--text", "wait for me", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        job = json.loads(res.stdout)["job"]
        lease = keys.lease("lane", "telegram:4242")
        wait_until(lambda: redis_client.exists(lease), 30, what="the drive to hold the lane")
        # no progress: the lease lapses (stall 3 s + its 20 s), the stuck pool process is replaced
        wait_until(lambda: not redis_client.exists(lease), 60, what="the stuck drive to lose the lane")
        wait_until(lambda: child not in children_of(w.pid) and children_of(w.pid), 60,
                   what="the stuck pool process to be replaced")
        fake_telegram.latency_s = 0.0  # the platform answers again
        wait_until(lambda: (receipts.job_deliveries(redis_client, job) or [{}])[0].get("state") == "delivered", 90,
                   what="the chat to move on")
        assert "no progress" in w.courier_log.read_text()
    finally:
        fake_telegram.latency_s = 0.0
        env.stop()
