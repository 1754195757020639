"""Each part of a delivery is sent once: the part records in Redis.

A delivery may go as several messages (a long text split in parts, a
caption's overflow, an album and its caption, a notice); each has a part id
(the `delivery_id` each send call gets: `<id>`, `<id>#0`, `<id>#c0`,
`<id>#album`, `<id>#notice`, ...). Each message sent is recorded under its
part id in the delivery's parts hash (`keys.delivery_parts`), so a delivery
re-scheduled midway (a rate limit, a transient error, a dead worker)
resumes after the parts already sent instead of sending them again. The
same hash keeps what a retry resumes from besides: an upload whose send
failed (`<id>#upload`), a refusal whose notice was re-scheduled
(`<id>#refused`).

`guard(redis, platform, delivery_id)` wraps a platform for one delivery:
before a send, its part's record is looked up (with the chat's rate-limit
gate, `tasks.ratelimit`, in the same round trip); a part already recorded is
not sent again; else the send takes its rate-limit slots, and once sent its
record is written (with the gate's release). Its Redis round trips per
send: one (part check + gate), one per window, one (gate release + part
record). The shared delivery flow saves two of them: `look_ahead` queues the
first with the flow's own reads (the file-id cache), and with `defer` the
last rides with the delivery's receipt (`flush`), as the upload's file id
does (`after_sent`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.platforms.base import FileSource, Kind, Platform, Sent
from tasks import keys, ratelimit

__all__ = ["PARTS_TTL_S", "Guarded", "guard", "queue_lookup", "queue_record"]

#: how long a delivery's part records are kept
PARTS_TTL_S = 30 * 24 * 3600


def queue_record(pipe: Any, delivery_id: str, records: dict[str, str]) -> None:
    """Queue on `pipe` the records of parts of `delivery_id` (part id -> what
    to remember: a message id, an upload's file id, ...), and their expiry."""
    key = keys.delivery_parts(delivery_id)
    for part, value in records.items():
        pipe.hset(key, part, value)
    pipe.expire(key, PARTS_TTL_S)


def queue_lookup(pipe: Any, delivery_id: str, parts: list[str]) -> None:
    """Queue on `pipe` reading the records of `parts` (None where there is none)."""
    pipe.hmget(keys.delivery_parts(delivery_id), parts)


class Guarded(Platform):
    """A platform seen through one delivery: each part sent once, every send through the shared rate limits."""

    def __init__(self, redis: Any, platform: Platform, delivery_id: str, *, first_attempt: bool = False,
                 defer: bool = False) -> None:
        self._redis = redis
        self._p = platform
        #: with `defer`, what follows a send (its record, the chat's gate released, `after_sent`
        #: writes) is written with the next part's send or the caller's receipt (`flush`)
        self._defer = defer
        self._pending: list[tuple[str, str]] = []
        #: what else follows sends so far: their chat intervals started, `after_sent` writes
        self._writes: list[Callable[[Any], Any]] = []
        #: a look-ahead's answers: (part, its record, whether the gate was taken, the gate, the
        #: window slot's answer: None when not asked)
        self._looked: tuple[str, Any, bool, str | None, bool | None] | None = None
        #: on a delivery's first attempt no part can have been sent before: no need to look
        self._fresh = first_attempt
        self._delivery_id = delivery_id
        self.name = platform.name
        self.limits = platform.limits

    # -- what the platform declares, as the platform says it --------------
    @property
    def cache_key(self) -> str | None:  # type: ignore[override]
        return self._p.cache_key

    @property
    def takes_empty_files(self) -> bool:  # type: ignore[override]
        return self._p.takes_empty_files

    def is_group(self, chat: str) -> bool:
        return self._p.is_group(chat)

    def caption_chars_for(self, kind: Kind, file: FileSource) -> int:
        return self._p.caption_chars_for(kind, file)

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        return self._p.route_file(kind, file)

    def __repr__(self) -> str:
        return f"Guarded({self._p!r})"

    # -- the first round trip of a send: its part's record, the chat's gate ------------------------
    def _ask(self, pipe: Any, part: str, gate: str | None) -> int:
        """Queue on `pipe` what a send of `part` asks first; returns how many replies that is."""
        n = 0
        if not self._fresh:
            pipe.hget(keys.delivery_parts(self._delivery_id), part)
            n += 1
        if gate is not None:
            ratelimit.ask_gate(pipe, gate)
            n += 1
        return n

    def _answers(self, replies: list[Any], gate: str | None) -> tuple[Any, bool]:
        """(the part's record, whether the gate was taken) from `_ask`'s replies."""
        done = None if self._fresh else replies[0]
        return done, (bool(replies[-1]) if gate is not None else True)

    def look_ahead(self, pipe: Any, chat: str, part: str) -> Callable[[list[Any]], None]:
        """Queue on `pipe` the first round trip of the coming send of `part` to `chat`, for the
        caller to execute with reads of its own; call the returned function with all of
        `pipe`'s replies. That send then makes no round trip before it goes (a send of another
        part first gives the gate back)."""
        if self._pending or self._writes or self._looked is not None:
            return lambda replies: None  # (earlier parts' records go first: no look-ahead then)
        gate, _ = ratelimit.gate_of(self._p, chat)
        start = len(pipe)
        n = self._ask(pipe, part, gate)
        # the window's slot too, unless the gate is known not to be free yet (its interval, started
        # here, still runs: the slot would be spent for nothing)
        window = None if gate is not None and ratelimit.released_lately(gate) else \
            ratelimit.ask_window(pipe, self._redis, self._p, chat)

        def answer(replies: list[Any]) -> None:
            took = window(replies[start + n]) if window is not None else None
            self._looked = (part, *self._answers(replies[start:start + n], gate), gate, took)

        return answer

    def _drop_looked(self, pipe: Any = None) -> None:
        """A look-ahead whose send did not come: give its gate back."""
        looked, self._looked = self._looked, None
        if looked is not None and looked[2] and looked[3] is not None:
            (pipe if pipe is not None else self._redis).delete(looked[3])

    def _once(self, chat: str, part: str, send: Callable[[], Sent]) -> Sent:
        r = self._redis
        gate, interval_s = ratelimit.gate_of(self._p, chat)
        if self._pending or self._writes:
            self.flush()  # an earlier part's record (and the gate's release) go before the next part is sent
        window = None
        if self._looked is not None and self._looked[0] == part:
            _, done, got_gate, _, window = self._looked
            self._looked = None
        else:
            self._drop_looked()
            if self._fresh and gate is None:
                done, got_gate = None, True
            else:
                pipe = r.pipeline(transaction=False)
                self._ask(pipe, part, gate)
                done, got_gate = self._answers(pipe.execute(), gate)
        if done is not None:  # sent by an earlier run of this delivery
            if gate is not None and got_gate:
                ratelimit.open_gate(r, gate)
            return Sent(message_id=str(done))
        slot = ratelimit.take(r, self._p, chat, gate, interval_s, got_gate=got_gate, window=window)
        try:
            sent = send()
        except BaseException:
            slot.release()
            raise
        if self._defer:
            # recorded, and the chat's interval started, with the next part's send or the
            # delivery's own receipt (`flush`): the same crash window, one round trip less
            self._pending.append((part, sent.message_id))
            self._writes.append(slot.release)
            return sent
        pipe = r.pipeline(transaction=False)
        slot.release(pipe)
        queue_record(pipe, self._delivery_id, {part: sent.message_id})
        pipe.execute()
        return sent

    def after_sent(self, write: Callable[[Any], Any]) -> None:
        """Queue `write(pipe)` for the flush (with `defer`; else it runs now): a write that
        follows a send (an upload's file id) rides with the delivery's receipt."""
        if self._defer:
            self._writes.append(write)
        else:
            pipe = self._redis.pipeline(transaction=False)
            write(pipe)
            pipe.execute()

    def flush(self, pipe: Any = None, *, covered: str | None = None) -> None:
        """Queue what follows the parts sent so far on `pipe` (the caller's receipt pipeline),
        or write it now: their records, the chat's interval started (the gate released),
        `after_sent` writes, the gate of a look-ahead whose send did not come given back.
        `covered`: the delivery id whose receipt the same pipeline marks delivered: a part
        that is the whole delivery needs no record of its own."""
        pending = [(part, m) for part, m in self._pending if part != covered]
        writes = self._writes
        self._pending, self._writes = [], []
        if not (pending or writes or self._looked is not None):
            return
        p = pipe if pipe is not None else self._redis.pipeline(transaction=False)
        if pending:
            queue_record(p, self._delivery_id, dict(pending))
        for write in writes:
            write(p)
        self._drop_looked(p)
        if pipe is None:
            p.execute()

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        return self._once(chat, delivery_id, lambda: self._p.send_text(chat, text, delivery_id=delivery_id))

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        return self._once(chat, delivery_id, lambda: self._p.send_file(
            chat, kind, file, caption=caption, delivery_id=delivery_id, file_id=file_id))

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        out: list[Sent] = []

        def send() -> Sent:
            out.extend(self._p.send_album(chat, files, caption=caption, delivery_id=delivery_id))
            return Sent(message_id=",".join(s.message_id for s in out))

        sent = self._once(chat, delivery_id, send)
        return out or [Sent(message_id=m) for m in sent.message_id.split(",")]

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


def guard(redis: Any, platform: Platform, delivery_id: str, *, first_attempt: bool = False,
          defer: bool = False) -> Guarded:
    return Guarded(redis, platform, delivery_id, first_attempt=first_attempt, defer=defer)
