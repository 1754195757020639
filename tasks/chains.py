"""The one module that builds every chain.

A job (a turn's reply, or an operator's send) becomes one Celery chain, so
order per chat is kept: the text first, then each file in the order the
reply names them, each file as `extract_file` (sandbox -> storage) then
`deliver` (storage -> platform). Files already in storage skip extraction.
Delivery ids are deterministic (`<job>.<seq>`): re-enqueuing a job never
sends twice what was delivered.

Albums: where the target platform takes them (`Plan.album_max` >= 2, filled
by the caller from the platform's `Limits.album_max`), a run of two or more
consecutive files that route to photos becomes one group (runs longer than
`album_max` are split): each file of the group is extracted as usual (its
result recorded in its receipt), then one `deliver_album` sends the group.
Each file keeps its own delivery id and receipt.
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
    #: photos one album may hold on the target platform (`Limits.album_max`; 0 or 1: no albums)
    album_max: int = 0


def sandbox_queue(ref: SandboxRef) -> str:
    """Docker containers and singularity instances live on one host: a ref
    pinned to a host (`?host=` in its URI) is extracted on that host's queue,
    `sandbox.<host>`; everything else on `sandbox`."""
    from adapters.sandboxes.routing import queue_for

    return queue_for(ref)


def register(r, plan: Plan, *, job_kind: str | None = None) -> list[str]:
    """Record the plan's deliveries as queued receipts (and, with `job_kind`,
    the job itself) in one round trip; returns their ids."""
    from tasks.pipeline import platform_of

    ids: list[str] = []
    seq = 0
    platform = platform_of(plan.target)
    r = r.pipeline(transaction=False)  # one round trip for the whole plan
    if job_kind is not None:
        receipts.create_job(r, plan.job_id, kind=job_kind, target=plan.target, pipe=r)
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
    r.execute()
    return ids


def _name(f: StoredFile | SandboxFile) -> str:
    return f.name if isinstance(f, StoredFile) else posixpath.basename(f.path)


def album_groups(plan: Plan) -> list[list[int]]:
    """Indexes (into `plan.files`) of the files sent as albums: runs of >= 2
    consecutive files that route to photos, cut into groups of <= album_max
    (a group of one left over goes alone)."""
    from adapters.platforms.base import Kind
    from tasks.reply import route

    size = plan.album_max
    if size < 2 or plan.as_document:
        return []
    runs: list[list[int]] = [[]]
    for i, f in enumerate(plan.files):
        if route(_name(f), voice=plan.voice, as_document=plan.as_document) == Kind.PHOTO:
            runs[-1].append(i)
        elif runs[-1]:
            runs.append([])
    groups = [run[j:j + size] for run in runs for j in range(0, len(run), size)]
    return [g for g in groups if len(g) >= 2]


def _label(sig, text: str):
    """A short `argsrepr` for a signature: what Flower and the worker's log
    show for the task instead of Celery's repr of the argument dicts, which
    costs CPU at every publish and would put chat text and captions on
    display."""
    return sig.set(argsrepr=text[:200], kwargsrepr="{}")


def build(plan: Plan):
    """The chain for a plan (call `.apply_async()` on it)."""
    from tasks.pipeline import deliver, deliver_album, extract_file

    sigs = []
    seq = 0
    if plan.text:
        d = delivery_id(plan.job_id, seq)
        sigs.append(_label(deliver.si(None, {"id": d, "job": plan.job_id, "target": plan.target, "type": "text",
                                             "text": plan.text}),
                           f"({d} text, {len(plan.text)} chars -> {plan.target})"))
        seq += 1
    first_seq = seq
    grouped = {g[0]: g for g in album_groups(plan)}
    i = 0
    while i < len(plan.files):
        if i in grouped:
            group = grouped[i]
            items = []
            for j in group:
                job, extract = _file_sig(plan, j, first_seq + j, extract_file)
                if extract is not None:
                    sigs.append(extract)
                    # the album task finds the extraction's result in the receipt, the bytes at this key
                    extract.args[0]["record"] = True
                    job.update(key=extract.args[0]["key"], name=_name(plan.files[j]), extracted=True)
                items.append(job)
            spec = {"job": plan.job_id, "target": plan.target, "items": items}
            if i == 0 and plan.caption:
                spec["caption"] = plan.caption
            sigs.append(_label(deliver_album.si(spec),
                               f"({items[0]['id']} album of {len(items)} -> {plan.target})"))
            i += len(group)
            continue
        job, extract = _file_sig(plan, i, first_seq + i, extract_file)
        if i == 0 and plan.caption:
            job["caption"] = plan.caption
        label = f"({job['id']} {_name(plan.files[i])} -> {plan.target})"
        if extract is None:
            sigs.append(_label(deliver.si(None, job), label))
        else:
            sigs.append(extract)
            sigs.append(_label(deliver.s(job), label))
        i += 1
    if not sigs:
        return None
    return chain(*sigs)


def _file_sig(plan: Plan, index: int, seq: int, extract_file):
    """A file's delivery job and, for a sandbox file, its extraction signature (else None).
    A sandbox file's job names the storage key its extraction writes."""
    f = plan.files[index]
    d = delivery_id(plan.job_id, seq)
    job = {"id": d, "job": plan.job_id, "target": plan.target, "type": "file",
           "voice": plan.voice, "as_document": plan.as_document}
    if isinstance(f, StoredFile):
        job.update(key=f.key, name=f.name, size=f.size, sha256=f.sha256)
        return job, None
    spec = {"job": plan.job_id, "delivery": d, "sandbox": f.ref.to_dict(), "path": f.path,
            "key": storage_key(plan.job_id, seq, f.path)}
    if plan.max_bytes:
        spec["max_bytes"] = plan.max_bytes
    return job, _label(extract_file.si(spec).set(queue=sandbox_queue(f.ref)), f"({d} {f.ref.kind}:{f.path})")


def enqueue(r, plan: Plan, *, job_kind: str | None = None) -> list[str]:
    """Register receipts (and the job, with `job_kind`), then publish the
    chain. Returns the delivery ids."""
    ids = register(r, plan, job_kind=job_kind)
    c = build(plan)
    if c is not None:
        c.apply_async()
    return ids


def enqueue_turn(r, target: str, message: str, *, agent: str, job_id: str | None = None,
                 sandbox: str | None = None, attachments: list[dict] | None = None,
                 origin: str | None = None) -> str:
    """Record a turn's job, then enqueue `agent_turn` with the job id as its
    task id (the CLI, the web process and the demo all come here). Returns
    the job id. The task's label shows the agent and the target, not the
    user's message."""
    job_id = job_id or new_job_id("turn")
    receipts.create_job(r, job_id, kind="turn", target=target, agent=agent, origin=origin)
    turn_sig(job_id, target, message, agent=agent, sandbox=sandbox, attachments=attachments).apply_async(
        task_id=job_id)
    return job_id


def turn_sig(job_id: str, target: str, message: str, *, agent: str, sandbox: str | None = None,
             attachments: list[dict] | None = None):
    """The `agent_turn` signature of a turn, labelled."""
    from tasks.pipeline import agent_turn

    spec = {"job": job_id, "target": target, "message": message, "agent": agent}
    if sandbox:
        spec["sandbox"] = sandbox
    if attachments:
        spec["attachments"] = attachments
    label = f"({job_id} {agent} -> {target}, {len(message)} chars"
    label += f", {len(attachments)} attachments)" if attachments else ")"
    return _label(agent_turn.si(spec), label)
