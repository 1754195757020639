"""Shared platform rate limits, enforced across every worker process in Redis.

Each platform declares its limits (`Limits.per_chat_per_s`,
`per_group_per_min`, `per_bot_per_s`); before each send one slot of each
that applies is taken, in Redis, so every worker process shares them:

- per bot and per group: the `limits` library's moving windows on the
  courier Redis (keys under `keys.rate_limit_prefix()`): at most N sends in
  any window of the declared length;
- per chat: a gate, one Redis key per chat taken with SET NX when a send
  starts and, when it ends, left to expire one interval (1 / per_chat_per_s)
  later. A window counts sends by when they start, but the platform counts
  them by when they arrive, and a send can take a while to arrive (a cold
  process, a big upload); the gate makes the next send to a chat start only
  once the previous one is over plus the interval, so arrivals are spaced
  by the limit whatever the sends' own latency. A worker that dies mid-send
  holds the gate at most `GATE_TTL_MS`.

When a slot is not free, `RateLimited(retry_after_s)` is raised with the time
until it frees (the gate's remaining time, the window's reset from its
stats): the task is re-scheduled by Celery, the worker never sleeps. A chain
is sequential, so a re-scheduled delivery is not overtaken by the next
message of its chain.

Slots are taken narrowest first (chat gate, group, bot) and a denied send
gives back what it took, so a send waiting for its chat uses none of the
bot's slots; a send that fails after taking its slots keeps them taken (the
limit errs on the safe side).

A send takes its slots with `acquire`, or in two steps when the chat's gate
goes in a pipeline with other commands (`tasks.parts`, which looks up a
part's record in the same round trip): `ask_gate` on the pipeline, then
`take` with its answer. When the bot's window is the only window that
applies, its slot can be asked on that pipeline too (`ask_window`: the
library's own script, EVALSHA): then the send makes no round trip of its
own for its slots. A window slot taken with a gate that turns out not free
is spent (the safe side); a process does not ask for it with a gate it
released itself less than an interval ago (`released_lately`): that gate is
not free yet.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter

from adapters.errors import RateLimited
from adapters.platforms.base import Platform
from tasks import keys

__all__ = ["acquire", "ask_gate", "ask_window", "open_gate", "rules", "take", "Paced", "Slot"]


class Paced(RateLimited):
    """courier's own pacing (a shared limit's slot is not free yet), not a
    platform's refusal: waiting for it is no attempt and never gives up."""


#: never re-schedule sooner than this (Celery timer granularity, Redis round trips)
MIN_RETRY_S = 0.02
#: a chat's gate while a send is on its way: after this a worker that died mid-send no longer blocks it
GATE_TTL_MS = 60_000

_lock = threading.Lock()
_limiters: dict[tuple[int, int], MovingWindowRateLimiter] = {}
#: gates this process released (a chat's interval started), by when (monotonic): `released_lately`
_released: dict[str, float] = {}
#: past this many, released gates older than the longest interval are forgotten
_RELEASED_MAX = 10_000


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
    """The moving windows that apply to one send (group, then bot), with their identifiers.
    The per-chat limit is the chat's gate (`gate_of`)."""
    lim = platform.limits
    bot = str(platform.cache_key or "default")
    out: list[tuple[RateLimitItem, tuple[str, ...]]] = []
    if lim.per_group_per_min and platform.is_group(chat):
        out.append((RateLimitItemPerMinute(int(round(lim.per_group_per_min)), 1),
                    (platform.name, bot, "group", chat)))
    if lim.per_bot_per_s:
        out.append((per_second(lim.per_bot_per_s), (platform.name, bot, "bot")))
    return out


def gate_of(platform: Platform, chat: str) -> tuple[str | None, float]:
    """The chat's gate key and interval, or (None, 0) without a per-chat limit."""
    rate = platform.limits.per_chat_per_s
    if not rate:
        return None, 0.0
    bot = str(platform.cache_key or "default")
    return f"{keys.rate_limit_prefix()}:gate:{platform.name}:{bot}:{chat}", 1.0 / rate


def _sending() -> str:
    return f"sending:{time.time():.3f}"


def _retry_after(limiter: MovingWindowRateLimiter, item: RateLimitItem, ids: tuple[str, ...]) -> Paced:
    stats = limiter.get_window_stats(item, *ids)
    wait = max(MIN_RETRY_S, stats.reset_time - time.time())
    return Paced(wait, f"{ids[0]}: {ids[2]} limit of {item.amount} per {item.get_expiry()}s reached, "
                             f"retry after {wait:.2f}s")


def _gate_wait(redis: Any, platform: Platform, gate: str, interval_s: float) -> Paced:
    pipe = redis.pipeline(transaction=False)
    pipe.get(gate)
    pipe.pttl(gate)
    value, pttl = pipe.execute()
    value = value or ""
    if value.startswith("sending:"):  # a send to this chat is on its way: check back later
        try:
            in_flight_s = max(0.0, time.time() - float(value.split(":", 1)[1]))
        except ValueError:
            in_flight_s = 0.0
        wait = min(30.0, max(interval_s, in_flight_s / 2))
    else:
        wait = max(MIN_RETRY_S, (pttl or 0) / 1000)
    return Paced(wait, f"{platform.name}: the previous send to this chat ended less than {interval_s:g}s "
                             f"ago or is still on its way, retry after {wait:.2f}s")


class Slot:
    """The slots of one send: `release()` when the send is over (also a context manager)."""

    def __init__(self, redis: Any, gate: str | None, interval_s: float) -> None:
        self._redis, self._gate, self._interval_s = redis, gate, interval_s

    def release(self, pipe: Any = None) -> None:
        """Start the chat's interval from now (queued on `pipe` when given)."""
        if self._gate is not None:
            (pipe or self._redis).set(self._gate, "done", px=max(1, int(self._interval_s * 1000)))
            _note_released(self._gate, self._interval_s)
            self._gate = None

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _windows(redis: Any, platform: Platform, chat: str, gate: str | None, interval_s: float) -> Slot:
    """Take the group and bot windows for a send that holds its chat gate (if any)."""
    rs = rules(platform, chat)
    try:
        if rs:
            limiter = _limiter(redis)
            for item, ids in rs[:-1]:  # the narrower ones: test first, so a denial takes nothing
                if not limiter.test(item, *ids):
                    raise _retry_after(limiter, item, ids)
            for item, ids in reversed(rs):  # then take them, broadest first
                if not limiter.hit(item, *ids):  # full (or just taken by another worker)
                    raise _retry_after(limiter, item, ids)
    except BaseException:
        if gate is not None:
            redis.delete(gate)  # nothing was sent: open the gate again
        raise
    return Slot(redis, gate, interval_s)


def acquire(redis: Any, platform: Platform, chat: str) -> Slot:
    """Take the send slots for `chat` on `platform`, or raise RateLimited.
    Release the returned slot when the send is over."""
    gate, interval_s = gate_of(platform, chat)
    got_gate = gate is None or bool(redis.set(gate, _sending(), nx=True, px=GATE_TTL_MS))
    return take(redis, platform, chat, gate, interval_s, got_gate=got_gate)


def ask_gate(pipe: Any, gate: str) -> None:
    """Queue taking the chat's gate (`gate_of`) on `pipe`; its answer says
    whether it was taken (`take`'s `got_gate`)."""
    pipe.set(gate, _sending(), nx=True, px=GATE_TTL_MS)


def take(redis: Any, platform: Platform, chat: str, gate: str | None, interval_s: float, *,
         got_gate: bool, window: bool | None = None) -> Slot:
    """The rest of a send's slots once its chat gate was asked for: Paced
    when the gate was not free, else the windows (a denial opens the gate
    again). `window`: the window slot's answer when it was asked with the
    gate (`ask_window`; None: not asked). Release the returned slot when the
    send is over."""
    if gate is not None and not got_gate:
        raise _gate_wait(redis, platform, gate, interval_s)
    if window is None:
        return _windows(redis, platform, chat, gate, interval_s)
    if not window:
        if gate is not None:
            redis.delete(gate)  # nothing was sent: open the gate again
        item, ids = rules(platform, chat)[0]
        raise _retry_after(_limiter(redis), item, ids)
    return Slot(redis, gate, interval_s)


def _note_released(gate: str, interval_s: float) -> None:
    now = time.monotonic()
    with _lock:
        _released[gate] = now + interval_s
        if len(_released) > _RELEASED_MAX:
            for k in [k for k, until in _released.items() if until < now]:
                del _released[k]


def released_lately(gate: str) -> bool:
    """This process started `gate`'s interval and it has not passed yet: the gate is not free."""
    until = _released.get(gate)
    return until is not None and time.monotonic() < until


def ask_window(pipe: Any, redis: Any, platform: Platform, chat: str) -> Callable[[Any], bool | None] | None:
    """Queue on `pipe` taking the send's window slot when the bot's window is the only one that
    applies (a group's narrower window is tested before any is taken: `_windows`); None when it
    was not queued. Else call the returned function with its reply: True taken, False full,
    None not asked after all (Redis did not have the script: `take` takes the slot itself)."""
    rs = rules(platform, chat)
    if len(rs) != 1:
        return None
    item, ids = rs[0]
    storage = cast(RedisStorage, _limiter(redis).storage)
    script = storage.lua_acquire_moving_window  # (what `MovingWindowRateLimiter.hit` runs)
    pipe.evalsha(script.sha, 1, storage.prefixed_key(item.key_for(*ids)), time.time(), item.amount,
                 item.get_expiry(), 1)
    return lambda reply: None if isinstance(reply, Exception) else bool(reply)


def open_gate(redis: Any, gate: str) -> None:
    """Give back a gate taken for a send that does not happen."""
    redis.delete(gate)
