"""Celery's queues as an operator sees them (`courier queues`, the metrics): depth, the oldest
message's age, consumers; and the orphans, queued messages with nothing left to do. A queue is a
Redis list consumed from the right: the oldest message is `LINDEX q -1`, stamped with its publish
time (header `sent_s`). Known queues are kept in `keys.queues()`, so a `sandbox.<host>` queue with
messages but no worker is still listed. A consumer is a worker whose heartbeat on the queue is
younger than `keys.CONSUMER_STALE_S`. The `delivery` queue counts the lanes of the ready set too.
"""

from __future__ import annotations

import base64
import json
import time
from typing import TypedDict, cast

from redis import Redis
from redis.client import NEVER_DECODE

from tasks import task_names
from tasks.ledger import keys, receipts, signing
from tasks.states import EXTRACTION_FAILED, EXTRACTION_OK, TURN_OVER

#: a queue nobody published to or consumed from for this long, and empty, is forgotten
FORGET_S = 7 * 24 * 3600
REGISTRY_TTL_S = 30 * 24 * 3600
#: the queues every deployment has (workers/celery_app.QUEUES)
BASE = ("turns", "sandbox", "delivery", "janitor")
#: the queue whose work includes the lanes of the ready set
LANES_QUEUE = "delivery"


class QueueStats(TypedDict):
    queue: str
    depth: int
    #: None: empty, or its oldest message carries no publish time
    oldest_age_s: float | None
    consumers: int


def register(r: Redis, queue: str, *, now: float | None = None) -> None:
    """Note that `queue` is in use (`r` may be a pipeline)."""
    r.zadd(keys.queues(), {queue: time.time() if now is None else now})
    r.expire(keys.queues(), REGISTRY_TTL_S)


def heartbeat(r: Redis, worker: str, queues: list[str], *, now: float | None = None) -> None:
    """A worker says it consumes `queues` (one round trip)."""
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.zadd(keys.consumers(q), {worker: now})
        pipe.zremrangebyscore(keys.consumers(q), "-inf", now - 10 * keys.CONSUMER_STALE_S)
        pipe.expire(keys.consumers(q), 24 * 3600)
        register(pipe, q, now=now)
    pipe.execute()


def leave(r: Redis, worker: str, queues: list[str]) -> None:
    """A worker that stops consuming says so (a dead one's heartbeat just goes stale)."""
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.zrem(keys.consumers(q), worker)
    pipe.execute()


def sent_at(raw: str | bytes | None) -> float | None:
    """The publish time courier stamped on a raw queue entry (None: unknown, or not UTF-8 JSON)."""
    if raw is None:
        return None
    try:
        return float(json.loads(raw)["headers"]["sent_s"])
    except (ValueError, KeyError, TypeError):
        return None


def stats(r: Redis, *, now: float | None = None) -> list[QueueStats]:
    """Per queue: {queue, depth, oldest_age_s, consumers}, in two round trips. Registry entries
    that are old, empty and unconsumed are dropped."""
    now = time.time() if now is None else now
    scored = cast("list[tuple[str, float]]", r.zrange(keys.queues(), 0, -1, withscores=True))
    reg = {q: float(s) for q, s in scored}
    qs = sorted(set(BASE) | set(reg))
    pipe = r.pipeline(transaction=False)
    for q in qs:
        pipe.llen(q)
        # Celery's message: kombu's JSON envelope (body base64); read as bytes, so a foreign
        # entry that is not UTF-8 shows as an unknown age, not a decoding error
        pipe.execute_command("LINDEX", q, -1, **{NEVER_DECODE: True})  # type: ignore[no-untyped-call]  # redis-py's
        keys.count_consumers(pipe, q, now)
    pipe.zcard(keys.lanes_ready())
    pipe.zrange(keys.lanes_ready(), 0, 0, withscores=True)
    res = pipe.execute()
    ready, first_ready = int(res[-2] or 0), res[-1]
    out: list[QueueStats] = []
    stale: list[str] = []
    for i, q in enumerate(qs):
        depth, oldest, consumers = int(res[3 * i] or 0), res[3 * i + 1], int(res[3 * i + 2] or 0)
        sent = sent_at(oldest) if depth else None
        if q == LANES_QUEUE and ready:
            depth += ready
            joined = float(first_ready[0][1]) if first_ready else None
            sent = joined if sent is None or (joined is not None and joined < sent) else sent
        if q not in BASE and not depth and not consumers and now - reg.get(q, now) > FORGET_S:
            stale.append(q)
            continue
        out.append({"queue": q, "depth": depth, "oldest_age_s": round(max(0.0, now - sent), 3)
                    if sent is not None else None, "consumers": consumers})
    if stale:
        r.zrem(keys.queues(), *stale)
    return out


# -- orphans: queued messages whose ledger entry is final or gone -----------------------------
class Orphan(TypedDict):
    queue: str
    task: str
    id: str
    #: what the message would act on (a delivery id, a job id, a lane) and why it has nothing to do
    subject: str
    why: str


#: messages read from a queue at once while looking for orphans
SCAN_CHUNK = 500


def _message(raw: bytes) -> tuple[str, str, list[object]] | None:
    """(task name, task id, args) of a raw queue entry; None when it is not a Celery message
    courier can read. A body that does not verify gives args []."""
    try:
        msg = json.loads(raw)
        headers = msg["headers"]
        body = base64.b64decode(msg["body"]) if msg["properties"].get("body_encoding") == "base64" else \
            str(msg["body"]).encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    task, tid = str(headers.get("task") or ""), str(headers.get("id") or "")
    try:
        payload = json.loads(signing.signer().open("message", "", body))
    except signing.Forged:
        return task, tid, []
    except ValueError:
        return None
    args = payload[0] if isinstance(payload, list) and payload and isinstance(payload[0], list) else []
    return task, tid, list(args)


def _orphan_why(r: Redis, task: str, args: list[object]) -> tuple[str, str] | None:
    """(subject, why) when a message of `task` with `args` has nothing left to do."""
    if not args:
        return "", "its body does not verify (it would be refused)"
    first = args[0]
    if task == task_names.EXTRACT_FILE and isinstance(first, str):
        rec = receipts.get_delivery(r, first)
        if rec is None:
            return first, "its delivery is gone"
        if rec.get("state") in receipts.TERMINAL or rec.get("extraction") in (EXTRACTION_OK, EXTRACTION_FAILED):
            return first, f"its delivery is {rec.get('state') if rec.get('state') in receipts.TERMINAL else 'extracted'}"
    if task == task_names.AGENT_TURN and isinstance(first, dict):
        job_id = str(first.get("job") or "")
        job = receipts.get_job(r, job_id)
        if job is None:
            return job_id, "its turn is gone"
        if job.get("state") in TURN_OVER:
            return job_id, f"its turn is {job.get('state')}"
    return None


def orphans(r: Redis, *, job: str | None = None) -> list[tuple[Orphan, bytes]]:
    """Every queued message whose ledger entry is final or gone (an extraction of a delivery that is
    over or extracted, a turn that is over), or whose body does not verify, with its raw entry (for
    `purge`). `job`: only that job's."""
    scored = cast("list[tuple[str, float]]", r.zrange(keys.queues(), 0, -1, withscores=True))
    out: list[tuple[Orphan, bytes]] = []
    for q in sorted(set(BASE) | {name for name, _ in scored}):
        start = 0
        while True:
            chunk = cast("list[bytes]", r.execute_command(  # type: ignore[no-untyped-call]  # redis-py's
                "LRANGE", q, start, start + SCAN_CHUNK - 1, **{NEVER_DECODE: True}))
            if not chunk:
                break
            start += len(chunk)
            for raw in chunk:
                got = _message(raw)
                if got is None:
                    continue
                task, tid, args = got
                why = _orphan_why(r, task, args)
                if why is None:
                    continue
                subject, reason = why
                if job is not None and not (subject == job or subject.startswith(job + ".")):
                    continue
                out.append(({"queue": q, "task": task, "id": tid, "subject": subject, "why": reason}, raw))
    return out


def purge(r: Redis, found: list[tuple[Orphan, bytes]]) -> int:
    """Remove those entries (each once, if still queued). Returns how many were removed."""
    if not found:
        return 0
    pipe = r.pipeline(transaction=False)
    for o, raw in found:
        pipe.execute_command("LREM", o["queue"], 1, raw)  # type: ignore[no-untyped-call]  # the exact bytes
    return sum(int(n or 0) for n in pipe.execute())
