"""Jobs and delivery receipts in Redis: what `courier status` shows.

A job (a send or a turn) has an ordered list of deliveries. A delivery's
receipt moves queued -> (sending) -> delivered | failed, with attempts, the
platform's message id or the failure reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks import keys

RETENTION_S = 30 * 24 * 3600
#: a send lock lives this long unless its holder renews it (every third of it)
SEND_LOCK_TTL_S = 30
TERMINAL = frozenset({"delivered", "failed"})


def _s(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode()
    return "" if v is None else str(v)


def _decode(h: dict) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in h.items()}


def create_job(r, job_id: str, *, kind: str, target: str, **meta: Any) -> None:
    fields = {"id": job_id, "kind": kind, "target": target, "state": "queued", "created_s": f"{time.time():.3f}"}
    fields.update({k: _s(v) for k, v in meta.items() if v is not None})
    pipe = r.pipeline()
    pipe.hset(keys.job(job_id), mapping=fields)
    pipe.expire(keys.job(job_id), RETENTION_S)
    pipe.execute()


def set_job(r, job_id: str, **fields: Any) -> None:
    r.hset(keys.job(job_id), mapping={k: _s(v) for k, v in fields.items()})


def get_job(r, job_id: str) -> dict[str, str] | None:
    h = r.hgetall(keys.job(job_id))
    return _decode(h) if h else None


def add_delivery(r, job_id: str, delivery_id: str, **meta: Any) -> None:
    """Register a delivery as queued (idempotent: an existing receipt is kept)."""
    k = keys.delivery(delivery_id)
    fields = {"id": delivery_id, "job": job_id, "state": "queued", "attempts": "0", "queued_s": f"{time.time():.3f}"}
    fields.update({kk: _s(v) for kk, v in meta.items() if v is not None})
    pipe = r.pipeline()
    pipe.exists(k)
    res = pipe.execute()
    if res[0]:
        return
    pipe = r.pipeline()
    pipe.hset(k, mapping=fields)
    pipe.expire(k, RETENTION_S)
    pipe.rpush(keys.job_deliveries(job_id), delivery_id)
    pipe.expire(keys.job_deliveries(job_id), RETENTION_S)
    pipe.execute()


def update_delivery(r, delivery_id: str, **fields: Any) -> None:
    """Set receipt fields (None values are skipped). `r` may be a pipeline."""
    r.hset(keys.delivery(delivery_id), mapping={k: _s(v) for k, v in fields.items() if v is not None})


def attempt(r, delivery_id: str) -> int:
    return int(r.hincrby(keys.delivery(delivery_id), "attempts", 1))


def get_delivery(r, delivery_id: str) -> dict[str, str] | None:
    h = r.hgetall(keys.delivery(delivery_id))
    return _decode(h) if h else None


def job_deliveries(r, job_id: str) -> list[dict[str, str]]:
    ids = [_s(x) for x in r.lrange(keys.job_deliveries(job_id), 0, -1)]
    if not ids:
        return []
    pipe = r.pipeline()
    for d in ids:
        pipe.hgetall(keys.delivery(d))
    return [_decode(h) for h in pipe.execute() if h]


def begin_send(r, delivery_id: str, owner: str, ttl_s: int = 600) -> tuple[bool, dict[str, str]]:
    """Take the send lock and read the receipt in one round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.set(keys.delivery_lock(delivery_id), owner, nx=True, ex=ttl_s)
    pipe.hgetall(keys.delivery(delivery_id))
    locked, rec = pipe.execute()
    return bool(locked), _decode(rec or {})


def start_attempt(r, delivery_id: str, **fields: Any) -> int:
    """Count an attempt and set fields in one round trip; returns the attempt number."""
    pipe = r.pipeline(transaction=False)
    pipe.hincrby(keys.delivery(delivery_id), "attempts", 1)
    pipe.hset(keys.delivery(delivery_id), mapping={k: _s(v) for k, v in fields.items()})
    return int(pipe.execute()[0])


_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def acquire_send_lock(r, delivery_id: str, owner: str, ttl_s: int = 600) -> bool:
    return bool(r.set(keys.delivery_lock(delivery_id), owner, nx=True, ex=ttl_s))


@contextmanager
def renewing(r, delivery_id: str, owner: str, ttl_s: int = SEND_LOCK_TTL_S) -> Iterator[None]:
    """Keep a send lock alive while the block runs (a daemon thread renews it)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                if not r.eval(_RENEW, 1, keys.delivery_lock(delivery_id), owner, ttl_s):
                    return  # lost (expired or released): nothing left to renew
            except Exception:  # noqa: BLE001 - a missed renewal only shortens the lock
                pass

    t = threading.Thread(target=beat, name=f"lock-{delivery_id}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()


def release_send_lock(r, delivery_id: str, owner: str) -> None:
    """Only the owner releases (compare-and-delete). `r` may be a pipeline."""
    r.eval(_RELEASE, 1, keys.delivery_lock(delivery_id), owner)
