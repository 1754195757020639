"""Phase events: one bounded Redis stream per job (turn or send).

An event is a flat JSON object with at least `kind` (`status`, `tool_start`,
`tool_result`, `delivery`) and `ts`. Readers (SSE, `courier watch`, `--wait`)
use stream ids to resume without gaps or repeats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from tasks import keys

TERMINAL_STATUSES = frozenset({"completed", "error", "no_reply"})


def publish(r, job_id: str, event: dict[str, Any], *, maxlen: int = 1000) -> str:
    event = {"ts": round(time.time(), 3), **event}
    eid = r.xadd(keys.events(job_id), {"data": json.dumps(event, ensure_ascii=False)}, maxlen=maxlen, approximate=True)
    r.expire(keys.events(job_id), 7 * 24 * 3600)
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


def follow(r, job_id: str, after: str = "0-0", *, block_ms: int = 1000, deadline_s: float | None = None
           ) -> Iterator[tuple[str, dict]]:
    """Yield events as they come, until `deadline_s` (monotonic) passes."""
    while deadline_s is None or time.monotonic() < deadline_s:
        batch = read(r, job_id, after, block_ms=block_ms)
        for eid, ev in batch:
            after = eid
            yield eid, ev
        if not batch:
            yield "", {}
