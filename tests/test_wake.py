"""Lane wake-ups under a backlog (issue 12: courier's own cost per delivery).

A lane's wake-up is a `drive_lane` message of its own while workers keep up;
once `chains.WAKE_BACKLOG` drives are waiting to start, further wake-ups join
the ready set (`keys.lanes_ready()`), and each drive drains that set after its
own lane: one Celery message then sends to several chats. Nothing may be
lost on the way: a drive that was lost (never starts) or dies mid-drain is
covered by the reconciler (stale ready lanes get a drain; popped lanes keep
their due times).

Real parts: the test's redis-server; the plain-code tests drive lanes
against an in-memory platform (tests/test_delivery_flow.py); the worker
tests run real worker processes against the Telegram fake through
python-telegram-bot.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time

import pytest

from storage.volume import VolumeStore
from tasks.delivery import lanes
from tasks.dispatch import chains, reconcile
from tasks.ledger import keys, receipts
from tasks.celery_tasks import stages
from tasks.runtime import Context
from tests.fixtures.services import wait_until
from tests.test_delivery_flow import MemoryPlatform
from tests.fixtures._messages import body_of

pytestmark = pytest.mark.timeout(180)


def _ctx(r, tmp_path, platform):
    return Context(redis=r, store=VolumeStore(tmp_path / "store"), platform=lambda name: platform,
                   sandbox=lambda ref: None, agent=lambda name: None)  # type: ignore[arg-type,return-value]


def _texts(env, r, targets: list[str], tag: str = "hi") -> list[str]:
    jobs = []
    with env.publishing():
        for i, target in enumerate(targets):
            job = chains.new_job_id("wake")
            chains.enqueue(r, chains.Plan(job_id=job, target=target, text=f"{tag} {i}"), job_kind="send")
            jobs.append(job)
    return jobs


def _queued(r) -> list[tuple[str, str]]:
    """(task id, lane target) of each drive message in the delivery queue, oldest first."""
    out = []
    for raw in reversed(r.lrange("delivery", 0, -1)):
        msg = json.loads(raw)
        args = body_of(msg)[0]
        out.append((msg["headers"]["id"], args[0]))
    return out


def test_under_a_backlog_wake_ups_join_the_ready_set_and_one_drive_sends_to_every_chat(
        courier_env, redis_client, tmp_path):
    env, r = courier_env(), redis_client
    targets = [f"memory:c{i}" for i in range(12)]
    _texts(env, r, targets)
    # nothing consumes the queue: the first wake-ups are messages, the rest wait in the ready set
    queued = _queued(r)
    assert len(queued) == chains.WAKE_BACKLOG, queued  # (one message per wake-up before)
    assert [t for _, t in queued] == targets[:chains.WAKE_BACKLOG]
    assert r.zrange(keys.lanes_ready(), 0, -1) == targets[chains.WAKE_BACKLOG:]
    assert r.zcard(keys.drives_waiting()) == chains.WAKE_BACKLOG

    platform = MemoryPlatform()
    task_id, target = queued[0]
    drains: list[int] = []
    out = lanes.drive_ready(_ctx(r, tmp_path, platform), target, lambda t, countdown=None: None,
                            lambda: drains.append(1), started=task_id)
    assert out["state"] == "empty" and out["sent"] == 1
    assert out["drained"] == len(targets) - chains.WAKE_BACKLOG and out["drained_sent"] == out["drained"]
    # its own chat first, then the ready set in the order the wake-ups came; the other message's chat waits for it
    assert [s[0] for s in platform.sent] == ["c0"] + [f"c{i}" for i in range(chains.WAKE_BACKLOG, 12)]
    assert not r.exists(keys.lanes_ready()) and drains == []
    assert r.zrange(keys.drives_waiting(), 0, -1) == [queued[1][0]]


def test_a_drive_out_of_time_publishes_a_drain_for_the_lanes_left(courier_env, redis_client, tmp_path,
                                                                   monkeypatch):
    env, r = courier_env(), redis_client
    _texts(env, r, [f"memory:b{i}" for i in range(5)])
    (task_id, target), _ = _queued(r)
    monkeypatch.setattr(lanes, "BUDGET_S", 0.0)
    drains: list[int] = []
    platform = MemoryPlatform()
    out = lanes.drive_ready(_ctx(r, tmp_path, platform), target, lambda t, countdown=None: None,
                            lambda: drains.append(1), started=task_id)
    assert out["sent"] == 1 and "drained" not in out
    assert drains == [1] and r.zcard(keys.lanes_ready()) == 3  # left for the drain it published


def test_a_drive_whose_lanes_are_slow_fans_out_to_idle_threads(courier_env, redis_client, tmp_path,
                                                                 monkeypatch):
    """A lane that takes FAN_OUT_S (a slow platform: I/O, not CPU) makes its drive publish a
    drain for the lanes left, while fewer than WAKE_BACKLOG drives wait to start."""
    env, r = courier_env(), redis_client
    _texts(env, r, [f"memory:f{i}" for i in range(6)])
    (task_id, target), (other, _) = _queued(r)  # two waiting; four lanes in the ready set
    monkeypatch.setattr(lanes, "FAN_OUT_S", 0.0)  # every lane counts as slow
    r.delete("delivery")
    platform = MemoryPlatform()
    with env.publishing():
        out = lanes.drive_ready(_ctx(r, tmp_path, platform), target, lambda t, countdown=None: None,
                                lambda: chains.publish_drain(r), started=task_id, backlog=chains.WAKE_BACKLOG)
    assert out["drained"] == 4 and len(platform.sent) == 5
    # its own lane left three in the set with one drive waiting: one drain (then two were waiting)
    assert [t for _, t in _queued(r)] == [""]
    assert set(r.zrange(keys.drives_waiting(), 0, -1)) == {other, _queued(r)[0][0]}


def test_a_drive_that_never_starts_stops_counting_after_a_while(courier_env, redis_client):
    env, r = courier_env(), redis_client
    old = time.time() - chains.WAKE_STALE_S - 1
    r.zadd(keys.drives_waiting(), {"lost-1": old, "lost-2": old})
    _texts(env, r, ["memory:s1"])
    assert [t for _, t in _queued(r)] == ["memory:s1"] and not r.exists(keys.lanes_ready())
    assert r.zcard(keys.drives_waiting()) == 1


def test_the_reconciler_publishes_a_drain_for_lanes_ready_too_long(courier_env, redis_client, tmp_path):
    env, r = courier_env(), redis_client
    r.zadd(keys.lanes_ready(), {"memory:r1": time.time()})
    ctx = _ctx(r, tmp_path, MemoryPlatform())
    with env.publishing():
        assert reconcile.tick(ctx, stages())["ready"] == 0  # just joined: its drives may start any moment
        assert reconcile.tick(ctx, stages(), now=time.time() + chains.READY_STALE_S + 1)["ready"] == 1
    assert [t for _, t in _queued(r)] == [""]  # a drain: it names no lane


# -- real workers --------------------------------------------------------------------------
def _sent_once(fake, chats: list[str]) -> None:
    for chat in chats:
        got = [c.text for c in fake.calls_for(chat=chat, ok=True)]
        assert len(got) == 1, (chat, got)


def test_lanes_whose_drives_were_lost_are_delivered_by_the_reconcilers_drain(courier_env, redis_client,
                                                                             fake_telegram):
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    r = redis_client
    # WAKE_BACKLOG drives "waiting" whose messages are gone (a broker that lost them)
    r.zadd(keys.drives_waiting(), {f"lost-{i}": time.time() for i in range(chains.WAKE_BACKLOG)})
    chats = [str(930000 + i) for i in range(8)]
    jobs = _texts(env, r, [f"telegram:{c}" for c in chats], tag="lost")
    assert _queued(r) == [] and r.zcard(keys.lanes_ready()) == len(chats)
    env.start_worker(queues="delivery", pool="threads", concurrency=4)
    wait_until(lambda: all(d.get("state") == "delivered" for j in jobs for d in receipts.job_deliveries(r, j) or [{}]),
               timeout_s=60, interval_s=0.1, what="every chat's text delivered")
    _sent_once(fake_telegram, chats)
    assert not r.exists(keys.lanes_ready())


def test_lanes_a_killed_drive_had_taken_from_the_ready_set_are_still_delivered_once(courier_env, redis_client,
                                                                                     fake_telegram):
    fake_telegram.latency_s = 0.4  # one chat after the other, slowly: the kill lands mid-drain
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    r = redis_client
    chats = [str(940000 + i) for i in range(8)]
    jobs = _texts(env, r, [f"telegram:{c}" for c in chats], tag="kill")
    first = _queued(r)
    assert len(first) == chains.WAKE_BACKLOG
    r.delete("delivery")  # one drive will do it all: a single drain, as after a long backlog
    r.delete(keys.drives_waiting())
    r.zadd(keys.lanes_ready(), {f"telegram:{c}": time.time() + i * 1e-3 for i, c in enumerate(chats)})
    with env.publishing():
        chains.publish_drain(r)
    w = env.start_worker(queues="delivery", pool="threads", concurrency=1)
    wait_until(lambda: len(fake_telegram.calls_for(ok=True)) >= 3, timeout_s=60, interval_s=0.02,
               what="the drain under way")
    os.kill(w.pid, signal.SIGKILL)
    w.wait(timeout=30)
    assert r.zcard(keys.lanes_ready()) < len(chats) - 1  # the drain had taken lanes from the set
    env.start_worker(queues="delivery", pool="threads", concurrency=4)
    wait_until(lambda: all(d.get("state") == "delivered" for j in jobs for d in receipts.job_deliveries(r, j) or [{}]),
               timeout_s=90, interval_s=0.1, what="every chat's text delivered after the kill")
    for chat in chats:
        got = [c.text for c in fake_telegram.calls_for(chat=chat, ok=True)]
        # Telegram has no idempotency key: only a send in flight at the kill may show twice
        assert 1 <= len(got) <= 2 and set(got) == {f"kill {chats.index(chat)}"}, (chat, got)
    assert sum(len(fake_telegram.calls_for(chat=c, ok=True)) for c in chats) <= len(chats) + 1


# -- an extraction in a worker that serves the delivery queue drives its lane itself ------------
def _lpushes(r) -> int:
    """LPUSHes Redis has run (those of scripts included): each is a task message."""
    return int(r.info("commandstats").get("cmdstat_lpush", {}).get("calls", 0))


def _sandbox_send(env, r, name: str) -> str:
    from adapters.sandboxes.base import SandboxRef

    p = env.sandbox / name
    p.write_bytes(os.urandom(1500))
    job = chains.new_job_id("inl")
    with env.publishing():
        chains.enqueue(r, chains.Plan(job_id=job, target="outbox:inl",
                                      files=[chains.SandboxFile(ref=SandboxRef("local"), path=str(p))]),
                       job_kind="send")
    return chains.delivery_id(job, 0)


def test_an_all_queues_workers_extraction_drives_the_lane_itself(courier_env, redis_client):
    env, r = courier_env(), redis_client
    env.start_worker(queues="sandbox,delivery", concurrency=1)
    before = _lpushes(r)
    did = _sandbox_send(env, r, "a.bin")
    wait_until(lambda: (receipts.get_delivery(r, did) or {}).get("state") == "delivered", timeout_s=60,
               interval_s=0.05, what="the file delivered")
    # one message: the extraction's; its end sent the file without a drive_lane message
    assert _lpushes(r) - before == 1


def test_a_sandbox_only_workers_extraction_wakes_the_lane_by_message(courier_env, redis_client):
    env, r = courier_env(), redis_client
    env.start_worker(queues="sandbox", concurrency=1)
    did = _sandbox_send(env, r, "b.bin")
    wait_until(lambda: _queued(r) != [], timeout_s=60, interval_s=0.05, what="the lane's drive message")
    assert [t for _, t in _queued(r)] == ["outbox:inl"]
    rec = receipts.get_delivery(r, did) or {}
    assert rec.get("extraction") == "ok" and rec.get("state") != "delivered"  # for a delivery worker to send


# -- publishing after the ledger's transaction ---------------------------------------------------
def test_a_job_is_published_after_its_ledger_commits_and_a_lost_publish_is_published_again(
        courier_env, redis_client, tmp_path, monkeypatch):
    """chains.enqueue writes the ledger first, then publishes with Celery's apply_async: each
    publish finds its receipt and due time already there; a publish the broker refuses loses
    nothing, the reconciler publishes the extraction and the lane's drive once they are due."""
    from celery.canvas import Signature
    from kombu.exceptions import OperationalError

    from adapters.sandboxes.base import SandboxRef

    env, r = courier_env(), redis_client
    p = env.sandbox / "lost.bin"
    p.write_bytes(os.urandom(100))
    job = chains.new_job_id("lost")
    plan = chains.Plan(job_id=job, target="memory:lost", text="hello",
                       files=[chains.SandboxFile(ref=SandboxRef("local"), path=str(p))])
    seen: list[tuple[str, bool, bool]] = []

    def refused(self, *args, **kwargs):
        did = self.args[0]
        stage = "extract" if self.task == chains.task_names.EXTRACT_FILE else "lane"
        seen.append((self.task, receipts.get_delivery(r, chains.delivery_id(job, 1)) is not None,
                     r.zscore(keys.due(stage), did) is not None))
        raise OperationalError("the broker refused it")

    monkeypatch.setattr(Signature, "apply_async", refused)
    with env.publishing():
        dids = chains.enqueue(r, plan, job_kind="send")
    assert dids == [chains.delivery_id(job, 0), chains.delivery_id(job, 1)]
    # the extraction first, then the lane's drive; each saw the ledger committed
    assert seen == [(chains.task_names.EXTRACT_FILE, True, True), (chains.task_names.DRIVE_LANE, True, True)]
    assert _queued(r) == [] and r.llen("sandbox") == 0
    monkeypatch.undo()
    ctx = _ctx(r, tmp_path, MemoryPlatform())
    with env.publishing():
        reconcile.tick(ctx, stages(), now=time.time() + max(chains.LANE_GRACE_S, chains.EXTRACT_GRACE_S) + 1)
    assert [t for _, t in _queued(r)] == ["memory:lost"]
    (raw,) = r.lrange("sandbox", 0, -1)
    assert body_of(json.loads(raw))[0] == [chains.delivery_id(job, 1)]
