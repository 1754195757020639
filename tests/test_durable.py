"""A send or turn answered "queued" survives a Redis failover (tasks/ledger/durable.py).

Real redis-server processes on loopback: a master and its replica; the failover is done by hand
as a Sentinel does it (the replica promoted with `REPLICAOF NO ONE`, the old master made its replica);
what the Sentinel tells a client is stood in for by `_Asks`, a connection that reads the master's port
on each connect, where redis-py's Sentinel-managed connection asks the Sentinel.
tests/chaos/test_sentinel.py runs the real Sentinel through the CLI.
"""

from __future__ import annotations

import contextlib

import pytest
import redis
import redis.asyncio

from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.ledger.durable import Durability, transaction
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _pair(tmp):
    (tmp / "a").mkdir(parents=True)
    (tmp / "b").mkdir(parents=True)
    a = RedisServer(tmp / "a").start()
    b = RedisServer(tmp / "b", extra_args=("--replicaof", "127.0.0.1", str(a.port))).start()
    try:
        _wait_replicas(a, 1)
        yield a, b
    finally:
        b.stop()
        a.stop()


def _wait_replicas(server: RedisServer, n: int) -> None:
    c = server.client()
    try:
        wait_until(lambda: int(c.info("replication")["connected_slaves"]) == n
                   and all(c.info("replication")[f"slave{i}"]["state"] == "online" for i in range(n)),
                   timeout_s=30, what=f"{n} replicas online on {server.port}")
    finally:
        c.close()


class _Asks(redis.Connection):
    """Connects to whichever port `master` names at the time (a Sentinel's answer)."""

    master: dict[str, int] = {}

    def connect(self, *args, **kwargs):
        self.port = self.master["port"]
        return super().connect(*args, **kwargs)


def _client(server: RedisServer) -> redis.Redis:
    _Asks.master["port"] = server.port
    r = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=_Asks, host="127.0.0.1",
                                                         port=server.port, decode_responses=True))
    r.ping()  # a connection to it waits in the pool, as a CLI's does after its checks
    return r


def _depose(old: RedisServer, new: RedisServer) -> None:
    """The first half of a failover: `new` promoted, `old` still a master with no replica (the Sentinel
    has not announced it yet, or a client is still connected to it); new connections reach `new`."""
    new.client().replicaof("NO", "ONE")
    _wait_replicas(old, 0)
    _Asks.master["port"] = new.port


def _rejoin(old: RedisServer, new: RedisServer) -> None:
    """The second half: the deposed master becomes the new one's replica (its own data dropped)."""
    old.client().replicaof("127.0.0.1", str(new.port))
    _wait_replicas(new, 1)


def _plan(job_id: str) -> chains.Plan:
    return chains.Plan(job_id=job_id, target="outbox:failover", text="sent during a failover")


@pytest.mark.parametrize("kind", ["send", "turn"])
def test_a_send_taken_by_a_deposed_master_is_written_again_on_the_new_one(tmp_path, kind):
    """The CI failure of stop 32: `courier send --wait` at a Sentinel failover got a job id from the old
    master (the Sentinel still named it), the old master became the new one's replica and dropped it,
    and the send was gone ("deliveries": [] for 90 s). Without confirmation (replicas 0, as before) the
    job is lost here; confirmed on a replica, the write goes again to the new master and stays."""
    for replicas in (0, 1):
        with _pair(tmp_path / f"r{replicas}") as (old, new):
            r = _client(old)
            _depose(old, new)
            told: list[str] = []
            d = Durability(replicas=replicas, wait_s=0.2, within_s=1.0)
            job = chains.new_job_id(kind)
            if kind == "send":
                chains.register(r, _plan(job), job_kind="send", durability=d, warn=told.append)
            else:
                chains.register_turn(r, chains.turn_spec(job, "outbox:failover", "hi", agent="demo"),
                                     durability=d, warn=told.append)
            _rejoin(old, new)
            on_new = receipts.get_job(new.client(), job)
            if replicas == 0:
                assert on_new is None  # the loss, reproduced
                continue
            assert on_new is not None and on_new["kind"] == kind, "the confirmed send is on the new master"
            # the new master had no replica until the old one rejoined: accepted unconfirmed, and said so
            assert len(told) == 1 and job in told[0] and "no replica confirmed" in told[0]
            r.close()


def test_a_healthy_pair_confirms_at_once_and_a_lone_master_takes_the_write_once(tmp_path):
    """With its replica online a send is confirmed on the first try (on the replica when answered). A
    master whose replica is away takes the write again at each try (idempotent: one receipt, one lane
    step), then accepts it unconfirmed, and says so."""
    with _pair(tmp_path) as (master, replica):
        r = _client(master)
        told: list[str] = []
        job = chains.new_job_id("send")
        items = chains.register(r, _plan(job), job_kind="send", durability=Durability(replicas=1), warn=told.append)
        assert told == [] and receipts.get_job(replica.client(), job) is not None
        assert replica.client().lrange(keys.lane("outbox:failover"), 0, -1) == [e.did for e in items]

        replica.client().replicaof("NO", "ONE")  # the replica leaves: nothing can confirm
        _wait_replicas(master, 0)
        lone = chains.new_job_id("send")
        items = chains.register(r, _plan(lone), job_kind="send", warn=told.append,
                                durability=Durability(replicas=1, wait_s=0.1, within_s=0.5))
        assert len(told) == 1 and lone in told[0]
        m = master.client()
        assert m.lrange(keys.job_deliveries(lone), 0, -1) == [e.did for e in items]
        assert m.lrange(keys.lane("outbox:failover"), 0, -1).count(items[0].did) == 1
        r.close()


def test_an_error_inside_the_transaction_is_raised(tmp_path):
    """A command refused inside EXEC (here: a hash command on a list) is not taken for a write."""
    (tmp_path / "a").mkdir()
    server = RedisServer(tmp_path / "a").start()
    try:
        r = _client(server)
        r.rpush("courier:test:list", "x")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            transaction(r, lambda p: p.hset("courier:test:list", "a", "b"), replicas=1, wait_s=0.05)
        assert transaction(r, lambda p: p.set("courier:test:ok", "1"), replicas=1, wait_s=0.05) == 0
        assert transaction(r, lambda p: p.set("courier:test:ok", "2")) is None
        assert r.get("courier:test:ok") == "2"
        r.close()
    finally:
        server.stop()


class _AsyncAsks(redis.asyncio.Connection):
    """`_Asks` for asyncio clients (the web process's)."""

    async def connect(self, *args, **kwargs):
        self.port = _Asks.master["port"]
        return await super().connect(*args, **kwargs)


def test_a_webhook_turn_claimed_by_a_deposed_master_is_claimed_again_on_the_new_one(tmp_path):
    """The web process's batch claim (webhook_claim.lua) under the same failover: unconfirmed, the claim
    lost with the old master; confirmed, claimed again on the new one (once: the script knows its own
    job), so the platform's retry is a duplicate there."""
    import asyncio
    import json
    import time

    from tasks.ledger import scripts
    from tasks.ledger.durable import write_async

    async def claim(r, job: str, d: Durability | None):
        ks = [keys.due("turn"), keys.webhook_seen("telegram", job), keys.job(job)]
        args = [60, 600, job, time.time() + 10, json.dumps({"id": job, "kind": "turn"})]
        if d is None:
            return await scripts.run_async(r, "webhook_claim", keys=ks, args=args), False
        return await write_async(r, lambda p: scripts.run_async(p, "webhook_claim", keys=ks, args=args), d)

    for confirm in (False, True):
        with _pair(tmp_path / f"c{int(confirm)}") as (old, new):
            async def run():
                _Asks.master["port"] = old.port
                r = redis.asyncio.Redis(connection_pool=redis.asyncio.ConnectionPool(
                    connection_class=_AsyncAsks, host="127.0.0.1", port=old.port, decode_responses=True))
                await r.ping()
                _depose(old, new)
                job = chains.new_job_id("turn")
                got = await claim(r, job, Durability(replicas=1, wait_s=0.2, within_s=1.0) if confirm else None)
                await r.aclose()
                return job, got

            job, (reply, confirmed) = asyncio.run(run())
            assert reply == [1] and not confirmed  # the new master has no replica yet: accepted unconfirmed
            _rejoin(old, new)
            n = new.client()
            if not confirm:
                assert receipts.get_job(n, job) is None  # the loss, reproduced
                continue
            assert receipts.get_job(n, job) is not None and n.exists(keys.webhook_seen("telegram", job))


def test_the_web_process_confirms_webhook_turns_on_replicas(tmp_path):
    """`courier web` with COURIER_REDIS_CONFIRM_REPLICAS=1 on a master without a replica: a webhook turn is
    claimed again until COURIER_REDIS_CONFIRM_S ends, then answered (queued on the master alone, with a
    warning in the log); the platform's retry is a duplicate."""
    import httpx

    from tests.fixtures.webstack import TELEGRAM_SECRET, web_only

    with web_only(tmp_path, COURIER_REDIS_CONFIRM_REPLICAS="1", COURIER_REDIS_CONFIRM_S="1") as web:
        body = b'{"update_id": 515151, "message": {"chat": {"id": 7}, "text": "hi"}}'
        headers = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET, "Content-Type": "application/json"}
        first = httpx.post(web.base + "/webhooks/telegram", content=body, headers=headers, timeout=30)
        assert first.status_code == 200 and first.json().get("job"), first.text
        assert [m["id"] for m in web.queued()] == [first.json()["job"]]
        assert "no replica confirmed them within 1 s" in web.log()
        again = httpx.post(web.base + "/webhooks/telegram", content=body, headers=headers, timeout=30)
        assert again.status_code == 200 and again.json().get("duplicate"), again.text
