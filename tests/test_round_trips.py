"""Courier's own Redis round trips per delivery, pinned (issue 14: the
pipeline's speed is mostly them). A sandbox file's delivery runs as a
worker runs it, as plain code: `extract.run` (local sandbox -> volume) then
`lanes.drive` (-> an in-memory platform), against the session's real
redis-server through a connection class that counts what is written to
Redis: one write is one round trip (a pipeline is one)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from adapters.platforms.base import Limits
from adapters.sandboxes.local import LocalSandbox
from adapters.sandboxes.base import SandboxRef
from storage.volume import VolumeStore
from tasks import chains, extract, keys, lanes, ratelimit, receipts
from tasks.runtime import Context
from tests.test_delivery_flow import MemoryPlatform

pytestmark = pytest.mark.timeout(60)

#: worker-side round trips of one sandbox file's delivery: the extraction's lease and
#: receipt (1), its result with the lane's drive queued (1); the lane's lease, head and send
#: lock (1), the delivered record with the lane popped and released (1)
EXTRACT_ROUND_TRIPS = 2
DRIVE_ROUND_TRIPS = 2


#: the commands of an extraction: its first script; then its result (the receipt's update, a
#: script), the due time cleared, the lease released (a script) and the lane's drive queued (this
#: test's stand-in for chains.queue_lane: one LPUSH)
EXTRACT_COMMANDS = ["EVALSHA", "EVAL", "ZREM", "EVAL", "LPUSH"]


def command_names(writes: list[Any]) -> list[str]:
    """The names of the Redis commands in what was written (RESP arrays of bulk strings)."""
    names = []
    for packed in writes:
        data = b"".join(bytes(p) for p in packed) if isinstance(packed, (list, tuple)) else bytes(packed)
        at = 0
        while at < len(data):
            end = data.index(b"\r\n", at)
            assert data[at:at + 1] == b"*", data[at:at + 40]
            n, at = int(data[at + 1:end]), end + 2
            for i in range(n):
                end = data.index(b"\r\n", at)
                size, at = int(data[at + 1:end]), end + 2
                if i == 0:
                    names.append(data[at:at + size].decode().upper())
                at += size + 2
    return names


class CountingConnection(redis.Connection):
    """Counts the writes this test's thread makes (the lease renewer's thread is not counted)."""

    writes: list[Any] = []
    thread: int | None = None

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == CountingConnection.thread:
            CountingConnection.writes.append(command)
        super().send_packed_command(command, check_health)


@pytest.fixture
def counted(redis_server, redis_client, tmp_path) -> Iterator[Any]:
    pool = redis.ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection,
                                         decode_responses=True)  # as courier's clients (workers/redis_url.py)
    r = redis.Redis(connection_pool=pool)
    r.ping()  # connected (its handshake not counted)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    box = LocalSandbox.with_roots((str(sandbox),))
    platform = MemoryPlatform()
    ctx = Context(redis=r, store=VolumeStore(tmp_path / "store"), platform=lambda name: platform,
                  sandbox=lambda ref: box, agent=lambda name: None)  # type: ignore[arg-type,return-value]

    class Counted:
        def __init__(self) -> None:
            self.r, self.ctx, self.platform, self.sandbox = r, ctx, platform, sandbox
            self.published: list[str] = []

        def plan(self, target: str, n: int) -> list[str]:
            files = []
            for i in range(n):
                p = sandbox / f"f{i}.bin"
                p.write_bytes(bytes([i]) * 1000)
                files.append(chains.SandboxFile(ref=SandboxRef("local"), path=str(p)))
            job = chains.new_job_id("rtt")
            return [e.did for e in chains.register(r, chains.Plan(job_id=job, target=target, files=files),
                                                  job_kind="send")]

        def trips(self, fn: Any) -> tuple[Any, int]:
            CountingConnection.writes, CountingConnection.thread = [], threading.get_ident()
            try:
                out = fn()
            finally:
                CountingConnection.thread = None
            return out, len(CountingConnection.writes)

        def extract(self, did: str) -> tuple[Any, int]:
            def queue_drive(pipe: Any, target: str) -> bool:
                pipe.lpush("rtt:drives", target)  # where chains.queue_lane queues the drive's message
                return True
            return self.trips(lambda: extract.run(ctx, did, queue_drive=queue_drive))

        def drive(self, target: str) -> tuple[Any, int]:
            return self.trips(lambda: lanes.drive(ctx, target, lambda t, countdown=None: self.published.append(t)))

    c = Counted()
    # one delivery first: Redis then has courier's scripts (a first EVALSHA of each loads it)
    (warm,) = c.plan("memory:warm", 1)
    c.extract(warm)
    c.drive("memory:warm")
    c.platform.sent.clear()
    yield c
    r.close()
    pool.disconnect()


def test_a_sandbox_files_delivery_takes_four_round_trips(counted):
    (did,) = counted.plan("memory:rt1", 1)
    out, extract_trips = counted.extract(did)
    assert out["state"] == "extracted" and out.get("lane_queued")
    out, drive_trips = counted.drive("memory:rt1")
    assert out == {"lane": "memory:rt1", "state": "empty", "sent": 1}
    assert counted.platform.sent == [("rt1", "document", "f0.bin", None)]
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] == "delivered" and rec["attempts"] == "1"
    assert not counted.r.exists(keys.delivery_lock(did), keys.lease("lane", "memory:rt1"))
    assert (extract_trips, drive_trips) == (EXTRACT_ROUND_TRIPS, DRIVE_ROUND_TRIPS), CountingConnection.writes


def test_an_extraction_makes_five_commands(counted):
    """Not only its round trips: the commands in them (a command more in a pipeline costs
    Redis and the worker's client on every delivery too)."""
    (did,) = counted.plan("memory:rt6", 1)
    out, _ = counted.extract(did)
    assert out["state"] == "extracted"
    assert command_names(CountingConnection.writes) == EXTRACT_COMMANDS


def test_each_further_delivery_in_a_drive_takes_one_round_trip(counted):
    ids = counted.plan("memory:rt2", 3)
    for did in ids:
        assert counted.extract(did)[0]["state"] == "extracted"
    out, trips = counted.drive("memory:rt2")
    assert out["state"] == "empty" and out["sent"] == 3
    assert [s[2] for s in counted.platform.sent] == ["f0.bin", "f1.bin", "f2.bin"]
    assert [(receipts.get_delivery(counted.r, d) or {}).get("attempts") for d in ids] == ["1", "1", "1"]
    assert trips == 1 + 3  # the first look, then one per delivery sent (its record and the next look)


def test_a_dead_senders_chat_gate_goes_with_the_drives_first_look(counted):
    counted.platform.limits = Limits(text_chars=200, caption_chars=50, upload_bytes=10_000, per_chat_per_s=1.0)
    (did,) = counted.plan("memory:rt3", 1)
    counted.extract(did)
    gate, _ = ratelimit.gate_of(counted.platform, "rt3")
    assert gate is not None
    # left by a worker of the release before issue 23 that died mid-send (its gate said "sending:"
    # for 60 s; a gate now lasts one interval from a send's start: a dead worker's lapses by itself)
    counted.r.set(gate, "sending:1", ex=60)
    out, _ = counted.drive("memory:rt3")
    assert out["state"] == "empty" and out["sent"] == 1  # not paced behind the stale gate
    assert counted.platform.sent == [("rt3", "document", "f0.bin", None)]


def test_a_send_lock_held_elsewhere_is_waited_for_and_nothing_is_sent(counted):
    (did,) = counted.plan("memory:rt4", 1)
    counted.extract(did)
    counted.r.set(keys.delivery_lock(did), "another-worker", ex=60)
    out, _ = counted.drive("memory:rt4")
    assert out["state"] == "waiting"
    assert counted.platform.sent == []
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] == "extracted" and rec.get("attempts", "0") == "0"  # no attempt counted without the lock
    assert counted.r.get(keys.delivery_lock(did)) == "another-worker"


def test_each_further_lane_a_drive_takes_from_the_ready_set_costs_one_round_trip(counted):
    """A drive goes on from its own lane to the lanes of the ready set (tests/test_wake.py):
    the look that finds a lane empty pops the next one and, on the same platform, takes that
    lane's first look too (its lease, head and send lock), so each further lane costs only its
    delivered record (with the look after it). Before, each took its own first look: two."""
    targets = [f"memory:rd{i}" for i in range(4)]
    dids = []
    for target in targets:
        dids += counted.plan(target, 1)
        counted.extract(dids[-1])
    counted.r.zadd(keys.lanes_ready(), {t: i for i, t in enumerate(targets[1:])})
    drains: list[int] = []
    out, trips = counted.trips(lambda: lanes.drive_ready(
        counted.ctx, targets[0], lambda t, countdown=None: None, lambda: drains.append(1)))
    assert out == {"lane": targets[0], "state": "empty", "sent": 1, "drained": 3, "drained_sent": 3}
    assert [s[0] for s in counted.platform.sent] == ["rd0", "rd1", "rd2", "rd3"] and drains == []
    assert not counted.r.exists(keys.lanes_ready())
    assert not any(counted.r.exists(keys.lease("lane", t), keys.delivery_lock(d)) for t, d in zip(targets, dids))
    assert [((receipts.get_delivery(counted.r, d) or {}).get("state"), (receipts.get_delivery(counted.r, d) or {})
             .get("attempts")) for d in dids] == [("delivered", "1")] * 4
    assert trips == DRIVE_ROUND_TRIPS + (len(targets) - 1), CountingConnection.writes


def test_a_next_lane_taken_with_the_look_clears_its_dead_senders_gate(counted):
    """The next lane's lease taken in the look that emptied the lane before it clears that
    chat's gate left by a worker that died mid-send, as its own first look would."""
    counted.platform.limits = Limits(text_chars=200, caption_chars=50, upload_bytes=10_000, per_chat_per_s=1.0)
    for chat in ("nx0", "nx1"):
        (did,) = counted.plan(f"memory:{chat}", 1)
        counted.extract(did)
    gate, interval = ratelimit.gate_of(counted.platform, "nx1")
    # left by a worker of the release before issue 23 that died mid-send (its gate said "sending:"
    # for 60 s; a gate now lasts one interval from a send's start: a dead worker's lapses by itself)
    counted.r.set(gate, "sending:1", ex=60)
    counted.r.zadd(keys.lanes_ready(), {"memory:nx1": 1})
    out, trips = counted.trips(lambda: lanes.drive_ready(
        counted.ctx, "memory:nx0", lambda t, countdown=None: None, lambda: None))
    assert out["drained_sent"] == 1 and [s[0] for s in counted.platform.sent] == ["nx0", "nx1"]
    # nx1's own send started its interval: not paced behind the stale gate
    assert 0 < counted.r.pttl(gate) <= interval * 1000
    # nx0: its first look, its gate, its record (with the look taking nx1); nx1: its gate, its record
    assert trips == 3 + 2, [command_names([w]) for w in CountingConnection.writes]


def test_a_next_lane_held_elsewhere_or_on_another_platform_is_left_or_looked_at_on_its_own(counted):
    """A next lane whose lease another worker holds is left to it (nothing sent, its lease
    untouched); one on another platform gets a first look of its own, as before."""
    for target in ("memory:ho0", "memory:ho1", "other:ho2"):
        (did,) = counted.plan(target, 1)
        counted.extract(did)
    counted.r.set(keys.lease("lane", "memory:ho1"), "another-worker", ex=60)
    counted.r.zadd(keys.lanes_ready(), {"memory:ho1": 1, "other:ho2": 2})
    out, trips = counted.trips(lambda: lanes.drive_ready(
        counted.ctx, "memory:ho0", lambda t, countdown=None: None, lambda: None))
    assert [s[0] for s in counted.platform.sent] == ["ho0", "ho2"]
    assert counted.r.get(keys.lease("lane", "memory:ho1")) == "another-worker"
    assert not counted.r.exists(keys.lanes_ready(), keys.lease("lane", "other:ho2"))
    # ho0: its look (which pops ho1 and finds it busy) and its record; the set popped again
    # (ho2); ho2 on its own: its first look and its record
    assert trips == DRIVE_ROUND_TRIPS + 1 + DRIVE_ROUND_TRIPS, [command_names([w]) for w in CountingConnection.writes]


def test_the_outbox_adds_no_round_trip(counted, tmp_path):
    """The same delivery to the outbox platform (the pipeline bench's): its files and its log
    line are all it writes, the round trips are the four above."""
    from dataclasses import replace

    from adapters.platforms.outbox import OutboxPlatform, read_log

    outbox = OutboxPlatform(tmp_path / "outbox")
    ctx = replace(counted.ctx, platform=lambda name: outbox)
    (warm,) = counted.plan("outbox:warm", 1)  # the outbox's chat directory made once per process
    counted.trips(lambda: extract.run(ctx, warm, queue_drive=lambda pipe, target: True))
    counted.trips(lambda: lanes.drive(ctx, "outbox:warm", lambda t, countdown=None: None))
    (did,) = counted.plan("outbox:rt5", 1)

    def queue_drive(pipe: Any, target: str) -> bool:
        pipe.lpush("rtt:drives", target)
        return True

    out, extract_trips = counted.trips(lambda: extract.run(ctx, did, queue_drive=queue_drive))
    assert out["state"] == "extracted" and out.get("lane_queued")
    out, drive_trips = counted.trips(lambda: lanes.drive(ctx, "outbox:rt5", lambda t, countdown=None: None))
    assert out == {"lane": "outbox:rt5", "state": "empty", "sent": 1}
    assert [(row["delivery_id"], row["name"], row["size_bytes"]) for row in read_log(tmp_path / "outbox", "rt5")] \
        == [(did, "f0.bin", 1000)]
    assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"
    assert (extract_trips, drive_trips) == (EXTRACT_ROUND_TRIPS, DRIVE_ROUND_TRIPS), CountingConnection.writes


class _BotLike(MemoryPlatform):
    """As Telegram declares itself: one send a second to a chat (its gate), a per-bot window,
    and a file id for every upload, reused for the same bytes (`cache_key`)."""

    name = "botlike"
    cache_key = "bot1"

    def __init__(self) -> None:
        super().__init__()
        self.limits = Limits(text_chars=200, caption_chars=50, upload_bytes=10_000, per_chat_per_s=1.0,
                             per_bot_per_s=30.0)
        self.file_ids: list[str | None] = []

    def send_file(self, chat, kind, file, *, caption, delivery_id, file_id=None):  # type: ignore[no-untyped-def]
        sent = super().send_file(chat, kind, file, caption=caption, delivery_id=delivery_id, file_id=file_id)
        self.file_ids.append(file_id)
        return type(sent)(message_id=sent.message_id, file_id=file_id or f"F-{file.sha256[:8]}")


#: a drive's round trips for one file to a chat with a gate, a per-bot window and a file-id
#: cache: the lane's lease, head and send lock (1); the cached file id (1); the chat's gate with
#: its back-off (1); the per-bot window's slot (`limits`' public `hit`: 1); the delivered record
#: with the file id kept and the lane popped (1). Session 6 had it at 3 by asking the gate and the
#: window's slot (`limits`' own Lua script, a private) with the file id (`Guarded.look_ahead`,
#: `ratelimit.ask_window`); issue 23 deleted both: 2 round trips to a local Redis, well under a
#: millisecond a delivery, for no private of `limits` and no look-ahead state in `tasks.parts`.
GATED_DRIVE_ROUND_TRIPS = 5


def test_a_delivery_to_a_chat_with_a_gate_a_window_and_file_ids_takes_five_round_trips(counted):
    from dataclasses import replace

    bot = _BotLike()
    ctx = replace(counted.ctx, platform=lambda name: bot)
    got = []
    for chat in ("warm", "g1", "g2"):  # the same bytes: uploaded, then sent by its file id
        if chat == "g1":  # (a first EVALSHA of the window's script loads it: warmed, then file ids forgotten)
            counted.r.delete(*counted.r.keys("courier:fileid:botlike:bot1:*"))
            bot.file_ids.clear()
            got.clear()
        target = f"botlike:{chat}"
        (did,) = counted.plan(target, 1)
        counted.trips(lambda: extract.run(ctx, did, queue_drive=lambda pipe, target: True))
        out, trips = counted.trips(lambda: lanes.drive(ctx, target, lambda t, countdown=None: None))
        got.append(trips)
        assert out == {"lane": target, "state": "empty", "sent": 1}
        assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"
        gate, interval = ratelimit.gate_of(bot, chat)
        assert 0 < counted.r.pttl(gate) <= interval * 1000  # the chat's interval started with the send
    sha = bot.file_ids and counted.r.keys("courier:fileid:botlike:bot1:*")
    assert len(sha) == 1 and counted.r.get(sha[0]).startswith("F-")
    assert bot.file_ids == [None, counted.r.get(sha[0])]  # the second send went by the first's file id
    assert got == [GATED_DRIVE_ROUND_TRIPS, GATED_DRIVE_ROUND_TRIPS], [command_names([w]) for w in CountingConnection.writes]


def _window_hits(r: Any, bot: Any) -> int:
    """How many sends the bot's window holds now (`limits`' moving window: one entry a send)."""
    ((item, ids),) = ratelimit.rules(bot, "any")
    storage = ratelimit._limiter(r).storage
    return int(r.llen(storage.prefixed_key(item.key_for(*ids))))


def _drive_bot(counted: Any, bot: Any, chat: str, n: int) -> tuple[Any, list[str]]:
    from dataclasses import replace

    ctx = replace(counted.ctx, platform=lambda name: bot)
    dids = counted.plan(f"botlike:{chat}", n)
    for did in dids:
        counted.trips(lambda: extract.run(ctx, did, queue_drive=lambda pipe, target: True))
    out, _ = counted.trips(lambda: lanes.drive(ctx, f"botlike:{chat}", lambda t, countdown=None: None))
    return out, dids


def test_a_full_window_asked_with_the_gate_gives_the_gate_back_and_sends_nothing(counted):
    """The window's slot refused after the chat's gate was taken: nothing is sent, the chat's
    gate is open again, the lane waits for the window (courier's own pacing)."""
    bot = _BotLike()
    bot.limits = dataclasses.replace(bot.limits, per_bot_per_s=1.0)
    _drive_bot(counted, bot, "wf0", 1)  # the window's one slot a second, taken
    out, (did,) = _drive_bot(counted, bot, "wf1", 1)
    assert out["state"] == "waiting" and 0 < out["wait_s"] <= 1.1
    assert [s[0] for s in bot.sent] == ["wf0"]
    gate, _ = ratelimit.gate_of(bot, "wf1")
    assert not counted.r.exists(gate)  # given back
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] != "delivered" and _window_hits(counted.r, bot) == 1


def test_a_send_waiting_for_its_chats_gate_takes_no_window_slot(counted):
    """Two deliveries to one chat in one drive: the second's gate is not free (the first's
    interval still runs), so it asks no window slot, which would be spent for nothing; the
    window holds the one send made."""
    bot = _BotLike()
    out, dids = _drive_bot(counted, bot, "wl0", 2)
    assert out["state"] == "waiting" and [s[0] for s in bot.sent] == ["wl0"]
    assert _window_hits(counted.r, bot) == 1


def test_a_window_script_redis_lost_is_taken_the_usual_way(counted):
    """Redis restarted (its scripts gone): the window's slot is still taken (the library loads
    its script again) and the send goes."""
    bot = _BotLike()
    _drive_bot(counted, bot, "ns0", 1)
    counted.r.script_flush()
    out, (did,) = _drive_bot(counted, bot, "ns1", 1)
    assert out == {"lane": "botlike:ns1", "state": "empty", "sent": 1}
    assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"
    assert _window_hits(counted.r, bot) == 2

