"""Hooks: shell commands and entry-point plugins add context before each LLM
call (and once before a bridge agent); failing, garbled and slow hooks are
skipped; a huge context is spilled. Real worker, real hook subprocesses, a
real (tiny, installed-by-path) distribution for the plugin."""

from __future__ import annotations

import glob
import json
import re
import os
import sys
import threading
from pathlib import Path

import pytest

from adapters.agents.hooks import HookRunner, PluginHook, ShellHook, load_plugins
from adapters.platforms.outbox import read_log
from storage.spill import SpillConfig
from storage.volume import VolumeStore
from tests.fixtures.fake_openai import calls, run_turn, say, tool_call
from tests.fixtures.workers import ROOT, CourierEnv

pytestmark = pytest.mark.slow

HUGE = "HEAD-MARK" + "h" * 50_000 + "TAIL-MARK"
SPILL = {"max_chars": 20_000, "preview_head": 300, "preview_tail": 200}

GOOD = """import json, sys
c = json.load(sys.stdin)
print(json.dumps({"context": f"GOOD step={c['step']} job={c['job']} target={c['target']} message={c['message']}"}))
"""
FAIL = "import sys\nsys.stderr.write('hook exploded\\n')\nsys.exit(3)\n"
BADJSON = "print('this is { not json')\n"
SLOW = "import time\ntime.sleep(60)\nprint('{}')\n"  # the hook under test hangs; courier kills it
HUGE_HOOK = f"import json\nprint(json.dumps({{'context': {HUGE!r}}}))\n"
EMPTY = "import sys\nsys.stdin.read()\n"

PLUGIN = """def add(ctx):
    return {"context": f"PLUGIN-CTX step={ctx['step']} agent={ctx['agent']}"}

def broken(ctx):
    raise RuntimeError("plugin bug")

def nothing(ctx):
    return None
"""


def _write_plugin_dist(d: Path) -> Path:
    """A minimal installed distribution (module + dist-info) found through sys.path / PYTHONPATH."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "courier_hook_plugin_test.py").write_text(PLUGIN)
    info = d / "courier_hook_plugin_test-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: courier-hook-plugin-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[courier.hooks]\nadd = courier_hook_plugin_test:add\nbroken = courier_hook_plugin_test:broken\n"
        "nothing = courier_hook_plugin_test:nothing\nmissing = courier_hook_plugin_test:no_such_function\n")
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_server, fake_openai):
    redis_server.client().flushall()
    tmp = tmp_path_factory.mktemp("hooks")
    scripts = tmp / "hooks"
    scripts.mkdir()
    hooks = []
    for name, src, extra in (("good", GOOD, {}), ("fail", FAIL, {}), ("badjson", BADJSON, {}),
                             ("slow", SLOW, {"timeout_s": 1}), ("huge", HUGE_HOOK, {}), ("empty", EMPTY, {})):
        (scripts / f"{name}.py").write_text(src)
        hooks.append({"command": [sys.executable, str(scripts / f"{name}.py")], "name": name, **extra})
    plug = _write_plugin_dist(tmp / "plugins")
    bridge = scripts / "bridge_agent.py"
    bridge.write_text("import os, sys\nsys.stdin.read()\nprint('ctx:', os.environ.get('COURIER_HOOK_CONTEXT', '<none>'))\n")
    agents = {"hooked": {"runtime": "openai", "model": "hooked", "timeout_s": 120},
              "bridged": {"command": [sys.executable, str(bridge)], "timeout_s": 60}}
    e = CourierEnv(tmp, redis_server.url, COURIER_AGENTS=json.dumps(agents), COURIER_HOOKS=json.dumps(hooks),
                   COURIER_HOOKS_OUTPUT_SPILL=json.dumps(SPILL), COURIER_OPENAI_BASE_URL=fake_openai.base_url,
                   COURIER_OPENAI_MODEL="unused-default", PYTHONPATH=os.pathsep.join([str(ROOT), str(plug)]))
    e.start_worker()
    yield e
    e.stop()


def _worker_log(env: CourierEnv) -> str:
    return "".join(p.read_text(errors="replace") for p in env.tmp.glob("worker-*.log"))


def _spill_location(body: dict) -> str:
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    return re.search(r"\[huge output truncated — [\d,]+ chars; full content saved to (\S+)\]", user).group(1)


def test_hooks_add_context_to_each_llm_call_and_bad_hooks_are_skipped(env, fake_openai, redis_server):
    fake_openai.script("hooked", calls(tool_call("terminal", command="true")),
                       # the agent reads the spill back at the path the preview gives (the whole file, then lines)
                       lambda body: calls(tool_call("read_file", path=_spill_location(body))),
                       lambda body: calls(tool_call("read_file", path=_spill_location(body), offset=1, limit=1)),
                       say("all good"))
    msg = "what is new?"
    job, term, _ = run_turn(env, redis_server.client(), "hooked", msg, "hk")
    assert term["status"] == "completed"
    assert read_log(env.outbox, "hk")[0]["text"] == "all good"

    reqs = fake_openai.requests("hooked")
    assert len(reqs) == 4
    # one spill per hook output per turn: every call names the same file, in the turn's workspace
    locations = {_spill_location(r.body) for r in reqs}
    ws = env.data_dir / "sandbox" / "hooked" / "turns" / job
    assert len(locations) == 1 and locations.pop().startswith(f"{ws}/.courier/spills/")
    for res in (reqs[2].tool_results()[-1]["content"], reqs[3].tool_results()[-1]["content"]):
        assert not res.startswith("error:") and "HEAD-MARK" in res and "TAIL-MARK" in res, res[:300]
    for step, req in enumerate(reqs, 1):
        user = req.user_text()
        assert user.startswith(msg + "\n\n")
        good = f"GOOD step={step} job={job} target=outbox:hk message={msg}"
        plugin = f"PLUGIN-CTX step={step} agent=hooked"
        header = f"[huge output truncated — {len(HUGE):,} chars; full content saved to "
        # declared order: shell hooks, then plugins; each context once
        assert user.index(good) < user.index(header) < user.index(plugin)
        assert user.count("GOOD step=") == 1 and user.count("PLUGIN-CTX") == 1
        assert "--- head ---\n" + HUGE[:SPILL["preview_head"]] + "\n--- tail ---\n" + HUGE[-SPILL["preview_tail"]:] in user
        assert "not json" not in user and "exploded" not in user
        assert len(user) < 2000
    # the conversation itself keeps the plain message: context is per call
    assert "step=1" not in reqs[1].user_text()

    spilled = sorted(glob.glob(str(env.data_dir / "storage" / "hook_outputs" / job / "*.txt")))
    texts = [open(p, encoding="utf-8").read() for p in spilled]
    # 4 calls, one file of the hook's output (reading it whole spilled the same text: the same file);
    # the line-range read is another text, so another file
    assert len(spilled) == 2 and texts.count(HUGE) == 1
    assert [t for t in texts if t != HUGE][0].startswith("[lines 1-1 of ")

    log = _worker_log(env)
    for name, why in (("fail", "exit code 3: hook exploded"), ("badjson", "stdout is not JSON"),
                      ("slow", "timed out after 1s"), ("broken", "plugin bug")):
        assert f"hook {name} skipped (job {job}): " in log and why in log, (name, log[-3000:])
    assert "hook plugin missing" in log and "failed to load" in log


def test_bridge_agent_gets_hook_context_in_its_environment(env, redis_server):
    _, term, _ = run_turn(env, redis_server.client(), "bridged", "hi", "br")
    assert term["status"] == "completed"
    text = read_log(env.outbox, "br")[0]["text"]
    assert text.startswith("ctx: GOOD step=0 ")
    assert "PLUGIN-CTX step=0 agent=bridged" in text and "[huge output truncated" in text


def test_runner_in_process_skips_bad_plugins_and_bounds_slow_ones(tmp_path):
    """The runner with plugin objects directly (no entry points): a non-dict
    return, a hang past the timeout and a non-string context."""
    release = threading.Event()

    def hangs(ctx):
        release.wait(30)
        return {"context": "too late"}

    store = VolumeStore(tmp_path / "store")
    runner = HookRunner([
        PluginHook("structured", lambda ctx: {"context": {"step": ctx["step"], "items": [1, 2]}}),
        PluginHook("listy", lambda ctx: ["not", "a", "dict"]),
        PluginHook("hangs", hangs, timeout_s=0.3),
        ShellHook((sys.executable, "-c", "import sys, json; print(json.dumps({'context': sys.stdin.read()}))"),
                  "echo"),
        PluginHook("big", lambda ctx: {"context": "z" * 1000}),
    ], store=store, spill=SpillConfig(max_chars=300, preview_head=10, preview_tail=0))
    try:
        out = runner.run({"job": "../../evil/job", "step": 4, "message": "m", "target": "outbox:x", "agent": "a"})
    finally:
        release.set()
    assert [name for name, _ in out] == ["structured", "echo", "big"]
    assert json.loads(out[0][1]) == {"step": 4, "items": [1, 2]}
    assert json.loads(out[1][1])["job"] == "../../evil/job"  # the shell hook got the context on stdin
    assert out[2][1] == ("[big output truncated — 1,000 chars; full content saved to "
                         + out[2][1].split("saved to ", 1)[1].split("]", 1)[0] + "]\n--- head ---\n" + "z" * 10)
    keys = [b.key for b in store.list("hook_outputs/")]
    assert len(keys) == 1 and ".." not in keys[0].split("/")
    with store.open_read(keys[0]) as f:
        assert f.read() == b"z" * 1000


def test_load_plugins_from_a_distribution_on_sys_path(tmp_path, monkeypatch):
    plug = _write_plugin_dist(tmp_path / "plugins")
    monkeypatch.syspath_prepend(str(plug))
    loaded = {p.name: p for p in load_plugins(timeout_s=2)}
    assert {"add", "broken", "nothing"} <= set(loaded) and "missing" not in loaded
    assert loaded["add"].call({"step": 7, "agent": "z"}) == {"context": "PLUGIN-CTX step=7 agent=z"}
