"""Many webhooks at once into the real web process (`courier web`, uvicorn on
loopback) with its own redis-server: every signed update is enqueued exactly
once in courier's Redis, replays are dropped, a failed enqueue leaves no
de-dup key and no job record (and answers 503, so the platform retries), and
the web process refuses to start when its Celery broker is not
COURIER_REDIS_URL.

No worker consumes here: the turns stay in the `turns` queue, where the test
counts them (2 000 echo turns would take minutes on 2 cores; what is tested
is the enqueue)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest

from tasks.ledger import keys
from tests.fixtures.services import free_port, wait_until
from tests.fixtures.webstack import (
    PLATFORMS,
    fire,
    signed_update,
    web_only,
)
from tests.fixtures.workers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PER_PLATFORM = 500
REPLAYS = 100  # per platform, sent at the same time as the originals
CONCURRENCY = 16


@pytest.fixture(scope="module")
def loadweb(tmp_path_factory):
    with web_only(tmp_path_factory.mktemp("load")) as w:
        yield w


def test_concurrent_signed_updates_are_each_enqueued_exactly_once(loadweb):
    r = loadweb.r
    r.flushall()
    tag = os.urandom(3).hex()
    updates = [signed_update(p, i, tag, loadweb.discord_key) for p in PLATFORMS for i in range(PER_PLATFORM)]
    sends = list(range(len(updates))) + [p * PER_PLATFORM + i for p in range(len(PLATFORMS)) for i in range(REPLAYS)]
    random.Random(7).shuffle(sends)
    reqs = [("POST", updates[k][0], updates[k][1], updates[k][2]) for k in sends]
    t0 = time.monotonic()
    res = fire(loadweb.base, reqs, concurrency=CONCURRENCY, timeout_s=20)
    took = time.monotonic() - t0
    print(f"{len(reqs)} requests at {CONCURRENCY} at once in {took:.1f}s ({len(reqs) / took:.0f}/s)")
    bad = [(updates[k][0], st, body[:200]) for k, (st, body) in zip(sends, res) if st != 200]
    assert not bad, f"{len(bad)} of {len(reqs)} not answered 200, e.g. {bad[:3]}"

    # every update: its de-dup key names its turn; each turn is in the `turns` queue once, nothing anywhere else
    job_of = {}
    for _path, _body, _h, seen, text in updates:
        v = r.get(seen)
        assert v is not None and v != "pending", (seen, v)
        job_of[v] = text
    assert len(job_of) == len(updates)
    # kept for the full de-dup TTL once queued (the claim alone expires within a minute)
    pipe = r.pipeline()
    for _path, _body, _h, seen, _text in updates:
        pipe.ttl(seen)
    assert min(pipe.execute()) > 3600
    msgs = loadweb.queued()
    assert {m["queue"] for m in msgs} == {"turns"} and {m["task"] for m in msgs} == {"courier.turns.agent_turn"}
    assert len(msgs) == len(updates), f"{len(msgs)} task messages in Redis for {len(updates)} updates"
    assert sorted(m["id"] for m in msgs) == sorted(job_of)  # exactly once each
    assert all(m["spec"]["job"] == m["id"] and m["spec"]["message"] == job_of[m["id"]] for m in msgs)
    # one job record per turn, none without its message (no orphans)
    jobs = loadweb.jobs()
    assert set(jobs) == set(job_of) and {j["state"] for j in jobs.values()} == {"queued"}
    # replays answered as duplicates where the answer says so (Discord's answer is the same either way)
    dup = sum(1 for k, (_st, body) in zip(sends, res) if updates[k][0] != "/webhooks/discord"
              and (json.loads(body).get("duplicate") or json.loads(body).get("duplicates")))
    assert dup == REPLAYS * 3
    # the web process waits for no turn's result: it subscribed to no result channel
    assert "cmdstat_subscribe" not in r.info("commandstats")


def test_a_failed_enqueue_answers_503_and_leaves_nothing_behind(loadweb):
    """The broker refuses the publish (a Redis ACL: the web's user may write
    courier's keys but not the queues): the claim is taken back, 503, no de-dup
    key, no job record; once the broker takes it again, the platform's retry is
    enqueued once."""
    r = loadweb.r
    r.flushall()
    r.execute_command("ACL", "SETUSER", "admin", "on", ">admin-pw", "~*", "&*", "+@all")
    import redis

    ra = redis.Redis.from_url(loadweb.srv.url.replace("redis://", "redis://admin:admin-pw@"))
    try:
        ra.execute_command("ACL", "SETUSER", "default", "resetkeys", "~courier:*")
        path, body, headers, seen, text = signed_update("telegram", 1, os.urandom(3).hex())
        got = httpx.post(loadweb.base + path, content=body, headers=headers, timeout=30)
        assert got.status_code == 503 and got.json() == {"ok": False, "error": "could not enqueue the turn"}
        assert ra.get(seen) is None and not list(ra.scan_iter(keys.job("*")))
        assert not [k for k in ra.scan_iter() if ra.type(k) == b"list"]
        ra.execute_command("ACL", "SETUSER", "default", "allkeys")
        got = httpx.post(loadweb.base + path, content=body, headers=headers, timeout=30)
        assert got.status_code == 200, got.text
        job = got.json()["job"]
        assert ra.get(seen) == job.encode()
        msgs = loadweb.queued()
        assert [(m["id"], m["spec"]["message"]) for m in msgs] == [(job, text)]
        assert list(loadweb.jobs()) == [job]
        # a publish refused where the claim cannot be taken back (no DEL): the turn is not lost,
        # the ledger keeps it (its job record and due time: the reconciler publishes it) and the
        # platform's retry is a duplicate
        ra.execute_command("ACL", "SETUSER", "default", "resetkeys", "~courier:*", "-del")
        path, body, headers, seen, _text2 = signed_update("whatsapp", 2, os.urandom(3).hex())
        got = httpx.post(loadweb.base + path, content=body, headers=headers, timeout=30)
        assert got.status_code == 200, got.text
        (job2,) = got.json()["jobs"]
        assert ra.get(seen) == job2.encode() and set(loadweb.jobs()) == {job, job2}
        assert ra.zscore(keys.due("turn"), job2) is not None  # the reconciler's to publish
        assert ra.llen("turns") == 1  # still only the first turn's message
        ra.execute_command("ACL", "SETUSER", "default", "allkeys", "+del")
        got = httpx.post(loadweb.base + path, content=body, headers=headers, timeout=30)
        assert got.status_code == 200 and got.json().get("duplicates"), got.text
    finally:
        ra.execute_command("ACL", "SETUSER", "default", "allkeys", "+@all")
        ra.execute_command("ACL", "DELUSER", "admin")
        ra.close()


@pytest.mark.parametrize("how", ["courier", "uvicorn"])
def test_web_refuses_to_start_when_its_broker_is_not_courier_redis(loadweb, tmp_path, how):
    env = {**loadweb.env.env, "CELERY_BROKER_URL": "amqp://guest:amqp-pw-123@127.0.0.1:5672//"}
    port = str(free_port())
    cmd = [sys.executable, "-m", "workers.cli", "web", "--port", port] if how == "courier" else \
        [sys.executable, "-m", "uvicorn", "workers.web:app", "--port", port]
    try:
        res = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the web process started with a broker that is not COURIER_REDIS_URL")
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "not COURIER_REDIS_URL" in out and "CELERY_BROKER_URL" in out, out
    assert "amqp-pw-123" not in out
    if how == "courier":
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_stalled_redis_answers_503_in_bounded_time_and_the_retry_is_not_lost(loadweb):
    """Redis stops answering writes (CLIENT PAUSE) while an update comes in: the
    platform gets a 503 after ENQUEUE_TIMEOUT_S, not a hung request; once Redis
    answers again, the turn is queued and the platform's retry is dropped as
    the duplicate it is: one turn, exactly."""
    from workers.web import ENQUEUE_TIMEOUT_S

    r = loadweb.r
    r.flushall()
    path, body, headers, seen, text = signed_update("slack", 1, os.urandom(3).hex())
    r.execute_command("CLIENT", "PAUSE", int((ENQUEUE_TIMEOUT_S + 60) * 1000), "WRITE")
    t0 = time.monotonic()
    got = httpx.post(loadweb.base + path, content=body, headers=headers, timeout=30)
    took = time.monotonic() - t0
    assert got.status_code == 503 and ENQUEUE_TIMEOUT_S - 1 < took < ENQUEUE_TIMEOUT_S + 40, (got.status_code, took)  # not the pause's end
    r.execute_command("CLIENT", "UNPAUSE")
    job = wait_until(lambda: r.get(seen), timeout_s=10, what="the turn queued after the pause")
    retry = httpx.post(loadweb.base + path, content=body, headers={**headers, "X-Slack-Retry-Num": "1"}, timeout=30)
    assert retry.json() == {"ok": True, "duplicate": True}
    wait_until(lambda: len(loadweb.queued()) == 1, timeout_s=10, what="the turn's message")
    assert [(m["id"], m["spec"]["message"]) for m in loadweb.queued()] == [(job, text)]
    assert list(loadweb.jobs()) == [job]
