"""The bridge runtime against real agent subprocesses (small python scripts
written to tmp), one table row per behaviour of the protocol."""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from adapters.agents import bridge
from adapters.agents.bridge import activity_for, normalise_activity, run_bridge
from tests.fixtures.services import wait_until

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent("""\
    import json, os, sys, time
    def ev(**kw):
        print("AX_GATEWAY_EVENT " + json.dumps(kw), flush=True)
    """)


def run_script(tmp_path, body: str, *, message: str = "hello", **kw) -> tuple[bridge.BridgeResult, list[dict]]:
    script = tmp_path / "agent.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    events: list[dict] = []
    res = run_bridge([sys.executable, str(script)], message, cwd=str(tmp_path), on_event=events.append, **kw)
    return res, events


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@dataclass
class Case:
    id: str
    script: str
    status: str
    reply: str | None = None
    reason: str | None = None
    events: list[dict] | None = None
    check: Callable[..., None] | None = None
    kw: dict = field(default_factory=dict)


def _strip(evs: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "duration_ms"} for e in evs]


def _check_terminal_never_forwarded(res, evs, tmp_path, caplog) -> None:
    assert all(e["kind"] != "status" or e["status"] in ("thinking", "processing") for e in evs), evs


def _check_malformed(res, evs, tmp_path, caplog) -> None:
    dropped = [r for r in caplog.records if "dropped an agent event" in r.getMessage()]
    assert len(dropped) == res.extra["dropped_events"] == 6
    assert "AX_GATEWAY" not in res.reply and "{bad" not in res.reply


def _check_non_dict(res, evs, tmp_path, caplog) -> None:
    assert res.extra["dropped_events"] == 4 and "AX_GATEWAY" not in res.reply


def _check_crash(res, evs, tmp_path, caplog) -> None:
    assert "Traceback" in res.stderr_tail and "boom" in res.stderr_tail
    assert "Traceback" not in res.reason and res.reply == ""


def _check_exit_stderr(res, evs, tmp_path, caplog) -> None:
    assert "db password rejected" in res.stderr_tail
    assert "password" not in res.reason and "password" not in res.reply


def _check_huge(res, evs, tmp_path, caplog) -> None:
    assert res.reply.startswith("start\n")
    assert len(res.reply) <= bridge.MAX_REPLY_CHARS + 100
    assert res.extra["reply_cut_chars"] >= 3_000_000 - bridge.MAX_REPLY_CHARS
    assert "reply cut at" in res.reply
    # the giant event line after the cut was dropped, the last event still arrived
    assert evs[-1]["activity"] == "after the flood"


def _check_stray(res, evs, tmp_path, caplog) -> None:
    pid = int((tmp_path / "stray.pid").read_text())
    wait_until(lambda: not pid_alive(pid), timeout_s=10, what="the stray child to be killed")
    # the guard (a subreaper) kills it as soon as the agent exits: no drain grace spent waiting on the pipes
    assert res.extra["duration_s"] < bridge.DRAIN_GRACE_S


def _check_stdin(res, evs, tmp_path, caplog) -> None:
    assert res.reply == "stdin=ünïcode message\nenv=ünïcode message"


UNICODE = "héllo wörld — 你好，世界 🚀🎉 ✓"

CASES = [
    Case("every-event-kind", """
        ev(kind="status", status="started")
        ev(kind="status", status="thinking", message="planning")
        ev(type="status", status="processing", activity="  crunching\\n numbers  ")
        ev(kind="tool_start", tool_name="terminal", tool_call_id="t1", args={"command": "pytest -q\\nexit"})
        ev(kind="tool_result", tool_name="terminal", tool_call_id="t1", status="tool_complete")
        ev(type="tool_start", tool_name="read_file", args={"path": "README.md"})
        ev(kind="tool_start", tool_name="read_file", arguments='{"path": "b.txt"}')
        ev(kind="tool_result", tool_name="read_file")
        ev(kind="tool_result", tool_name="read_file", status="error", error="ENOENT")
        ev(kind="tool_start", tool_name="grep", activity="x" * 200)
        ev(kind="tool_result", tool_call_id="ghost")
        ev(kind="status", status="completed")
        print("done")
        """, "completed", reply="done", events=[
            {"kind": "status", "status": "processing"},
            {"kind": "status", "status": "thinking", "message": "planning"},
            {"kind": "status", "status": "processing", "activity": "crunching numbers"},
            {"kind": "tool_start", "tool_name": "terminal", "tool_call_id": "t1", "activity": "$ pytest -q",
             "status": "tool_call"},
            {"kind": "tool_result", "tool_name": "terminal", "tool_call_id": "t1", "status": "tool_complete",
             "activity": "$ pytest -q"},
            {"kind": "tool_start", "tool_name": "read_file", "tool_call_id": "auto_1", "activity": "reading README.md",
             "status": "tool_call"},
            {"kind": "tool_start", "tool_name": "read_file", "tool_call_id": "auto_2", "activity": "reading b.txt",
             "status": "tool_call"},
            # a result without an id closes the last open call of its tool
            {"kind": "tool_result", "tool_name": "read_file", "tool_call_id": "auto_2", "status": "tool_complete",
             "activity": "reading b.txt"},
            {"kind": "tool_result", "tool_name": "read_file", "tool_call_id": "auto_1", "status": "error",
             "activity": "reading README.md", "error": "ENOENT"},
            {"kind": "tool_start", "tool_name": "grep", "tool_call_id": "auto_3", "activity": "x" * 79 + "…",
             "status": "tool_call"},
            {"kind": "tool_result", "tool_name": "tool", "tool_call_id": "ghost", "status": "tool_complete"},
        ], check=_check_terminal_never_forwarded),
    Case("interleaved-chatter", """
        print("first line of the answer")
        ev(kind="status", status="thinking", message="this is chatter, not the reply")
        print("  indented second line")
        ev(kind="tool_start", tool_name="write_file", tool_call_id="w", args={"path": "/tmp/x.png"})
        print("MEDIA:/tmp/x.png")
        ev(kind="tool_result", tool_name="write_file", tool_call_id="w")
        sys.stdout.write("no newline at the end")
        """, "completed", reply="first line of the answer\n  indented second line\nMEDIA:/tmp/x.png\n"
                               "no newline at the end",
         events=[{"kind": "status", "status": "thinking", "message": "this is chatter, not the reply"},
                 {"kind": "tool_start", "tool_name": "write_file", "tool_call_id": "w",
                  "activity": "writing /tmp/x.png", "status": "tool_call"},
                 {"kind": "tool_result", "tool_name": "write_file", "tool_call_id": "w",
                  "status": "tool_complete", "activity": "writing /tmp/x.png"}]),
    Case("malformed-json", """
        print("AX_GATEWAY_EVENT {bad json", flush=True)
        print("AX_GATEWAY_EVENT", flush=True)
        print("AX_GATEWAY_EVENTX {}", flush=True)
        ev(kind="telepathy")
        ev(kind="status", status="dancing")
        ev(foo=1)
        print("the reply")
        """, "completed", reply="the reply", events=[], check=_check_malformed),
    Case("non-dict-event", """
        for raw in ("[1, 2]", '"a string"', "42", "null"):
            print("AX_GATEWAY_EVENT " + raw, flush=True)
        ev(kind="status", status="thinking")
        print("ok")
        """, "completed", reply="ok", events=[{"kind": "status", "status": "thinking"}], check=_check_non_dict),
    Case("crash", """
        print("half a reply")
        ev(kind="tool_start", tool_name="terminal", args={"command": "make"})
        raise RuntimeError("boom")
        """, "error", reason="agent exited with code 1", check=_check_crash),
    Case("exit-code-with-stderr", """
        print("partial answer")
        sys.stderr.write("fatal: db password rejected\\n")
        sys.exit(3)
        """, "error", reason="agent exited with code 3", events=[], check=_check_exit_stderr),
    Case("killed-by-signal", """
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
        """, "error", reason="agent was killed by signal SIGKILL"),
    Case("agent-reports-error", """
        print("this text never reaches the chat")
        ev(kind="status", status="error", reason="quota exceeded")
        ev(kind="status", status="completed")
        """, "error", reason="quota exceeded", events=[]),
    Case("no-reply", """
        print("I would rather not")
        ev(kind="status", status="declined", reason="off topic")
        """, "no_reply", reply="", reason="off topic", events=[]),
    Case("no-reply-plain", """
        ev(type="status", status="not_responding")
        """, "no_reply", reply="", reason="not_responding", events=[]),
    Case("huge-reply", """
        print("start")
        line = "y" * 999 + "\\n"
        for _ in range(2000):
            sys.stdout.write(line)
        sys.stdout.write("z" * 1_000_000 + "\\n")
        sys.stdout.write("AX_GATEWAY_EVENT " + json.dumps({"kind": "status", "status": "thinking",
                                                           "message": "q" * 200_000}) + "\\n")
        ev(kind="status", status="processing", activity="after the flood")
        """, "completed", check=_check_huge),
    Case("unicode-split-across-reads", f"""
        text = {UNICODE!r}
        data = (text + "\\n").encode()
        out = sys.stdout.buffer
        for i in range(len(data)):  # one byte per write: every character is split
            out.write(data[i:i + 1]); out.flush()
            if i % 7 == 0:
                time.sleep(0.002)
        evline = ("AX_GATEWAY_EVENT " + json.dumps({{"kind": "status", "status": "thinking",
                                                    "activity": text}}, ensure_ascii=False) + "\\n").encode()
        out.write(evline[:20]); out.flush(); time.sleep(0.02)
        out.write(evline[20:]); out.flush()
        # a 4-byte character straddling the 64 KiB read size
        out.write(b"a" * ({bridge.READ_BYTES} - 2) + "🚀 tail\\n".encode()); out.flush()
        """, "completed", events=[{"kind": "status", "status": "thinking", "activity": UNICODE}],
         check=lambda res, evs, tmp, cl: (
             None if res.reply.splitlines() == [UNICODE, "a" * (bridge.READ_BYTES - 2) + "🚀 tail"]
             else pytest.fail(f"bad reply {res.reply[:100]!r}"))),
    Case("stray-child-holds-stdout", """
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open("stray.pid", "w").write(str(p.pid))
        print("answer")
        """, "completed", reply="answer", check=_check_stray),
    Case("stdin-and-env", """
        msg = sys.stdin.read()
        print("stdin=" + msg)
        print("env=" + os.environ["COURIER_MESSAGE"])
        """, "completed", check=_check_stdin, kw={"message": "ünïcode message"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bridge_protocol(case: Case, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="adapters.agents.bridge")
    res, evs = run_script(tmp_path, case.script, **case.kw)
    assert res.status == case.status, (res, evs)
    if case.reply is not None:
        assert res.reply == case.reply
    if case.reason is not None:
        assert res.reason == case.reason
    if case.events is not None:
        assert _strip(evs) == case.events
    for e in evs:  # exactly one terminal event per turn is the caller's: none comes from here
        assert not (e["kind"] == "status" and e["status"] in bridge.TERMINAL_STATUSES)
        assert len(e.get("activity", "")) <= bridge.ACTIVITY_MAX_CHARS
        assert e["kind"] not in ("tool_start", "tool_result") or e["tool_call_id"]
    if case.status != "completed":
        assert res.reply == ""
    if case.check is not None:
        case.check(res, evs, tmp_path, caplog)


def test_timeout_kills_the_whole_process_group(tmp_path):
    """The agent and its grandchild both ignore SIGTERM: the group gets SIGKILL."""
    body = """
        import signal, subprocess
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, subprocess, sys, time\\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\\n"
            "open('grandchild.pid', 'w').write(str(g.pid))\\n"
            "time.sleep(120)\\n"])
        open("child.pid", "w").write(str(child.pid))
        ev(kind="tool_start", tool_name="terminal", args={"command": "sleep forever"})
        print("never finished", flush=True)
        time.sleep(120)
        """
    t0 = time.monotonic()
    res, evs = run_script(tmp_path, body, timeout_s=1.5)
    took = time.monotonic() - t0
    assert res.status == "error" and res.reason == "runtime_timeout" and res.reply == ""
    assert 1.4 < took < 1.5 + bridge.KILL_GRACE_S + 5
    assert [e["activity"] for e in evs] == ["$ sleep forever"]
    pids = [int((tmp_path / n).read_text()) for n in ("child.pid", "grandchild.pid")]
    for pid in pids:
        wait_until(lambda: not pid_alive(pid), timeout_s=10, what=f"process {pid} to die")


def test_a_killed_worker_takes_its_agent_and_the_agents_children_with_it(tmp_path):
    """SIGKILL the process running the bridge (a worker killed mid-turn): the
    agent, a child it started and a setsid daemon it double-forked die too
    (the guard's parent-death signal; the daemon was re-parented to the
    guard, a subreaper), so a redelivered turn never races a leftover agent."""
    import signal
    import subprocess

    agent = tmp_path / "agent.py"
    agent.write_text(PRELUDE + textwrap.dedent("""
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        if os.fork() == 0:  # and a daemon: double fork, its own session
            os.setsid()
            if os.fork() == 0:
                open("daemon.tmp", "w").write(str(os.getpid()))
                os.rename("daemon.tmp", "daemon")
                time.sleep(120)
            os._exit(0)
        os.wait()
        while not os.path.exists("daemon"):
            time.sleep(0.01)
        open("pids", "w").write(f"{os.getpid()} {child.pid} {open('daemon').read()}")
        ev(kind="status", status="thinking")
        time.sleep(120)
        """))
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys; from adapters.agents.bridge import run_bridge; "
         f"run_bridge([sys.executable, {str(agent)!r}], 'hi', cwd={str(tmp_path)!r}, timeout_s=300)"],
        cwd=str(ROOT))
    try:
        pids_file = tmp_path / "pids"
        wait_until(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 3, timeout_s=30,
                   what="the agent to start its child")
        pids = [int(x) for x in pids_file.read_text().split()]
        assert all(pid_alive(p) for p in pids)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        try:
            for pid in pids:
                wait_until(lambda: not pid_alive(pid), timeout_s=10, what=f"process {pid} to die with the worker")
        finally:
            for pid in pids:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)  # a leak under test: not left running
    finally:
        worker.kill()


def test_agent_exit_codes_and_signals_pass_through_the_guard(tmp_path):
    res, _ = run_script(tmp_path, "sys.exit(3)")
    assert res.status == "error" and res.reason == "agent exited with code 3" and res.exit_code == 3
    res, _ = run_script(tmp_path, "import signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert res.reason == "agent was killed by signal SIGSEGV"
    # the agent gets default signal dispositions, not the guard's
    res, _ = run_script(tmp_path, "import signal; print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "
                                  "signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    assert res.status == "completed" and res.reply == "True True"
    assert run_bridge(["no-such-agent-anywhere"], "hi").reason == \
        "agent could not start: no-such-agent-anywhere: not found on PATH"
    script = tmp_path / "noexec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    assert run_bridge([str(script)], "hi").reason == f"agent could not start: {script}: not executable"


def test_timeout_default_and_agent_setting():
    import inspect

    from workers.settings import AgentSpec

    assert inspect.signature(run_bridge).parameters["timeout_s"].default == 900.0
    assert AgentSpec(command=["x"]).timeout_s == 900.0
    assert AgentSpec(command=["x"], timeout_s=5).timeout_s == 5


def test_missing_command_is_a_clean_error(tmp_path):
    res = run_bridge([str(tmp_path / "no-such-agent")], "hi")
    assert res.status == "error" and res.reason.startswith("agent could not start")
    assert run_bridge([], "hi").reason == "agent has no command"


def test_failing_event_sink_does_not_kill_the_turn(tmp_path):
    script = tmp_path / "a.py"
    script.write_text(PRELUDE + 'ev(kind="status", status="thinking")\nprint("fine")\n')

    def sink(ev):
        raise RuntimeError("sink down")

    res = run_bridge([sys.executable, str(script)], "x", on_event=sink)
    assert res.status == "completed" and res.reply == "fine"


ACTIVITY_TABLE = [
    ("terminal", {"command": "pytest -q\nrm -rf build"}, "$ pytest -q"),
    ("bash", '{"cmd": ["ls", "-la", "my dir"]}', "$ ls -la 'my dir'"),
    ("shell", {"command": "\n\n  make all  \n"}, "$ make all"),
    ("read_file", {"path": "README.md"}, "reading README.md"),
    ("mcp__fs__read_file", {"file_path": "/srv/a.txt"}, "reading /srv/a.txt"),
    ("write_file", {"path": "/tmp/chart.png", "content": "..."}, "writing /tmp/chart.png"),
    ("edit_file", {"path": "src/app.py", "old": "a", "new": "b"}, "editing src/app.py"),
    ("str_replace_based_edit_tool", {"command": "view", "path": "x.py"}, "reading x.py"),
    ("search_files", {"pattern": "TODO"}, "searching TODO"),
    ("grep", {"regex": "def main"}, "searching def main"),
    ("web_search", {"query": "celery custom states"}, "web search: celery custom states"),
    ("WebSearch", {"q": "sse spec"}, "web search: sse spec"),
    ("fetch", {"url": "https://example.com/a"}, "fetching https://example.com/a"),
    ("WebFetch", {"url": "https://example.com"}, "fetching https://example.com"),
    ("calculator", {"expression": "2+2", "precise": True}, "calculator: 2+2"),
    ("calculator", {"precise": True, "n": 3}, "calculator: 3"),
    ("make_coffee", {}, "using make_coffee"),
    ("make_coffee", None, "using make_coffee"),
    ("read_file", {}, "using read_file"),
    (None, None, "using tool"),
    ("terminal", {"command": "echo " + "x" * 200}, "$ echo " + "x" * 72 + "…"),
    ("terminal", "not json at all", "$ not json at all"),
]


@pytest.mark.parametrize("tool,args,expect", ACTIVITY_TABLE)
def test_activity_for(tool, args, expect):
    got = activity_for(tool, args)
    assert got == expect
    assert len(got) <= 80


def test_normalise_activity():
    assert normalise_activity("  a\tb\n\nc\x00d ") == "a b c d"
    assert normalise_activity("é" * 100) == "é" * 79 + "…"
    assert normalise_activity(None) == ""


def test_demo_agent_speaks_the_protocol(tmp_path):
    res = run_bridge([sys.executable, "-m", "adapters.agents.demo_agent"], "make a chart of x^3",
                     cwd=str(tmp_path), env={"PYTHONPATH": str(ROOT)})
    assert res.status == "completed"
    assert f"MEDIA:{tmp_path / 'chart.png'}" in res.reply and "AX_GATEWAY" not in res.reply
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(res.extra))["dropped_events"] == 0
