"""A sandbox file's delivery as a worker runs it, as plain code: `extract.run`
(local sandbox -> volume) then `lanes.drive` (-> an in-memory platform),
against the session's real redis-server: what is sent, in what order, what
the ledger records, and that nothing is left held. (Redis round-trip counts
were pinned here while courier pushed its own task messages; they are
internals, not behaviour.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from adapters.platforms.base import Limits
from adapters.sandboxes.local import LocalSandbox
from adapters.sandboxes.base import SandboxRef
from storage.volume import VolumeStore
from tasks.delivery import lanes, ratelimit
from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.turn import extract
from tasks.runtime import Context
from tests.test_delivery_flow import MemoryPlatform

pytestmark = pytest.mark.timeout(60)

@pytest.fixture
def counted(redis_server, redis_client, tmp_path) -> Iterator[Any]:
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)  # as courier's clients (workers/redis_url.py)
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

        def extract(self, did: str) -> Any:
            return extract.run(ctx, did)

        def drive(self, target: str) -> Any:
            return lanes.drive(ctx, target, lambda t, countdown=None: self.published.append(t))

    c = Counted()
    yield c
    r.close()


def test_a_sandbox_files_delivery_is_sent_once_and_leaves_nothing_held(counted):
    (did,) = counted.plan("memory:rt1", 1)
    out = counted.extract(did)
    assert out["state"] == "extracted" and out["target"] == "memory:rt1"
    assert not counted.r.exists(keys.lease("extract", did))
    assert counted.r.zscore(keys.due("extract"), did) is None
    out = counted.drive("memory:rt1")
    assert out == {"lane": "memory:rt1", "state": "empty", "sent": 1}
    assert counted.platform.sent == [("rt1", "document", "f0.bin", None)]
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] == "delivered" and rec["attempts"] == "1"
    assert not counted.r.exists(keys.delivery_lock(did), keys.lease("lane", "memory:rt1"))
    assert counted.published == []  # nothing left to drive again


def test_one_drive_sends_a_lanes_deliveries_in_order_once_each(counted):
    ids = counted.plan("memory:rt2", 3)
    for did in reversed(ids):  # extracted in any order: sent in the lane's
        assert counted.extract(did)["state"] == "extracted"
    out = counted.drive("memory:rt2")
    assert out["state"] == "empty" and out["sent"] == 3
    assert [s[2] for s in counted.platform.sent] == ["f0.bin", "f1.bin", "f2.bin"]
    assert [(receipts.get_delivery(counted.r, d) or {}).get("attempts") for d in ids] == ["1", "1", "1"]


def test_a_dead_senders_chat_gate_goes_with_the_drives_first_look(counted):
    counted.platform.limits = Limits(text_chars=200, caption_chars=50, upload_bytes=10_000, per_chat_per_s=1.0)
    (did,) = counted.plan("memory:rt3", 1)
    counted.extract(did)
    gate, _ = ratelimit.gate_of(counted.platform, "rt3")
    assert gate is not None
    # left by a worker of the release before issue 23 that died mid-send (its gate said "sending:"
    # for 60 s; a gate now lasts one interval from a send's start: a dead worker's lapses by itself)
    counted.r.set(gate, "sending:1", ex=60)
    out = counted.drive("memory:rt3")
    assert out["state"] == "empty" and out["sent"] == 1  # not paced behind the stale gate
    assert counted.platform.sent == [("rt3", "document", "f0.bin", None)]


def test_a_send_lock_held_elsewhere_is_waited_for_and_nothing_is_sent(counted):
    (did,) = counted.plan("memory:rt4", 1)
    counted.extract(did)
    counted.r.set(keys.delivery_lock(did), "another-worker", ex=60)
    out = counted.drive("memory:rt4")
    assert out["state"] == "waiting"
    assert counted.platform.sent == []
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] == "extracted" and rec.get("attempts", "0") == "0"  # no attempt counted without the lock
    assert counted.r.get(keys.delivery_lock(did)) == "another-worker"


def test_a_drive_sends_the_ready_sets_lanes_after_its_own_in_order(counted):
    """A drive goes on from its own lane to the lanes of the ready set (tests/test_wake.py),
    in the order they joined it, each once, nothing left held."""
    targets = [f"memory:rd{i}" for i in range(4)]
    dids = []
    for target in targets:
        dids += counted.plan(target, 1)
        counted.extract(dids[-1])
    counted.r.zadd(keys.lanes_ready(), {t: i for i, t in enumerate(targets[1:])})
    drains: list[int] = []
    out = lanes.drive_ready(counted.ctx, targets[0], lambda t, countdown=None: None, lambda: drains.append(1))
    assert out == {"lane": targets[0], "state": "empty", "sent": 1, "drained": 3, "drained_sent": 3}
    assert [s[0] for s in counted.platform.sent] == ["rd0", "rd1", "rd2", "rd3"] and drains == []
    assert not counted.r.exists(keys.lanes_ready())
    assert not any(counted.r.exists(keys.lease("lane", t), keys.delivery_lock(d)) for t, d in zip(targets, dids))
    assert [((receipts.get_delivery(counted.r, d) or {}).get("state"), (receipts.get_delivery(counted.r, d) or {})
             .get("attempts")) for d in dids] == [("delivered", "1")] * 4


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
    out = lanes.drive_ready(counted.ctx, "memory:nx0", lambda t, countdown=None: None, lambda: None)
    assert out["drained_sent"] == 1 and [s[0] for s in counted.platform.sent] == ["nx0", "nx1"]
    # nx1's own send started its interval: not paced behind the stale gate
    assert 0 < counted.r.pttl(gate) <= interval * 1000


def test_a_next_lane_held_elsewhere_or_on_another_platform_is_left_or_looked_at_on_its_own(counted):
    """A next lane whose lease another worker holds is left to it (nothing sent, its lease
    untouched); one on another platform gets a first look of its own, as before."""
    dids = {}
    for target in ("memory:ho0", "memory:ho1", "other:ho2"):
        (dids[target],) = counted.plan(target, 1)
        counted.extract(dids[target])
    counted.r.set(keys.lease("lane", "memory:ho1"), "another-worker", ex=60)
    counted.r.zadd(keys.lanes_ready(), {"memory:ho1": 1, "other:ho2": 2})
    lanes.drive_ready(counted.ctx, "memory:ho0", lambda t, countdown=None: None, lambda: None)
    assert [s[0] for s in counted.platform.sent] == ["ho0", "ho2"]
    assert counted.r.get(keys.lease("lane", "memory:ho1")) == "another-worker"
    assert not counted.r.exists(keys.lanes_ready(), keys.lease("lane", "other:ho2"))
    assert (receipts.get_delivery(counted.r, dids["memory:ho1"]) or {})["state"] == "extracted"  # its holder's to send


def test_the_outbox_gets_the_file_and_its_log_line(counted, tmp_path):
    """The same delivery to the outbox platform (the pipeline bench's): its file and one log line."""
    from dataclasses import replace

    from adapters.platforms.outbox import OutboxPlatform, read_log

    outbox = OutboxPlatform(tmp_path / "outbox")
    ctx = replace(counted.ctx, platform=lambda name: outbox)
    (did,) = counted.plan("outbox:rt5", 1)
    out = extract.run(ctx, did)
    assert out["state"] == "extracted"
    out = lanes.drive(ctx, "outbox:rt5", lambda t, countdown=None: None)
    assert out == {"lane": "outbox:rt5", "state": "empty", "sent": 1}
    assert [(row["delivery_id"], row["name"], row["size_bytes"]) for row in read_log(tmp_path / "outbox", "rt5")] \
        == [(did, "f0.bin", 1000)]
    assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"


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


def test_a_delivery_to_a_chat_with_a_gate_a_window_and_file_ids_starts_the_gate_and_reuses_the_file_id(counted):
    from dataclasses import replace

    bot = _BotLike()
    ctx = replace(counted.ctx, platform=lambda name: bot)
    for chat in ("g1", "g2"):  # the same bytes: uploaded, then sent by its file id
        target = f"botlike:{chat}"
        (did,) = counted.plan(target, 1)
        extract.run(ctx, did)
        out = lanes.drive(ctx, target, lambda t, countdown=None: None)
        assert out == {"lane": target, "state": "empty", "sent": 1}
        assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"
        gate, interval = ratelimit.gate_of(bot, chat)
        assert 0 < counted.r.pttl(gate) <= interval * 1000  # the chat's interval started with the send
    sha = bot.file_ids and counted.r.keys("courier:fileid:botlike:bot1:*")
    assert len(sha) == 1 and counted.r.get(sha[0]).startswith("F-")
    assert bot.file_ids == [None, counted.r.get(sha[0])]  # the second send went by the first's file id


def _window_hits(r: Any, bot: Any) -> int:
    """How many slots the bot's window has given or booked (rate_book.lua: one entry a send)."""
    ((item, ids),) = ratelimit.rules(bot, "any")
    return int(r.llen(ratelimit.booked_key(ids)))


def _drive_bot(counted: Any, bot: Any, chat: str, n: int) -> tuple[Any, list[str]]:
    from dataclasses import replace

    ctx = replace(counted.ctx, platform=lambda name: bot)
    dids = counted.plan(f"botlike:{chat}", n)
    for did in dids:
        extract.run(ctx, did)
    out = lanes.drive(ctx, f"botlike:{chat}", lambda t, countdown=None: None)
    return out, dids


def test_a_full_window_asked_with_the_gate_gives_the_gate_back_and_sends_nothing(counted):
    """The window's slot not free after the chat's gate was taken: nothing is sent, the chat's
    gate is open again, the lane waits for the window (courier's own pacing) with the slot
    booked for it."""
    bot = _BotLike()
    bot.limits = dataclasses.replace(bot.limits, per_bot_per_s=1.0)
    _drive_bot(counted, bot, "wf0", 1)  # the window's one slot a second, taken
    out, (did,) = _drive_bot(counted, bot, "wf1", 1)
    assert out["state"] == "waiting" and 0 < out["wait_s"] <= 1.1
    assert [s[0] for s in bot.sent] == ["wf0"]
    gate, _ = ratelimit.gate_of(bot, "wf1")
    assert not counted.r.exists(gate)  # given back
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] != "delivered"
    ((_item, ids),) = ratelimit.rules(bot, "wf1")  # the window's last slot (it keeps one) is booked for wf1
    assert counted.r.lrange(ratelimit.booked_key(ids), 0, -1) == [counted.r.get(ratelimit.booked_key(ids, "wf1"))]


def test_a_send_waiting_for_its_chats_gate_takes_no_window_slot(counted):
    """Two deliveries to one chat in one drive: the second's gate is not free (the first's
    interval still runs), so it asks no window slot, which would be spent for nothing; the
    window holds the one send made."""
    bot = _BotLike()
    out, dids = _drive_bot(counted, bot, "wl0", 2)
    assert out["state"] == "waiting" and [s[0] for s in bot.sent] == ["wl0"]
    assert _window_hits(counted.r, bot) == 1


def test_a_window_script_redis_lost_is_taken_the_usual_way(counted):
    """Redis restarted (its scripts gone): the window's slot is still taken (the script is
    loaded again) and the send goes."""
    bot = _BotLike()
    _drive_bot(counted, bot, "ns0", 1)
    counted.r.script_flush()
    out, (did,) = _drive_bot(counted, bot, "ns1", 1)
    assert out == {"lane": "botlike:ns1", "state": "empty", "sent": 1}
    assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"
    assert _window_hits(counted.r, bot) == 2



def test_a_delivery_queued_by_the_code_before_the_typed_spec_is_extracted_and_sent(counted):
    """An upgrade mid-flight: a receipt whose spec the code before `DeliverySpec` sealed (this dict,
    the keys it wrote) is extracted and sent by this code, once."""
    from tasks.ledger import signing

    (did,) = counted.plan("memory:rt-old", 1)
    job, key, path = did.rsplit(".", 1)[0], f"files/{did.rsplit('.', 1)[0]}/0-f0.bin", str(counted.sandbox / "f0.bin")
    legacy = {"id": did, "job": job, "target": "memory:rt-old", "type": "file", "voice": False, "as_document": False,
              "key": key, "name": "f0.bin",
              "extract": {"sandbox": SandboxRef("local").to_dict(), "path": path, "key": key}}
    assert signing.open_json("delivery", did, receipts.get_delivery(counted.r, did)["spec"]) == legacy  # as written
    counted.r.hset(keys.delivery(did), "spec", signing.seal_json("delivery", did, legacy))
    assert counted.extract(did)["state"] == "extracted"
    assert counted.drive("memory:rt-old") == {"lane": "memory:rt-old", "state": "empty", "sent": 1}
    assert counted.platform.sent == [("rt-old", "document", "f0.bin", None)]
    assert (receipts.get_delivery(counted.r, did) or {})["state"] == "delivered"


def test_a_signed_spec_that_is_no_delivery_spec_is_refused_not_retried(counted):
    """A receipt whose spec verifies but cannot be read as a delivery spec (no release writes one):
    neither stage acts on it or fails over and over; the receipt says why, the lane moves on."""
    from tasks.ledger import signing

    (did,) = counted.plan("memory:rt-bad", 1)
    counted.r.hset(keys.delivery(did), "spec", signing.seal_json("delivery", did, {"id": did, "type": "file"}))
    assert counted.extract(did)["state"] == "refused"
    assert counted.drive("memory:rt-bad") == {"lane": "memory:rt-bad", "state": "empty", "sent": 0}
    rec = receipts.get_delivery(counted.r, did) or {}
    assert rec["state"] == "failed" and rec["reason"].startswith("refused:") and counted.platform.sent == []
