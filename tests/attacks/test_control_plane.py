"""The control-plane rows: an agent on the default (local) sandbox goes for
the deployment itself, not for a file path (issue 22). A real worker on a
password-protected redis-server, real bubblewrap, the agent of
tests/fixtures/control_plane_agent.py: it reads every /proc/*/environ it
can, scans /proc/net/tcp and every port of 127.0.0.1 (PING, AUTH with every
password it found), CONNECTs to Redis through its proxy, runs `courier send`
to another chat with every environment it read, writes into the worker's
data dir and ptraces its parent and the worker. Each row asserts that
nothing reached another chat and that no secret showed in what the agent
could say (its reply is its loot)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path

import pytest
import redis

from adapters.platforms.outbox import read_log
from tests.fixtures.faults import children_of
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "control_plane_agent.py"


class _PasswordRedis(RedisServer):
    def __init__(self, tmp: Path) -> None:
        self.password = secrets.token_hex(16)
        super().__init__(tmp, extra_args=("--requirepass", self.password))

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def loot(tmp_path_factory):
    """One attack turn (it takes a port scan): the report, the deployment and its secrets."""
    tmp = tmp_path_factory.mktemp("control-plane")
    srv = _PasswordRedis(tmp).start()
    with pytest.raises(redis.AuthenticationError):  # the Redis the rows attack needs its password
        redis.Redis(port=srv.port, socket_timeout=5).ping()
    secret_env = {"TELEGRAM_BOT_TOKEN": f"123456:{secrets.token_hex(12)}", "SLACK_BOT_TOKEN": f"xoxb-{secrets.token_hex(8)}",
                  "COURIER_OPENAI_API_KEY": f"sk-{secrets.token_hex(12)}", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16)}
    agents = {"evil": {"command": [sys.executable, str(AGENT)], "timeout_s": 240}}
    env = CourierEnv(tmp / "env", srv.url, COURIER_AGENTS=json.dumps(agents), **secret_env)
    worker = None
    try:
        worker = env.start_worker(concurrency=1)
        message = json.dumps({"redis_port": srv.port, "worker_pid": worker.pid, "data_dir": str(env.data_dir),
                              "victim": "outbox:victim", "courier": shutil.which("courier") or ""})
        res = env.cli("turn", "outbox:attacker", message, "--agent", "evil", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        wait_until(lambda: read_log(env.outbox, "attacker"), 240,
                   what=lambda: f"the attacking agent's reply (the worker's state: {_state(worker.pid)})")
        text = read_log(env.outbox, "attacker")[0]["text"]
        try:
            report = json.loads(text)
        except ValueError:
            raise AssertionError(f"the agent did not reply with its report: {text[:2000]}") from None
        secret_values = [*secret_env.values(), srv.password, srv.url]
        yield {"report": report, "text": text, "env": env, "srv": srv, "secrets": secret_values,
               "worker": worker}
    finally:
        for pid in ((worker.pid, *children_of(worker.pid)) if worker is not None else ()):  # a traced worker (the unconfined case) is stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        env.stop()
        srv.stop()


def _state(pid: int) -> str:
    """A process's state letter (T: stopped, as a ptraced worker is)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return "gone"
    return st[st.rfind(b")") + 2:][:1].decode()


def test_no_secret_reaches_the_agent(loot):
    """Its ancestors' environments (the worker's tokens, the Redis URL with its password) are out of its reach."""
    text = loot["text"]
    leaked = [s for s in loot["secrets"] if s in text]
    assert not leaked, f"the agent's reply carries {len(leaked)} of the worker's secrets"
    report = loot["report"]
    worker = f"/proc/{loot['worker'].pid}/environ"
    readable = {p: v for p, v in report["environs"].items() if not v.startswith("! ")}
    assert "COURIER_REDIS_URL" not in json.dumps(readable), sorted(readable)
    assert report["environs"].get(worker, "! gone").startswith("! ") or "COURIER_" not in report["environs"][worker]
    assert report["uid"] != os.geteuid()  # its own uid, never the worker's
    # nothing of the worker's home either
    assert ".local" not in report["home_listing"] and "data" not in report["home_listing"]


def test_the_agent_reaches_no_redis(loot):
    """No port of the host answers it (an empty network namespace), and its proxy refuses loopback."""
    report = loot["report"]
    answers = [a for said in report["open_ports"].values() for a in said]
    assert not any("PONG" in a or "+OK" in a or "NOAUTH" in a or "*" in a[:1] for a in answers), report["open_ports"]
    # it sees no listening socket of the host: only its own forwarder to the egress proxy
    assert set(report["listening"]) <= {3128}, report["listening"]
    assert "PONG" not in report["proxy_to_redis"] and " 403 " in report["proxy_to_redis"], report["proxy_to_redis"]


def test_the_agent_cannot_send_as_the_bot(loot):
    """`courier send` to another chat, with every environment it could read: nothing reached that chat."""
    env = loot["env"]
    assert loot["report"]["send"], "the agent tried no send"
    assert not (env.outbox / "victim").exists()
    r = redis.Redis.from_url(loot["srv"].url, decode_responses=True)
    try:
        targets = set()
        for k in r.scan_iter("*"):
            if r.type(k) == "hash":
                t = r.hget(k, "target")
                if t:
                    targets.add(t)
        assert "outbox:victim" not in targets, targets
    finally:
        r.close()


def test_the_agent_cannot_write_the_data_dir_or_trace_its_parent(loot):
    env = loot["env"]
    report = loot["report"]
    for rel in ("storage/pwned.txt", "outbox/victim/pwned.txt", "pwned.txt"):
        assert not (env.data_dir / rel).exists(), rel
    assert all(v.startswith("! ") for v in report["ptrace"].values()), report["ptrace"]
