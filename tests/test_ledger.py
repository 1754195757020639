"""The ledger's plain code against a real Redis, without a broker: leases,
due times, lane steps and the reconciler's decisions. Publishing is the one
thing replaced (recorded instead of sent to Celery): what is checked here is
what the reconciler decides to publish."""

from __future__ import annotations

import json
import time

import pytest

from tasks.dispatch import chains, reconcile
from tasks.ledger import keys, ledger, receipts, signing
from tasks.turn import turn
from tasks.celery_tasks import stages
from tasks.runtime import Context
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.services import wait_until


@pytest.fixture
def published(monkeypatch):
    out: list[tuple] = []
    monkeypatch.setattr(chains, "publish_lane", lambda target, countdown=None: out.append(("lane", target)))
    monkeypatch.setattr(chains, "publish_extract", lambda did, queue, what="": out.append(("extract", did, queue)))

    class _Sig:
        def __init__(self, spec):
            self.spec = spec

        def apply_async(self):
            out.append(("turn", self.spec["job"]))

    monkeypatch.setattr(chains, "spec_sig", _Sig)
    return out


@pytest.fixture
def ctx(redis_client):
    return Context(redis=redis_client, store=None, platform=None, sandbox=None, agent=lambda name: None)


def test_a_lease_is_held_renewed_and_released_only_by_its_holder(redis_client):
    r = redis_client
    key = keys.lease("lane", "outbox:x")
    assert ledger.take(r, key, "a", ttl_s=5) and not ledger.take(r, key, "b", ttl_s=5)
    assert 4 < ledger.held(r, key) <= 5
    assert not ledger.renew(r, key, "b", 50) and ledger.renew(r, key, "a", 50) and ledger.held(r, key) > 40
    ledger.release(r, key, "b")
    assert ledger.held(r, key)
    ledger.release(r, key, "a")
    assert ledger.held(r, key) == 0.0
    with ledger.leased(r, "lane", "outbox:x") as token:
        assert token and token.split(":")[1].isdigit()  # host:pid:random
        with ledger.leased(r, "lane", "outbox:x") as second:
            assert second is None  # a live holder keeps it
    assert ledger.held(r, key) == 0.0


def test_registering_a_plan_queues_its_steps_in_the_chats_lane_once(redis_client):
    r = redis_client
    plan = chains.Plan(job_id="snd_a", target="outbox:c", text="hi",
                       files=[chains.StoredFile(key="files/snd_a/1-x.pdf", name="x.pdf", size=3, sha256="00")])
    chains.register(r, plan, job_kind="send")
    chains.register(r, plan, job_kind="send")  # a re-enqueue of the same job adds nothing
    chains.register(r, chains.Plan(job_id="snd_b", target="outbox:c", text="after"))
    assert r.lrange(keys.lane("outbox:c"), 0, -1) == ["snd_a.0", "snd_a.1", "snd_b.0"]
    spec = signing.open_json("delivery", "snd_a.1", receipts.get_delivery(r, "snd_a.1")["spec"])
    assert spec == {"id": "snd_a.1", "job": "snd_a", "target": "outbox:c", "type": "file", "voice": False,
                    "as_document": False, "key": "files/snd_a/1-x.pdf", "name": "x.pdf", "size": 3, "sha256": "00"}
    assert ledger.pending(r) == {"lane": 1, "extract": 0, "turn": 0}


def test_the_reconciler_redrives_only_what_is_overdue_and_unheld(redis_client, ctx, published):
    r = redis_client
    past = time.time() - 1
    for target in ("outbox:a", "outbox:b", "outbox:c", "outbox:d"):
        r.zadd(keys.due("lane"), {target: past})
        if target != "outbox:d":
            r.rpush(keys.lane(target), f"{target}.0")
    r.zadd(keys.due("lane"), {"outbox:c": time.time() + 60})  # not due yet
    assert ledger.take(r, keys.lease("lane", "outbox:b"), "alive", ttl_s=15)
    out = reconcile.tick(ctx, stages())
    assert published == [("lane", "outbox:a")] and out["lanes"] == 1
    due = {k: v - time.time() for k, v in r.zrange(keys.due("lane"), 0, -1, withscores=True)}
    assert "outbox:d" not in due  # an empty lane is forgotten
    assert 14 < due["outbox:b"] <= 15.2  # looked at again when the live holder's lease would lapse
    assert due["outbox:a"] > 5  # published: a grace before the next look


def test_a_lost_extraction_is_published_again_with_a_grace_that_grows_only_behind_a_backlog(
        redis_client, ctx, published):
    """Its queue empty, the message is waiting nowhere (a worker that lost its broker connection
    dropped what it had prefetched): each re-drive is looked at again after the base grace (the
    Sentinel chaos row: 20 + 20 + 40 + 80 s, a chat waiting 158 s). Behind a backlog, it doubles."""
    r = redis_client
    plan = chains.Plan(job_id="snd_e", target="outbox:e",
                       files=[chains.SandboxFile(chains.SandboxRef("local"), "/tmp/e.txt")])
    chains.register(r, plan)

    def redrive() -> float:
        r.zadd(keys.due("extract"), {"snd_e.0": time.time() - 1})
        reconcile.tick(ctx, stages())
        return r.zscore(keys.due("extract"), "snd_e.0") - time.time()

    waits = [redrive() for _ in range(3)]
    assert ("extract", "snd_e.0", "sandbox") in published and published.count(published[-1]) == 3
    assert all(ledger.EXTRACT_GRACE_S - 1 < w <= ledger.EXTRACT_GRACE_S for w in waits), waits
    r.zadd(keys.consumers("sandbox"), {"w1": time.time()})  # a worker consumes the queue...
    r.rpush("sandbox", "a message of another stage")  # ...which has a backlog
    assert redrive() > ledger.EXTRACT_GRACE_S * 7  # its fourth re-drive: 2**3 x the base
    assert published.count(published[-1]) == 4
    # once extracted, the reconciler forgets it and drives its lane
    receipts.update_delivery(r, "snd_e.0", extraction="ok")
    r.zadd(keys.due("extract"), {"snd_e.0": time.time() - 1})
    published.clear()
    reconcile.tick(ctx, stages())
    assert published == [("lane", "outbox:e")] and r.zscore(keys.due("extract"), "snd_e.0") is None


def test_an_extraction_waiting_in_a_queue_nobody_consumes_is_not_copied_there(redis_client, ctx, published):
    """A file pinned to a host nobody serves (`sandbox.gpu7`): its message is still in that queue, so the
    reconciler looks again without publishing a copy (which would pile up while the host is down);
    once a worker consumes the queue, an overdue extraction is published again."""
    r = redis_client
    plan = chains.Plan(job_id="snd_g", target="outbox:g",
                       files=[chains.SandboxFile(chains.SandboxRef("docker", "ctr1", options={"host": "gpu7"}),
                                                 "/w/a.png")])
    chains.register(r, plan)
    r.rpush("sandbox.gpu7", "its message")
    for _ in range(3):
        r.zadd(keys.due("extract"), {"snd_g.0": time.time() - 1})
        reconcile.tick(ctx, stages())
    assert published == [] and r.zscore(keys.due("extract"), "snd_g.0") > time.time()
    r.zadd(keys.consumers("sandbox.gpu7"), {"gpu7-worker": time.time()})
    r.zadd(keys.due("extract"), {"snd_g.0": time.time() - 1})
    reconcile.tick(ctx, stages())
    assert published == [("extract", "snd_g.0", "sandbox.gpu7")]


def test_a_turn_that_keeps_killing_its_worker_ends_with_an_error_and_a_message(redis_client, ctx, published):
    r = redis_client
    spec = {"job": "turn_k", "target": "outbox:k", "message": "hi", "agent": "demo"}
    receipts.create_job(r, "turn_k", kind="turn", target="outbox:k", spec=signing.seal_json("turn", "turn_k", spec))
    r.zadd(keys.due("turn"), {"turn_k": time.time() - 1})
    reconcile.tick(ctx, stages())
    assert published == [("turn", "turn_k")]  # never started: run it again
    r.hset(keys.job("turn_k"), "attempts", turn.TURN_MAX_RUNS)
    r.zadd(keys.due("turn"), {"turn_k": time.time() - 1})
    out = reconcile.tick(ctx, stages())
    assert out["abandoned"] == 1 and receipts.get_job(r, "turn_k")["state"] == "error"
    (text,) = [signing.open_json("delivery", d["id"], d["spec"])["text"] for d in receipts.job_deliveries(r, "turn_k")]
    assert text.startswith("Sorry, that did not work") and "died 3 times" in text
    assert r.zscore(keys.due("turn"), "turn_k") is None


def test_a_stage_that_finds_its_lease_held_is_looked_at_again_when_the_lease_lapses(redis_client):
    """A turn redelivered while a dead worker's lease still runs (a killed pool child: its
    message comes back at once) returns busy; its due time comes in to the lease's end,
    so it runs again ~LEASE_TTL_S after the crash, not at its 60 s grace."""
    import time

    from tasks.dispatch import chains
    from tasks.ledger import keys, ledger

    r = redis_client
    ledger.set_due(r, "turn", "turn_busy", chains.TURN_GRACE_S)
    r.set(keys.lease("turn", "turn_busy"), "dead-worker", px=3000)
    left_s = ledger.due_when_free(r, "turn", "turn_busy")
    assert 2.0 < left_s <= 3.0
    due = r.zscore(keys.due("turn"), "turn_busy")
    assert due == pytest.approx(time.time() + left_s + 0.1, abs=0.5)
    r.set(keys.lease("turn", "turn_busy"), "dead-worker", px=30_000)
    ledger.due_when_free(r, "turn", "turn_busy")  # a later due time never pushes it out
    assert r.zscore(keys.due("turn"), "turn_busy") == due
    r.delete(keys.lease("turn", "turn_busy"))
    assert ledger.due_when_free(r, "turn", "turn_busy") == 0.0


def test_a_lease_whose_release_met_an_outage_is_released_once_redis_answers(tmp_path):
    """A drive that fails with Redis (its outage) cannot release its lease: before, the stage was
    held for the rest of the dead lease's TTL, then waited for its due time (the Sentinel chaos row:
    chats idle 20-30 s after each restart). Now this process releases it once Redis answers and
    brings the stage's due time forward, so the reconciler re-drives it at once."""
    srv = RedisServer(tmp_path, appendonly=True, appendfsync="always").start()
    r = srv.client()
    try:
        x, y = keys.lease("lane", "outbox:x"), keys.lease("lane", "outbox:y")
        assert ledger.take(r, x, "tok", ttl_s=300) and ledger.take(r, y, "tok", ttl_s=300)  # outlive the test
        ledger.set_due(r, "lane", "outbox:x", 300)  # y: a stage with no due time (final)
        srv.stop()
        for key, ident in ((x, "outbox:x"), (y, "outbox:y")):
            ledger.release_soon(r, key, "tok", "lane", ident, ttl_s=300)  # Redis away: later
        srv.start()
        wait_until(lambda: not r.exists(x) and not r.exists(y), timeout_s=60,
                   what="the leases released after the outage")
        assert r.zscore(keys.due("lane"), "outbox:x") <= time.time()  # due now, not in 300 s
        assert r.zscore(keys.due("lane"), "outbox:y") is None  # no due time made for a final stage
    finally:
        r.close()
        srv.stop()
