"""The one module that builds every chain.

A job (a turn's reply, or an operator's send) becomes one Celery chain, so
order per chat is kept: the text first, then each file in the order the
reply names them, each file as `extract_file` (sandbox -> storage) then
`deliver` (storage -> platform). Files already in storage skip extraction.
Delivery ids are deterministic (`<job>.<seq>`): re-enqueuing a job never
sends twice what was delivered.
"""

from __future__ import annotations

import posixpath
import re
import secrets
from dataclasses import dataclass, field

from celery import chain

from adapters.sandboxes.base import SandboxRef
from tasks import receipts

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def new_job_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def delivery_id(job_id: str, seq: int) -> str:
    return f"{job_id}.{seq}"


def storage_key(job_id: str, seq: int, name: str, *, prefix: str = "files") -> str:
    """`files/<job>/<seq>-<safe name>` (outbound) or `inbound/...` (attachments)."""
    safe = _SAFE.sub("_", posixpath.basename(name)).lstrip(".")[:100] or "file"
    return f"{prefix}/{job_id}/{seq}-{safe}"


@dataclass
class StoredFile:
    """A file already in storage (an operator's own file)."""

    key: str
    name: str
    size: int
    sha256: str


@dataclass
class SandboxFile:
    """A file still in a sandbox."""

    ref: SandboxRef
    path: str


@dataclass
class Plan:
    job_id: str
    target: str
    text: str | None = None
    files: list[StoredFile | SandboxFile] = field(default_factory=list)
    caption: str | None = None
    voice: bool = False
    as_document: bool = False
    max_bytes: int | None = None


def sandbox_queue(ref: SandboxRef) -> str:
    """Docker containers and singularity instances live on one host: a ref
    pinned to a host (`?host=` in its URI) is extracted on that host's queue,
    `sandbox.<host>`; everything else on `sandbox`."""
    from adapters.sandboxes.routing import queue_for

    return queue_for(ref)


def register(r, plan: Plan) -> list[str]:
    """Record the plan's deliveries as queued receipts; returns their ids."""
    from tasks.pipeline import platform_of

    ids: list[str] = []
    seq = 0
    platform = platform_of(plan.target)
    if plan.text:
        d = delivery_id(plan.job_id, seq)
        receipts.add_delivery(r, plan.job_id, d, type="text", platform=platform, kind="text",
                              size_bytes=len(plan.text.encode()))
        ids.append(d)
        seq += 1
    for f in plan.files:
        d = delivery_id(plan.job_id, seq)
        if isinstance(f, StoredFile):
            receipts.add_delivery(r, plan.job_id, d, type="file", platform=platform, name=f.name,
                                  size_bytes=f.size, sha256=f.sha256)
        else:
            receipts.add_delivery(r, plan.job_id, d, type="file", platform=platform,
                                  name=posixpath.basename(f.path), source=f.path)
        ids.append(d)
        seq += 1
    return ids


def build(plan: Plan):
    """The chain for a plan (call `.apply_async()` on it)."""
    from tasks.pipeline import deliver, extract_file

    sigs = []
    seq = 0
    if plan.text:
        sigs.append(deliver.si(None, {"id": delivery_id(plan.job_id, seq), "job": plan.job_id,
                                      "target": plan.target, "type": "text", "text": plan.text}))
        seq += 1
    first_file = True
    for f in plan.files:
        d = delivery_id(plan.job_id, seq)
        job = {"id": d, "job": plan.job_id, "target": plan.target, "type": "file",
               "voice": plan.voice, "as_document": plan.as_document}
        if first_file and plan.caption:
            job["caption"] = plan.caption
        first_file = False
        if isinstance(f, StoredFile):
            job.update(key=f.key, name=f.name, size=f.size, sha256=f.sha256)
            sigs.append(deliver.si(None, job))
        else:
            spec = {"job": plan.job_id, "delivery": d, "sandbox": f.ref.to_dict(), "path": f.path,
                    "key": storage_key(plan.job_id, seq, f.path)}
            if plan.max_bytes:
                spec["max_bytes"] = plan.max_bytes
            sigs.append(extract_file.si(spec).set(queue=sandbox_queue(f.ref)))
            sigs.append(deliver.s(job))
        seq += 1
    if not sigs:
        return None
    return chain(*sigs)


def enqueue(r, plan: Plan) -> list[str]:
    """Register receipts, then publish the chain. Returns the delivery ids."""
    ids = register(r, plan)
    c = build(plan)
    if c is not None:
        c.apply_async()
    return ids
