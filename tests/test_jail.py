"""The agents' namespace sandbox (adapters/agents/jail.py) with real bubblewrap:
what a command inside sees and reaches, its limits and the words a turn
ends with when one is hit, the hooks' and the terminal tool's sandbox, and
the refusal, naming the opt-in, where bwrap cannot isolate."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from adapters.agents.bridge import run_bridge
from adapters.agents.jail import Jail, JailConfig, Limits, unavailable
from tests.fixtures.services import need

PY = sys.executable


@pytest.fixture(scope="module", autouse=True)
def bwrap_here():
    why = unavailable(JailConfig())
    need(why is None, f"bubblewrap cannot isolate here: {why}")


def _run(jail: Jail, code: str, *, network: str = "none", env: dict | None = None) -> subprocess.CompletedProcess:
    argv = jail.argv([PY, "-c", code], {"PATH": "/usr/bin:/bin", **(env or {})}, network=network)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_a_command_runs_as_its_own_uid_in_its_own_namespaces(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "outside.txt").write_text("not for the agent")
    os.environ["COURIER_TEST_WORKER_SECRET"] = "worker-secret-value"
    try:
        with Jail(JailConfig(), str(ws), "turn_ns") as jail:
            res = _run(jail, f"""
import json, os, socket
out = {{"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
       "env": dict(os.environ), "outside": os.path.exists({str(tmp_path / 'outside.txt')!r}),
       "home": os.path.exists('/root/.ssh'), "cwd": os.getcwd()}}
try:
    socket.create_connection(('127.0.0.1', 6379), timeout=2); out['redis'] = 'reached'
except OSError as e:
    out['redis'] = str(e)
open('made.txt', 'w').write('x')
try:
    open('/usr/evil', 'w')
except OSError as e:
    out['usr'] = e.strerror
print(json.dumps(out))
""")
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout)
            uid = jail.uid
    finally:
        del os.environ["COURIER_TEST_WORKER_SECRET"]
    assert got["uid"] != os.getuid() and (os.geteuid() != 0 or got["uid"] == uid)
    assert max(got["pids"]) < 10  # its own PID namespace: a handful of its own processes
    assert "COURIER_TEST_WORKER_SECRET" not in got["env"] and got["env"]["HOME"] == str(ws)
    assert not got["outside"] and not got["home"] and got["cwd"] == str(ws)
    assert "refused" in got["redis"].lower() or "unreachable" in got["redis"].lower()
    assert got["usr"] == "Read-only file system"
    assert (ws / "made.txt").stat().st_uid == (uid if os.geteuid() == 0 else os.getuid())


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = b"hello from the model API"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_network_proxy_reaches_only_what_the_egress_allowlist_allows(tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    ws = tmp_path / "ws"
    ws.mkdir()
    code = """
import sys, urllib.request
for port in sys.argv[1:]:
    try:
        print(port, urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=10).read().decode())
    except Exception as e:
        print(port, 'refused', getattr(e, 'code', e))
"""
    try:
        allowed = f"127.0.0.1:{srv.server_address[1]}"
        with Jail(JailConfig(allowed_hosts=(allowed,)), str(ws), "turn_net") as jail:
            argv = jail.argv([PY, "-c", code, str(srv.server_address[1]), str(other.server_address[1])],
                             {"PATH": "/usr/bin:/bin"}, network="proxy")
            res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            refusals = jail.refusals
            none = subprocess.run(jail.argv([PY, "-c", code, str(srv.server_address[1])], {"PATH": "/usr/bin"},
                                            network="none"), capture_output=True, text=True, timeout=120)
    finally:
        srv.shutdown()
        other.shutdown()
    lines = res.stdout.splitlines()
    assert lines[0].endswith("hello from the model API"), res.stdout + res.stderr
    assert "refused 403" in lines[1], lines
    assert [(r.port, r.status) for r in refusals] == [(other.server_address[1], 403)]
    assert "refused" in none.stdout and "hello" not in none.stdout  # network "none": no way out at all


@pytest.mark.parametrize("limit, code, words", [
    ("processes", "import os\nfor i in range(200):\n    os.fork() or __import__('time').sleep(30)",
     "limit of 20 processes"),
    ("open_files", "fs = [open('/dev/null') for i in range(500)]", "limit of 64 open files"),
    ("memory_bytes", "b = bytearray(600 * 1024 * 1024)", "ran out of memory"),
    ("workspace_bytes", "open('big', 'wb').write(b'x' * 5_000_000)", "passed the limit of 1 MiB"),
])
def test_a_limit_hit_ends_the_turn_with_words_that_name_it(tmp_path, limit, code, words):
    ws = tmp_path / "ws"
    ws.mkdir()
    limits = Limits(processes=20, open_files=64, memory_bytes=400 * 1024 * 1024, workspace_bytes=1024 * 1024)
    with Jail(JailConfig(), str(ws), f"turn_{limit}", limits=limits) as jail:
        res = run_bridge([PY, "-c", code], "go", cwd=str(ws), jail=jail, network="none", timeout_s=60)
    assert res.status == "error" and words in res.reason, (res.reason, res.stderr_tail[-500:])


def test_a_workspace_filled_file_by_file_is_cut_at_its_limit(tmp_path):
    """Many files each under the per-file cap: the workspace as a whole is measured while the agent runs."""
    ws = tmp_path / "ws"
    ws.mkdir()
    code = "import time\nfor i in range(400):\n    open(f'f{i}', 'wb').write(b'x' * 100_000)\ntime.sleep(60)"
    with Jail(JailConfig(), str(ws), "turn_ws", limits=Limits(workspace_bytes=2 * 1024 * 1024)) as jail:
        res = run_bridge([PY, "-c", code], "go", cwd=str(ws), jail=jail, network="none", timeout_s=60)
    assert res.status == "error" and res.reason == "the agent's workspace passed its limit of 2 MiB", res.reason


def test_a_hook_runs_in_the_sandbox_with_the_workspace_read_only(tmp_path):
    from adapters.agents.hooks import ShellHook

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("the turn's notes")
    hook = tmp_path / "hook.py"
    hook.write_text("""
import json, os, sys
ctx = json.load(sys.stdin)
try:
    open('written.txt', 'w'); w = 'wrote'
except OSError as e:
    w = e.strerror
print(json.dumps({"context": json.dumps({"uid": os.getuid(), "write": w, "notes": open('notes.txt').read(),
                                          "secret": os.environ.get('COURIER_TEST_HOOK_SECRET')})}))
""")
    os.environ["COURIER_TEST_HOOK_SECRET"] = "hook-secret"
    try:
        with Jail(JailConfig(), str(ws), "turn_hook") as jail:
            out = ShellHook((PY, str(hook)), "h", 30).call({"job": "turn_hook"}, jail)
    finally:
        del os.environ["COURIER_TEST_HOOK_SECRET"]
    got = json.loads(out["context"])
    assert got["uid"] != os.getuid() and got["notes"] == "the turn's notes"
    assert got["write"] == "Read-only file system" and got["secret"] is None


def test_the_terminal_tool_runs_in_the_sandbox_without_a_network(tmp_path):
    from adapters.agents.tools import Toolbox
    from adapters.sandboxes.local import LocalSandbox
    from storage.volume import VolumeStore

    ws = tmp_path / "ws"
    ws.mkdir()
    with Jail(JailConfig(), str(ws), "turn_term") as jail:
        tools = Toolbox(sandbox=LocalSandbox.with_roots((str(ws),)), workdir=str(ws),
                        store=VolumeStore(str(tmp_path / "store")), job_id="turn_term", jail=jail)
        res = tools.call("terminal", {"command": "id -u; ls /proc | grep -c '^[0-9]'; echo hi > made.txt; "
                                                 f"{PY} -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\""})
        wrote = tools.call("write_file", {"path": "given.txt", "content": "from the model"})
        again = tools.call("terminal", {"command": "cat given.txt && echo more >> given.txt && cat given.txt"})
    lines = res.text.splitlines()
    assert int(lines[0]) == jail.uid and int(lines[1]) < 10, res.text
    assert "Network is unreachable" in res.text and (ws / "made.txt").exists()
    assert wrote.ok and again.ok and again.text.startswith("from the modelfrom the modelmore"), again.text


def test_bwrap_missing_refuses_a_local_agent_naming_the_opt_in(tmp_path, redis_server):
    """Where bwrap cannot isolate, a local agent is refused (never run unconfined by surprise): the chat is
    told, the job's reason names the opt-in; an agent that opted in runs, and the worker's start says so."""
    from adapters.platforms.outbox import read_log
    from tests.fixtures.services import wait_until
    from tests.fixtures.workers import CourierEnv
    from workers.wiring import agent_sandbox_report

    agents = {"free": {"command": [PY, "-c", "print('ran unconfined')"], "isolation": "host"}}
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_SANDBOX_BWRAP="/nonexistent/bwrap",
                     COURIER_AGENTS=json.dumps(agents))
    report = agent_sandbox_report(env.settings())
    assert any("'free' runs UNCONFINED" in t for _, t in report)
    assert any("cannot isolate agents here" in t and "'demo'" in t for _, t in report)
    try:
        w = env.start_worker()
        jobs = {}
        for agent, chat in (("demo", "d"), ("free", "f")):
            res = env.cli("turn", f"outbox:{chat}", "hi", "--agent", agent, "--json")
            assert res.returncode == 0, res.stderr
            jobs[agent] = json.loads(res.stdout)["job"]
        wait_until(lambda: read_log(env.outbox, "d") and read_log(env.outbox, "f"), 60, what="both replies")
        assert "cannot run safely on this host" in read_log(env.outbox, "d")[0]["text"]
        assert read_log(env.outbox, "f")[0]["text"] == "ran unconfined"
        job = redis_server.client().hgetall(f"courier:job:{jobs['demo']}")
        assert job["state"] == "error" and '"isolation": "host"' in job["reason"], job
        assert "/nonexistent/bwrap" in job["reason"]
        log = w.courier_log.read_text()
        assert "'free' runs UNCONFINED" in log and "cannot isolate agents here" in log
    finally:
        env.stop()
