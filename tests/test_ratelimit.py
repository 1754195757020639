"""Shared rate limits: Redis-backed windows (the `limits` library) and the
per-chat gate, against real Redis; then held by two worker processes sending
40 messages to one chat at once through the real Telegram SDK."""

from __future__ import annotations

import time

import pytest

from adapters.errors import RateLimited
from adapters.platforms.base import Limits, Platform, Sent
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


def _limits(**kw) -> Limits:
    return Limits(text_chars=100, caption_chars=10, upload_bytes=10, **kw)


def test_per_chat_window_and_gate(redis_client):
    p = _Stub(_limits(per_chat_per_s=1))
    with ratelimit.acquire(redis_client, p, "a"):
        with pytest.raises(RateLimited) as in_flight:  # the first send is still on its way
            ratelimit.acquire(redis_client, p, "a")
        ratelimit.acquire(redis_client, p, "b").release()  # other chats are not held
        t_end = time.time()  # just before the release (the gate's second starts at it, not before)
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
