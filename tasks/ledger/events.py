"""Phase events: one bounded Redis stream per job (turn or send).

An event is a flat JSON object with at least `kind` (`status`, `tool_start`, `tool_result`,
`delivery`) and `ts`. Readers resume by stream id, and an `EndTracker` tells when a job is
over: its terminal status, then every delivery's final state.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from adapters.display import visible
from tasks.ledger import keys, receipts
from tasks.states import DELIVERY_OVER, DeliveryState, JobState
from tasks.workspaces import relative

#: one event: a flat JSON object (`kind`, `ts` and the kind's fields; agents add their own)
Event = dict[str, Any]

STREAM_TTL_S = 7 * 24 * 3600
TERMINAL_STATUSES = frozenset({"completed", JobState.ERROR, JobState.NO_REPLY, JobState.CANCELLED})


def publish(r: Redis, job_id: str, event: Event, *, maxlen: int = 1000, pipe: Pipeline | None = None
            ) -> str | None:
    """Append an event (one round trip); with `pipe`, queue it there and return None."""
    event = {"ts": round(time.time(), 3), **shown(event, job_id)}
    p = pipe if pipe is not None else r.pipeline(transaction=False)
    p.xadd(keys.events(job_id), {"data": json.dumps(event, ensure_ascii=False)}, maxlen=maxlen, approximate=True)
    p.expire(keys.events(job_id), STREAM_TTL_S)
    return None if pipe is not None else cast(str, p.execute()[0])


def shown(event: Event, job_id: str) -> Event:
    """The event as its readers show it: in every text, paths relative to the turn's workspace
    (never the worker host's), nothing invisible or reordering (`visible`), line breaks as spaces."""
    return {k: visible(_BREAKS.sub(" ", relative(v, job_id))) if isinstance(v, str) else v for k, v in event.items()}


_BREAKS = re.compile(r"[\t\n\r\x0b\x0c]")


def read(r: Redis, job_id: str, after: str = "0-0", *, block_ms: int | None = None, count: int = 100
         ) -> list[tuple[str, Event]]:
    """The job's events after stream id `after` (blocking up to `block_ms` for the first)."""
    return [(eid, ev) for _job, eid, ev in read_many(r, {job_id: after}, block_ms=block_ms, count=count)]


def read_many(r: Redis, after: Mapping[str, str], *, block_ms: int | None = None, count: int = 100
              ) -> list[tuple[str, str, Event]]:
    """Several jobs' events in one XREAD, each after its own stream id (`after`: job id -> stream id)."""
    if not after:
        return []
    job_of = {keys.events(job_id): job_id for job_id in after}
    # courier's clients speak RESP2: [[stream, [(id, fields), ...]]] (None: nothing before the timeout)
    res = cast("list[tuple[str, list[tuple[str, dict[str, str]]]]] | None",
               r.xread({keys.events(job_id): cursor for job_id, cursor in after.items()}, count=count,
                       block=block_ms))
    return [(job_of.get(stream, stream), eid, ev) for stream, entries in res or [] for eid, ev in _decoded(entries)]


def _decoded(entries: Iterable[tuple[str, Mapping[Any, Any]]]) -> Iterator[tuple[str, Event]]:
    for eid, fields in entries:
        ev = decode(fields) if fields else None
        if eid is not None and ev is not None:
            yield eid, ev


def decode(fields: Mapping[Any, Any]) -> Event | None:
    """The event of one stream entry's fields (None if it is not one)."""
    raw = fields.get("data")
    if not isinstance(raw, str):
        return None
    try:
        ev = json.loads(raw)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def read_range(r: Redis, job_id: str, start: str = "-", end: str = "+", *, count: int | None = None
               ) -> list[tuple[str, Event]]:
    """Events between two stream ids, inclusive (`-`/`+`: the ends)."""
    entries = cast("list[tuple[str, dict[str, str]]]", r.xrange(keys.events(job_id), start, end, count=count))
    return list(_decoded(entries or []))


def describe(ev: Event) -> str:
    """The human text of one event, one line, no markup: every place that says an event in
    words says it with this (the turn page renders events itself, in the browser)."""
    kind = ev.get("kind")
    if kind == "status":
        return _text(ev.get("reason") or ev.get("activity") or ev.get("message") or ev.get("status"))
    if kind == "tool_start":
        return _text(ev.get("activity") or f"using {ev.get('tool_name') or 'a tool'}")
    if kind == "tool_result":
        status = ev.get("status") or "tool_complete"
        error = f": {ev['error']}" if status == "error" and ev.get("error") else ""
        return _text(f"{ev.get('activity') or ev.get('tool_name') or 'tool'} ({status}{error})")
    if kind == "delivery":
        tail = ev.get("reason") or ev.get("media") or ""
        return _text(f"{ev.get('state', '')} {ev.get('name') or ev.get('delivery_id', '')} {tail}".strip())
    return json.dumps(ev, ensure_ascii=False)


def _text(v: object) -> str:
    """One line of text, nothing in it invisible or reordering (`visible`: an agent's names)."""
    return visible(" ".join(str(v if v is not None else "").split()))


def is_terminal(ev: Event) -> bool:
    return ev.get("kind") == "status" and ev.get("status") in TERMINAL_STATUSES


class EndTracker:
    """Tells when a job's stream is over: after the terminal status and the final state of every delivery
    (those it counts in `deliveries`, and any seen queued). A send job has no status events:
    `expect_deliveries(n)` marks it started with `n` deliveries to wait for."""

    def __init__(self) -> None:
        self.terminal: Event | None = None
        self.expected = 0
        self.seen: set[str] = set()
        self.final: dict[str, str] = {}

    def expect_deliveries(self, n: int) -> None:
        self.terminal = self.terminal or {"kind": "status", "status": "completed", "deliveries": n,
                                          "synthetic": True}
        self.expected = max(self.expected, n)

    def feed(self, ev: Event) -> None:
        if is_terminal(ev):
            if self.terminal is None or self.terminal.get("synthetic"):
                self.terminal = ev
            with suppress(TypeError, ValueError):
                self.expected = max(self.expected, int(ev.get("deliveries") or 0))
        elif ev.get("kind") == "delivery" and ev.get("delivery_id"):
            did = str(ev["delivery_id"])
            self.seen.add(did)
            if ev.get("state") in DELIVERY_OVER:
                self.final[did] = ev["state"]

    @property
    def done(self) -> bool:
        return (self.terminal is not None and len(self.final) >= self.expected
                and all(d in self.final for d in self.seen))

    @property
    def ok(self) -> bool:
        """The turn completed and no delivery failed."""
        return (self.terminal or {}).get("status") == "completed" and DeliveryState.FAILED not in self.final.values()

    @classmethod
    def for_job(cls, r: Redis, job_id: str) -> "EndTracker":
        """A tracker primed for the job's kind (a send: its registered deliveries)."""
        t = cls()
        if (receipts.get_job(r, job_id) or {}).get("kind") == "send":
            t.expect_deliveries(int(r.llen(keys.job_deliveries(job_id)) or 0))
        return t
