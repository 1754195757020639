"""An agent turn: run the agent, parse its reply, hand the reply to the
delivery chain. Plain code, no Celery.

Lifecycle published on the turn's event stream: started -> (thinking, tool
events from the agent) -> completed | error | no_reply, exactly one terminal
event per turn. An error gives the chat a short message, never a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from adapters.agents.bridge import run_bridge
from adapters.errors import ConfigError, CourierError
from adapters.sandboxes.base import SandboxRef, parse_uri
from tasks import chains, events, receipts
from tasks.runtime import Context

DONE_STATES = frozenset({"replied", "no_reply", "error"})

#: the bundled demo agent, always available as --agent demo
BUILTIN_AGENTS = {"demo": [sys.executable, "-m", "adapters.agents.demo_agent"]}


def _sandbox_for(ctx: Context, spec: dict, agent) -> tuple[SandboxRef, str | None]:
    """The turn's sandbox ref and, for a local sandbox, its working directory."""
    uri = spec.get("sandbox") or (agent.sandbox if agent is not None else None)
    if uri:
        ref, path = parse_uri(uri)
        if ref.kind == "local":
            return ref, path
        return SandboxRef(ref.kind, ref.target, ref.roots, {**ref.options, "workdir": path}), None
    d = os.path.join(ctx.default_sandbox_dir, spec.get("agent") or "default")
    return SandboxRef("local"), d


def run_turn(ctx: Context, spec: dict, *, on_activity: Callable[[dict], None] | None = None) -> dict:
    """spec: job, target, message, agent?, sandbox? (URI)."""
    r = ctx.redis
    job_id = spec["job"]
    job = receipts.get_job(r, job_id) or {}
    if job.get("state") in DONE_STATES:
        return {"job": job_id, "state": job["state"], "skipped": True}

    def publish(ev: dict) -> None:
        events.publish(r, job_id, ev, maxlen=ctx.events_maxlen)
        if on_activity is not None:
            on_activity(ev)

    def finish(state: str, **ev) -> dict:
        receipts.set_job(r, job_id, state=state, **{k: v for k, v in ev.items() if k == "reason"})
        publish({"kind": "status", "status": "completed" if state == "replied" else state, **ev})
        return {"job": job_id, "state": state, **ev}

    receipts.set_job(r, job_id, state="running")
    publish({"kind": "status", "status": "started"})
    name = spec.get("agent") or "demo"
    agent = ctx.agent(name)
    if agent is None and name in BUILTIN_AGENTS:
        command, env, timeout_s = BUILTIN_AGENTS[name], {}, 900.0
    elif agent is None:
        return _fail(ctx, spec, finish, f"unknown agent {name!r}")
    else:
        command, env, timeout_s = list(agent.command), dict(agent.env), float(agent.timeout_s)

    try:
        ref, workdir = _sandbox_for(ctx, spec, agent)
    except ConfigError as exc:
        return _fail(ctx, spec, finish, exc.reason)
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    publish({"kind": "status", "status": "thinking"})
    env = {**env, "COURIER_TURN_ID": job_id, "COURIER_TARGET": spec["target"],
           "PYTHONPATH": os.pathsep.join(p for p in [_project_root(), os.environ.get("PYTHONPATH", "")] if p)}
    result = run_bridge(command, spec.get("message", ""), cwd=workdir or (agent.cwd if agent else None), env=env,
                        timeout_s=timeout_s, on_event=publish)
    if result.status == "error":
        return _fail(ctx, spec, finish, result.reason)
    if result.status == "no_reply":
        return finish("no_reply")

    from tasks.reply import parse_reply

    parsed = parse_reply(result.reply)
    files = []
    home = os.path.expanduser("~") if ref.kind == "local" else None
    for path in parsed.media:
        if path.startswith("~/") and home:
            path = os.path.join(home, path[2:])
        files.append(chains.SandboxFile(ref=ref, path=path))
    plan = chains.Plan(job_id=job_id, target=spec["target"], text=parsed.text or None, files=files,
                       voice=parsed.audio_as_voice, as_document=parsed.as_document,
                       max_bytes=ctx.max_file_bytes)
    try:
        ids = chains.enqueue(r, plan)
    except CourierError as exc:
        return _fail(ctx, spec, finish, exc.reason)
    for d in ids:
        publish({"kind": "delivery", "delivery_id": d, "state": "queued"})
    return finish("replied", deliveries=len(ids))


def _fail(ctx: Context, spec: dict, finish, reason: str) -> dict:
    """One clean error event, and a short message to the chat."""
    out = finish("error", reason=reason)
    plan = chains.Plan(job_id=spec["job"], target=spec["target"],
                       text=f"Sorry, that did not work ({reason[:200]}).")
    try:
        chains.enqueue(ctx.redis, plan)
    except CourierError:
        pass
    return out


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
