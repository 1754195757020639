"""The operator CLI: `courier send | turn | status | watch | web | janitor | demo` (and more below).

Exit codes: 0 done; 1 a delivery or turn failed; 2 bad input (nothing was
enqueued); 3 a service (Redis, storage) is unavailable (nothing was
enqueued); 4 timed out waiting.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlparse

import typer
from rich.table import Table

from adapters.errors import ConfigError, CourierError, StorageError
from storage import prefixes
from tasks.ledger import keys, receipts
from tasks.states import DeliveryState, JobState
from workers.console import (
    EXIT_FAILED, EXIT_INPUT, EXIT_SERVICE, EXIT_TIMEOUT, cell, deliveries_table, delivery_cells, delivery_columns,
    die, err, esc, follow, new_table, out, wait_deliveries, warn, watch_job,
)

if TYPE_CHECKING:
    from tasks.messages import Attachment

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False)
PROGRESS_MIN_BYTES = 8 * 1024 * 1024


@contextmanager
def _or_die(errors: type[Exception] | tuple[type[Exception], ...] = ConfigError, prefix: str = "",
            code: int = EXIT_INPUT):
    """An `errors` raised inside: its message (after `prefix`) as the one-line error, exit `code`."""
    try:
        yield
    except errors as exc:
        raise die(f"{prefix}{exc}", code) from None


def _emit(as_json: bool, data: object, *shown: object, **print_kw) -> None:
    """`data` as one JSON line with --json, else each of `shown` printed."""
    if as_json:
        print(json.dumps(data))
    else:
        for x in shown:
            out.print(x, **print_kw)


def _settings():
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from workers.settings import Settings, SecretFileError, env_names, get_settings

    try:
        settings = get_settings()
    except SecretFileError as exc:  # a <NAME>_FILE: the message names it, never the content
        raise die(f"bad setting {exc}", EXIT_INPUT) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise die(f"bad setting {loc.upper()}: {first.get('msg')}", EXIT_INPUT) from None
    except SettingsError as exc:  # a JSON setting that is not JSON (COURIER_AGENTS='{bad')
        m = re.search(r'field "([a-z0-9_]+)"', str(exc))
        field = Settings.model_fields.get(m.group(1)) if m else None
        name = env_names(m.group(1), field)[0] if field is not None else "a setting"
        why = f": {exc.__cause__}" if isinstance(exc.__cause__, ValueError) else ""
        raise die(f"bad setting {name}: not valid JSON{why}", EXIT_INPUT) from None
    from workers import logformat, logsafe

    logsafe.install(settings)  # whatever a command (or a library under it) logs: no secret
    logformat.install(settings.log_format)
    return settings


def _redis(settings, *, enqueues: bool = False):
    """Redis, or a one-line error (exit 3); with `enqueues` (a command that would have enqueued) it says nothing was."""
    from workers.embedded import redact_url, redis_refusal
    from workers.wiring import redis_client

    why = redis_refusal(settings.redis_url, 2.0)
    if why is not None:
        tail = "; nothing was enqueued" if enqueues else ""
        hint = " (start Redis or set COURIER_REDIS_URL)" if why == "is not answering" else ""
        raise die(f"Redis at {redact_url(settings.redis_url)} {why}{tail}{hint}", EXIT_SERVICE)
    return redis_client(settings.redis_url)


def _store(settings):
    from workers.wiring import store

    with _or_die(StorageError, "storage unavailable: ", EXIT_SERVICE), _or_die(prefix="COURIER_STORAGE_URL: "):
        return store(settings)


def _target(settings, target: str) -> str:
    from adapters.platforms.base import split_target
    from workers.wiring import check_platform

    with _or_die():
        platform, _chat = split_target(target)
        check_platform(platform, settings)
    return platform


def _celery():
    import tasks.celery_tasks  # noqa: F401
    import workers.celery_app  # noqa: F401 - binds the tasks to the configured app


@app.command()
def send(
    target: Annotated[str, typer.Argument(help="<platform>:<chat id>, e.g. outbox:demo or telegram:-100123")],
    paths: Annotated[list[str] | None, typer.Argument(help="local files (stored as they are) or sandbox URIs "
                                                           "(local:///abs/path, docker://ctr/path, ssh://host/path, "
                                                           "...)")] = None,
    text: Annotated[str | None, typer.Option("--text", help="a text message, sent before the files (alone: a "
                                                           "text-only send)")] = None,
    caption: Annotated[str | None, typer.Option(help="caption for the first file")] = None,
    as_document: Annotated[bool, typer.Option("--as-document", help="send images and video as documents")] = False,
    voice: Annotated[bool, typer.Option("--voice", help="send audio as voice notes")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="wait for receipts; exit 1 if any delivery failed")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait with --wait")] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Deliver files (and/or a text) to a chat."""
    from tasks.dispatch import chains
    from tasks.ops.send import HostFile, NothingToSend, check_send, check_size
    from workers.wiring import durability, open_sandbox
    from workers.wiring import platform as wired_platform
    from workers.wiring import platform_limits

    settings = _settings()
    platform_name = _target(settings, target)

    def host_file(raw: str) -> HostFile:
        """A file of this host: there, readable, not empty, within the platform's limits."""
        p = Path(raw).expanduser()
        if not p.exists():
            raise die(f"no such file: {raw}", EXIT_INPUT)
        if not p.is_file():
            raise die(f"not a regular file: {raw}", EXIT_INPUT)
        if not os.access(p, os.R_OK):
            raise die(f"cannot read {raw}: permission denied", EXIT_INPUT)
        if p.stat().st_size == 0:  # no platform takes an empty file: say so now, not in the worker
            raise die(f"{raw} is empty (0 bytes): nothing to send", EXIT_INPUT)
        check_size(wired_platform(platform_name, settings), raw, p.name, p.stat().st_size, voice=voice,
                   as_document=as_document, path=str(p))
        return HostFile(path=str(p), name=p.name)

    try:
        checked = check_send(target, platform=lambda: wired_platform(platform_name, settings),
                             album_max=lambda: platform_limits(platform_name, settings).album_max,
                             open_sandbox=lambda ref: open_sandbox(ref, settings),
                             max_files=settings.max_files_per_job, max_file_bytes=settings.max_file_bytes,
                             text=text, files=paths or [], caption=caption, voice=voice, as_document=as_document,
                             host_files=host_file)
    except NothingToSend:
        raise die("nothing to send: give files, --text, or both", EXIT_INPUT) from None
    except ConfigError as exc:
        raise die(str(exc), EXIT_INPUT) from None
    r = _redis(settings, enqueues=True)
    store = _store(settings)
    _celery()

    def upload(job_id: str, seq: int, f: HostFile) -> chains.StoredFile:
        key = chains.storage_key(job_id, seq, f.name)
        info = _upload(store, key, Path(f.path))
        return chains.StoredFile(key=key, name=f.name, size=info.size_bytes, sha256=info.sha256 or "")

    plan = checked.plan(upload=upload)
    job_id = plan.job_id
    ids = chains.enqueue(r, plan, job_kind="send", durability=durability(settings), warn=warn)
    if not wait:
        return _emit(as_json, {"job": job_id, "deliveries": ids},
                     f"queued [bold]{esc(job_id)}[/]: " + esc(" ".join(ids)), highlight=False)
    rows, done = wait_deliveries(r, job_id, timeout)
    _finish(job_id, rows, done, as_json)


def _upload(store, key: str, p: Path):
    """Store a file of this host (a progress bar from PROGRESS_MIN_BYTES on), or exit 3."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    size = p.stat().st_size
    with _or_die(CourierError, f"could not store {p}: ", EXIT_SERVICE), open(p, "rb") as f:
        if size < PROGRESS_MIN_BYTES:
            return store.put_stream(key, f)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=err, transient=True) as prog:
            t = prog.add_task(f"storing {p.name}", total=size)
            return store.put_stream(key, f, progress=lambda n: prog.advance(t, n))


def _finish(job_id: str, rows: list[dict], done: bool, as_json: bool) -> None:
    _emit(as_json, {"job": job_id, "done": done, "deliveries": rows}, deliveries_table(job_id, rows))
    if not done:
        raise die(f"timed out waiting for {job_id}; see `courier status {job_id}`", EXIT_TIMEOUT)
    if any(row.get("state") == DeliveryState.FAILED for row in rows):
        raise typer.Exit(EXIT_FAILED)


@app.command()
def turn(
    target: Annotated[str, typer.Argument(help="<platform>:<chat id> the reply goes to")],
    message: Annotated[str, typer.Argument(help="the user's message")],
    agent: Annotated[str | None, typer.Option(help="agent name (settings COURIER_AGENTS, or the built-in demo)")] = None,
    sandbox: Annotated[str | None, typer.Option(help="sandbox URI the agent works in, e.g. local:///srv/work")] = None,
    attach: Annotated[list[Path] | None, typer.Option("--attach", help="a file for the agent (repeatable): "
                                                                        "put in its sandbox under inbox/")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="show live phases and wait for the deliveries")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait with --wait")] = 1200.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Enqueue an agent turn."""
    from adapters.sandboxes.base import parse_uri
    from tasks.dispatch import chains
    from tasks.turn.turn import BUILTIN_AGENTS
    from workers.eventauth import events_token
    from workers.wiring import durability

    settings = _settings()
    _target(settings, target)
    name = agent or settings.default_agent
    if settings.agent(name) is None and name not in BUILTIN_AGENTS:
        known = sorted(set(settings.agents) | set(BUILTIN_AGENTS))
        raise die(f"unknown agent {name!r}: known agents are {', '.join(known)}", EXIT_INPUT)
    if sandbox:
        with _or_die():
            parse_uri(sandbox)
    for p in attach or []:
        if not p.is_file():
            raise die(f"no such file to attach: {p}", EXIT_INPUT)
    r = _redis(settings, enqueues=True)
    _celery()

    job_id = chains.new_job_id("turn")
    attachments: list[Attachment] = []
    if attach:
        store = _store(settings)
        for i, p in enumerate(attach):
            key = chains.storage_key(job_id, i, p.name, prefix=prefixes.INBOUND)
            _upload(store, key, p)
            attachments.append({"key": key, "name": p.name})
    chains.enqueue_turn(r, target, message, agent=name, job_id=job_id, sandbox=sandbox, attachments=attachments,
                        durability=durability(settings), warn=warn)
    if not wait:
        print(json.dumps({"job": job_id, "events_token": events_token(r, job_id)}) if as_json else job_id)
        return
    if not as_json:
        out.print(f"turn [bold]{esc(job_id)}[/] queued", highlight=False)
    ok = watch_job(r, job_id, timeout, quiet=as_json)
    if ok is None:
        raise die(f"timed out waiting for {job_id}; see `courier status {job_id}`", EXIT_TIMEOUT)
    rows, done = wait_deliveries(r, job_id, timeout)
    _finish(job_id, rows, done, as_json)
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def watch(
    job_id: Annotated[str, typer.Argument(help="a turn or send id")],
    timeout: Annotated[float, typer.Option(help="seconds to watch")] = 3600.0,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON line per event (with its stream id)")] = False,
) -> None:
    """Show a turn's (or a send's) events live, until its deliveries are done."""
    r = _redis(_settings())
    if receipts.get_job(r, job_id) is None and not r.exists(keys.events(job_id)):
        raise die(f"no turn or send with id {job_id!r}", EXIT_INPUT)
    res = watch_job(r, job_id, timeout, as_json=as_json)
    if res is None:
        raise die(f"timed out watching {job_id}; see `courier status {job_id}`", EXIT_TIMEOUT)
    if not res:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def web(
    host: Annotated[str | None, typer.Option(help="address to bind (default COURIER_WEB_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default COURIER_WEB_PORT)")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: critical, error, warning, info, debug, "
                                                "trace (no level logs a secret)")] = "info",
) -> None:
    """Serve platform webhooks and the turns' Server-Sent Events (uvicorn)."""
    import uvicorn

    from workers import logformat, logsafe
    from workers.web import BrokerMismatch, courier_celery

    settings = _settings()
    with _or_die(BrokerMismatch):  # the app checks it too (lifespan); here with a one-line error
        courier_celery(settings)
    # courier's own lines (and its libraries') at the same level, on stderr like uvicorn's
    logging.basicConfig(level="DEBUG" if log_level.lower() == "trace" else log_level.upper(),
                        format=logformat.PLAIN)
    logsafe.install(settings)
    logformat.install(settings.log_format)
    # log_config=None: uvicorn's loggers go through the root logger's handler, formatted as every process's
    uvicorn.run("workers.web:app", host=host or settings.web_host, port=port or settings.web_port,
                log_level=log_level.lower(), timeout_graceful_shutdown=5, log_config=None)


@app.command()
def status(
    ident: Annotated[str, typer.Argument(metavar="ID", help="a send, turn or delivery id")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Show a job's deliveries (or one delivery's receipt)."""
    from tasks.ops.listing import shown
    from workers.eventauth import events_token

    r = _redis(_settings())
    job = receipts.get_job(r, ident)
    if job is not None:
        rows = receipts.job_deliveries(r, ident)
        token = events_token(r, ident)
        if job.get("kind") == "send":  # a send's job record is not updated as it goes: its receipts say
            job["state"] = send_state(rows)
        line = f"{job.get('kind')} {ident} → {job.get('target')}: {job.get('state')}"
        line += f" ({job['reason']})" if job.get("reason") else ""
        _emit(as_json, {"job": shown(job), "deliveries": [shown(row) for row in rows], "events_token": token},
              line, f"events: /turns/{ident}/events?token={token}", highlight=False, markup=False)
        if not as_json:
            out.print(deliveries_table(ident, rows))
        if any(row.get("state") == DeliveryState.FAILED for row in rows) or job.get("state") == JobState.ERROR:
            raise typer.Exit(EXIT_FAILED)
        return
    rec = receipts.get_delivery(r, ident)
    if rec is None:
        raise die(f"no send, turn or delivery with id {ident!r}", EXIT_INPUT)
    _emit(as_json, shown(rec), deliveries_table(rec.get("job", ""), [rec]))
    if rec.get("state") == DeliveryState.FAILED:
        raise typer.Exit(EXIT_FAILED)


@app.command()
def deliveries(
    failed: Annotated[bool, typer.Option("--failed", help="only deliveries that failed")] = False,
    chat: Annotated[str | None, typer.Option("--chat", help="only this target, e.g. telegram:-100123")] = None,
    since: Annotated[str | None, typer.Option(help="only jobs from the last ... (e.g. 30m, 12h, 7d)")] = None,
    limit: Annotated[int, typer.Option(help="at most this many rows, newest first", min=1)] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List recent deliveries (newest job first) with their state and reason."""
    from adapters.platforms.base import split_target
    from tasks.ops import listing

    settings = _settings()
    since_s = None if since is None else time.time() - parse_duration(since, "--since")
    if chat is not None:
        with _or_die(prefix="--chat: "):
            split_target(chat)
    r = _redis(settings)
    rows = listing.deliveries(r, failed=failed, chat=chat, since_s=since_s, limit=limit)
    if as_json:
        print(json.dumps([listing.shown(row) for row in rows]))
        return
    what = ("failed deliveries" if failed else "deliveries") + (f" to {chat}" if chat else "")
    if not rows:
        out.print(f"no {what}" + (f" in the last {since}" if since else ""), markup=False, highlight=False)
        return
    t = new_table(what, (*delivery_columns("target"), "queued"), overflow="fold")
    for row in rows:
        queued = row.get("queued_s") or row.get("created_s")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(queued))) if queued else ""
        t.add_row(*delivery_cells(row, "target"), cell(when))
    out.print(t)


@app.command()
def queues(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    purge_orphans: Annotated[bool, typer.Option(
        "--purge-orphans", help="list the queued messages whose ledger entry is final or gone (a cancelled "
                                "or delivered file's extraction, an ended turn); with --yes, drop them")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="with --purge-orphans: drop them (without: a dry run)")] = False,
) -> None:
    """Celery queues (depth, oldest message's age, consumers; sandbox.<host> too) and the ledger's pending stages."""
    from tasks.ledger import ledger
    from tasks.ops import queues as queues_mod

    r = _redis(_settings())
    if yes and not purge_orphans:
        raise die("--yes goes with --purge-orphans", EXIT_INPUT)
    if purge_orphans:
        found = queues_mod.orphans(r)
        removed = queues_mod.purge(r, found) if yes else 0
        rows_o = [o for o, _raw in found]
        if as_json:
            print(json.dumps({"orphans": rows_o, "removed": removed, "dry_run": not yes}))
            return
        if rows_o:
            t = new_table("orphaned messages" + ("" if yes else " (dry run: --yes drops them)"),
                          ("queue", "task", "for", "why"))
            for o in rows_o:
                t.add_row(o["queue"], o["task"].rsplit(".", 1)[-1], o["subject"], o["why"])
            out.print(t)
        verb = f"dropped {removed}" if yes else "nothing dropped (dry run)"
        out.print(f"{len(rows_o)} orphaned message{'s' if len(rows_o) != 1 else ''}; {verb}", markup=False,
                  highlight=False)
        return
    rows = queues_mod.stats(r)
    pending = ledger.pending(r)
    t = new_table("queues", ("queue", "depth", "oldest", "consumers"), numeric=True)
    for row in rows:
        age = row["oldest_age_s"]
        warn = row["depth"] and not row["consumers"]
        t.add_row(cell(row["queue"]), cell(row["depth"]), cell(_age(age) if age is not None else "-"),
                  cell(row["consumers"], "bold red" if warn else ""))
    lt = new_table("ledger: pending per stage", ("stage", "pending"), numeric=True)
    for stage, n in pending.items():
        lt.add_row(cell(stage), cell(n))
    _emit(as_json, {"queues": rows, "ledger_pending": pending}, t, lt)


def _age(s: float) -> str:
    unit, per = ("s", 1) if s < 120 else ("m", 60) if s < 7200 else ("h", 3600)
    return f"{s / per:.1f}{unit}"


def _outcome_table(title: str, rows: list[dict]) -> Table:
    t = new_table(title, ("delivery", "outcome", "state", "note"), overflow="fold")
    for row in rows:
        style = {"requeued": "green", "cancelled": "green", "refused": "red", "in_flight": "yellow"}.get(
            row.get("outcome", ""), "")
        t.add_row(cell(row.get("id", "")), cell(row.get("outcome", ""), style),
                  cell(row.get("state", "")), cell(row.get("reason") or row.get("note") or ""))
    return t


@app.command()
def retry(
    ids: Annotated[list[str], typer.Argument(metavar="ID...", help="failed delivery ids, or a job id (all its "
                                                                   "failed or cancelled deliveries)")],
    wait: Annotated[bool, typer.Option("--wait", help="wait until the retried deliveries are final; exit 1 if "
                                                      "one failed again")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait with --wait")] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Re-queue failed (or cancelled) deliveries through the ledger: their chat's lane, and a new extraction
    when that is what failed. A delivered one is refused. Exit 2 (nothing re-queued) when an id is unknown
    or not failed."""
    from tasks.dispatch import chains
    from tasks.ops import operations

    r = _redis(_settings(), enqueues=True)
    recs: dict[str, dict] = {}
    problems: list[dict] = []
    for ident in dict.fromkeys(ids):
        found = operations.retry_targets(r, ident)
        if found is None:
            problems.append({"id": ident, "outcome": "refused", "state": "", "reason": "no such delivery or job"})
            continue
        what, rows = found
        if what == "job" and not rows:
            problems.append({"id": ident, "outcome": "refused", "state": "",
                             "reason": "the job has no failed or cancelled delivery"})
        for rec in rows:
            if rec.get("state") not in operations.RETRYABLE:
                st = rec.get("state", "")
                why = ("already delivered" + (f" (message id {rec['message_id']})" if rec.get("message_id") else "")
                       if st == DeliveryState.DELIVERED else f"not failed: it is {st}")
                problems.append({"id": rec["id"], "outcome": "refused", "state": st, "reason": why})
            else:
                recs.setdefault(rec["id"], rec)
    if problems:
        _emit(as_json, {"retried": [], "refused": problems}, _outcome_table("retry: nothing re-queued", problems))
        raise die("; ".join(f"{p['id']}: {p['reason']}" for p in problems) + " (nothing was re-queued)",
                  EXIT_INPUT)
    _celery()
    results = [operations.retry(r, rec) for rec in recs.values()]
    for res in results:  # the ledger's due times are set: a lost publish only waits for the reconciler
        if res.get("extract"):
            chains.publish_extract(res["id"], res["extract"], f"retry:{res.get('source', '')}")
    requeued = [res for res in results if res["outcome"] == "requeued"]
    refused = [res for res in results if res["outcome"] != "requeued"]
    for target in dict.fromkeys(res["target"] for res in requeued):
        chains.publish_lane(target)
    if not wait:
        _emit(as_json, {"retried": requeued, "refused": refused}, _outcome_table("retry", results))
        if refused:  # raced: it changed between the check and the reset
            raise typer.Exit(EXIT_FAILED)
        return
    done_ids = [res["id"] for res in requeued]

    def look() -> tuple[list[dict], bool]:
        rows = [receipts.get_delivery(r, d) or {"id": d, "state": "gone"} for d in done_ids]
        return rows, all(row.get("state") in receipts.TERMINAL or row.get("state") == "gone" for row in rows)

    jobs = dict.fromkeys(recs[d].get("job") or d.rsplit(".", 1)[0] for d in done_ids)
    rows, finished = follow(r, jobs, look, timeout)
    rows = [{k: v for k, v in row.items() if k != "spec"} for row in rows]
    _emit(as_json, {"done": finished, "deliveries": rows, "refused": refused},
          deliveries_table("retried deliveries", rows))
    if not finished:
        raise die("timed out waiting for the retried deliveries; see `courier status ID`", EXIT_TIMEOUT)
    if refused or any(row.get("state") != DeliveryState.DELIVERED for row in rows):
        raise typer.Exit(EXIT_FAILED)


@app.command()
def cancel(
    job: Annotated[str, typer.Argument(metavar="JOB", help="a send or turn id")],
    timeout: Annotated[float, typer.Option(help="seconds to wait for sends already in flight to finish")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Cancel a job: its deliveries not sent yet are never sent (state `cancelled`); a send already in
    flight finishes; a queued turn ends, a running one is marked and delivers nothing."""
    from tasks.dispatch import chains
    from tasks.ops import operations
    from tasks.ops import queues as queues_mod

    r = _redis(_settings())
    rec = receipts.get_job(r, job)
    if rec is None:
        if receipts.get_delivery(r, job) is not None:
            raise die(f"{job} is a delivery: cancel takes its job ({job.rsplit('.', 1)[0]})", EXIT_INPUT)
        raise die(f"no send or turn with id {job!r}", EXIT_INPUT)
    turn_was = operations.mark_turn(r, job) if rec.get("kind") == "turn" else None
    results: dict[str, dict] = {}

    def look() -> tuple[None, bool]:  # cancel what has not started; done when no send is in flight
        for row in receipts.job_deliveries(r, job):
            before = results.get(row["id"])
            if before is not None and before["outcome"] != "in_flight":
                continue
            res = operations.cancel_delivery(r, row)
            if res["outcome"] == "in_flight":
                res["note"] = "being sent: it finishes"
            elif res["outcome"] == "final":
                res["note"] = "was in flight: it finished" if before is not None else "already final"
            results[res["id"]] = res
        return None, all(res["outcome"] != "in_flight" for res in results.values())

    _, settled = follow(r, [job], look, timeout)  # a send in flight: its final event wakes the next look
    # its messages still queued (an extraction waiting on a sandbox.<host> queue nobody consumes, a
    # turn that had not started) would only find their entries cancelled: they go now
    purged = queues_mod.purge(r, queues_mod.orphans(r, job=job))
    if any(res["outcome"] == "cancelled" for res in results.values()):
        _celery()
        chains.publish_lane(rec.get("target", ""))  # the lane drops the cancelled steps now, not at its due time
    rows_out = list(results.values())
    if as_json:
        print(json.dumps({"job": job, "kind": rec.get("kind"), "turn": turn_was, "deliveries": rows_out,
                          "timed_out": not settled, "messages_dropped": purged}))
    else:
        if turn_was is not None:
            msg = {"queued": "the turn had not started: it ends now, delivering nothing",
                   "running": "the turn is running: marked, it delivers nothing when it ends"}.get(
                turn_was, f"the turn was over ({turn_was})")
            out.print(f"{job}: {msg}", markup=False, highlight=False)
        n = sum(1 for res in rows_out if res["outcome"] == "cancelled")
        out.print(f"{job}: {n} deliver{'y' if n == 1 else 'ies'} cancelled", markup=False, highlight=False)
        if rows_out:
            out.print(_outcome_table(f"cancel {job}", rows_out))
    if not settled:
        raise die(f"sends still in flight after {timeout:g}s; see `courier status {job}`", EXIT_TIMEOUT)


webhook_app = typer.Typer(no_args_is_help=True, help="Point a platform's webhook at the web process.")
app.add_typer(webhook_app, name="webhook")

WEBHOOK_STEPS = {
    "slack": ("Slack does not take its events URL through the API. In https://api.slack.com/apps → your app → "
              "Event Subscriptions: enable events, Request URL {url} (courier answers the url_verification "
              "challenge; SLACK_SIGNING_SECRET must be set), subscribe to the bot events message.channels, "
              "message.im and app_mention, save, and reinstall the app."),
    "discord": ("Discord takes its interactions endpoint in the developer portal: https://discord.com/developers"
                "/applications → your application → General Information → Interactions Endpoint URL {url} "
                "(Discord checks it with a signed PING: DISCORD_PUBLIC_KEY must be that page's public key). "
                "Then register a slash command with one string option, e.g. `ask` with option `message`: "
                "POST https://discord.com/api/v10/applications/<application id>/commands with the bot token."),
    "whatsapp": ("WhatsApp takes its callback in the Meta app dashboard: WhatsApp → Configuration → Webhook: "
                 "Callback URL {url}, Verify token the value of WHATSAPP_VERIFY_TOKEN (courier answers the "
                 "hub.challenge), then subscribe to the `messages` field. WHATSAPP_APP_SECRET must be the app's "
                 "secret (it checks X-Hub-Signature-256)."),
}


@webhook_app.command("set")
def webhook_set(
    platform: Annotated[str, typer.Argument(help="telegram, slack, discord or whatsapp")],
    url: Annotated[str, typer.Argument(help="the web process's public https base URL (…/webhooks/<platform> "
                                            "is added unless given)")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Telegram: call setWebhook with the secret token. Others: print the steps their console needs."""
    settings = _settings()
    name = platform.lower()
    if name not in ("telegram", *WEBHOOK_STEPS):
        raise die(f"unknown platform {platform!r}: telegram, slack, discord or whatsapp", EXIT_INPUT)
    u = urlparse(url)
    if u.scheme != "https" or not u.hostname or u.query or u.fragment:
        raise die(f"the webhook URL must be a public https URL without a query, got {url!r}", EXIT_INPUT)
    full = url.rstrip("/")
    if not full.endswith(f"/webhooks/{name}"):
        full += f"/webhooks/{name}"
    if name != "telegram":
        steps = WEBHOOK_STEPS[name].format(url=full)
        return _emit(as_json, {"platform": name, "url": full, "done": False, "steps": steps}, steps,
                     markup=False, highlight=False)
    token, secret = settings.telegram_bot_token, settings.telegram_webhook_secret
    if token is None or secret is None:
        raise die("telegram webhook set needs TELEGRAM_BOT_TOKEN and TELEGRAM_WEBHOOK_SECRET "
                  "(the secret Telegram sends back in every update's header)", EXIT_INPUT)
    import httpx

    api = f"{settings.telegram_base_url.rstrip('/')}/bot{token.get_secret_value()}/setWebhook"
    body = {"url": full, "secret_token": secret.get_secret_value(), "allowed_updates": ["message", "channel_post"]}
    try:
        resp = httpx.post(api, json=body, timeout=30)
        answer = resp.json()
    except (httpx.HTTPError, ValueError) as exc:  # never the exception text: it holds the token's URL
        raise die(f"Telegram did not answer setWebhook ({type(exc).__name__})", EXIT_SERVICE) from None
    if not answer.get("ok"):
        raise die(f"Telegram refused the webhook: {answer.get('description') or resp.status_code}", EXIT_FAILED)
    _emit(as_json, {"platform": name, "url": full, "done": True},
          f"telegram: webhook set to {full} (updates carry TELEGRAM_WEBHOOK_SECRET)", markup=False, highlight=False)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(raw: str, option: str) -> float:
    """`90`, `90s`, `15m`, `12h`, `7d`, `2w` -> seconds; anything else exits 2, naming `option`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", raw)
    if not m:
        raise die(f"{option}: not a duration: {raw!r} (e.g. 3600, 90m, 12h, 7d)", EXIT_INPUT)
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@app.command()
def janitor(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="count what would go (files and bytes); delete nothing")] = False,
    older_than: Annotated[str | None, typer.Option(help="instead of each TTL: everything older than this "
                                                       "(e.g. 12h, 3d; at least 1h)")] = None,
    install_lifecycle: Annotated[bool, typer.Option("--install-lifecycle", help="S3 storage: put the retention "
                                                    "rules on the bucket as lifecycle rules (the S3 service then "
                                                    "expires the files) and exit; see COURIER_S3_LIFECYCLE")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Run one janitor sweep now (old screenshots, files, spills, partial writes, turn workspaces)."""
    from tasks.delivery.text import human_bytes
    from tasks.ops import janitor as janitor_mod
    from workers.wiring import build_context

    settings = _settings()
    if install_lifecycle:
        _redis(settings)
        _store(settings)
        with _or_die(CourierError, "could not install the lifecycle rules: ", EXIT_SERVICE), _or_die():
            res = janitor_mod.install_lifecycle(build_context(settings))
        t = new_table("S3 lifecycle rules " + ("installed" if res["changed"] else "already in place")
                      + (f" (and {res['kept']} other rules kept)" if res["kept"] else ""), ("rule", "prefix", "after"))
        for rule in res["rules"]:
            after = (f"expire {rule['Expiration']['Days']} d" if "Expiration" in rule else
                     f"abort unfinished uploads {rule['AbortIncompleteMultipartUpload']['DaysAfterInitiation']} d")
            t.add_row(cell(rule["ID"]), cell(rule["Filter"]["Prefix"]), cell(after))
        return _emit(as_json, res, t)
    older_s = None if older_than is None else parse_duration(older_than, "--older-than")
    if older_s is not None and older_s < janitor_mod.MIN_OLDER_THAN_S:
        raise die("--older-than must be at least 1h: younger files may still be waiting for their delivery",
                  EXIT_INPUT)
    _redis(settings)
    _store(settings)
    with _or_die(CourierError, "the sweep stopped: ", EXIT_SERVICE):
        res = janitor_mod.sweep(build_context(settings), dry_run=dry_run, older_than_s=older_s)
    if as_json:
        print(json.dumps(res))
    elif not res.get("skipped"):
        t = new_table("janitor (dry run: nothing deleted)" if dry_run else "janitor",
                      ("what", "would go" if dry_run else "deleted", "bytes"), numeric=True)
        for what, v in res.items():
            if what in ("dry_run", "took_s"):
                continue
            if what == "s3_lifecycle":
                row = ("(S3 lifecycle rules)", f"{v['rules']} rules" + (", updated" if v["changed"] else ""), "")
            elif v is None:
                row = (what, "by the bucket's lifecycle" if res.get("s3_lifecycle") else "not counted", "")
            else:
                row = (what, v["count"], "" if v["bytes"] is None else human_bytes(int(v["bytes"])))
            t.add_row(*map(cell, row))
        out.print(t)
    if res.get("skipped"):
        raise die(f"another sweep is running ({res.get('holder')}); nothing was done", EXIT_FAILED)


def send_state(rows: list[dict]) -> str:
    """A send's state from its receipts: queued, sending (some final or under
    way), delivered (all), failed (all final, one or more failed)."""
    states = [row.get("state") for row in rows]
    if states and all(st in receipts.TERMINAL for st in states):
        if DeliveryState.FAILED in states:
            return DeliveryState.FAILED
        return DeliveryState.DELIVERED if DeliveryState.DELIVERED in states else DeliveryState.CANCELLED
    if any(st not in (DeliveryState.QUEUED, None) for st in states):
        return DeliveryState.SENDING
    return DeliveryState.QUEUED


@app.command()
def demo(
    to: Annotated[str | None, typer.Option("--to", help="deliver to this target instead of the outbox")] = None,
    message: Annotated[str, typer.Option(help="what to ask the demo agent")] = "make a chart of x^2",
    timeout: Annotated[float, typer.Option(help="seconds before giving up")] = 120.0,
) -> None:
    """Run the whole pipeline locally: Redis (embedded if needed), a worker, the demo agent, the outbox."""
    from workers.demo import run_demo

    raise typer.Exit(run_demo(to=to, message=message, timeout_s=timeout, console=out, err=err))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(ctx: typer.Context) -> None:
    """Start a Celery worker (any `celery worker` option, e.g. -Q delivery -n d@%h): a delivery-only
    worker gets COURIER_DELIVERY_POOL x COURIER_DELIVERY_CONCURRENCY (threads x 16), others prefork.
    It stays up: a Celery worker that exits is started again (back-off up to 30 s); SIGTERM stops it."""
    from workers.worker import main as start

    start(list(ctx.args))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def flower(ctx: typer.Context) -> None:
    """Start Flower on courier's Celery app (any `celery flower` option, e.g. --port=5555; --help is
    Flower's); it needs the flower extra."""
    if importlib.util.find_spec("flower") is None:
        # (`celery flower` without it says only "No such command 'flower'")
        raise die("Flower is not installed: pip install 'courier[flower]' (or pip install flower)", EXIT_SERVICE)
    env = dict(os.environ)
    path = env.pop("FLOWER_BASIC_AUTH_FILE", "").strip()
    if path:  # its login from a secret file (compose): handed to Flower in its own environment only
        from workers.settings import SecretFileError, read_secret_file

        if env.get("FLOWER_BASIC_AUTH", "").strip():
            raise die("FLOWER_BASIC_AUTH and FLOWER_BASIC_AUTH_FILE are both set: set one of them", EXIT_INPUT)
        with _or_die(SecretFileError):
            login = read_secret_file("FLOWER_BASIC_AUTH_FILE", path).strip()
        if ":" not in login.split(",")[0]:
            raise die(f"FLOWER_BASIC_AUTH_FILE: {path} must hold user:password (Flower would start without a "
                      "login)", EXIT_INPUT)
        env["FLOWER_BASIC_AUTH"] = login
    os.execve(sys.executable, [sys.executable, "-m", "celery", "-A", "workers.celery_app", "flower", *ctx.args], env)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("courier")
        except PackageNotFoundError:
            v = "unknown"
        print(f"courier {v}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print courier's version and exit")] = False,
) -> None:
    """courier: run chat-agent turns and deliver their files to chat platforms."""


def main() -> None:
    try:
        app(prog_name="courier")
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
