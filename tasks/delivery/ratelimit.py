"""Shared platform rate limits, enforced across every worker process in Redis: where a chat's pace is decided.

Before each send one slot of each limit a platform declares is taken, narrowest first:
- per chat (`per_chat_per_s`): a gate, one Redis key SET NX PX one interval (1 / rate + `PACE_MARGIN_S`)
  when a send *starts*, so a platform answering in 250 ms still gets 1/s;
- per group: the `limits` library's moving window (its public API);
- per bot: a moving window that books (rate_book.lua): while it is full, a send is given the earliest
  slot after those booked before it, in the order the sends asked, and its chat keeps that booking (first
  come, first served). `limits` answers yes or no and when the window resets: every send it held back came
  back at that reset and the window's slots went by lottery (measured, 300 sends to 100 chats at 30/s: one
  chat's first message 8 s late while others had sent three, and 29.1/s at the platform).

The platform counts a send when it arrives, and a cold connection, a big upload or a descheduled process
can bring two arrivals closer than two starts: an answered send's arrival is estimated as its end minus
the quickest send this process made to that platform lately; when that is later than its start, the gate
is pushed to it plus the interval (two arrivals come no closer than the limit minus `ARRIVAL_JITTER_S`).
A platform's 429 (`refused`) closes the gate for its `retry_after` and widens the chat's interval a while.

A slot not free raises `Paced` (the lane is driven again then; no worker sleeps); a denied send gives back
what it took, so a send waiting for its chat uses none of the bot's slots (one waiting for the bot holds
the slot booked for it); a send that fails keeps its slots (the safe side). `ask` (on a pipeline) then
`take` the slots (`acquire`: both); release the `Slot` when the send is over.
"""

from __future__ import annotations

import collections
import math
import os
import random
import threading
import time
from typing import Any

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from adapters.errors import RateLimited
from adapters.platforms.base import Platform
from tasks.ledger import keys, scripts


class Paced(RateLimited):
    """courier's own pacing (a shared limit's slot is not free yet), not a
    platform's refusal: waiting for it is no attempt and never gives up."""


#: never re-schedule sooner than this (Celery timer granularity, Redis round trips)
MIN_RETRY_S = 0.02
#: a send held back by a full window comes back after its reset plus up to this much
WINDOW_SPREAD_S = 0.05
#: added to a chat's interval (1 / per_chat_per_s): sends to a chat start at least this much more apart
PACE_MARGIN_S = 0.01
#: how much closer than the limit two arrivals may come (the way to the platform, unevenly slow)
ARRIVAL_JITTER_S = 0.1
#: a send's estimated arrival later than its start by less than this does not move the gate
_PUSH_MIN_S = 0.005
#: a chat's booked slot of the bot's window is good this long before its time (a timer's slack) ...
TICKET_EARLY_S = 0.01
#: ... and kept this long past it (a drive later than that books again, behind the others)
TICKET_KEEP_S = 30.0
#: a 429 widens the chat's interval by this factor (on top of any widening still in force) ...
BACKOFF_FACTOR = 2.0
#: ... at most this much ...
BACKOFF_MAX = 8.0
#: ... and the widening halves every this many seconds (forgotten after 8 half-lives)
BACKOFF_HALF_LIFE_S = 30.0
#: how many recent send durations per platform estimate its quickest answer
_DURATIONS = 32

_lock = threading.Lock()
_limiters: dict[tuple[int, int], MovingWindowRateLimiter] = {}
#: recent send durations (s) per (platform, bot), this process's: `_quickest`
_durations: dict[tuple[str, str], collections.deque[float]] = {}


def _limiter(redis: Any) -> MovingWindowRateLimiter:
    """One limiter per process and Redis client, on that client's connection pool."""
    k = (os.getpid(), id(redis))
    with _lock:
        lim = _limiters.get(k)
        if lim is None:
            storage = RedisStorage("redis://", connection_pool=redis.connection_pool,
                                   key_prefix=keys.rate_limit_prefix())
            lim = _limiters[k] = MovingWindowRateLimiter(storage)
        return lim


def per_second(rate: float) -> RateLimitItem:
    """`rate` sends a second as a moving-window item: 30/s -> 30 per 1 s, 0.2/s -> 1 per 5 s."""
    if rate >= 1:
        return RateLimitItemPerSecond(int(round(rate)), 1)
    return RateLimitItemPerSecond(1, max(1, int(round(1 / rate))))


def _bot(platform: Platform) -> str:
    return str(platform.cache_key or "default")


Window = tuple[RateLimitItem, tuple[str, ...]]


def group_window(platform: Platform, chat: str) -> Window | None:
    """The group's moving window (`limits`) for a send to `chat`, with its identifiers, if it has one."""
    lim = platform.limits
    if not (lim.per_group_per_min and platform.is_group(chat)):
        return None
    return RateLimitItemPerMinute(int(round(lim.per_group_per_min)), 1), (platform.name, _bot(platform), "group", chat)


def bot_window(platform: Platform) -> Window | None:
    """The bot's booked window (rate_book.lua), with its identifiers, if the platform has one."""
    rate = platform.limits.per_bot_per_s
    return (per_second(rate), (platform.name, _bot(platform), "bot")) if rate else None


def rules(platform: Platform, chat: str) -> list[Window]:
    """The windows that apply to one send (group, then bot). The per-chat limit is the chat's gate (`gate_of`)."""
    return [w for w in (group_window(platform, chat), bot_window(platform)) if w is not None]


def gate_of(platform: Platform, chat: str) -> tuple[str | None, float]:
    """The chat's gate key and interval between two sends' starts (with `PACE_MARGIN_S`),
    or (None, 0) without a per-chat limit."""
    rate = platform.limits.per_chat_per_s
    if not rate:
        return None, 0.0
    return f"{keys.rate_limit_prefix()}:gate:{platform.name}:{_bot(platform)}:{chat}", 1.0 / rate + PACE_MARGIN_S


def _backoff_key(gate: str) -> str:
    """The chat's widening after the platform's 429s: a hash {f: factor, t: when}."""
    return gate.replace(":gate:", ":backoff:", 1)


def _widening(reply: Any, now: float) -> float:
    """The factor on a chat's interval now, from its back-off hash's (f, t) reply."""
    try:
        f, t = float(reply[0]), float(reply[1])
    except (TypeError, ValueError, IndexError):
        return 1.0
    return 1.0 + max(0.0, f - 1.0) * math.pow(0.5, max(0.0, now - t) / BACKOFF_HALF_LIFE_S)


def _ms(s: float) -> int:
    return max(1, int(s * 1000))


def _retry_after(limiter: MovingWindowRateLimiter, item: RateLimitItem, ids: tuple[str, ...]) -> Paced:
    stats = limiter.get_window_stats(item, *ids)
    # (spread: the sends a full window holds back do not all come back at its reset)
    wait = max(MIN_RETRY_S, stats.reset_time - time.time()) + random.uniform(0.0, WINDOW_SPREAD_S)
    return Paced(wait, f"{ids[0]}: {ids[2]} limit of {item.amount} per {item.get_expiry()}s reached, "
                       f"retry after {wait:.2f}s")


def _window(redis: Any, window: Window, *, take: bool) -> None:
    """A `limits` moving window's slot tested, or taken (`take`); `Paced` when it is full."""
    limiter, (item, ids) = _limiter(redis), window
    if not (limiter.hit if take else limiter.test)(item, *ids):
        raise _retry_after(limiter, item, ids)


def booked_key(ids: tuple[str, ...], chat: str | None = None) -> str:
    """The bot window's slots given (a list of times), or with `chat` the chat's booked slot."""
    if chat is None:
        return ":".join((keys.rate_limit_prefix(), "slots", *ids))
    return ":".join((keys.rate_limit_prefix(), "ticket", *ids, chat))


def _book(redis: Any, item: RateLimitItem, ids: tuple[str, ...], chat: str) -> None:
    """The bot's slot for a send to `chat` (rate_book.lua): now, or `Paced` until the time booked
    for the chat (first come, first served; the chat's next ask uses that booking)."""
    got = scripts.run(redis, "rate_book", keys=[booked_key(ids), booked_key(ids, chat)],
                      args=[item.amount, item.get_expiry(), TICKET_EARLY_S, TICKET_KEEP_S])
    if got[0] != "go":
        wait = max(MIN_RETRY_S, float(got[1]))
        raise Paced(wait, f"{ids[0]}: {ids[2]} limit of {item.amount} per {item.get_expiry()}s reached, "
                          f"this chat's turn in {wait:.2f}s")


def _quickest(kind: tuple[str, str]) -> float:
    """This process's quickest recent send to platform `kind` (0 when none was seen yet)."""
    with _lock:
        seen = _durations.get(kind)
        return min(seen) if seen else 0.0


class Slot:
    """The slots of one send: `sent()` when it is over, then `release()` (also a context manager)."""

    def __init__(self, redis: Any, platform: Platform, gate: str | None, interval_s: float) -> None:
        self._redis, self._gate, self._interval_s = redis, gate, interval_s
        self._kind = (platform.name, _bot(platform))
        self._start = time.time()
        self._end: float | None = None
        self._quickest: float | None = None

    def sent(self) -> None:
        """The platform answered the send: its arrival is estimated from now, and how long it
        took tells how quickly the platform answers (a send that failed tells neither)."""
        if self._end is None:
            self._end = time.time()
            self._quickest = _quickest(self._kind)  # (seen before this send: none seen, 0)
            with _lock:
                seen = _durations.setdefault(self._kind, collections.deque(maxlen=_DURATIONS))
                seen.append(self._end - self._start)

    def release(self, pipe: Any = None) -> None:
        """Push the chat's gate to the send's estimated arrival plus the interval when that is
        later than its start (see the module's doc; queued on `pipe` when given)."""
        gate, self._gate = self._gate, None
        if gate is None:
            return
        quickest = self._quickest if self._quickest is not None else _quickest(self._kind)
        arrival = max(self._start, (self._end or time.time()) - quickest)
        if arrival - self._start < _PUSH_MIN_S:
            return  # the gate taken at the start holds
        (pipe if pipe is not None else self._redis).set(gate, "paced", px=_ms(arrival + self._interval_s - time.time()))

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def ask(pipe: Any, platform: Platform, chat: str) -> int:
    """Queue on `pipe` taking the chat's gate (with its widening after 429s); returns how many
    replies that is, for `take`."""
    gate, interval_s = gate_of(platform, chat)
    if gate is None:
        return 0
    pipe.hmget(_backoff_key(gate), ["f", "t"])
    pipe.set(gate, "paced", nx=True, px=_ms(interval_s))
    return 2


def take(redis: Any, platform: Platform, chat: str, replies: list[Any]) -> Slot:
    """The rest of a send's slots once its chat gate was asked for (`ask`'s `replies`): Paced
    when the gate was not free, else the windows (a denial opens the gate again)."""
    gate, interval_s = gate_of(platform, chat)
    if gate is not None:
        if not replies[1]:
            wait = max(MIN_RETRY_S, (redis.pttl(gate) or 0) / 1000)
            raise Paced(wait, f"{platform.name}: the previous send to this chat started less than {interval_s:g}s "
                              f"ago, retry after {wait:.2f}s")
        widening = _widening(replies[0], time.time())
        if widening > 1.0 + 1e-3:  # after the platform's 429s: this chat's interval is wider for a while
            interval_s *= widening
            redis.pexpire(gate, _ms(interval_s))
    try:
        group, bot = group_window(platform, chat), bot_window(platform)
        if group is not None:  # tested first: a denial takes nothing
            _window(redis, group, take=False)
        if bot is not None:
            _book(redis, *bot, chat)
        if group is not None:  # then taken (full again only when another worker just took it)
            _window(redis, group, take=True)
    except BaseException:
        if gate is not None:
            redis.delete(gate)  # nothing was sent: open the gate again
        raise
    return Slot(redis, platform, gate, interval_s)


def acquire(redis: Any, platform: Platform, chat: str) -> Slot:
    """Take the send slots for `chat` on `platform`, or raise Paced; release the slot when sent."""
    pipe = redis.pipeline(transaction=False)
    return take(redis, platform, chat, pipe.execute() if ask(pipe, platform, chat) else [])


def refused(redis: Any, platform: Platform, chat: str, retry_after_s: float) -> None:
    """The platform refused a send to `chat` (its 429): no send to the chat before
    `retry_after_s` has passed, from any process, and the chat's interval widened."""
    gate, _ = gate_of(platform, chat)
    if gate is None:
        return
    key, now = _backoff_key(gate), time.time()
    factor = min(BACKOFF_MAX, max(BACKOFF_FACTOR, BACKOFF_FACTOR * _widening(redis.hmget(key, ["f", "t"]), now)))
    pipe = redis.pipeline(transaction=False)
    pipe.hset(key, mapping={"f": f"{factor:.3f}", "t": f"{now:.3f}"})
    pipe.expire(key, int(8 * BACKOFF_HALF_LIFE_S))
    if retry_after_s > 0:
        pipe.set(gate, "retry_after", px=_ms(retry_after_s))
    pipe.execute()
