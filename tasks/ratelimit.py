"""Shared platform rate limits, enforced across every worker process in Redis.

Each platform declares its limits (`Limits.per_chat_per_s`,
`per_group_per_min`, `per_bot_per_s`); `acquire(redis, platform, chat)`
takes one slot of each that applies, with the `limits` library's moving
window on the courier Redis (keys under `keys.rate_limit_prefix()`). A moving
window of 1 per second means no two sends to one chat start less than a
second apart, whichever worker makes them.

When a slot is not free, `acquire` raises `RateLimited(retry_after_s)` with
the time until the window frees (from its window stats): the task is
re-scheduled by Celery, the worker never sleeps. A chain is sequential, so a
re-scheduled delivery is not overtaken by the next message of its chain.

`guard(redis, platform, delivery_id)` wraps a platform for one delivery:
before each send it acquires, and it records each message it sent under the
part's id (the `delivery_id` every send call gets: `<id>`, `<id>#0`,
`<id>#c0`, ...). A delivery of several messages (long text, caption
overflow) that is re-scheduled midway resumes after the parts already sent
instead of sending them again.

Slots are tested narrowest first (chat, group, bot) and then taken, so a
denied send uses no slot; a slot taken by a send that then fails stays taken
(the limit errs on the safe side).

A window counts sends by when they start, but the platform counts them by
when they arrive, and a send can take long to arrive (a cold process, a big
upload). So a chat with a per-chat limit also has a gate (a Redis key): it
is taken with SET NX when a send starts and, when the send ends, left to
expire one interval later. The next send to that chat starts only after the
previous one ended plus the interval, which bounds the spacing on arrival,
whatever the sends' own latency. `acquire` returns the `Slot` to `release`
when the send is over (`Guarded` does this for every send of a delivery).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from adapters.errors import RateLimited
from adapters.platforms.base import FileSource, Kind, Platform, Sent
from tasks import keys

__all__ = ["acquire", "guard", "rules", "Guarded", "Slot"]

#: never re-schedule sooner than this (Celery timer granularity, Redis round trips)
MIN_RETRY_S = 0.02
PARTS_TTL_S = 30 * 24 * 3600
#: a chat's gate while a send is on its way: after this a worker that died mid-send no longer blocks it
GATE_TTL_MS = 60_000

_lock = threading.Lock()
_limiters: dict[tuple[int, int], MovingWindowRateLimiter] = {}


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


def rules(platform: Platform, chat: str) -> list[tuple[RateLimitItem, tuple[str, ...]]]:
    """The limits that apply to one send, narrowest first, with their identifiers."""
    lim = platform.limits
    bot = str(getattr(platform, "cache_key", None) or "default")
    out: list[tuple[RateLimitItem, tuple[str, ...]]] = []
    if lim.per_chat_per_s:
        out.append((per_second(lim.per_chat_per_s), (platform.name, bot, "chat", chat)))
    is_group: Callable[[str], bool] | None = getattr(platform, "is_group", None)
    if lim.per_group_per_min and is_group is not None and is_group(chat):
        out.append((RateLimitItemPerMinute(int(round(lim.per_group_per_min)), 1),
                    (platform.name, bot, "group", chat)))
    if lim.per_bot_per_s:
        out.append((per_second(lim.per_bot_per_s), (platform.name, bot, "bot")))
    return out


def _retry_after(limiter: MovingWindowRateLimiter, item: RateLimitItem, ids: tuple[str, ...], what: str) -> RateLimited:
    stats = limiter.get_window_stats(item, *ids)
    wait = max(MIN_RETRY_S, stats.reset_time - time.time())
    return RateLimited(wait, f"{ids[0]}: {what} limit {item.amount} per {item.get_expiry()}s reached, "
                             f"retry after {wait:.2f}s")


class Slot:
    """A send slot: `release()` it when the send is over (also a context manager)."""

    def __init__(self, redis: Any, gate: str | None, interval_s: float) -> None:
        self._redis, self._gate, self._interval_s = redis, gate, interval_s

    def release(self) -> None:
        if self._gate is not None:
            # the next send to this chat may start one interval after this one ended
            self._redis.set(self._gate, "done", px=max(1, int(self._interval_s * 1000)))
            self._gate = None

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _gate_key(platform: Platform, chat: str) -> str:
    bot = str(getattr(platform, "cache_key", None) or "default")
    return f"{keys.rate_limit_prefix()}:gate:{platform.name}:{bot}:{chat}"


def _gate_wait(redis: Any, gate: str, interval_s: float) -> RateLimited:
    pipe = redis.pipeline()
    pipe.get(gate)
    pipe.pttl(gate)
    value, pttl = pipe.execute()
    value = value.decode() if isinstance(value, bytes) else (value or "")
    if value.startswith("sending:"):  # a send to this chat is on its way: check back later
        try:
            in_flight_s = max(0.0, time.time() - float(value.split(":", 1)[1]))
        except ValueError:
            in_flight_s = 0.0
        wait = min(30.0, max(interval_s, in_flight_s / 2))
    else:
        wait = max(MIN_RETRY_S, (pttl or 0) / 1000)
    return RateLimited(wait, f"{platform_name(gate)}: the previous send to this chat ended less than "
                             f"{interval_s:g}s ago or is still on its way, retry after {wait:.2f}s")


def platform_name(gate: str) -> str:
    return gate.split(":gate:", 1)[-1].split(":", 1)[0]


def acquire(redis: Any, platform: Platform, chat: str) -> Slot:
    """Take a send slot for `chat` on `platform`, or raise RateLimited.
    Release the returned slot when the send is over."""
    rs = rules(platform, chat)
    lim = platform.limits
    gate = None
    interval_s = 0.0
    if lim.per_chat_per_s:
        interval_s = 1.0 / lim.per_chat_per_s
        gate = _gate_key(platform, chat)
        if not redis.set(gate, f"sending:{time.time():.3f}", nx=True, px=GATE_TTL_MS):
            raise _gate_wait(redis, gate, interval_s)
    try:
        limiter = _limiter(redis) if rs else None
        for item, ids in rs:
            if not limiter.test(item, *ids):  # type: ignore[union-attr]
                raise _retry_after(limiter, item, ids, ids[2])  # type: ignore[arg-type]
        for item, ids in rs:
            if not limiter.hit(item, *ids):  # type: ignore[union-attr] # taken meanwhile by another worker
                raise _retry_after(limiter, item, ids, ids[2])  # type: ignore[arg-type]
    except BaseException:
        if gate is not None:
            redis.delete(gate)  # nothing was sent: open the gate again
        raise
    return Slot(redis, gate, interval_s)


class Guarded(Platform):
    """A platform seen through one delivery: rate-limited sends, each part sent once."""

    def __init__(self, redis: Any, platform: Platform, delivery_id: str) -> None:
        self._redis = redis
        self._p = platform
        self._parts_key = keys.delivery_parts(delivery_id)
        self.name = platform.name
        self.limits = platform.limits

    def __getattr__(self, name: str) -> Any:  # cache_key, is_group, ...
        return getattr(self._p, name)

    def __repr__(self) -> str:
        return f"Guarded({self._p!r})"

    def _once(self, chat: str, part: str, send: Callable[[], Sent]) -> Sent:
        done = self._redis.hget(self._parts_key, part)
        if done is not None:
            return Sent(message_id=done.decode() if isinstance(done, bytes) else str(done))
        with acquire(self._redis, self._p, chat):
            sent = send()
        pipe = self._redis.pipeline()
        pipe.hset(self._parts_key, part, sent.message_id)
        pipe.expire(self._parts_key, PARTS_TTL_S)
        pipe.execute()
        return sent

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        return self._once(chat, delivery_id, lambda: self._p.send_text(chat, text, delivery_id=delivery_id))

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        return self._once(chat, delivery_id, lambda: self._p.send_file(
            chat, kind, file, caption=caption, delivery_id=delivery_id, file_id=file_id))

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        done = self._redis.hget(self._parts_key, delivery_id)
        if done is not None:
            return [Sent(message_id=m) for m in (done.decode() if isinstance(done, bytes) else done).split(",")]
        with acquire(self._redis, self._p, chat):
            sents = self._p.send_album(chat, files, caption=caption, delivery_id=delivery_id)
        pipe = self._redis.pipeline()
        pipe.hset(self._parts_key, delivery_id, ",".join(s.message_id for s in sents))
        pipe.expire(self._parts_key, PARTS_TTL_S)
        pipe.execute()
        return sents

    def typing(self, chat: str) -> None:
        return self._p.typing(chat)

    def start_progress(self, chat: str, text: str) -> str | None:
        return self._p.start_progress(chat, text)

    def edit_progress(self, chat: str, message_id: str, text: str) -> None:
        return self._p.edit_progress(chat, message_id, text)

    def end_progress(self, chat: str, message_id: str) -> None:
        return self._p.end_progress(chat, message_id)

    def close(self) -> None:
        return None  # the wrapped platform is shared by the process


def guard(redis: Any, platform: Platform, delivery_id: str) -> Platform:
    return Guarded(redis, platform, delivery_id)
