"""The delivery flow as plain code: a chat's lane driven against an in-memory
platform, no broker, no worker process (issue 14: the richest logic gets fast
unit tests). Redis is real (the session's private redis-server); the store is
a real volume in a temp dir. What runs here is what a worker's `drive_lane`
task runs: `lanes.drive` → `delivery.deliver` → the guarded platform."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.base import FileSource, Kind, Limits, Platform, Sent
from storage.volume import VolumeStore
from tasks.delivery import lanes
from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.runtime import Context

pytestmark = pytest.mark.timeout(60)


class MemoryPlatform(Platform):
    """Records every send; `fail` maps a call number (1-based, across all
    sends) to the exception that call raises instead of sending."""

    name = "memory"

    def __init__(self, *, caption_chars: int = 50, upload_bytes: int = 10_000) -> None:
        self.limits = Limits(text_chars=200, caption_chars=caption_chars, upload_bytes=upload_bytes)
        self.sent: list[tuple[str, str, str, str | None]] = []  # (chat, what, text or name, caption)
        self.bodies: dict[str, bytes] = {}
        self.fail: dict[int, BaseException] = {}
        self._calls = itertools.count(1)
        self._ids = itertools.count(1)

    def _call(self) -> None:
        exc = self.fail.pop(next(self._calls), None)
        if exc is not None:
            raise exc

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        self._call()
        self.sent.append((chat, "text", text, None))
        return Sent(message_id=str(next(self._ids)))

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        self._call()
        with file.opener() as f:  # type: ignore[operator]
            body = b"".join(iter(lambda: f.read(4096), b""))
        self.bodies[file.name] = body
        self.sent.append((chat, kind.value, file.name, caption))
        return Sent(message_id=str(next(self._ids)))


@pytest.fixture
def flow(redis_client, tmp_path):
    platform = MemoryPlatform()
    store = VolumeStore(tmp_path / "store")
    ctx = Context(redis=redis_client, store=store, platform=lambda name: platform,
                  sandbox=lambda ref: None, agent=lambda name: None,  # type: ignore[arg-type,return-value]
                  max_transient_attempts=3)
    published: list[tuple[str, float | None]] = []

    class Flow:
        def __init__(self) -> None:
            self.ctx, self.platform, self.store, self.published = ctx, platform, store, published
            self.r = redis_client

        def plan(self, target: str, *, text: str | None = None, files: dict[str, bytes] | None = None,
                 caption: str | None = None) -> list[str]:
            job = chains.new_job_id("snd")
            stored = []
            for seq, (name, body) in enumerate((files or {}).items(), start=1 if text else 0):
                key = chains.storage_key(job, seq, name)
                info = store.put_bytes(key, body)
                stored.append(chains.StoredFile(key=key, name=name, size=len(body),
                                                sha256=info.sha256 or hashlib.sha256(body).hexdigest()))
            entries = chains.register(self.r, chains.Plan(job_id=job, target=target, text=text, files=stored,
                                                          caption=caption), job_kind="send")
            return [e.did for e in entries]

        def drive(self, target: str) -> dict:
            return lanes.drive(ctx, target, lambda t, countdown=None: published.append((t, countdown)))

        def state(self, did: str) -> dict:
            return receipts.get_delivery(self.r, did) or {}

    return Flow()


def test_a_lane_sends_text_then_files_in_order_once(flow):
    ids = flow.plan("memory:c1", text="hello", files={"a.bin": b"A" * 100, "b.bin": b"B" * 200}, caption="first")
    out = flow.drive("memory:c1")
    assert out["state"] == "empty" and out["sent"] == 3
    assert flow.platform.sent == [("c1", "text", "hello", None), ("c1", "document", "a.bin", "first"),
                                  ("c1", "document", "b.bin", None)]
    assert flow.platform.bodies == {"a.bin": b"A" * 100, "b.bin": b"B" * 200}
    assert [flow.state(d)["state"] for d in ids] == ["delivered"] * 3
    assert flow.drive("memory:c1")["state"] == "empty"  # nothing left: nothing sent again
    assert len(flow.platform.sent) == 3
    assert flow.r.llen(keys.lane("memory:c1")) == 0


def test_a_caption_over_the_limit_rides_as_a_part_and_a_retry_resumes_after_the_sent_file(flow):
    caption = "word " * 30  # 150 characters: 50 fit in the caption, the rest follows as text
    (did,) = flow.plan("memory:c2", files={"r.bin": b"x" * 10}, caption=caption)
    flow.platform.fail[2] = Transient("connection reset")  # the overflow text fails once
    out = flow.drive("memory:c2")
    assert out["state"] == "waiting"  # backing off: transient
    assert flow.state(did)["state"] == "retrying"
    flow.r.delete(keys.lease("lane", "memory:c2"))
    assert flow.drive("memory:c2")["state"] == "empty"
    kinds = [s[1] for s in flow.platform.sent]
    assert kinds == ["document", "text"]  # the file once; its overflow once, after it
    assert flow.state(did)["state"] == "delivered"
    sent_caption = flow.platform.sent[0][3] or ""
    assert len(sent_caption) <= 50
    assert (sent_caption + " " + flow.platform.sent[1][2]).split() == caption.split()


def test_an_empty_file_and_one_over_the_limit_fail_with_a_notice_and_the_lane_goes_on(flow):
    ids = flow.plan("memory:c3", files={"empty.bin": b"", "big.bin": b"z" * 20_000, "ok.bin": b"ok"})
    assert flow.drive("memory:c3")["state"] == "empty"
    states = [flow.state(d) for d in ids]
    assert [s["state"] for s in states] == ["failed", "failed", "delivered"]
    assert "empty" in states[0]["reason"] and "over" in states[1]["reason"].lower()
    texts = [s[2] for s in flow.platform.sent if s[1] == "text"]
    assert any("empty.bin" in t for t in texts) and any("big.bin" in t for t in texts)
    assert [s[2] for s in flow.platform.sent if s[1] != "text"] == ["ok.bin"]  # nothing else uploaded


def test_a_permanent_error_fails_that_delivery_only(flow):
    ids = flow.plan("memory:c4", files={"a.bin": b"a", "b.bin": b"b"})
    flow.platform.fail[1] = Permanent("chat not found")
    assert flow.drive("memory:c4")["state"] == "empty"
    assert flow.state(ids[0])["state"] == "failed" and "chat not found" in flow.state(ids[0])["reason"]
    assert flow.state(ids[1])["state"] == "delivered"


def test_a_platform_429_waits_its_retry_after_then_sends_once(flow):
    (did,) = flow.plan("memory:c5", text="paced")
    flow.platform.fail[1] = RateLimited(7.0)
    out = flow.drive("memory:c5")
    assert out["state"] == "waiting" and 7.0 <= out["wait_s"] < 8.0
    assert flow.state(did)["state"] == "rate_limited"
    assert flow.published and flow.published[-1][0] == "memory:c5" and flow.published[-1][1] >= 7.0
    flow.r.delete(keys.lease("lane", "memory:c5"))
    assert flow.drive("memory:c5")["state"] == "empty"
    assert flow.platform.sent == [("c5", "text", "paced", None)]


def test_transient_errors_give_up_after_the_attempts_with_a_notice(flow):
    (did,) = flow.plan("memory:c6", files={"f.bin": b"f"})
    for n in range(1, 4):
        flow.platform.fail[n] = Transient("HTTP 502")
    for _ in range(3):
        flow.r.delete(keys.lease("lane", "memory:c6"))
        flow.drive("memory:c6")
    rec = flow.state(did)
    assert rec["state"] == "failed" and "gave up after 3 attempts" in rec["reason"]
    assert [s[1] for s in flow.platform.sent] == ["text"]  # the chat is told; the file never went
    assert "f.bin" in flow.platform.sent[0][2]


def test_a_refusal_whose_notice_was_paced_sends_only_the_notice_and_frees_the_chats_gate(flow):
    """The platform refuses a file; its notice waits for the chat's next second (courier's own
    pacing). The retry reads the recorded refusal before the file's send asks for the chat's
    gate; the file is not sent again: the notice goes, and the chat's interval starts with it."""
    from adapters.platforms.base import FileRefused
    from tasks.delivery import ratelimit

    gated = MemoryPlatform()
    gated.limits = Limits(text_chars=200, caption_chars=50, upload_bytes=10_000, per_chat_per_s=1.0)
    flow.ctx.platform = lambda name: gated
    (did,) = flow.plan("memory:c9", files={"huge.bin": b"h" * 100})
    gated.fail[1] = FileRefused("memory: too large (413)", too_large=True)  # the platform's own refusal
    first = flow.drive("memory:c9")
    assert first["state"] == "waiting" and gated.sent == [], first  # the notice waits for the chat's second
    assert flow.state(did)["state"] != "failed"  # not final: its notice is owed
    gate, _ = ratelimit.gate_of(gated, "c9")
    flow.r.delete(keys.lease("lane", "memory:c9"), gate)  # (the chat's second has passed)
    second = flow.drive("memory:c9")
    assert second["state"] == "empty", (second, gated.sent)
    assert flow.state(did)["state"] == "failed" and flow.state(did)["reason"].startswith("too large")
    (notice,) = gated.sent
    assert notice[1] == "text" and "huge.bin" in notice[2]  # the notice, and the file never again
    _, interval = ratelimit.gate_of(gated, "c9")
    assert 0 < flow.r.pttl(gate) <= interval * 1000  # the notice's send started the chat's interval
