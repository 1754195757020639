"""Each part of a delivery is sent once: the part records in Redis.

Each message of a delivery has a part id (`<id>`, `<id>#0`, `<id>#c0`, `<id>#album`, `<id>#notice` ...),
recorded once sent in its parts hash (`keys.delivery_parts`), so a delivery re-scheduled midway resumes
after the parts already sent; the hash also keeps an upload whose send failed (`<id>#upload`) and a
refusal whose notice was re-scheduled (`<id>#refused`). `guard` wraps a platform for one delivery: a
send looks up its part's record with the chat's rate-limit gate in one round trip, then takes its slots.
"""

from __future__ import annotations

from collections.abc import Callable

from redis import Redis
from redis.client import Pipeline

from adapters.errors import RateLimited
from adapters.platforms.base import FileSource, Kind, Platform, Sent
from tasks.delivery import ratelimit
from tasks.ledger import keys

#: how long a delivery's part records are kept
PARTS_TTL_S = 30 * 24 * 3600


def queue_record(pipe: Pipeline, delivery_id: str, records: dict[str, str]) -> None:
    """Queue on `pipe` the records of parts of `delivery_id` (part id -> a message id, a file id ...)."""
    key = keys.delivery_parts(delivery_id)
    for part, value in records.items():
        pipe.hset(key, part, value)
    pipe.expire(key, PARTS_TTL_S)


class Guarded(Platform):
    """A platform seen through one delivery: each part sent once, every send through the shared rate limits."""

    def __init__(self, redis: Redis, platform: Platform, delivery_id: str, *, first_attempt: bool = False,
                 defer: bool = False) -> None:
        self._redis = redis
        self._p = platform
        #: with `defer`, what follows a send (its record, the chat's gate pushed, `after_sent`
        #: writes) is written with the next part's send or the caller's receipt (`flush`)
        self._defer = defer
        self._pending: list[tuple[str, str]] = []
        #: what else follows sends so far: their chat gates pushed (`Slot.release`), `after_sent` writes
        self._writes: list[Callable[[Pipeline], object]] = []
        self._fresh = first_attempt
        self._delivery_id = delivery_id
        # what the platform declares, as the platform says it
        self.name, self.limits = platform.name, platform.limits
        self.cache_key, self.takes_empty_files = platform.cache_key, platform.takes_empty_files

    def is_group(self, chat: str) -> bool:
        return self._p.is_group(chat)

    def caption_chars_for(self, kind: Kind, file: FileSource) -> int:
        return self._p.caption_chars_for(kind, file)

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        return self._p.route_file(kind, file)

    def __repr__(self) -> str:
        return f"Guarded({self._p!r})"

    # -- a send: its part's record and the chat's gate in one round trip ------------------------
    def _once(self, chat: str, part: str, send: Callable[[], Sent]) -> Sent:
        r = self._redis
        self.flush()  # an earlier part's record (and the gate's push) go before the next part is sent
        pipe = r.pipeline(transaction=False)
        if not self._fresh:  # on a delivery's first attempt no part can have been sent before
            pipe.hget(keys.delivery_parts(self._delivery_id), part)
        asked = ratelimit.ask(pipe, self._p, chat)
        replies = pipe.execute()  # (an empty pipeline: [], no round trip)
        done = None if self._fresh else replies[0]
        if done is not None:  # sent by an earlier run of this delivery
            gate, _ = ratelimit.gate_of(self._p, chat)
            if gate is not None and replies[-1]:
                r.delete(gate)  # sent before: the gate taken for it goes back
            return Sent(message_id=str(done))
        slot = ratelimit.take(r, self._p, chat, replies[len(replies) - asked:])
        try:
            sent = send()
        except RateLimited as exc:  # the platform's own 429: the chat waits it out, and slows down
            ratelimit.refused(r, self._p, chat, exc.retry_after_s)
            raise
        except BaseException:
            slot.release()
            raise
        slot.sent()
        # recorded (and the chat's gate pushed, for a late arrival): with `defer`, with the next part's
        # send or the delivery's own receipt (`flush`): the same crash window, one round trip less
        self._pending.append((part, sent.message_id))
        self._writes.append(slot.release)
        if not self._defer:
            self.flush()
        return sent

    def after_sent(self, write: Callable[[Pipeline], object]) -> None:
        """Queue `write(pipe)` for the flush (with `defer`; else it runs now): a write that
        follows a send (an upload's file id) rides with the delivery's receipt."""
        self._writes.append(write)
        if not self._defer:
            self.flush()

    def flush(self, pipe: Pipeline | None = None, *, covered: str | None = None) -> None:
        """Queue what follows the parts sent so far (records, gates pushed, `after_sent` writes) on
        `pipe`, or write it now. `covered`: the delivery whose receipt the same pipeline marks
        delivered (a part that is the whole delivery needs no record of its own)."""
        pending = [(part, m) for part, m in self._pending if part != covered]
        writes = self._writes
        self._pending, self._writes = [], []
        if not (pending or writes):
            return
        p = pipe if pipe is not None else self._redis.pipeline(transaction=False)
        if pending:
            queue_record(p, self._delivery_id, dict(pending))
        for write in writes:
            write(p)
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


guard = Guarded
