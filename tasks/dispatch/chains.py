"""The one module that turns a job into ledger entries and task messages.

A job (a turn's reply, an operator's send) is registered in one Redis transaction: a receipt per delivery
holding its signed `spec` (all it takes to run it again), and its steps appended to the chat's lane (the
text, then the files in order; jobs to one chat queue up in enqueue order). Then messages carrying ids only
go out: an `extract_file` per sandbox file (on its sandbox's queue) and a `drive_lane` for the chat. A lost
message costs nothing: the reconciler re-drives any stage whose due time passed. Delivery ids are
deterministic (`<job>.<seq>`): re-enqueuing a job never sends twice what was delivered. Albums
(`Plan.album_max` >= 2): a run of consecutive files that route to photos becomes one step (split at
`album_max`); each file keeps its own delivery id and receipt.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from redis import Redis

from adapters.display import visible
from adapters.platforms.base import Kind, split_target
from adapters.sandboxes.base import SandboxRef
from adapters.sandboxes.routing import queue_for
from storage import prefixes
from tasks.delivery import specs
from tasks.delivery.routing import route
from tasks import task_names
from tasks.ledger import durable, keys, ledger, receipts, scripts, signing
from tasks.ledger.durable import Durability
from tasks.messages import Attachment, DeliverySpec, ExtractSpec, TurnSpec

if TYPE_CHECKING:
    from celery import Signature

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def new_job_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def delivery_id(job_id: str, seq: int) -> str:
    return f"{job_id}.{seq}"


def storage_key(job_id: str, seq: int, name: str, *, prefix: str = prefixes.FILES) -> str:
    """`files/<job>/<seq>-<safe name>` (outbound) or `inbound/...` (attachments)."""
    safe = _SAFE.sub("_", posixpath.basename(name)).lstrip(".")[:100] or "file"
    return f"{prefix}{job_id}/{seq}-{safe}"


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
    #: files one job may send (0: no cap); the rest are left out with a notice in the text
    max_files: int = 0
    #: a turn's reply: its last file's step tells, in one notice, every file of it that could not go
    tell_unsent: bool = False


#: a ref pinned to a host (`?host=`: containers live on one) is extracted on `sandbox.<host>`, others on `sandbox`
sandbox_queue = queue_for


#: the reconciler re-drives a stage nobody has looked at for this long (defined once, in the ledger)
LANE_GRACE_S, EXTRACT_GRACE_S, TURN_GRACE_S = ledger.LANE_GRACE_S, ledger.EXTRACT_GRACE_S, ledger.TURN_GRACE_S

#: lane drives waiting to start beyond which a lane's wake-up joins `keys.lanes_ready()` (drained
#: by each drive after its own lane) instead of being a message of its own: under a backlog one
#: message serves several chats; idle, every wake-up is its own message.
WAKE_BACKLOG = 2
#: a drive published this long ago and not started no longer counts as waiting; the reconciler
#: publishes a drain for lanes ready longer than `READY_STALE_S`
WAKE_STALE_S = 5.0
READY_STALE_S = 2.0


def capped(plan: Plan) -> Plan:
    """A plan over `max_files` keeps its first `max_files` files; the text tells how many were left out."""
    if not plan.max_files or len(plan.files) <= plan.max_files:
        return plan
    cut = len(plan.files) - plan.max_files
    notice = (f"⚠️ {cut} more file{'s were' if cut != 1 else ' was'} not sent: "
              f"at most {plan.max_files} files go with one message.")
    text = f"{plan.text}\n\n{notice}" if plan.text else notice
    return replace(plan, files=plan.files[:plan.max_files], text=text)


@dataclass
class _Entry:
    """One delivery as the ledger keeps it: its receipt fields and what it takes to run it."""

    did: str
    fields: dict[str, str | int]
    spec: DeliverySpec
    lane: bool = True  # a step of its own in the lane (album members after the first: no)
    queue: str | None = None  # extraction queue of a sandbox file


def entries(plan: Plan) -> list[_Entry]:
    """The plan's deliveries in lane order, each with its spec (the text or
    file job, the extraction of a sandbox file, an album's members)."""
    platform = split_target(plan.target)[0]
    out: list[_Entry] = []
    if plan.text:
        d = delivery_id(plan.job_id, 0)
        out.append(_Entry(d, {"type": "text", "platform": platform, "kind": "text",
                              "size_bytes": len(plan.text.encode())},
                          DeliverySpec(delivery_id=d, job_id=plan.job_id, target=plan.target, type="text",
                                       text=plan.text)))
    first_seq = len(out)  # the files' ids follow the text's
    groups = {j: g for g in album_groups(plan) for j in g}
    for i, f in enumerate(plan.files):
        d = delivery_id(plan.job_id, first_seq + i)
        spec = DeliverySpec(delivery_id=d, job_id=plan.job_id, target=plan.target, type="file",
                            voice=plan.voice, as_document=plan.as_document,
                            caption=plan.caption if i == 0 and plan.caption else None)
        fields: dict[str, str | int] = {"type": "file", "platform": platform, "name": _name(f)}
        queue = None
        if isinstance(f, StoredFile):
            spec = replace(spec, key=f.key, name=f.name, size=f.size, sha256=f.sha256)
            fields.update(size_bytes=f.size, sha256=f.sha256)
        else:
            key = storage_key(plan.job_id, first_seq + i, f.path)
            spec = replace(spec, key=key, name=_name(f), extract=ExtractSpec(
                sandbox=f.ref.to_dict(), path=f.path, key=key, max_bytes=plan.max_bytes or None))
            fields["source"] = f.path
            queue = sandbox_queue(f.ref)
        group = groups.get(i)
        entry = _Entry(d, fields, spec, queue=queue)
        if group is not None:
            fields["step"] = delivery_id(plan.job_id, first_seq + group[0])
            entry.lane = i == group[0]
            if entry.lane:
                fields["album"] = json.dumps([delivery_id(plan.job_id, first_seq + j) for j in group])
        out.append(entry)
    files = [e for e in out if e.spec.type == "file"]
    if plan.tell_unsent and files:
        files[-1].spec = replace(files[-1].spec, tell=tuple(e.did for e in files))
        for e in files[:-1]:
            e.spec = replace(e.spec, told_by=files[-1].did)
    return out


def register(r: Redis, plan: Plan, *, job_kind: str | None = None, durability: Durability | None = None,
             warn: Callable[[str], None] | None = None) -> list[_Entry]:
    """Record the plan in one transaction: the job (with `job_kind`), a queued receipt per delivery with its
    spec, the steps at the end of the chat's lane, due times for the lane and each extraction. Idempotent.
    With `durability`, confirmed on replicas (tasks/ledger/durable.py); `warn` hears when it was not."""
    items = entries(plan)

    def fill(p: Any) -> None:  # one round trip, no other job's steps in between
        if job_kind is not None:
            receipts.create_job(r, plan.job_id, kind=job_kind, target=plan.target, pipe=p)
        for e in items:
            receipts.add_delivery(p, plan.job_id, e.did, spec=specs.seal_delivery(e.spec),
                                  queue=e.queue, lane=plan.target if e.lane else None, **e.fields)
        if items:
            ledger.set_due(p, "lane", plan.target, LANE_GRACE_S)
        for e in items:
            if e.queue is not None:
                ledger.set_due(p, "extract", e.did, EXTRACT_GRACE_S)

    _durably(r, fill, durability, warn, plan.job_id)
    return items


def _durably(r: Redis, fill: Callable[[Any], None], d: Durability | None, warn: Callable[[str], None] | None,
             job_id: str) -> None:
    if not durable.write(r, fill, d) and d is not None:
        text = (f"job {job_id} is recorded on the Redis master, but no replica confirmed it within "
                f"{d.within_s:g} s: it would be lost if that master failed now")
        log.warning("%s", text)
        if warn is not None:
            warn(text)


def _name(f: StoredFile | SandboxFile) -> str:
    return f.name if isinstance(f, StoredFile) else posixpath.basename(f.path)


def album_groups(plan: Plan) -> list[list[int]]:
    """Indexes (into `plan.files`) of the files sent as albums: runs of >= 2 consecutive files that route
    to photos, cut into groups of <= album_max (a group of one left over goes alone)."""
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


def _label(sig: Signature, text: str) -> Signature:
    """A short `argsrepr`: what Flower and the worker's log show instead of the arguments (never chat text)."""
    return sig.set(argsrepr=text[:200], kwargsrepr="{}")


# -- the messages: ids only ----------------------------------------------------------------------
def _sig(name: str, *args: Any) -> Signature:
    """An immutable signature of the task `name` (by name: the task module imports chains)."""
    from celery import current_app

    return current_app.signature(name, args=args, immutable=True)


def extract_sig(did: str, queue: str, what: str = "") -> Signature:
    """Labelled `(<delivery id> <sandbox>:<path>)`, the path as shown (`visible`)."""
    label = f"({did} {visible(what)})" if what else f"({did})"
    return _label(_sig(task_names.EXTRACT_FILE, did).set(queue=queue), label)


def lane_sig(target: str, countdown: float | None = None) -> Signature:
    sig = _label(_sig(task_names.DRIVE_LANE, target), f"(lane {target})" if target else "(ready lanes)")
    return sig.set(countdown=countdown) if countdown else sig


def publish_extract(did: str, queue: str, what: str = "") -> None:
    extract_sig(did, queue, what).apply_async()


def publish_lane(target: str, countdown: float | None = None) -> None:
    lane_sig(target, countdown).apply_async()


def wake_lane(r: Redis, target: str) -> bool:
    """Wake `target`'s lane: publish its `drive_lane`, unless `WAKE_BACKLOG` drives are waiting already:
    then it joins the ready set they drain (lane_wake.lua decides). `target` '': a drain of the ready set,
    always published. True when a drive was published. A failed publish loses nothing (the lane's due time)."""
    task_id = str(uuid.uuid4())
    if not scripts.run(r, "lane_wake", keys=[keys.drives_waiting(), keys.lanes_ready()],
                       args=[target, task_id, time.time(), WAKE_BACKLOG, WAKE_STALE_S]):
        return False
    lane_sig(target).apply_async(task_id=task_id)
    return True


def publish_drain(r: Redis) -> None:
    """Publish a drive of the lanes in the ready set (a drive that ran out of time with some
    left; the reconciler, for lanes there longer than READY_STALE_S)."""
    wake_lane(r, "")


def enqueue(r: Redis, plan: Plan, *, job_kind: str | None = None, durability: Durability | None = None,
            warn: Callable[[str], None] | None = None) -> list[str]:
    """Register the plan (and the job, with `job_kind`; `durability`, `warn`: see `register`), then publish
    its extractions and a wake-up of the chat's lane. Returns the delivery ids. A failed publish is logged
    and loses nothing (the due times)."""
    items = register(r, capped(plan), job_kind=job_kind, durability=durability, warn=warn)
    for e in items:
        if e.queue is not None:
            extract = e.spec.extract
            what = f"{extract.sandbox.get('kind', '')}:{extract.path}" if extract is not None else ""
            _published(plan.job_id, publish_extract, e.did, e.queue, what)
    if any(e.queue is None for e in items):
        # something is ready now; a step waiting for an extraction is driven by its end (and the lane's due time)
        _published(plan.job_id, wake_lane, r, plan.target)
    return [e.did for e in items]


def _published(job_id: str, publish: Callable[..., object], *args: Any) -> None:
    """`publish(*args)`; one that fails is logged, and the reconciler publishes it again."""
    try:
        publish(*args)
    except Exception as exc:  # noqa: BLE001 - the ledger has it: a lost publish costs nothing
        log.warning("job %s: a publish failed (%s); the reconciler will publish it", job_id, type(exc).__name__)


def enqueue_turn(r: Redis, target: str, message: str, *, agent: str, job_id: str | None = None,
                 sandbox: str | None = None, attachments: list[Attachment] | None = None,
                 origin: str | None = None, durability: Durability | None = None,
                 warn: Callable[[str], None] | None = None) -> str:
    """Record a turn's job (`register_turn`), then enqueue `agent_turn` with the job id as its task id.
    Returns the job id."""
    job_id = job_id or new_job_id("turn")
    spec = turn_spec(job_id, target, message, agent=agent, sandbox=sandbox, attachments=attachments)
    register_turn(r, spec, origin=origin, durability=durability, warn=warn)
    spec_sig(spec).apply_async(task_id=job_id)
    return job_id


def register_turn(r: Redis, spec: TurnSpec, *, origin: str | None = None, durability: Durability | None = None,
                  warn: Callable[[str], None] | None = None) -> None:
    """A turn's job record (with its spec, sealed: the ledger can run it again) and its due time, in one
    transaction (`durability`, `warn`: see `register`)."""
    job_id = spec["job"]
    sealed = signing.seal_json("turn", job_id, spec)

    def fill(p: Any) -> None:
        receipts.create_job(r, job_id, kind="turn", target=spec["target"], agent=spec["agent"], origin=origin,
                            pipe=p, spec=sealed)
        ledger.set_due(p, "turn", job_id, TURN_GRACE_S)

    _durably(r, fill, durability, warn, job_id)


def turn_spec(job_id: str, target: str, message: str, *, agent: str, sandbox: str | None = None,
              attachments: list[Attachment] | None = None) -> TurnSpec:
    """A turn's spec: the one argument of its `agent_turn` (and what its job record keeps)."""
    spec: TurnSpec = {"job": job_id, "target": target, "message": message, "agent": agent}
    if sandbox:
        spec["sandbox"] = sandbox
    if attachments:
        spec["attachments"] = attachments
    return spec


def spec_sig(spec: TurnSpec) -> Signature:
    """The `agent_turn` signature of a turn's spec (also the reconciler's way to run it again),
    labelled with the job, agent, target and sizes, never the text."""
    attachments = spec.get("attachments")
    label = f"({spec['job']} {spec['agent']} -> {spec['target']}, {len(spec.get('message', ''))} chars"
    label += f", {len(attachments)} attachments)" if attachments else ")"
    return _label(_sig(task_names.AGENT_TURN, spec), label)
