"""Shared rate limits: Redis-backed windows (the `limits` library) and the
per-chat gate, against real Redis; then held by two worker processes sending
40 messages to one chat at once through the real Telegram SDK."""

from __future__ import annotations

import time

import pytest

from adapters.errors import RateLimited, Transient
from adapters.platforms.base import Kind, Limits, Platform, Sent
from tasks import ratelimit
from tests.fixtures.fake_telegram import enqueue, wait_job
from tests.fixtures.services import wait_until


class _Stub(Platform):
    """Only what the limiter reads: name, limits, cache_key, is_group; sends are counted."""

    name = "stub"

    def __init__(self, limits: Limits, bot: str = "b1") -> None:
        self.limits = limits
        self.cache_key = bot
        self.sent: list[tuple[str, str]] = []
        self.fail_with: Exception | None = None

    def is_group(self, chat: str) -> bool:
        return chat.startswith("-")

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append((chat, text))
        return Sent(message_id=f"m{len(self.sent)}")

    def send_file(self, chat, kind, file, *, caption, delivery_id, file_id=None):  # pragma: no cover
        raise NotImplementedError


def _unless_limited(send):
    try:
        return send()
    except RateLimited:
        return None


def _limits(**kw) -> Limits:
    return Limits(text_chars=100, caption_chars=10, upload_bytes=10, **kw)


def test_per_chat_window_and_gate(redis_client):
    p = _Stub(_limits(per_chat_per_s=1))
    with ratelimit.acquire(redis_client, p, "a"):
        with pytest.raises(RateLimited) as in_flight:  # the first send is still on its way
            ratelimit.acquire(redis_client, p, "a")
        ratelimit.acquire(redis_client, p, "b").release()  # other chats are not held
    t_end = time.time()
    with pytest.raises(RateLimited) as after:
        ratelimit.acquire(redis_client, p, "a")
    assert 0.5 < after.value.retry_after_s <= 1.0 and in_flight.value.retry_after_s >= 1.0
    assert "stub" in str(after.value)
    # a second after the previous send ended, the chat is free again
    def free() -> bool:
        try:
            ratelimit.acquire(redis_client, p, "a").release()
            return True
        except RateLimited:
            return False

    wait_until(free, timeout_s=10, interval_s=0.01, what="the chat's slot")
    assert time.time() - t_end >= 1.0


def test_group_and_bot_limits_and_denied_sends_use_no_slot(redis_client):
    p = _Stub(_limits(per_group_per_min=3, per_bot_per_s=5))
    for i in range(3):
        ratelimit.acquire(redis_client, p, "-100").release()
    with pytest.raises(RateLimited) as grp:
        ratelimit.acquire(redis_client, p, "-100")
    assert 55 < grp.value.retry_after_s <= 60 and "group" in str(grp.value)
    ratelimit.acquire(redis_client, p, "7").release()  # private chats: no group limit
    ratelimit.acquire(redis_client, p, "8").release()
    with pytest.raises(RateLimited) as bot:  # 3 + 2 sends: the bot's 5 per second are used
        ratelimit.acquire(redis_client, p, "9")
    assert 0 < bot.value.retry_after_s <= 1.0 and "bot" in str(bot.value)
    other = _Stub(_limits(per_group_per_min=3, per_bot_per_s=5), bot="b2")  # another bot: its own limits
    ratelimit.acquire(redis_client, other, "-100").release()


def test_per_second_items():
    assert (ratelimit.per_second(30).amount, ratelimit.per_second(30).get_expiry()) == (30, 1)
    assert (ratelimit.per_second(0.2).amount, ratelimit.per_second(0.2).get_expiry()) == (1, 5)
    assert ratelimit.rules(_Stub(_limits()), "x") == []


def test_guarded_delivery_resumes_after_the_parts_already_sent(redis_client):
    p = _Stub(_limits(per_chat_per_s=1))
    g = ratelimit.guard(redis_client, p, "job.0")
    assert g.send_text("c", "part one", delivery_id="job.0#0").message_id == "m1"
    with pytest.raises(RateLimited):  # the second part must wait for the chat's slot
        g.send_text("c", "part two", delivery_id="job.0#1")
    # the task is re-scheduled and runs the delivery again from the top
    g2 = ratelimit.guard(redis_client, p, "job.0")
    assert g2.send_text("c", "part one", delivery_id="job.0#0").message_id == "m1"  # not sent again
    sent = wait_until(lambda: _unless_limited(lambda: g2.send_text("c", "part two", delivery_id="job.0#1")),
                      timeout_s=10, interval_s=0.05, what="the chat's next slot")
    assert sent.message_id == "m2"
    assert p.sent == [("c", "part one"), ("c", "part two")]
    # a failed send takes its slot too, and records nothing
    p.fail_with = Transient("boom")
    with pytest.raises(Transient):
        ratelimit.guard(redis_client, p, "job.1").send_text("d", "x", delivery_id="job.1")
    with pytest.raises(RateLimited):
        ratelimit.guard(redis_client, p, "job.1").send_text("d", "x", delivery_id="job.1")
    assert g.cache_key == "b1" and g.limits is p.limits and Kind.TEXT in g.limits.native_kinds


def test_deferred_part_records_skip_the_part_the_receipt_covers(redis_client):
    """A delivery sent in one part is recorded by its receipt alone; the
    parts of a delivery sent in several are recorded for a retry to skip."""
    from tasks import keys

    p = _Stub(_limits())
    g = ratelimit.guard(redis_client, p, "job.5", first_attempt=True, defer=True)
    g.send_text("c", "whole", delivery_id="job.5")
    pipe = redis_client.pipeline(transaction=False)
    g.flush(pipe, covered="job.5")
    pipe.execute()
    assert not redis_client.exists(keys.delivery_parts("job.5"))
    g = ratelimit.guard(redis_client, p, "job.6", first_attempt=True, defer=True)
    g.send_text("c", "one", delivery_id="job.6#0")
    g.send_text("c", "two", delivery_id="job.6#1")  # the first part is recorded before this one goes
    assert redis_client.hget(keys.delivery_parts("job.6"), "job.6#0") == b"m2"
    g.flush(covered="job.6")
    assert redis_client.hgetall(keys.delivery_parts("job.6")) == {b"job.6#0": b"m2", b"job.6#1": b"m3"}
    assert 0 < redis_client.ttl(keys.delivery_parts("job.6"))


@pytest.mark.slow
def test_two_workers_40_messages_to_one_chat_hold_one_per_second(courier_env, fake_telegram, redis_client):
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    env.start_worker(concurrency=2)
    env.start_worker(concurrency=2)
    chat = "555000"
    jobs = [enqueue(env, f"telegram:{chat}", text=f"message {i}") for i in range(40)]
    for job in jobs:
        (row,) = wait_job(redis_client, job, timeout_s=150)
        assert row["state"] == "delivered", row
    calls = fake_telegram.calls_for("sendMessage", chat=chat)
    assert sorted(c.text for c in calls) == sorted(f"message {i}" for i in range(40))  # each once
    gaps = [b.t - a.t for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 1.0 - 0.02, sorted(gaps)[:5]
    # one chat's lane: the messages went out in the order they were enqueued, and courier's own
    # pacing was no attempt and no rate limit (the platform refused none)
    assert [c.text for c in calls] == [f"message {i}" for i in range(40)]
    rows = [wait_job(redis_client, job)[0] for job in jobs]
    assert {(row["attempts"], row.get("rate_limited", "0")) for row in rows} == {("1", "0")}
    # the sends came over several connections (the workers' processes), yet never closer than 1 s
    assert len({c.peer for c in calls}) >= 2
