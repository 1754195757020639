"""Shared rate limits: the group window (the `limits` library), the bot's
booked window (rate_book.lua) and the per-chat gate, against real Redis;
then held by two worker processes sending 40 messages to one chat at once
through the real Telegram SDK."""

from __future__ import annotations

import time

import pytest

from adapters.errors import RateLimited
from adapters.platforms.base import Limits, Platform, Sent
from tasks.delivery import parts, ratelimit
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
        #: how long the platform takes to answer a send
        self.latency_s = 0.0

    def is_group(self, chat: str) -> bool:
        return chat.startswith("-")

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        if self.latency_s:
            time.sleep(self.latency_s)  # the platform answering (not a wait for a condition)
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append((chat, text))
        return Sent(message_id=f"m{len(self.sent)}")

    def send_file(self, chat, kind, file, *, caption, delivery_id, file_id=None):  # pragma: no cover
        raise NotImplementedError


def _limits(**kw) -> Limits:
    return Limits(text_chars=100, caption_chars=10, upload_bytes=10, **kw)


def test_per_chat_gate_holds_a_chat_one_interval_from_a_sends_start(redis_client):
    p = _Stub(_limits(per_chat_per_s=1))
    gate, interval = ratelimit.gate_of(p, "a")
    assert interval == 1.0 + ratelimit.PACE_MARGIN_S
    with ratelimit.acquire(redis_client, p, "a"):
        with pytest.raises(RateLimited) as in_flight:  # the first send is still on its way
            ratelimit.acquire(redis_client, p, "a")
        ratelimit.acquire(redis_client, p, "b").release()  # other chats are not held
    assert 0.5 < in_flight.value.retry_after_s <= interval and "stub" in str(in_flight.value)
    assert isinstance(in_flight.value, ratelimit.Paced)
    wait_until(lambda: not redis_client.exists(gate), timeout_s=10, interval_s=0.01, what="the chat's gate")
    ratelimit.acquire(redis_client, p, "a").release()  # a second after, the chat is free again


def _gate_expiry(r, gate: str) -> tuple[float, float]:
    """When `gate` expires: (an early bound, a late bound) on this machine's clock."""
    t0 = time.time()
    left = r.pttl(gate) / 1000
    return t0 + left, time.time() + left


def test_pacing_by_start_and_a_late_arrival_pushes_the_gate(redis_client):
    """A send answered after the platform's usual latency leaves the gate as its start set it
    (the next send may start one interval after this one started, not after it ended); a send
    that took longer than the quickest send seen (an upload: it arrived late) pushes the gate
    to that arrival plus the interval."""
    p = _Stub(_limits(per_chat_per_s=1), bot=f"paced-{time.time()}")  # a bot no send was seen for
    p.latency_s = 0.3  # the platform answers 300 ms after a request arrives
    gate, interval = ratelimit.gate_of(p, "a")

    def send(i: int) -> tuple[float, float]:
        wait_until(lambda: not redis_client.exists(gate), timeout_s=10, interval_s=0.01, what="the gate")
        t0 = time.time()
        parts.guard(redis_client, p, f"pace.{i}").send_text("a", "x", delivery_id=f"pace.{i}")
        return t0, time.time()

    send(0)  # the first send to this platform: its arrival is taken as its end (the old rule)
    start, end = send(1)
    early, _ = _gate_expiry(redis_client, gate)
    # every send took >= 0.3 s: an arrival is estimated no later than its end minus 0.3 s
    assert early <= end - 0.25 + interval, (early - start, end - start)
    p.latency_s = 0.8  # a send taking 0.5 s longer than the quickest: it arrived late
    start, end = send(2)
    _, late = _gate_expiry(redis_client, gate)
    assert late >= start + interval + 0.15, (late - start, end - start)


def test_a_platforms_429_holds_the_chat_for_retry_after_and_widens_its_interval(redis_client):
    p = _Stub(_limits(per_chat_per_s=1), bot=f"refused-{time.time()}")
    gate, interval = ratelimit.gate_of(p, "a")
    p.fail_with = RateLimited(3.0)
    with pytest.raises(RateLimited) as exc:
        parts.guard(redis_client, p, "r.0").send_text("a", "x", delivery_id="r.0")
    assert not isinstance(exc.value, ratelimit.Paced)
    with pytest.raises(ratelimit.Paced) as held:  # every process waits the platform's retry_after out
        ratelimit.acquire(redis_client, p, "a")
    assert 2.5 < held.value.retry_after_s <= 3.0
    ratelimit.acquire(redis_client, p, "b").release()  # another chat: not held, not widened
    assert redis_client.pttl(ratelimit.gate_of(p, "b")[0]) <= interval * 1000
    redis_client.delete(gate)  # (retry_after has passed)
    p.fail_with = None
    with ratelimit.acquire(redis_client, p, "a"):  # the next send: the chat's interval is about doubled
        assert redis_client.pttl(gate) > 1.8 * interval * 1000
    redis_client.delete(gate)
    p.fail_with = RateLimited(0.0)  # a second 429: wider again (at most BACKOFF_MAX)
    with pytest.raises(RateLimited):
        parts.guard(redis_client, p, "r.1").send_text("a", "x", delivery_id="r.1")
    p.fail_with = None
    redis_client.delete(gate)  # (the refused send's own interval has passed)
    with ratelimit.acquire(redis_client, p, "a"):
        assert redis_client.pttl(gate) > 3.5 * interval * 1000
    # recovering gradually: the widening halves every BACKOFF_HALF_LIFE_S
    f, t = redis_client.hmget(gate.replace(":gate:", ":backoff:", 1), ["f", "t"])
    later = float(t) + ratelimit.BACKOFF_HALF_LIFE_S
    assert abs(ratelimit._widening([f, t], later) - (1 + (float(f) - 1) / 2)) < 1e-6
    assert ratelimit._widening([f, t], float(t) + 10 * ratelimit.BACKOFF_HALF_LIFE_S) < 1.01


def test_group_and_bot_limits_and_denied_sends_use_no_slot(redis_client):
    p = _Stub(_limits(per_group_per_min=3, per_bot_per_s=5))
    for i in range(3):
        ratelimit.acquire(redis_client, p, "-100").release()
    with pytest.raises(RateLimited) as grp:
        ratelimit.acquire(redis_client, p, "-100")
    assert 55 < grp.value.retry_after_s <= 60 + ratelimit.WINDOW_SPREAD_S and "group" in str(grp.value)
    ratelimit.acquire(redis_client, p, "7").release()  # private chats: no group limit
    ratelimit.acquire(redis_client, p, "8").release()
    with pytest.raises(RateLimited) as bot:  # 3 + 2 sends: the bot's 5 per second are used
        ratelimit.acquire(redis_client, p, "9")
    assert 0 < bot.value.retry_after_s <= 1.0 + ratelimit.WINDOW_SPREAD_S and "bot" in str(bot.value)
    other = _Stub(_limits(per_group_per_min=3, per_bot_per_s=5), bot="b2")  # another bot: its own limits
    ratelimit.acquire(redis_client, other, "-100").release()


def test_a_full_bot_window_books_slots_first_come_first_served(redis_client):
    """While the bot's window is full each send is given its own slot, in the order the sends asked:
    with 1 send per 2 s, the second to fifth chats wait about 2, 4, 6 and 8 s; a chat asking again
    early keeps its slot (never booked twice), at its time it goes, and a newcomer goes behind every
    slot booked before it. (With a window that only said when it resets, all four waited for the same
    reset and took the slot by lottery: one chat's first message came after others' third.)"""
    p = _Stub(_limits(per_bot_per_s=0.5), bot=f"fifo-{time.time()}")
    ratelimit.acquire(redis_client, p, "0").release()
    waits = []
    for chat in "1234":
        with pytest.raises(ratelimit.Paced) as held:
            ratelimit.acquire(redis_client, p, chat)
        assert "bot limit of 1 per 2s" in str(held.value)
        waits.append(held.value.retry_after_s)
    assert all(2 * k < w <= 2 * (k + 1) for k, w in enumerate(waits)), waits  # first come, first served
    with pytest.raises(ratelimit.Paced) as again:  # chat 4 asks again before its turn: the same slot
        ratelimit.acquire(redis_client, p, "4")
    assert again.value.retry_after_s <= waits[-1]
    slot4 = time.time() + again.value.retry_after_s  # (a bound: when chat 4 goes, at the latest)

    def goes(chat: str) -> bool:
        try:
            ratelimit.acquire(redis_client, p, chat).release()
        except ratelimit.Paced:
            return False
        return True

    wait_until(lambda: goes("1"), timeout_s=30, interval_s=0.02, what="chat 1's slot")
    t0 = time.time()
    with pytest.raises(ratelimit.Paced) as late:  # a newcomer, once chat 1 went: behind chat 4's slot
        ratelimit.acquire(redis_client, p, "new")
    assert t0 + late.value.retry_after_s > slot4, (late.value.retry_after_s, slot4 - t0)


def test_per_second_items():
    assert (ratelimit.per_second(30).amount, ratelimit.per_second(30).get_expiry()) == (30, 1)
    assert (ratelimit.per_second(0.2).amount, ratelimit.per_second(0.2).get_expiry()) == (1, 5)
    assert ratelimit.rules(_Stub(_limits()), "x") == []


@pytest.mark.slow
def test_two_workers_20_messages_to_one_chat_hold_one_per_second(courier_env, fake_telegram, redis_client):
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    env.start_worker(concurrency=2)
    env.start_worker(concurrency=2)
    chat = "555000"
    jobs = [enqueue(env, f"telegram:{chat}", text=f"message {i}") for i in range(20)]
    for job in jobs:
        (row,) = wait_job(redis_client, job, timeout_s=150)
        assert row["state"] == "delivered", row
    calls = fake_telegram.calls_for("sendMessage", chat=chat)
    assert sorted(c.text for c in calls) == sorted(f"message {i}" for i in range(20))  # each once
    gaps = [b.t - a.t for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 1.0 - ratelimit.ARRIVAL_JITTER_S, sorted(gaps)[:5]
    # one chat's lane: the messages went out in the order they were enqueued, and courier's own
    # pacing was no attempt and no rate limit (the platform refused none)
    assert [c.text for c in calls] == [f"message {i}" for i in range(20)]
    rows = [wait_job(redis_client, job)[0] for job in jobs]
    assert {(row["attempts"], row.get("rate_limited", "0")) for row in rows} == {("1", "0")}
    # the sends came over several connections (the workers' processes), yet never closer than the limit
    assert len({c.peer for c in calls}) >= 2


def _sent_in_order(env, fake, redis_client, chat: str, n: int) -> list:
    jobs = [enqueue(env, f"telegram:{chat}", text=f"message {i}") for i in range(n)]
    rows = [wait_job(redis_client, job, timeout_s=120)[0] for job in jobs]
    assert {row["state"] for row in rows} == {"delivered"}, rows
    calls = sorted(fake.calls_for("sendMessage", chat=chat), key=lambda c: c.t)
    ok = [c for c in calls if c.ok]
    assert [c.text for c in ok] == [f"message {i}" for i in range(n)]  # each once, in order: none lost
    return calls


@pytest.mark.slow
def test_a_chat_is_paced_by_start_measured_at_arrival(courier_env, fake_telegram, redis_client):
    """12 messages to one chat from two worker processes, the platform answering 0.6 s after a
    request arrives. No two arrivals closer than the limit minus the platform's jitter (a lower
    bound: load only widens gaps); and the next send starts one interval after the previous one
    *started*: the rule it replaces (one interval after the previous send *ended*) made every
    gap at least the interval plus the latency, here most gaps are shorter than that (an upper
    bound with the latency's 0.6 s of slack for load)."""
    fake_telegram.latency_s = 0.6
    env = courier_env(**fake_telegram.courier_settings())
    env.start_worker(concurrency=2)
    env.start_worker(concurrency=2)
    calls = _sent_in_order(env, fake_telegram, redis_client, "555001", 12)
    assert all(c.ok for c in calls)  # the platform refused none
    gaps = [b.t - a.t for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 1.0 - ratelimit.ARRIVAL_JITTER_S, gaps
    by_start = [g for g in gaps if g < 1.0 + fake_telegram.latency_s]
    assert len(by_start) > len(gaps) // 2, gaps


@pytest.mark.slow
def test_a_platforms_429_holds_the_chat_for_retry_after_and_paces_it_wider(courier_env, fake_telegram,
                                                                           redis_client):
    """The platform refuses the first send with 429 retry_after 2: nothing goes to the chat before
    those 2 s have passed, the sends after it are spaced wider than the chat's limit (the
    interval widened, recovering over BACKOFF_HALF_LIFE_S), and none is lost."""
    fake_telegram.fail_next(1, 429, retry_after=2, method="sendMessage")
    env = courier_env(**fake_telegram.courier_settings())
    env.start_worker(concurrency=2)
    calls = _sent_in_order(env, fake_telegram, redis_client, "555002", 5)
    refused, ok = calls[0], calls[1:]
    assert refused.status == 429 and refused.text == "message 0" and all(c.ok for c in ok)
    assert ok[0].t - refused.t >= 2.0  # retry_after honoured
    gaps = [b.t - a.t for a, b in zip(ok, ok[1:])]
    assert min(gaps) >= 1.5, gaps  # widened (about 2x, still ~1.8x after 12 s), not back to 1 s
