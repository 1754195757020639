"""Agent turns are isolated from each other and from the worker: a workspace
per turn, paths confined to it, an environment allowlist, nothing the agent
starts outlives its turn. Real worker processes, real agent processes
(tests/fixtures/hostile_agent.py)."""

from __future__ import annotations

import hashlib
import json
import re
import os
import sys

import pytest

from adapters.platforms.outbox import read_log
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

# each test's Redis starts empty: the rows reuse agent and chat names ("d"), and a reply the previous test's
# worker left undelivered (stopped cold) was re-driven by the next test's reconciler into its own outbox
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("redis_emptied")]

#: a script the agent's sandbox sees (a path its command names), the standard library only
HOSTILE = [sys.executable, str(__import__("pathlib").Path(__file__).parent / "fixtures" / "hostile_agent.py")]


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _enqueue(env: CourierEnv, chat: str, agent: str, message: str = "go") -> str:
    res = env.cli("turn", f"outbox:{chat}", message, "--agent", agent, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)["job"]


def test_ten_concurrent_turns_of_one_agent_get_only_their_own_files(tmp_path, redis_server):
    gate = tmp_path / "gate"
    gate.mkdir()
    go = gate / "go"
    agents = {"same": {"command": [*HOSTILE, "same-names", str(gate)], "timeout_s": 120}}
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_AGENTS=json.dumps(agents))
    try:
        env.start_worker(concurrency=10)
        chats = [f"c{i}" for i in range(10)]
        for chat in chats:
            _enqueue(env, chat, "same")
        go.write_text("go")  # every agent waits for this: the ten turns write at the same moment

        def done() -> bool:
            return all(len(read_log(env.outbox, c)) >= 3 for c in chats)

        wait_until(done, 120, what="ten turns' deliveries")
        crossed = []
        for chat in chats:
            log = read_log(env.outbox, chat)
            assert [r["kind"] for r in log] == ["text", "photo", "document"], log
            want = dict(re.findall(r"(png|csv)=([0-9a-f]{64})", log[0]["text"]))
            got = {"png": _sha(env.outbox / chat / log[1]["file"]), "csv": _sha(env.outbox / chat / log[2]["file"])}
            assert got["png"] == log[1]["sha256"] and got["csv"] == log[2]["sha256"]
            if got != want:
                crossed.append(chat)
        assert not crossed, f"{len(crossed)} of 10 chats got another turn's files: {crossed}"
    finally:
        env.stop()


def test_janitor_sweeps_old_turn_workspaces(tmp_path):
    import os
    import time

    from tasks.ops.janitor import sweep_workspaces

    now = time.time()
    a = tmp_path / "sandbox" / "demo"
    old, new = a / "turns" / "turn_old", a / "turns" / "turn_new"
    for d in (old, new):
        (d / "inbox").mkdir(parents=True)
        (d / "inbox" / "x.txt").write_text("x")
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "precious").write_text("p")
    (old / "link").symlink_to(outside)
    os.utime(old, (now - 25 * 3600, now - 25 * 3600))
    assert sweep_workspaces([str(a)], 24 * 3600, now=now) == 1
    assert not old.exists() and (new / "inbox" / "x.txt").exists()
    assert (outside / "precious").read_text() == "p"  # a link inside is removed, never followed


def _status(env: CourierEnv, job: str) -> dict:
    res = env.cli("status", job, "--json")
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return json.loads(res.stdout)


def test_an_agent_reaches_only_its_workspace_and_its_configured_roots(tmp_path, redis_server):
    """MEDIA paths outside the turn's workspace are refused: another turn's
    workspace, the outbox, /tmp, storage (spills), the worker's home; a
    root the agent's config names is reachable."""
    import os
    import tempfile

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ok.txt").write_text("configured root\n")
    env = CourierEnv(tmp_path / "env", redis_server.url)
    first = env.data_dir / "sandbox" / "m" / "turns" / "turn_other"
    first.mkdir(parents=True)
    (first / "other.txt").write_text("another chat's file\n")
    (env.outbox / "someone").mkdir(parents=True)
    (env.outbox / "someone" / "their.txt").write_text("another chat's delivery\n")
    spill = env.data_dir / "storage" / "hook_outputs" / "turn_other" / "x.txt"
    spill.parent.mkdir(parents=True)
    spill.write_text("another turn's spill\n")
    fd, tmp_secret = tempfile.mkstemp(prefix="courier-worker-key-", dir="/tmp")
    os.write(fd, b"worker secret\n")
    os.close(fd)
    try:
        bad = [str(first / "other.txt"), str(env.outbox / "someone" / "their.txt"), str(spill), tmp_secret,
               f"{first}/../../turns/turn_other/other.txt"]
        agents = {"m": {"command": [*HOSTILE, "media", *bad, str(shared / "ok.txt"), "~/own.txt"],
                        "roots": [str(shared)]}}
        env.env["COURIER_AGENTS"] = json.dumps(agents)
        # the operator's roots (courier send local://...) still name /tmp: agent turns do not get them
        env.env["COURIER_LOCAL_ROOTS"] = json.dumps([str(env.data_dir / "sandbox"), "/tmp", str(env.outbox),
                                                     str(env.data_dir / "storage")])
        env.start_worker()
        job = _enqueue(env, "m", "m")
        def settled() -> bool:
            st = _status(env, job)
            return st["job"].get("state") in ("replied", "error") and bool(st["deliveries"]) and all(
                d.get("state") in ("delivered", "failed") for d in st["deliveries"])

        wait_until(settled, 90, what="the turn's deliveries")
        st = _status(env, job)
        rows = st["deliveries"]
        delivered = [r.get("name") for r in rows if r["state"] == "delivered"]
        failed = [r for r in rows if r["state"] == "failed"]
        # ~/own.txt is the workspace's own.txt, named by its absolute path too: one file, sent once (issue 24)
        assert sorted(n for n in delivered if n) == ["ok.txt", "own.txt"], rows
        assert len(failed) == len(bad), rows
        assert all(("outside the allowed roots" in r.get("reason", "") or "'..'" in r.get("reason", ""))
                   for r in failed), failed
        got = [r for r in read_log(env.outbox, "m") if r["kind"] == "document"]
        assert sorted(r["name"] for r in got) == ["ok.txt", "own.txt"]
    finally:
        os.unlink(tmp_secret)
        env.stop()


def test_an_agent_gets_an_environment_allowlist_not_the_workers_secrets(tmp_path, redis_server):
    agents = {"dump": {"command": [*HOSTILE, "env"], "env": {"MODEL": "m-1"},
                       "env_passthrough": ["AGENT_FLAVOUR", "HTTPS_PROXY"]}}
    secrets = {"TELEGRAM_BOT_TOKEN": "123:tg-secret", "COURIER_OPENAI_API_KEY": "sk-secret-key",
               "AWS_SECRET_ACCESS_KEY": "aws-secret", "SLACK_SIGNING_SECRET": "slack-secret"}
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_AGENTS=json.dumps(agents),
                     HTTPS_PROXY="http://proxy.example:3128", AGENT_FLAVOUR="mild", **secrets)
    try:
        env.start_worker()
        job = _enqueue(env, "dump", "dump")
        wait_until(lambda: read_log(env.outbox, "dump"), 60, what="the env dump")
        text = read_log(env.outbox, "dump")[0]["text"]
        got = json.loads(text)
        leaked = [k for k in got if k.startswith(("COURIER_REDIS", "COURIER_DATA", "COURIER_LOCAL", "COURIER_AGENTS",
                                                   "COURIER_OPENAI", "TELEGRAM", "AWS_", "SLACK_"))]
        assert not leaked, leaked
        assert not any(v in text for v in [*secrets.values(), redis_server.url])
        assert got["MODEL"] == "m-1" and got["AGENT_FLAVOUR"] == "mild"
        # in its sandbox the only way out is courier's egress proxy: a passed-through proxy is replaced by it
        assert got["HTTPS_PROXY"] == got["HTTP_PROXY"] == "http://127.0.0.1:3128"
        assert got["COURIER_TURN_ID"] == job and got["PATH"]
        assert got["HOME"] == got["COURIER_WORKSPACE"] == str(env.data_dir / "sandbox" / "dump" / "turns" / job)
    finally:
        env.stop()


def _daemon_pid(beat) -> int:
    return int(beat.read_text().split()[0])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except FileNotFoundError:
        return True
    return st[st.rfind(b")") + 2:][:1] in (b"Z", b"X")  # dead, waiting to be reaped


def _assert_daemon_ends(beat) -> None:
    import os
    import signal

    pid = _daemon_pid(beat)
    try:
        wait_until(lambda: _gone(pid), 10, what=f"the agent's setsid daemon {pid} to end")
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)  # the old code's leak: do not leave it running


def test_a_setsid_daemon_a_sandboxed_agent_started_ends_with_its_turn(tmp_path, redis_server):
    """In its namespace sandbox the agent's processes run as the turn's own
    uid: when the turn ends none of them is left on the host (the PID
    namespace dies with it)."""
    from adapters.agents.jail import Jail, JailConfig

    agents = {"d": {"command": [*HOSTILE, "daemon", "heartbeat"]}}  # in its workspace
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_AGENTS=json.dumps(agents))
    try:
        env.start_worker()
        job = _enqueue(env, "d", "d")
        wait_until(lambda: read_log(env.outbox, "d"), 60, what="the turn's reply")
        assert read_log(env.outbox, "d")[0]["text"] == "daemon started"
        ws = env.data_dir / "sandbox" / "d" / "turns" / job
        assert (ws / "heartbeat").read_text().split()[1] != "0"  # the daemon ran, in the workspace
        uid = Jail(JailConfig(), str(ws), job).uid
        assert uid != os.geteuid()

        def agent_processes() -> list[int]:
            out = []
            for name in os.listdir("/proc"):
                try:
                    if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid and not _gone(int(name)):
                        out.append(int(name))
                except FileNotFoundError:
                    pass
            return out

        wait_until(lambda: not agent_processes(), 10, what=lambda: f"the agent's processes to end: {agent_processes()}")
    finally:
        env.stop()


def test_a_setsid_daemon_an_unconfined_agent_started_ends_with_its_turn(tmp_path, redis_server):
    """`"isolation": "host"`: the guard (a subreaper) still ends everything the agent started."""
    beat = tmp_path / "heartbeat"
    agents = {"d": {"command": [*HOSTILE, "daemon", str(beat)], "isolation": "host"}}
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_AGENTS=json.dumps(agents))
    try:
        env.start_worker()
        _enqueue(env, "d", "d")
        wait_until(lambda: read_log(env.outbox, "d"), 60, what="the turn's reply")
        assert read_log(env.outbox, "d")[0]["text"] == "daemon started"
        _assert_daemon_ends(beat)
    finally:
        env.stop()


def test_a_setsid_daemon_ends_with_a_turn_that_times_out(tmp_path):
    from adapters.agents.bridge import run_bridge

    beat = tmp_path / "heartbeat"
    # 8 s: the agent starts and puts its daemon on record before the timeout, however loaded the machine
    res = run_bridge([*HOSTILE, "daemon-sleep", str(beat)], "go", cwd=str(tmp_path), timeout_s=8)
    assert res.status == "error" and res.reason == "runtime_timeout"
    _assert_daemon_ends(beat)


def test_a_root_configured_inside_a_denied_prefix_allows_below_it_only():
    from adapters.errors import UnsafePath
    from adapters.sandboxes.base import PathPolicy

    data = "/root/.local/share/courier/sandbox"
    p = PathPolicy(roots=(data, "/var/lib/courier"), home="/root")
    assert p.check(f"{data}/demo/turns/t1/chart.png") == f"{data}/demo/turns/t1/chart.png"
    assert p.check("/var/lib/courier/x")
    for bad, why in [("/root/secret.txt", "/root is never readable"), ("/root/.ssh/id_rsa", "is never readable"),
                     ("/var/lib/dpkg/status", "/var/lib is never readable"), ("/etc/passwd", "/etc is never")]:
        with pytest.raises(UnsafePath, match=why):
            p.check(bad)
    # never: the home's secrets, special files, or a root that is the denied prefix itself
    for roots, path in [(("/root/.ssh/keys",), "/root/.ssh/keys/id"), (("/proc/self",), "/proc/self/environ"),
                        (("/root",), "/root/x"), (("/",), "/etc/shadow")]:
        with pytest.raises(UnsafePath, match="is never readable"):
            PathPolicy(roots=roots, home="/root").check(path)


def test_the_readme_example_works_with_the_default_data_dir_of_root(tmp_path, redis_server):
    """`courier turn outbox:me "make a chart of x^2" --agent demo --wait` with
    no COURIER_DATA_DIR: as root the default data dir is under /root (a
    denied prefix). HOME is a fresh directory under the real home here (so
    under /root when the tests run as root) and removed afterwards."""
    import os
    import shutil
    import tempfile

    home = tempfile.mkdtemp(prefix="courier-test-home-", dir=os.path.expanduser("~"))
    try:
        env = CourierEnv(tmp_path / "env", redis_server.url, HOME=home,
                         COURIER_OUTBOX_DIR=str(tmp_path / "outbox"))
        for k in ("COURIER_DATA_DIR", "COURIER_LOCAL_ROOTS", "XDG_DATA_HOME"):
            env.env.pop(k, None)
        try:
            env.start_worker()
            res = env.cli("turn", "outbox:me", "make a chart of x^2", "--agent", "demo", "--wait", "--timeout", "90")
            assert res.returncode == 0, res.stdout + res.stderr
            log = read_log(tmp_path / "outbox", "me")
            assert [r["kind"] for r in log] == ["text", "photo", "document"], log
            assert not any("UnsafePath" in (r.get("text") or "") for r in log)
            turns = os.listdir(f"{home}/.local/share/courier/sandbox/demo/turns")  # the default data dir
            assert len(turns) == 1
        finally:
            env.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_docker_sandbox_turn_gets_its_own_workspace_inside_the_container(tmp_path, redis_server, docker_api,
                                                                           fake_openai):
    """The OpenAI runtime in a container (podman's Docker API): the turn's
    workspace is made inside the agent's workdir before the model's first
    tool call, its tools work there, `..` out of it is refused, and the file
    it sends comes out of the container."""
    from tests.fixtures.fake_openai import calls, run_turn, say, tool_call

    ctr = docker_api.run_container()
    ctr_name = ctr.name
    ctr.exec_run(["sh", "-c", "mkdir -p /workspace && echo s > /workspace/secret.txt"])
    agents = {"box": {"runtime": "openai", "model": "box", "sandbox": f"docker://{ctr_name}/workspace"}}
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_AGENTS=json.dumps(agents),
                     COURIER_OPENAI_BASE_URL=fake_openai.base_url, COURIER_DOCKER_HOST=docker_api.base_url)
    fake_openai.script(
        "box",
        calls(tool_call("terminal", command="pwd > where.txt; echo made >> where.txt")),
        calls(tool_call("send_file", path="where.txt"), tool_call("read_file", path="../../secret.txt"),
              tool_call("send_file", path="/workspace/secret.txt")),
        say("sent"),
    )
    try:
        env.start_worker()
        job, term, _ = run_turn(env, redis_server.client(), "box", "in the box", "box")
        assert term["status"] == "completed", term
        results = [m["content"] for m in fake_openai.requests("box")[2].tool_results()][-3:]
        assert results[0].startswith(f"MEDIA:/workspace/turns/{job}/where.txt")
        assert all(r.startswith("error:") and "outside the allowed roots" in r for r in results[1:]), results
        log = read_log(env.outbox, "box")
        assert [r["kind"] for r in log] == ["text", "document"]
        assert (env.outbox / "box" / log[1]["file"]).read_text() == f"/workspace/turns/{job}\nmade\n"
    finally:
        env.stop()


def test_a_singularity_sandbox_turn_gets_its_workspace_made_without_exec(tmp_path):
    """Singularity has no exec: the workspace is made through the sandbox's
    own make_dirs, inside the instance root, never through a link. (The
    instance root is a directory tree, as in test_sandbox_singularity: no
    apptainer binary here.)"""
    import os

    from adapters.errors import UnsafePath
    from adapters.sandboxes.singularity import SingularitySandbox
    from tasks.runtime import Context
    from tasks.turn.turn import _sandbox_for, make_workspace

    root = tmp_path / "instances" / "box" / "rootfs"
    (root / "workspace").mkdir(parents=True)
    (root / "etc").mkdir()
    ctx = Context(redis=None, store=None, platform=None, agent=lambda n: None,
                  sandbox=lambda ref: SingularitySandbox(ref, None, instances_dir=str(tmp_path / "instances")))
    ref, local = _sandbox_for(ctx, {"sandbox": "singularity://box/workspace", "agent": "x"}, None)
    turn_ref, ws = make_workspace(ctx, ref, local, "turn_abc", ("/workspace/shared",))
    assert ws == "/workspace/turns/turn_abc" and (root / "workspace" / "turns" / "turn_abc").is_dir()
    assert turn_ref.roots == (ws, "/workspace/shared") and turn_ref.options["workdir"] == ws
    assert oct((root / "workspace" / "turns" / "turn_abc").stat().st_mode & 0o777) == oct(0o700)
    # a link on the way (planted by an earlier turn) is refused, nothing is made through it
    os.symlink("/etc", root / "workspace" / "evil")
    ref2, _ = _sandbox_for(ctx, {"sandbox": "singularity://box/workspace/evil", "agent": "x"}, None)
    with pytest.raises(UnsafePath):
        make_workspace(ctx, ref2, None, "turn_def")
    assert not (root / "etc" / "turns").exists()
