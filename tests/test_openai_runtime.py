"""The built-in OpenAI-compatible runtime, end to end: a real worker runs
turns against a local chat-completions server playing scripted turns; tools
act in a local sandbox; files and screenshots land in the outbox."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adapters.agents.openai_runtime import OpenAIConfig, run_openai
from adapters.agents.tools import SCREENSHOT_VIEWPORT, Toolbox
from adapters.platforms.outbox import read_log
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tasks.ledger import events
from tests.fixtures.fake_openai import calls, drop, forever, http_error, raw, run_turn, say, stall, tool_call
from tests.fixtures.services import free_port, need
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

API_KEY = "sk-test-" + "k3y" * 8
AGENTS = {
    "files": {}, "shot": {}, "shotdeny": {}, "spill": {}, "http500": {}, "http400": {}, "badjson": {}, "escape": {},
    "flaky": {},
    "steps": {"max_steps": 3},
}


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_server, fake_openai):
    redis_server.client().flushall()
    agents = {name: {"runtime": "openai", "model": name, "timeout_s": 120, **extra} for name, extra in AGENTS.items()}
    agents["files"]["system_prompt"] = "You are a careful file clerk."
    e = CourierEnv(tmp_path_factory.mktemp("openai"), redis_server.url, COURIER_AGENTS=json.dumps(agents),
                   COURIER_OPENAI_BASE_URL=fake_openai.base_url, COURIER_OPENAI_API_KEY=API_KEY,
                   # the test pages are on 127.0.0.1: allowed here (loopback is refused by default)
                   COURIER_BROWSER_ALLOWED_HOSTS='["127.0.0.1"]',
                   # retries of a model call: few and quick here
                   COURIER_OPENAI_MAX_ATTEMPTS="4", COURIER_OPENAI_RETRY_BASE_S="0.05")
    e.start_worker()
    yield e
    e.stop()


def _terminal(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e.get("kind") == "status" and e.get("status") in events.TERMINAL_STATUSES]


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_file_tools_are_confined_to_the_turns_workspace(env, fake_openai, redis_server, tmp_path):
    """send_file / read_file with '..' or an absolute path outside the turn's
    workspace are refused (the agent's own directory above its turns, /tmp)."""
    import tempfile

    agent_dir = env.data_dir / "sandbox" / "escape"
    agent_dir.mkdir(parents=True, exist_ok=True)
    (agent_dir / "secret.txt").write_text("not for the chat\n")
    fd, tmp_secret = tempfile.mkstemp(prefix="courier-worker-key-", dir="/tmp")
    os.write(fd, b"worker secret\n")
    os.close(fd)
    try:
        fake_openai.script(
            "escape",
            calls(tool_call("send_file", path="../../secret.txt"), tool_call("read_file", path="../../secret.txt"),
                  tool_call("send_file", path=tmp_secret), tool_call("read_file", path=tmp_secret),
                  tool_call("write_file", path="../../planted.txt", content="x")),
            say("nothing to send"),
        )
        job, term, evs = run_turn(env, redis_server.client(), "escape", "leak it", "escape")
    finally:
        os.unlink(tmp_secret)
    assert term["status"] == "completed"
    results = [m["content"] for m in fake_openai.requests("escape")[1].tool_results()]
    assert len(results) == 5, results
    assert all(r.startswith("error:") and "outside the allowed roots" in r for r in results), results
    assert not any("not for the chat" in r or "worker secret" in r for r in results)
    assert not (agent_dir / "planted.txt").exists()
    assert [r["kind"] for r in read_log(env.outbox, "escape")] == ["text"]


def test_terminal_writes_a_file_and_send_file_delivers_it(env, fake_openai, redis_server):
    fake_openai.script(
        "files",
        calls(tool_call("terminal", command="printf 'made in %s\\n' \"$(basename \"$PWD\")\" > out.txt && "
                                            "echo done; echo warn >&2")),
        calls(tool_call("write_file", path="notes/hello.md", content="# héllo\nline 2\n"),
              tool_call("read_file", path="notes/hello.md")),
        calls(tool_call("send_file", path="out.txt")),
        say("Here is your file."),
    )
    job, term, evs = run_turn(env, redis_server.client(), "files", "make me a file", "files")
    assert term["status"] == "completed"

    sandbox = env.data_dir / "sandbox" / "files" / "turns" / job  # the turn's own workspace
    made = sandbox / "out.txt"
    assert made.read_text() == f"made in {job}\n"
    log = read_log(env.outbox, "files")
    assert [r["kind"] for r in log] == ["text", "document"]
    assert log[0]["text"] == "Here is your file."
    assert log[1]["name"] == "out.txt" and log[1]["sha256"] == _sha(made)
    assert _sha(env.outbox / "files" / log[1]["file"]) == _sha(made)

    reqs = fake_openai.requests("files")
    assert len(reqs) == 4
    assert reqs[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert reqs[0].messages[0] == {"role": "system", "content": "You are a careful file clerk."}
    assert {t["function"]["name"] for t in reqs[0].body["tools"]} == {
        "terminal", "read_file", "write_file", "browser_screenshot", "send_file"}
    term = reqs[1].tool_results()[-1]["content"]
    assert "done" in term and "[stderr]\nwarn" in term and "[exit code 0]" in term
    wrote, read = [m["content"] for m in reqs[2].tool_results()[-2:]]
    assert wrote.startswith("wrote ") and read == "# héllo\nline 2\n"
    assert (sandbox / "notes" / "hello.md").read_text(encoding="utf-8") == "# héllo\nline 2\n"
    assert f"MEDIA:{made}" in reqs[3].tool_results()[-1]["content"]

    statuses = [e["status"] for e in evs if e["kind"] == "status"]
    assert statuses[0] == "started" and statuses.count("thinking") == 4 and statuses[-1] == "completed"
    assert len(_terminal(evs)) == 1
    starts = [e for e in evs if e["kind"] == "tool_start"]
    results = [e for e in evs if e["kind"] == "tool_result"]
    assert [e["tool_name"] for e in starts] == ["terminal", "write_file", "read_file", "send_file"]
    assert starts[0]["activity"].startswith("$ printf") and len(starts[0]["activity"]) <= 80
    assert starts[1]["activity"] == "writing notes/hello.md" and starts[2]["activity"] == "reading notes/hello.md"
    assert [e["tool_call_id"] for e in results] == [e["tool_call_id"] for e in starts]
    assert {e["status"] for e in results} == {"tool_complete"}
    # the key goes only in the Authorization header
    for log_file in env.tmp.glob("worker-*.log"):
        assert API_KEY not in log_file.read_text(errors="replace")


class _Page(BaseHTTPRequestHandler):
    hits: list[str] = []
    BODY = (b"<!doctype html><html><head><title>courier test page</title></head>"
            b"<body style='margin:0;background:#1e6fd9'><h1 style='color:#fff;font:64px sans-serif'>"
            b"courier screenshot test</h1><div style='width:600px;height:300px;background:#f5c400'></div>"
            b"</body></html>")

    def do_GET(self) -> None:  # noqa: N802
        type(self).hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, *args) -> None:
        return None


def _served_page(host: str, name: str):
    """The test page served on `host` (a loopback address) as /`name`."""
    srv = ThreadingHTTPServer((host, 0), _Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://{host}:{srv.server_address[1]}/{name}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def page():
    yield from _served_page("127.0.0.1", "page.html")


@pytest.fixture
def denied_page():
    """The same page on 127.0.0.2: loopback too, and not in the worker's allow-list."""
    yield from _served_page("127.0.0.2", "denied.html")


def _need_browser() -> None:
    need(os.access("/usr/bin/chromium", os.X_OK), "chromium is not installed (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        need(False, "the playwright package is not installed (pip install playwright)")


def test_browser_screenshot_is_stored_and_delivered(env, fake_openai, page, redis_server):
    _need_browser()
    fake_openai.script("shot", calls(tool_call("browser_screenshot", url=page)), say("Screenshot attached."))
    job, term, evs = run_turn(env, redis_server.client(), "shot", "screenshot that page", "shot")
    assert term["status"] == "completed"
    assert "/page.html" in _Page.hits

    log = read_log(env.outbox, "shot")
    assert [r["kind"] for r in log] == ["text", "photo"]
    png = (env.outbox / "shot" / log[1]["file"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (SCREENSHOT_VIEWPORT["width"], SCREENSHOT_VIEWPORT["height"])
    stored = glob.glob(str(env.data_dir / "storage" / "screenshots" / job / "*.png"))
    assert len(stored) == 1 and _sha(stored[0]) == hashlib.sha256(png).hexdigest() == log[1]["sha256"]
    # delivered from screenshots/ (24 h expiry), not extracted again into files/
    assert not glob.glob(str(env.data_dir / "storage" / "files" / job / "*.png"))
    # and the agent has its copy in the sandbox
    shot_name = os.path.basename(stored[0])
    ws = env.data_dir / "sandbox" / "shot" / "turns" / job
    assert (ws / "screenshots" / shot_name).read_bytes() == png
    tool_msg = fake_openai.requests("shot")[1].tool_results()[-1]["content"]
    assert tool_msg.startswith(f"MEDIA:{ws / 'screenshots' / shot_name}")
    assert len(_terminal(evs)) == 1


def test_browser_screenshot_of_a_denied_address_is_refused(env, fake_openai, denied_page, redis_server):
    """The worker's egress guard: a loopback page outside COURIER_BROWSER_ALLOWED_HOSTS
    is never fetched; the model gets the reason and the turn goes on."""
    _need_browser()
    fake_openai.script("shotdeny", calls(tool_call("browser_screenshot", url=denied_page)), say("Could not."))
    job, term, evs = run_turn(env, redis_server.client(), "shotdeny", "screenshot that page", "shotdeny")
    assert term["status"] == "completed"
    assert "/denied.html" not in _Page.hits
    tool_msg = fake_openai.requests("shotdeny")[1].tool_results()[-1]["content"]
    assert tool_msg == (f"error: screenshot of {denied_page} refused: 127.0.0.2 is a loopback address "
                        "(allow it with COURIER_BROWSER_ALLOWED_HOSTS)")
    assert [r["kind"] for r in read_log(env.outbox, "shotdeny")] == ["text"]
    assert not glob.glob(str(env.data_dir / "storage" / "screenshots" / job / "*"))


def test_huge_tool_output_is_spilled(env, fake_openai, redis_server):
    n = 30000
    fake_openai.script("spill", calls(tool_call("terminal", command=f"seq 1 {n}")), say("counted"))
    job, term, _ = run_turn(env, redis_server.client(), "spill", "count", "spill")
    assert term["status"] == "completed"
    full = "\n".join(str(i) for i in range(1, n + 1)) + "\n[exit code 0]"
    preview = fake_openai.requests("spill")[1].tool_results()[-1]["content"]
    assert preview.startswith(f"[terminal output truncated — {len(full):,} chars; full content saved to ")
    assert "--- head ---\n1\n2\n3\n" in preview and preview.endswith(f"{n}\n[exit code 0]")
    assert len(preview) < 1500
    spilled = glob.glob(str(env.data_dir / "storage" / "hook_outputs" / job / "*.txt"))
    assert len(spilled) == 1
    with open(spilled[0], encoding="utf-8") as f:
        assert f.read() == full
    assert oct(os.stat(spilled[0]).st_mode & 0o777) == oct(0o600)


@pytest.mark.parametrize("agent, step, reason, tries", [
    ("http500", forever(http_error(500)), "openai endpoint returned HTTP 500; gave up after 4 attempts", 4),
    ("http400", http_error(400), "openai endpoint returned HTTP 400 (bad request)", 1),
    ("badjson", raw(b"<html>not json</html>"), "openai endpoint sent a malformed response", 1),
])
def test_endpoint_errors_end_the_turn_cleanly(env, fake_openai, redis_server, agent, step, reason, tries):
    fake_openai.script(agent, step)
    job, term, evs = run_turn(env, redis_server.client(), agent, "hello?", agent)
    assert len(_terminal(evs)) == 1 and term["status"] == "error" and term["reason"] == reason
    assert not [e for e in evs if e["kind"] == "tool_start"]
    log = read_log(env.outbox, agent)
    assert len(log) == 1 and log[0]["kind"] == "text"
    text = log[0]["text"]
    assert reason in text and len(text) < 300 and "Traceback" not in text
    assert len(fake_openai.requests(agent)) == tries  # a 5xx is tried again (COURIER_OPENAI_MAX_ATTEMPTS), a 4xx not


def test_429_500_and_dropped_connections_are_retried_and_the_turn_goes_on(env, fake_openai, redis_server):
    """Mid-turn: a 429 with retry-after, a 500, a dropped connection, a 503:
    each model call is asked again, the turn completes, no tool ran twice and
    nothing reached the chat twice."""
    fake_openai.script(
        "flaky",
        calls(tool_call("terminal", command="echo ran >> runs.txt")),
        http_error(429, "slow down", headers={"retry-after": "1"}),
        http_error(500),
        drop(),
        calls(tool_call("send_file", path="runs.txt")),
        http_error(503),
        drop(),
        say("All done."),
    )
    job, term, evs = run_turn(env, redis_server.client(), "flaky", "do it once", "flaky")
    assert term["status"] == "completed" and len(_terminal(evs)) == 1
    reqs = fake_openai.requests("flaky")
    assert len(reqs) == 8
    assert reqs[2].t - reqs[1].t >= 1.0  # the 429's retry-after was honoured
    # the retried calls are the same request: the conversation went on where it was
    assert reqs[1].body["messages"] == reqs[2].body["messages"] == reqs[3].body["messages"] == reqs[4].body["messages"]
    assert reqs[5].body["messages"] == reqs[6].body["messages"] == reqs[7].body["messages"]
    ws = env.data_dir / "sandbox" / "flaky" / "turns" / job
    assert (ws / "runs.txt").read_text() == "ran\n"  # the tool ran once
    log = read_log(env.outbox, "flaky")
    assert [(r["kind"], r.get("text") or r.get("name")) for r in log] == [("text", "All done."),
                                                                         ("document", "runs.txt")]
    assert len([e for e in evs if e["kind"] == "tool_start"]) == 2


def test_max_steps_bounds_the_loop(env, fake_openai, redis_server):
    fake_openai.script("steps", forever(calls(tool_call("terminal", command="echo again"))))
    job, term, evs = run_turn(env, redis_server.client(), "steps", "loop forever", "steps")
    assert len(fake_openai.requests("steps")) == AGENTS["steps"]["max_steps"]
    assert len([e for e in evs if e["kind"] == "tool_start"]) == AGENTS["steps"]["max_steps"]
    assert len(_terminal(evs)) == 1 and term["status"] == "error" and term["reason"].startswith("max_steps_exceeded")
    assert "max_steps_exceeded" in read_log(env.outbox, "steps")[0]["text"]



# -- the loop in process (no worker): endpoint failures and tool errors ----------------------------------------
def _toolbox(tmp_path) -> Toolbox:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return Toolbox(sandbox=LocalSandbox.with_roots((str(tmp_path),)), workdir=str(work),
                   store=VolumeStore(tmp_path / "store"), job_id="job_inproc")


@pytest.mark.parametrize("case", ["timeout", "turn_timeout", "unreachable", "401", "no_choices"])
def test_endpoint_failures_in_process(tmp_path, fake_openai, case):
    model = f"inproc-{case}"
    base, call_timeout_s, timeout_s = fake_openai.base_url, 30.0, 60.0
    step, reason = {
        "timeout": (stall(30, say("late")), "openai endpoint timed out after 0.5s"),
        "turn_timeout": (stall(30, say("late")), "runtime_timeout"),
        "unreachable": (None, "openai endpoint 127.0.0.1 unreachable (ConnectError); gave up after 2 attempts"),
        "401": (http_error(401), "openai endpoint returned HTTP 401 (unauthorized: check COURIER_OPENAI_API_KEY)"),
        "no_choices": (raw(b'{"choices": []}'), "openai endpoint sent a malformed response"),
    }[case]
    if case == "timeout":
        call_timeout_s = 0.5
    if case == "turn_timeout":
        timeout_s = 0.5
    if case == "unreachable":
        base = f"http://127.0.0.1:{free_port()}/v1"
    fake_openai.script(model, step)
    seen: list[dict] = []
    res = run_openai(OpenAIConfig(base_url=base, model=model, api_key="sk-x", call_timeout_s=call_timeout_s,
                                  timeout_s=timeout_s, max_attempts=2, retry_base_s=0.01),
                     "hi", tools=_toolbox(tmp_path), on_event=seen.append)
    assert (res.status, res.reason) == ("error", reason)
    assert not [e for e in seen if e["kind"] in ("tool_start", "tool_result")]


def test_tool_errors_go_back_to_the_model_and_the_turn_goes_on(tmp_path, fake_openai):
    fake_openai.script(
        "inproc-tools",
        calls({"id": "bad1", "type": "function", "function": {"name": "terminal", "arguments": "{not json"}},
              tool_call("no_such_tool", x=1),
              tool_call("read_file", path="/etc/passwd"),
              tool_call("send_file", path="missing.txt"),
              tool_call("browser_screenshot", url="file:///etc/passwd"),
              tool_call("terminal", command="exit 7")),
        say("recovered"),
    )
    seen: list[dict] = []
    res = run_openai(OpenAIConfig(base_url=fake_openai.base_url, model="inproc-tools"), "go",
                     tools=_toolbox(tmp_path), on_event=seen.append)
    assert (res.status, res.reply) == ("completed", "recovered")
    results = [m["content"] for m in fake_openai.requests("inproc-tools")[1].tool_results()]
    assert len(results) == 6
    assert results[0] == "error: the arguments are not valid JSON"
    assert results[1].startswith("error: unknown tool 'no_such_tool'")
    assert results[2].startswith("error: ") and "/etc is never readable" in results[2]
    assert results[3].startswith("error: ") and "no such file" in results[3]
    assert results[4] == "error: only http:// and https:// URLs can be screenshotted"
    assert results[5].endswith("[exit code 7]")
    assert [e["status"] for e in seen if e["kind"] == "tool_result"] == ["error"] * 6
    assert [e["tool_call_id"] for e in seen if e["kind"] == "tool_start"][0] == "bad1"


def test_empty_answer_is_no_reply(tmp_path, fake_openai):
    fake_openai.script("inproc-empty", say(""))
    res = run_openai(OpenAIConfig(base_url=fake_openai.base_url, model="inproc-empty"), "hm",
                     tools=_toolbox(tmp_path))
    assert res.status == "no_reply"


def test_terminal_on_a_local_sandbox_leaves_nothing_running(tmp_path):
    """A setsid daemon the terminal tool starts ends with the command (the
    agents' guard); a command past its timeout is killed with everything it
    started, and the tool says it timed out."""
    import time as _time

    tools = _toolbox(tmp_path)
    work = tmp_path / "work"
    daemon = ("setsid sh -c 'while :; do echo $$ > beat.tmp; mv beat.tmp beat; sleep 0.05; done' "
              "</dev/null >/dev/null 2>&1 & while [ ! -e beat ]; do sleep 0.01; done; echo started")
    res = tools.call("terminal", {"command": daemon})
    assert res.ok and res.text.startswith("started"), res.text
    pid = int((work / "beat").read_text())

    def gone(p: int) -> bool:
        try:
            st = open(f"/proc/{p}/stat", "rb").read()
        except FileNotFoundError:
            return True
        return st[st.rfind(b")") + 2:][:1] in (b"Z", b"X")

    from tests.fixtures.services import wait_until

    try:
        wait_until(lambda: gone(pid), 10, what=f"the terminal's setsid daemon {pid} to end")
    finally:
        if not gone(pid):
            os.kill(pid, 9)  # do not leave the leak running
    t0 = _time.monotonic()
    res = tools.call("terminal", {"command": "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $! > sleeper; "
                                             "sleep 60", "timeout_s": 1})
    assert not res.ok and "[exit code 124]" in res.text and "timed out after 1s" in res.text, res.text
    assert _time.monotonic() - t0 < 10
    sleeper = int((work / "sleeper").read_text())
    try:
        wait_until(lambda: gone(sleeper), 10, what="the timed-out command's daemon to end")
    finally:
        if not gone(sleeper):
            os.kill(sleeper, 9)
