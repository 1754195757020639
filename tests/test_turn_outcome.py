"""An agent turn as plain code: `turn.run_turn` runs the agent and returns a
`TurnOutcome` (nothing enqueued), `turn.finish` enqueues its plan through the
callable it is handed and records the end (issue 14: the turn's logic tested
without a broker or a worker). Redis is real (the session's private
redis-server); the agents are real bridge subprocesses in a local sandbox;
the enqueue is a recorder, or `chains.register` (the ledger half of
`chains.enqueue`, without publishing Celery messages)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from adapters.errors import CourierError
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tasks.delivery import lanes
from tasks.dispatch import chains
from tasks.ledger import events, keys, receipts, signing
from tasks.ops import operations
from tasks.turn import extract, turn
from tasks.runtime import Context
from tests.fixtures.webstack import AGENT_PRELUDE
from tests.test_delivery_flow import MemoryPlatform
from workers.settings import AgentSpec

pytestmark = pytest.mark.timeout(60)

AGENTS = {
    # a text reply naming two files of its workspace (one by `~/`, its home)
    "files": """
        ev(kind="status", status="thinking", activity="planning")
        open("chart.png", "wb").write(b"png")
        open("notes.txt", "w").write("notes")
        print("here you go")
        print("MEDIA:" + os.path.join(os.getcwd(), "chart.png"))
        print("MEDIA:~/notes.txt")
        """,
    "crash": """
        ev(kind="tool_start", tool_name="terminal", args={"command": "make"})
        sys.exit(2)
        """,
    "quiet": """
        ev(kind="status", status="declined", reason="not for me")
        """,
    # the worker host's absolute paths in its events and in a MEDIA tag of a file it never made
    "paths": """
        ws = os.getcwd()
        os.makedirs("out", exist_ok=True)
        ev(kind="tool_start", tool_name="write_file", tool_call_id="c1", activity="writing " + ws + "/out/report.csv")
        ev(kind="tool_result", tool_name="write_file", tool_call_id="c1", status="error",
           error="cannot write " + os.path.join(ws, "out") + ": busy")
        ev(kind="status", status="thinking", message="in " + ws)
        print("done")
        print("MEDIA:" + ws + "/out/missing.png")
        """,
    # what the turn handed it: its message and the attachments' paths
    "inbox": """
        print("got: " + msg.replace(chr(10), " | ") + " env=" + os.environ.get("COURIER_ATTACHMENTS", ""))
        """,
}


class Recorder:
    """An enqueue that records the plans it is given: `fail` raises for the first ones."""

    def __init__(self, *, fail: int = 0) -> None:
        self.plans: list[chains.Plan] = []
        self.fail = fail

    def __call__(self, r, plan: chains.Plan) -> list[str]:
        self.plans.append(plan)
        if len(self.plans) <= self.fail:
            raise CourierError("the ledger is away")
        return [chains.delivery_id(plan.job_id, i) for i in range(len(chains.entries(plan)))]


@pytest.fixture
def turns(redis_client, tmp_path):
    scripts = tmp_path / "agents"
    scripts.mkdir()
    specs = {}
    for name, body in AGENTS.items():
        p = scripts / f"{name}.py"
        p.write_text(AGENT_PRELUDE + textwrap.dedent(body))
        specs[name] = AgentSpec(command=[sys.executable, str(p)], timeout_s=30)
    platform = MemoryPlatform()
    ctx = Context(redis=redis_client, store=VolumeStore(tmp_path / "store"), platform=lambda name: platform,
                  sandbox=lambda ref: LocalSandbox.with_roots(tuple(ref.roots)), agent=specs.get,
                  default_sandbox_dir=str(tmp_path / "sandbox"))

    class Turns:
        def __init__(self) -> None:
            self.ctx, self.r, self.seen = ctx, redis_client, []

        def new(self, agent: str, message: str = "hi", **extra) -> dict:
            job = chains.new_job_id("turn")
            spec = chains.turn_spec(job, "memory:chat", message, agent=agent)
            spec.update(extra)  # type: ignore[typeddict-item]
            receipts.create_job(redis_client, job, kind="turn", target="memory:chat", agent=agent)
            return spec

        def run(self, spec: dict, on_activity=None) -> turn.TurnOutcome:
            return turn.run_turn(ctx, spec, on_activity=on_activity or self.seen.append)  # type: ignore[arg-type]

        def events(self, job: str) -> list[dict]:
            return [ev for _, ev in events.read_range(redis_client, job)]

    return Turns()


def test_a_reply_is_an_outcome_with_its_plan_and_nothing_enqueued(turns):
    spec = turns.new("files")
    out = turns.run(spec)
    assert out.state == "replied" and out.reason is None and not out.skipped
    plan = out.plan
    assert plan is not None and plan.job_id == spec["job"] and plan.target == "memory:chat"
    assert plan.text == "here you go"
    ws = turn.workspace_path(os.path.join(turns.ctx.default_sandbox_dir, "files"), spec["job"])
    assert [(f.path, f.ref.roots) for f in plan.files] == [(f"{ws}/chart.png", (ws,)), (f"{ws}/notes.txt", (ws,))]
    # the ledger has nothing of the reply yet, and no terminal event was published
    assert receipts.job_deliveries(turns.r, spec["job"]) == [] and not turns.r.exists(keys.lane("memory:chat"))
    assert receipts.get_job(turns.r, spec["job"])["state"] == "running"
    # the turn's own phases, then the agent's
    assert [(ev.get("status"), ev.get("activity")) for ev in turns.events(spec["job"])] == [
        ("started", None), ("thinking", None), ("thinking", "planning")]
    assert [ev.get("activity") for ev in turns.seen] == [None, None, "planning"]  # the task's activity glue sees them
    assert not any(events.is_terminal(ev) for ev in turns.events(spec["job"]))


def test_finish_enqueues_the_plan_then_records_one_terminal_event(turns):
    spec = turns.new("files")
    out = turns.run(spec)
    enqueue = Recorder()
    res = turn.finish(turns.ctx, out, enqueue, on_activity=turns.seen.append)
    assert enqueue.plans == [out.plan]
    assert res == {"job": spec["job"], "state": "replied", "deliveries": 3}
    evs = turns.events(spec["job"])
    assert [(e["kind"], e.get("delivery_id") or e.get("status")) for e in evs[-4:]] == [
        ("delivery", f"{spec['job']}.0"), ("delivery", f"{spec['job']}.1"), ("delivery", f"{spec['job']}.2"),
        ("status", "completed")]
    assert evs[-1]["deliveries"] == 3
    assert turns.seen[-1] == {k: v for k, v in evs[-1].items() if k != "ts"}  # the activity glue saw the end
    assert receipts.get_job(turns.r, spec["job"])["state"] == "replied"
    assert turns.r.zscore(keys.due("turn"), spec["job"]) is None


def test_finish_through_the_ledger_registers_each_delivery(turns):
    spec = turns.new("files")
    res = turn.finish(turns.ctx, turns.run(spec), lambda r, plan: [e.did for e in chains.register(r, plan)])
    assert res["deliveries"] == 3
    recs = receipts.job_deliveries(turns.r, spec["job"])
    assert [(rec["type"], rec.get("name")) for rec in recs] == [("text", None), ("file", "chart.png"),
                                                                 ("file", "notes.txt")]
    assert all(rec["state"] == "queued" for rec in recs)


def test_an_agent_that_fails_is_an_error_with_a_short_message_for_the_chat(turns):
    spec = turns.new("crash")
    out = turns.run(spec)
    assert out.state == "error" and "exit" in (out.reason or "") and "2" in (out.reason or "")
    assert out.plan is not None and out.plan.files == []
    assert out.plan.text == f"Sorry, that did not work ({out.reason})."
    res = turn.finish(turns.ctx, out, Recorder())
    assert res == {"job": spec["job"], "state": "error", "deliveries": 1, "reason": out.reason}
    last = turns.events(spec["job"])[-1]
    assert last["status"] == "error" and last["reason"] == out.reason and last["deliveries"] == 1
    assert receipts.get_job(turns.r, spec["job"])["reason"] == out.reason


def test_an_unknown_agent_fails_before_anything_runs(turns):
    spec = turns.new("nobody")
    out = turns.run(spec)
    assert out.state == "error" and out.reason == "unknown agent 'nobody'"
    assert not os.path.exists(turns.ctx.default_sandbox_dir)  # no workspace was made


def test_no_reply_enqueues_nothing(turns):
    spec = turns.new("quiet")
    out = turns.run(spec)
    assert out.state == "no_reply" and out.plan is None
    enqueue = Recorder()
    res = turn.finish(turns.ctx, out, enqueue)
    assert enqueue.plans == [] and res["state"] == "no_reply" and res["deliveries"] == 0
    last = turns.events(spec["job"])[-1]
    assert last["status"] == "no_reply" and last["deliveries"] == 0


def test_a_reply_that_cannot_be_enqueued_ends_as_an_error_with_the_chats_message(turns):
    spec = turns.new("files")
    out = turns.run(spec)
    enqueue = Recorder(fail=1)
    res = turn.finish(turns.ctx, out, enqueue)
    # the chat is told in its words; the reason (courier's detail) is the job's record's
    assert [p.text for p in enqueue.plans] == [
        "here you go", "Sorry, that did not work (the reply could not be sent: something went wrong on courier's "
                       "side; the operator was told)."]
    assert res == {"job": spec["job"], "state": "error", "deliveries": 1, "reason": "the ledger is away"}
    assert receipts.get_job(turns.r, spec["job"])["state"] == "error"


def test_when_even_the_error_message_cannot_be_enqueued_the_turn_still_ends(turns):
    spec = turns.new("crash")
    res = turn.finish(turns.ctx, turns.run(spec), Recorder(fail=1))
    assert res["state"] == "error" and res["deliveries"] == 0
    assert turns.events(spec["job"])[-1]["deliveries"] == 0


def test_a_turn_cancelled_while_it_runs_delivers_nothing(turns):
    spec = turns.new("files")

    def cancel_on_thinking(ev: dict) -> None:
        if ev.get("status") == "thinking":
            assert operations.mark_turn(turns.r, spec["job"]) == "running"

    out = turns.run(spec, on_activity=cancel_on_thinking)
    assert out.state == "cancelled" and out.plan is None and out.reason == receipts.CANCEL_REASON
    enqueue = Recorder()
    assert turn.finish(turns.ctx, out, enqueue)["state"] == "cancelled" and enqueue.plans == []
    assert turns.events(spec["job"])[-1]["status"] == "cancelled"


def test_a_turn_over_already_is_skipped_and_left_alone(turns):
    spec = turns.new("files")
    receipts.set_job(turns.r, spec["job"], state="replied")
    before = turns.events(spec["job"])
    out = turns.run(spec)
    assert out.skipped and out.state == "replied" and out.plan is None
    assert turn.finish(turns.ctx, out, Recorder()) == {"job": spec["job"], "state": "replied", "skipped": True}
    assert turns.events(spec["job"]) == before  # nothing published
    assert "attempts" not in receipts.get_job(turns.r, spec["job"])


def test_attachments_reach_the_agent_in_its_inbox(turns, tmp_path):
    spec = turns.new("inbox", "read these")
    key = chains.storage_key(spec["job"], 0, "a.pdf", prefix="inbound/")
    turns.ctx.store.put_bytes(key, b"%PDF")
    spec["attachments"] = [{"key": key, "name": "a.pdf"}, {"key": key, "name": "a.pdf"}]
    out = turns.run(spec)
    ws = turn.workspace_path(os.path.join(turns.ctx.default_sandbox_dir, "inbox"), spec["job"])
    assert out.state == "replied" and out.plan is not None
    assert out.plan.text is not None and out.plan.text.startswith("got: read these |  | [attached files: ")
    assert f"{ws}/inbox/a.pdf, {ws}/inbox/a-2.pdf" in out.plan.text
    assert open(f"{ws}/inbox/a-2.pdf", "rb").read() == b"%PDF"
    assert [ev.get("message") for ev in turns.events(spec["job"]) if ev.get("status") == "processing"] == [
        "received 2 files"]


def test_abandon_ends_a_turn_with_the_chats_message(turns):
    spec = turns.new("files")
    receipts.set_job(turns.r, spec["job"], spec=signing.seal_json("turn", spec["job"], spec))
    enqueue = Recorder()
    res = turn.abandon(turns.ctx, spec["job"], "the agent's worker died 3 times", enqueue)
    assert res["state"] == "error" and res["deliveries"] == 1
    assert enqueue.plans[0].target == "memory:chat" and "worker died" in (enqueue.plans[0].text or "")
    assert turns.events(spec["job"])[-1]["status"] == "error"


def test_a_turns_events_show_workspace_relative_paths_never_the_hosts(turns):
    # what the turn page (and `courier watch`, the chat's progress message) shows: the turn's events
    spec = turns.new("paths")
    out = turns.run(spec)
    ws = turn.workspace_path(os.path.join(turns.ctx.default_sandbox_dir, "paths"), spec["job"])
    (did,) = turn.finish(turns.ctx, out, lambda r, plan: [e.did for e in chains.register(r, plan)]) and \
        [d["id"] for d in receipts.job_deliveries(turns.r, spec["job"]) if d.get("type") == "file"]
    assert extract.run(turns.ctx, did)["state"] == "failed"  # the file it named does not exist
    lanes.drive(turns.ctx, "memory:chat", lambda t, countdown=None: None)
    evs = turns.events(spec["job"])
    shown = [events.describe(ev) for ev in evs]
    assert "writing out/report.csv" in shown, shown
    assert "writing out/report.csv (error: cannot write out: busy)" in shown and "in ." in shown, shown
    (failed,) = [ev for ev in evs if ev.get("kind") == "delivery" and ev.get("state") == "failed"]
    assert "out/missing.png" in failed["reason"] and failed["name"] == "missing.png", failed
    for ev in evs:
        assert ws not in json.dumps(ev) and turns.ctx.default_sandbox_dir not in json.dumps(ev), ev
    # the receipt keeps the detail
    assert f"{ws}/out/missing.png" in (receipts.get_delivery(turns.r, did) or {})["reason"]
