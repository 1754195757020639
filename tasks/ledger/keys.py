"""Every Redis key courier writes, in one place: all start with `courier:` (Celery's own keys,
the broker queues, `unacked*`, `celery-task-meta-*`, are Celery's)."""

from __future__ import annotations

from typing import Any

PREFIX = "courier:"


def job(job_id: str) -> str:
    """hash: a send or a turn (kind, target, created_s, state, ...)"""
    return f"{PREFIX}job:{job_id}"


def job_deliveries(job_id: str) -> str:
    """list: the delivery ids of a job, in delivery order"""
    return f"{PREFIX}job:{job_id}:deliveries"


def sent_message(platform: str, message_id: str) -> str:
    """string: the delivery a platform's message id belongs to (for its status webhook: confirm.py)"""
    return f"{PREFIX}sent:{platform}:{message_id}"


def delivery(delivery_id: str) -> str:
    """hash: one delivery's receipt (state, platform, kind, size, attempts, message_id, reason)"""
    return f"{PREFIX}delivery:{delivery_id}"


def delivery_lock(delivery_id: str) -> str:
    """string with TTL: held while a worker sends this delivery"""
    return f"{PREFIX}lock:delivery:{delivery_id}"


def events(job_id: str) -> str:
    """stream: the phase events of a turn or send (bounded length)"""
    return f"{PREFIX}events:{job_id}"


def file_id(platform: str, bot: str, sha256: str, kind: str) -> str:
    """string: a platform file id for the bytes with this hash (upload once, send many)"""
    return f"{PREFIX}fileid:{platform}:{bot}:{kind}:{sha256}"


def delivery_parts(delivery_id: str) -> str:
    """hash: the parts of one delivery already sent (part id -> message id): tasks/delivery/parts.py"""
    return f"{PREFIX}parts:{delivery_id}"


def rate_limit_prefix() -> str:
    """prefix the `limits` library's Redis storage uses for shared rate limits"""
    return f"{PREFIX}rl"


def webhook_seen(platform: str, update_id: str) -> str:
    """string with TTL: a webhook update already enqueued (drops platform retries)"""
    return f"{PREFIX}webhook:{platform}:{update_id}"


def progress_message(job_id: str) -> str:
    """hash: the platform progress message of a turn (chat, message id)"""
    return f"{PREFIX}progress:{job_id}"


# -- the ledger (tasks/ledger/ledger.py): leases, lanes, due times ------------------------------------
def lease(stage: str, ident: str) -> str:
    """string with TTL: the holder's token while a worker runs a stage (`extract`, `lane`, `turn`)"""
    return f"{PREFIX}lease:{stage}:{ident}"


def lane(target: str) -> str:
    """list: a chat's ordered lane of delivery steps (a delivery id, or an album's first id)"""
    return f"{PREFIX}lane:{target}"


def lanes_ready() -> str:
    """sorted set: lanes whose wake-up joined the waiting drives' (each drains it), by when (chains.wake_lane)"""
    return f"{PREFIX}lanes:ready"


def drives_waiting() -> str:
    """sorted set: lane drives published and not started yet (task ids), by when (stale: chains.WAKE_STALE_S)"""
    return f"{PREFIX}lanes:waiting"


def due(stage: str) -> str:
    """sorted set: the stage's entries scored by when the reconciler must look at them again"""
    return f"{PREFIX}due:{stage}"


def breakers() -> str:
    """sorted set: sandboxes (`<kind>:<host>:<target>`) whose breaker is open or half-open, by its end"""
    return f"{PREFIX}breakers"


def breaker(ident: str) -> str:
    """hash with TTL: one sandbox's breaker (`opens` in a row, `since_s`, `until_s`, the timeout's `reason`)"""
    return f"{PREFIX}breaker:{ident}"


def breaker_scout(ident: str) -> str:
    """string with TTL (a delivery id): the one extraction trying a sandbox not heard from lately"""
    return f"{PREFIX}breaker:scout:{ident}"


def breaker_waiting(ident: str) -> str:
    """set with TTL: the extractions postponed by a sandbox's breaker (delivery ids): due at once when it closes"""
    return f"{PREFIX}breaker:waiting:{ident}"


def sandboxes_answered() -> str:
    """sorted set: sandboxes (`<kind>:<host>:<target>`) scored by when one last answered an extraction"""
    return f"{PREFIX}sandboxes:answered"


def reconciler_lock() -> str:
    """string with TTL: held by the one process whose reconciler runs"""
    return f"{PREFIX}reconciler"


def events_key() -> str:
    """string, no TTL: the random key per-job events tokens are made with (workers/eventauth.py)"""
    return f"{PREFIX}events_key"


# -- operations (tasks/ops/queues.py, tasks/ops/janitor.py, workers/celery_app.py) ----------------------
def queues() -> str:
    """sorted set: every Celery queue courier published to or consumed from, by when last seen (TTL 30 days)"""
    return f"{PREFIX}queues"


#: a worker says which queues it consumes this often; one silent for `CONSUMER_STALE_S` consumes nothing
HEARTBEAT_S = 10.0
CONSUMER_STALE_S = 3 * HEARTBEAT_S


def consumers(queue: str) -> str:
    """sorted set: the workers consuming `queue`, scored by their last heartbeat (every 10 s)"""
    return f"{PREFIX}consumers:{queue}"


def count_consumers(pipe: Any, queue: str, now: float) -> Any:
    """Queue on `pipe` (sync or async) the count of `queue`'s consumers heard within `CONSUMER_STALE_S`."""
    return pipe.zcount(consumers(queue), now - CONSUMER_STALE_S, "+inf")


def janitor_lock() -> str:
    """string with TTL: held (value: the holder's token) while a janitor sweep runs"""
    return f"{PREFIX}lock:janitor"


def beat_lock() -> str:
    """string with TTL: held by the one beat process that schedules (the others stand by)"""
    return f"{PREFIX}lock:beat"


def files_key() -> str:
    """string, no TTL: the random key a volume store's download links are signed with (storage/links.py)"""
    return f"{PREFIX}files_key"


def send_order(target: str) -> str:
    """hash, 1-day TTL: send messages to `target` in publish order (`issued`, `next`: tasks/ops/sendorder.py)"""
    return f"{PREFIX}sendorder:{target}"
