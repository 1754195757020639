"""Phase events: one bounded Redis stream per job (turn or send).

An event is a flat JSON object with at least `kind` (`status`, `tool_start`,
`tool_result`, `delivery`) and `ts`. Readers (SSE, `courier watch`, `--wait`)
use stream ids to resume without gaps or repeats, and an `EndTracker` to know
when a job is over: its terminal status (which carries `deliveries`, how many
were queued) and then every delivery's final state (delivered | failed).
"""

from __future__ import annotations

import json
import time
from typing import Any

from tasks import keys
from tasks.states import DELIVERY_OVER

STREAM_TTL_S = 7 * 24 * 3600
TERMINAL_STATUSES = frozenset({"completed", "error", "no_reply", "cancelled"})


def publish(r, job_id: str, event: dict[str, Any], *, maxlen: int = 1000, pipe=None) -> str | None:
    """Append an event (one round trip). With `pipe`, queue it on that pipeline
    instead and return None."""
    event = {"ts": round(time.time(), 3), **event}
    p = pipe if pipe is not None else r.pipeline(transaction=False)
    p.xadd(keys.events(job_id), {"data": json.dumps(event, ensure_ascii=False)}, maxlen=maxlen, approximate=True)
    p.expire(keys.events(job_id), STREAM_TTL_S)
    if pipe is not None:
        return None
    eid = p.execute()[0]
    return eid.decode() if isinstance(eid, bytes) else eid


def read(r, job_id: str, after: str = "0-0", *, block_ms: int | None = None, count: int = 100) -> list[tuple[str, dict]]:
    res = r.xread({keys.events(job_id): after}, count=count, block=block_ms)
    out: list[tuple[str, dict]] = []
    for _stream, entries in res or []:
        for eid, fields in entries:
            eid = eid.decode() if isinstance(eid, bytes) else eid
            raw = fields.get(b"data") or fields.get("data")
            try:
                out.append((eid, json.loads(raw)))
            except (TypeError, ValueError):
                continue
    return out



DELIVERY_FINAL = DELIVERY_OVER


def decode(fields: dict) -> dict | None:
    """The event of one stream entry's fields (None if it is not one)."""
    raw = fields.get(b"data") or fields.get("data")
    try:
        ev = json.loads(raw)  # type: ignore[arg-type]  # None: not an event (TypeError below)
    except (TypeError, ValueError):
        return None
    return ev if isinstance(ev, dict) else None


def read_range(r, job_id: str, start: str = "-", end: str = "+", *, count: int | None = None
               ) -> list[tuple[str, dict]]:
    """Events between two stream ids, inclusive (`-`/`+`: the ends)."""
    out: list[tuple[str, dict]] = []
    for eid, fields in r.xrange(keys.events(job_id), start, end, count=count):
        ev = decode(fields)
        if ev is not None:
            out.append((eid.decode() if isinstance(eid, bytes) else eid, ev))
    return out


def is_terminal(ev: dict) -> bool:
    return ev.get("kind") == "status" and ev.get("status") in TERMINAL_STATUSES


class EndTracker:
    """Tells when a job's stream is over: after the terminal status and the
    final state of every delivery (those it counts in `deliveries`, and any
    seen queued). A send job has no status events: `expect_deliveries(n)`
    marks it started with `n` deliveries to wait for."""

    def __init__(self) -> None:
        self.terminal: dict | None = None
        self.expected = 0
        self.seen: set[str] = set()
        self.final: dict[str, str] = {}

    def expect_deliveries(self, n: int) -> None:
        self.terminal = self.terminal or {"kind": "status", "status": "completed", "deliveries": n,
                                          "synthetic": True}
        self.expected = max(self.expected, n)

    def feed(self, ev: dict) -> None:
        if is_terminal(ev):
            if self.terminal is None or self.terminal.get("synthetic"):
                self.terminal = ev
            try:
                self.expected = max(self.expected, int(ev.get("deliveries") or 0))
            except (TypeError, ValueError):
                pass
        elif ev.get("kind") == "delivery" and ev.get("delivery_id"):
            did = str(ev["delivery_id"])
            self.seen.add(did)
            if ev.get("state") in DELIVERY_FINAL:
                self.final[did] = ev["state"]

    @property
    def done(self) -> bool:
        return (self.terminal is not None and len(self.final) >= self.expected
                and all(d in self.final for d in self.seen))

    @property
    def ok(self) -> bool:
        """The turn completed and no delivery failed."""
        st = (self.terminal or {}).get("status")
        return st == "completed" and "failed" not in self.final.values()

    @classmethod
    def for_job(cls, r, job_id: str) -> "EndTracker":
        """A tracker primed for the job's kind (a send: its registered deliveries)."""
        from tasks import receipts

        t = cls()
        job = receipts.get_job(r, job_id) or {}
        if job.get("kind") == "send":
            t.expect_deliveries(int(r.llen(keys.job_deliveries(job_id)) or 0))
        return t
