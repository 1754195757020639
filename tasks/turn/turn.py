"""An agent turn: run the agent, parse its reply, hand the reply to the delivery chain.

Its event stream: started -> (thinking, the agent's tool events) -> exactly one terminal
completed | error | no_reply. An error gives the chat a short message, never a traceback.
The agent runs as a bridge command (`run_bridge`) or the built-in OpenAI-compatible loop
(`run_openai`); hooks run before each LLM call of the loop, or once before a bridge agent
starts (their context in env `COURIER_HOOK_CONTEXT`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from adapters.defaults import AGENT_TIMEOUT_S
from adapters.agents.bridge import BridgeResult, run_bridge
from adapters.agents.hooks import TurnHooks
from adapters.agents.jail import Jail, Limits, bind_paths, maybe, unavailable
from adapters.display import visible
from adapters.errors import ConfigError, CourierError, SandboxError, in_chat_words
from adapters.platforms.base import split_target
from adapters.sandboxes.base import SandboxRef, parse_uri
from storage.spill import SpillConfig
import tasks
from tasks import task_names
from tasks.dispatch import chains
from tasks.ledger import events, keys, ledger, receipts, signing
from tasks.ledger.events import Event
from tasks.messages import TurnResult, TurnSpec
from tasks.dispatch.reconcile import Stage, grace, queue_load
from tasks.runtime import AgentConfig, Context
from tasks.states import TURN_OVER, DeliveryState, JobState
from tasks.turn.reply import parse_reply
from tasks.workspaces import relative, workspace_path

log = logging.getLogger(__name__)

#: courier's root: the folder of the `tasks` package
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tasks.__file__)))
#: the bundled demo agent, always available as --agent demo (a script of the standard library only: in its
#: sandbox it sees that one file, not courier's code)
BUILTIN_AGENTS = {"demo": [sys.executable, os.path.join(_ROOT, "adapters", "agents", "demo_agent.py")]}


def _sandbox_for(ctx: Context, spec: TurnSpec, agent: AgentConfig | None) -> tuple[SandboxRef, str | None]:
    """The agent's sandbox ref and, for a local sandbox, its directory (the turn workspaces' parent)."""
    uri = spec.get("sandbox") or (agent.sandbox if agent is not None else None)
    if uri:
        ref, path = parse_uri(uri)
        if ref.kind == "local":
            return ref, path
        return SandboxRef(ref.kind, ref.target, ref.roots, {**ref.options, "workdir": path}), None
    return SandboxRef("local"), os.path.join(ctx.default_sandbox_dir, spec.get("agent") or "default")


def make_workspace(ctx: Context, ref: SandboxRef, local_dir: str | None, job_id: str,
                   extra_roots: tuple[str, ...] = ()) -> tuple[SandboxRef, str]:
    """Make the turn's workspace (`<agent dir or workdir>/turns/<job>`); returns the turn's sandbox
    ref, whose roots are that workspace plus `extra_roots` (its MEDIA paths reach nothing else)."""
    if ref.kind == "local":
        assert local_dir is not None
        ws = workspace_path(os.path.abspath(local_dir), job_id)
        os.makedirs(ws, mode=0o700, exist_ok=True)
        return SandboxRef("local", roots=(ws, *extra_roots), options=dict(ref.options)), ws
    base = ref.options.get("workdir") or "/workspace"
    ws = workspace_path(base, job_id)
    sandbox = ctx.sandbox(ref)
    make_dirs = getattr(sandbox, "make_dirs", None)
    if make_dirs is not None:
        make_dirs(ws)
    else:
        rc, _out, err = sandbox.exec(["mkdir", "-p", "--", ws], timeout_s=60)
        if rc != 0:
            raise SandboxError(f"mkdir {ws}: exit {rc}: {err.decode('utf-8', 'replace').strip()[:200]}")
    turn_ref = SandboxRef(ref.kind, ref.target, (ws, *extra_roots), {**ref.options, "workdir": ws})
    return turn_ref, ws


@dataclass(frozen=True)
class TurnOutcome:
    """How a turn ended (`run_turn`'s), before `finish` enqueues its plan and records it:
    replied (`plan`: the reply), error (`plan`: the chat's short message; `reason`),
    no_reply, cancelled (while it ran: the reply is dropped). `skipped`: over before this
    run took it, nothing recorded again."""

    job_id: str
    target: str
    state: JobState
    plan: chains.Plan | None = None
    reason: str | None = None
    skipped: bool = False


#: enqueues a plan (chains.enqueue), returning its delivery ids
Enqueue = Callable[[Redis, chains.Plan], list[str]]


def failed(job_id: str, target: str, reason: str, *, said: str | None = None) -> TurnOutcome:
    """An error outcome: its plan is a short message to the chat, never a traceback:
    `said` (courier's own failure in the chat's words, `in_chat_words`: the `reason`
    names buckets, keys, endpoints and paths, and stays in the job's record), else
    the reason (the agent's), its paths relative to the turn's workspace."""
    shown = said or visible(relative(reason, job_id))
    plan = chains.Plan(job_id=job_id, target=target, text=f"Sorry, that did not work ({shown[:200]}).")
    return TurnOutcome(job_id, target, JobState.ERROR, plan=plan, reason=reason)


def run_turn(ctx: Context, spec: TurnSpec, *, on_activity: Callable[[Event], None] | None = None) -> TurnOutcome:
    """Run the turn's agent and make its reply a plan (`finish` enqueues it): the job marked
    running, `started` and the agent's phase events published (the terminal one is `finish`'s)."""
    r = ctx.redis
    job_id, target = spec["job"], spec["target"]
    job = receipts.get_job(r, job_id) or {}
    over = job.get("state") in TURN_OVER
    if over or job.get("cancel_requested") == "1":
        ledger.clear_due(r, "turn", job_id)
        if not over:  # cancelled while a worker was taking it
            receipts.set_job(r, job_id, state=JobState.CANCELLED)
        return TurnOutcome(job_id, target, JobState(job["state"]) if over else JobState.CANCELLED, skipped=True)
    r.hincrby(keys.job(job_id), "attempts", 1)  # the reconciler gives up on a turn that kills its worker
    publish = _publisher(ctx, job_id, on_activity)
    receipts.set_job(r, job_id, state=JobState.RUNNING)
    publish({"kind": "status", "status": "started"})
    name = spec.get("agent") or "demo"
    agent = ctx.agent(name)
    if agent is None and name in BUILTIN_AGENTS:
        command, env, timeout_s = BUILTIN_AGENTS[name], {}, AGENT_TIMEOUT_S
    elif agent is None:
        return failed(job_id, target, f"unknown agent {name!r}")
    else:
        command, env, timeout_s = list(agent.command), dict(agent.env), float(agent.timeout_s)
    try:
        ref, local_dir = _sandbox_for(ctx, spec, agent)
        ref, workdir = make_workspace(ctx, ref, local_dir, job_id, tuple(agent.roots if agent is not None else ()))
    except (CourierError, OSError) as exc:
        why = exc.reason if isinstance(exc, CourierError) else exc.strerror or exc
        return failed(job_id, target, f"could not make the turn's workspace: {why}",
                      said="could not make the turn's workspace; the operator was told")
    try:
        jail = turn_jail(ctx, name, agent, command, workdir, job_id) if ref.kind == "local" else None
    except CourierError as exc:
        log.error("turn %s: %s", job_id, exc.reason)
        return failed(job_id, target, exc.reason,
                      said="this agent cannot run safely on this host; the operator was told")
    with maybe(jail):
        return _run_agent(ctx, spec, agent, name, ref, workdir, jail, command, env, timeout_s, publish)


def turn_jail(ctx: Context, name: str, agent: AgentConfig | None, command: list[str], workdir: str,
              job_id: str) -> Jail | None:
    """The turn's namespace sandbox on this host (None: the agent opted out, `"isolation": "host"`).
    ConfigError, naming the opt-in, where bwrap cannot isolate it: never unconfined by surprise."""
    if agent is not None and agent.isolation == "host":
        return None
    config = ctx.turn_tools().jail
    why = unavailable(config)
    if why:
        raise ConfigError(f"the local sandbox cannot isolate agent {name!r} here: {why}; to run it unconfined, "
                          f"as the worker's own user, set \"isolation\": \"host\" in its config")
    limits = Limits(**({k: int(getattr(agent.limits, k)) for k in
                        ("processes", "open_files", "memory_bytes", "workspace_bytes")} if agent is not None else {}))
    return Jail(config, workdir, job_id, ro_paths=(*(agent.roots if agent is not None else ()), *bind_paths(command)),
                limits=limits, extra_allowed_hosts=tuple(agent.allowed_hosts) if agent is not None else ())


def _run_agent(ctx: Context, spec: TurnSpec, agent: AgentConfig | None, name: str, ref: SandboxRef, workdir: str,
               jail: Jail | None, command: list[str], env: dict[str, str], timeout_s: float,
               publish: Callable[[Event], None]) -> TurnOutcome:
    """The agent's run in its workspace (and sandbox), to the outcome."""
    job_id, target = spec["job"], spec["target"]
    local = ref.kind == "local"
    tools = ctx.turn_tools()
    hook_ctx = {"job": job_id, "target": target, "message": spec.get("message", ""), "agent": name}
    place = spill_placer(ctx, ref, workdir, jail)
    hooks = TurnHooks(tools.hooks, place, jail, tools.tool_network) if tools.hooks else None
    try:
        attached = put_attachments(ctx, spec, ref, workdir)
    except CourierError as exc:
        return failed(job_id, target, f"could not hand the attached files to the agent: {exc.reason}",
                      said=f"could not hand the attached files to the agent: {in_chat_words(exc)}")
    if jail is not None:
        for p in attached:
            jail.own(p)
    message = spec.get("message", "")
    if attached:
        publish({"kind": "status", "status": "processing",
                 "message": f"received {len(attached)} file{'s' if len(attached) != 1 else ''}"})
        message += "\n\n[attached files: " + ", ".join(attached) + "]"
        env = {**env, "COURIER_ATTACHMENTS": json.dumps(attached)}
    publish({"kind": "status", "status": "thinking"})
    if agent is not None and agent.runtime == "openai":
        result = _run_openai(ctx, job_id, message, agent, ref, workdir, hooks, hook_ctx, timeout_s, publish, place,
                             jail)
    else:
        # the agent's environment is an allowlist (run_bridge): basics, its env_passthrough, its config's env
        turn_env = {"COURIER_TURN_ID": job_id, "COURIER_TARGET": target, "COURIER_WORKSPACE": workdir}
        if jail is None:  # unconfined, it may import courier's own helpers (a sandbox does not see them)
            turn_env["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH", "")] if p)
        home = {"HOME": workdir} if local else {}  # ~ is the workspace, as for its MEDIA paths
        env = {**home, **env, **turn_env}
        hook_text = hooks.context_for({**hook_ctx, "step": 0}) if hooks else ""
        if hook_text:
            env["COURIER_HOOK_CONTEXT"] = hook_text
        no_network = agent is not None and agent.network == "none"  # else through the proxy
        result = run_bridge(command, message, cwd=workdir if local else (agent.cwd if agent else None),
                            env=env, timeout_s=timeout_s, on_event=publish,
                            passthrough=tuple(agent.env_passthrough if agent is not None else ()),
                            jail=jail, network="none" if no_network else "proxy",
                            shown=lambda text: relative(text, job_id))
    if result.status == "error":
        return failed(job_id, target, result.reason)
    if result.status == "no_reply":
        return TurnOutcome(job_id, target, JobState.NO_REPLY, reason=result.reason or None)

    parsed = parse_reply(result.reply)
    paths: dict[str, str] = {}  # `./x` and `x` name one file: it goes once, where first named
    for path in parsed.media:
        if path.startswith("~/") and local:  # a local agent's home is its workspace
            path = posixpath.join(workdir, path[2:])
        paths.setdefault(_same_file(path), path)
    stored = result.extra.get("stored") or {}  # screenshots of the OpenAI runtime: already in storage
    files: list[chains.StoredFile | chains.SandboxFile] = [
        chains.StoredFile(**stored[p]) if p in stored else chains.SandboxFile(ref=ref, path=p) for p in paths.values()]
    try:  # photos one album holds on the target's platform (0: none, or not configured)
        album_max = ctx.platform(split_target(target)[0]).limits.album_max
    except CourierError:
        album_max = 0
    plan = chains.Plan(job_id=job_id, target=target, text=parsed.text or None, files=files,
                       voice=parsed.audio_as_voice, as_document=parsed.as_document,
                       max_bytes=ctx.max_file_bytes, album_max=album_max,
                       max_files=ctx.max_files_per_job, tell_unsent=True)
    if receipts.cancel_requested(ctx.redis, job_id):  # `courier cancel` while it ran: its reply is not delivered
        return TurnOutcome(job_id, target, JobState.CANCELLED, reason=receipts.CANCEL_REASON)
    return TurnOutcome(job_id, target, JobState.REPLIED, plan=plan)


def _same_file(path: str) -> str:
    """A MEDIA path as duplicates compare: `.` parts and repeated slashes dropped; `..` kept
    (what it names depends on links: such a path is never taken for another and left out)."""
    head = "/" if path.startswith("/") else ""
    return head + "/".join(p for p in path.split("/") if p not in ("", "."))


def finish(ctx: Context, outcome: TurnOutcome, enqueue: Enqueue, *,
           on_activity: Callable[[Event], None] | None = None) -> TurnResult:
    """Enqueue the outcome's plan (`chains.enqueue` in a worker) and record how the turn
    ended: the job's state, its `delivery queued` events, then exactly one terminal status
    event counting the deliveries readers wait for. A reply that cannot be enqueued ends
    the turn as an error (with the chat's short message, if that goes)."""
    r = ctx.redis
    job_id = outcome.job_id
    if outcome.skipped:  # run_turn left it as it was
        return {"job": job_id, "state": outcome.state, "skipped": True}
    publish = _publisher(ctx, job_id, on_activity)
    ids: list[str] = []
    if outcome.state == JobState.REPLIED and outcome.plan is not None:
        try:
            ids = enqueue(r, outcome.plan)
        except CourierError as exc:
            outcome = failed(job_id, outcome.target, exc.reason,
                             said=f"the reply could not be sent: {in_chat_words(exc)}")
    if outcome.state == JobState.ERROR and outcome.plan is not None:
        with contextlib.suppress(CourierError):
            ids = enqueue(r, outcome.plan)
    for d in ids:
        publish({"kind": "delivery", "delivery_id": d, "state": DeliveryState.QUEUED})
    state = outcome.state
    reason = {"reason": outcome.reason} if outcome.reason else {}
    receipts.set_job(r, job_id, state=state, **reason)
    ledger.clear_due(r, "turn", job_id)
    # `deliveries`: readers wait for this many deliveries' final states
    publish({"kind": "status", "status": "completed" if state == JobState.REPLIED else state, **reason,
             "deliveries": len(ids)})
    out: TurnResult = {"job": job_id, "state": state, "deliveries": len(ids)}
    if outcome.reason:
        out["reason"] = outcome.reason
    return out


def _publisher(ctx: Context, job_id: str, on_activity: Callable[[Event], None] | None) -> Callable[[Event], None]:
    """Publishes a turn's event on its stream, as shown (the chat's progress message shows it too)."""

    def publish(ev: Event) -> None:
        ev = events.shown(ev, job_id)
        events.publish(ctx.redis, job_id, ev, maxlen=ctx.events_maxlen)
        if on_activity is not None:
            on_activity(ev)

    return publish


def spill_placer(ctx: Context, ref: SandboxRef, workdir: str, jail: Jail | None = None) -> Callable[[str], str]:
    """`place` for the turn's spills: the blob is copied once (by the sandbox's `put`) into
    `<workspace>/.courier/spills/<name>`, the path the preview names for the agent to read."""
    placed: dict[str, str] = {}

    def place(key: str) -> str:
        if key not in placed:
            dest = posixpath.join(workdir, ".courier", "spills", posixpath.basename(key))
            placed[key] = ctx.sandbox(ref).put(ctx.store, key, dest, max_bytes=ctx.max_file_bytes * 4)
            if jail is not None:
                jail.own(placed[key])
        return placed[key]

    return place


def put_attachments(ctx: Context, spec: TurnSpec, ref: SandboxRef, workdir: str) -> list[str]:
    """Inbound files (a chat user's, `courier turn --attach`): storage -> `<workspace>/inbox/`,
    with the sandbox's path checks; two of one name keep both (`a.pdf`, `a-2.pdf`).
    Returns the sandbox paths, in order."""
    items = spec.get("attachments") or []
    if not items:
        return []
    sandbox = ctx.sandbox(ref)
    out = []
    taken: set[str] = set()
    for item in items:
        name = posixpath.basename(item["name"]).lstrip(".") or "file"
        (stem, ext), n = posixpath.splitext(name), 1
        while name.lower() in taken:  # an earlier attachment of the turn took it: `stem-N.ext`
            n += 1
            name = f"{stem}-{n}{ext}"
        taken.add(name.lower())
        out.append(sandbox.put(ctx.store, item["key"], posixpath.join(workdir, "inbox", name),
                               max_bytes=ctx.max_file_bytes))
    return out


def _run_openai(ctx: Context, job_id: str, message: str, agent: AgentConfig, ref: SandboxRef, workdir: str,
                hooks: TurnHooks | None, hook_ctx: dict[str, Any], timeout_s: float, publish: Callable[[Event], None],
                place: Callable[[str], str], jail: Jail | None) -> BridgeResult:
    """The built-in OpenAI-compatible loop, its tools acting in the turn's sandbox."""
    from adapters.agents.openai_runtime import OpenAIConfig, run_openai
    from adapters.agents.tools import Toolbox

    turn_tools = ctx.turn_tools()
    o = turn_tools.openai
    model = agent.model or o.get("model")
    if not model:
        return BridgeResult("error", reason="no model: set COURIER_OPENAI_MODEL or the agent's model")
    key = o.get("api_key")
    config = OpenAIConfig(
        base_url=agent.base_url or o.get("base_url") or "https://api.openai.com/v1", model=model,
        api_key=key.get_secret_value() if key is not None and hasattr(key, "get_secret_value") else key,
        system_prompt=agent.system_prompt, max_steps=agent.max_steps or int(o.get("max_steps") or 20),
        call_timeout_s=float(o.get("call_timeout_s") or 120.0), timeout_s=timeout_s,
        **{k: o[k] for k in ("max_attempts", "retry_base_s", "retry_max_s") if o.get(k) is not None},
    )
    try:
        sandbox = ctx.sandbox(ref)
    except CourierError as exc:
        return BridgeResult("error", reason=exc.reason)
    tools = Toolbox(sandbox=sandbox, workdir=workdir, store=ctx.store,
                    job_id=job_id, spill=turn_tools.spill or SpillConfig(),
                    chromium_path=turn_tools.chromium_path, browser_allowed_hosts=turn_tools.browser_allowed_hosts,
                    place=place, jail=jail, tool_network=turn_tools.tool_network)
    return run_openai(config, message, tools=tools, hooks=hooks, hook_context=hook_ctx, on_event=publish,
                      shown=lambda text: relative(text, job_id))


def abandon(ctx: Context, job_id: str, reason: str, enqueue: Enqueue = chains.enqueue) -> TurnResult:
    """End a turn whose runs kept dying with their workers: the chat's short message, the error event."""
    job = receipts.get_job(ctx.redis, job_id) or {}
    try:
        spec = signing.open_json("turn", job_id, job["spec"]) if job.get("spec") else {}
    except signing.Forged as exc:  # its chat is not known for sure: the job ends, no message to anyone
        return finish(ctx, TurnOutcome(job_id, "", JobState.ERROR, reason=f"refused: {exc.reason}"), enqueue)
    return finish(ctx, failed(job_id, spec.get("target") or job.get("target", ""), reason), enqueue)


#: a turn that has started this many times and died each time (it kills its worker) is ended
TURN_MAX_RUNS = 3
#: the queue of a turn's task (its area: workers/celery_app.task_queue)
TURNS_QUEUE = task_names.AGENT_TURN.split(".")[1]


def _redrive(ctx: Context, job_id: str) -> str:
    """The reconciler's re-drive of an overdue turn: run it again (its spec from the job's record),
    end it once it has killed `TURN_MAX_RUNS` workers, or forget it when it is over."""
    r = ctx.redis
    job = receipts.get_job(r, job_id)
    if job is None or job.get("state") in TURN_OVER or not job.get("spec"):
        ledger.clear_due(r, "turn", job_id)
        return ""
    if int(job.get("attempts") or 0) >= TURN_MAX_RUNS:
        abandon(ctx, job_id, f"the agent's worker died {job['attempts']} times during this turn")
        return "abandoned"
    n = int(r.hincrby(keys.job(job_id), "redrives", 1))
    ledger.set_due(r, "turn", job_id, grace(ledger.TURN_GRACE_S, n - 1, queue_load(r, TURNS_QUEUE)[0]))
    try:
        spec = signing.open_json("turn", job_id, job["spec"])  # logged and counted when forged
    except signing.Forged as exc:
        ledger.clear_due(r, "turn", job_id)
        receipts.set_job(r, job_id, state=JobState.ERROR, reason=f"refused: {exc.reason}")
        return ""
    chains.spec_sig(spec).apply_async()
    return "turns"


#: the turn's stage, for the reconciler
STAGE = Stage("turn", _redrive, ("turns", "abandoned"))
