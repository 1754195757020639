"""Redis high availability: COURIER_REDIS_URL names a Sentinel-managed master,
and a failover in the middle of a run loses nothing. Real redis-server
processes on loopback: a master, a replica, and a sentinel (redis-server
--sentinel)."""

from __future__ import annotations

import subprocess

import pytest
import redis

from tests.chaos.test_chaos import Run
from tests.fixtures.redis_server import RedisServer, _redis_binary
from tests.fixtures.services import free_port, stop_process, wait_until
from tests.fixtures.workers import CourierEnv
from workers.redis_url import client as redis_client

pytestmark = pytest.mark.slow
MASTER = "courier"


class Sentinel:
    def __init__(self, tmp, master_port: int) -> None:
        self.dir = tmp
        self.port = free_port()
        self.conf = tmp / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {tmp}\nlogfile {tmp / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
            f"sentinel parallel-syncs {MASTER} 1\n")
        self.proc = subprocess.Popen([_redis_binary(), str(self.conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, socket_timeout=5)
        wait_until(self.client.ping, timeout_s=15, what="the sentinel")

    def master_port(self) -> int:
        return int(self.client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)[1])

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc)


@pytest.fixture
def sentinel_pair(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "s").mkdir()
    master = RedisServer(tmp_path / "m", appendonly=True, appendfsync="always").start()
    replica = RedisServer(tmp_path / "r", appendonly=True, appendfsync="always",
                          extra_args=("--replicaof", "127.0.0.1", str(master.port))).start()
    rep = replica.client()
    wait_until(lambda: rep.info("replication").get("master_link_status") == "up", timeout_s=30,
               what="the replica in sync")
    rep.close()
    sentinel = Sentinel(tmp_path / "s", master.port)
    wait_until(lambda: sentinel.client.execute_command("SENTINEL", "replicas", MASTER), timeout_s=30,
               what="the sentinel to see the replica")
    yield master, replica, sentinel
    sentinel.stop()
    replica.stop()
    master.stop()


def test_failover_mid_run_loses_nothing(tmp_path, sentinel_pair, fake_telegram):
    """80 deliveries to 4 chats through 2 workers connected through the
    sentinel (started as the Procfile does, `courier worker`); a failover after
    15 of them: the rest go through the new master, in order, none lost, and
    no `courier worker` exits."""
    master, replica, sentinel = sentinel_pair
    url = f"sentinel://127.0.0.1:{sentinel.port}/{MASTER}/0"
    env = CourierEnv(tmp_path / "env", url, TELEGRAM_BOT_TOKEN=fake_telegram.token,
                     COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    r = redis_client(url)
    try:
        workers = [env.start_worker(concurrency=2, supervised=True) for _ in range(2)]
        run = Run(env, r, fake_telegram, ["telegram:7301", "telegram:7302", "outbox:h1", "outbox:h2"],
                  jobs_per_chat=10)
        run.enqueue_all()
        wait_until(lambda: run.delivered() >= 15, timeout_s=120, what="15 deliveries before the failover")
        assert sentinel.master_port() == master.port
        sentinel.client.execute_command("SENTINEL", "failover", MASTER)
        wait_until(lambda: sentinel.master_port() == replica.port, timeout_s=60, what="the failover")
        # what was done on the old master between the replica's promotion and the sentinel's
        # announcement (~1 s; the client drops its connections on +switch-master) is replayed
        # from the new master's history: at most what the workers send in that window, which a
        # loaded machine stretches (25 of 80 seen under CI load; the order and the count of
        # first arrivals are exact whatever the window)
        run.check(max_duplicates=40)
        assert all(w.poll() is None for w in workers)  # issue 24: no worker exits over a failover
        # the old master is a replica now: every write went to the new one
        assert master.client().info("replication")["role"] == "slave"
    finally:
        env.stop()
        r.close()


def test_the_cli_follows_the_sentinel_master_through_a_failover(tmp_path, sentinel_pair):
    """The documented `sentinel://` URL works for the real CLI as for the workers: `courier send
    --wait` and `courier status` before and after a failover (e82a350: both exited 3, "Redis ... is
    not answering", while the workers ran on it)."""
    import json

    from adapters.platforms.outbox import read_log

    master, replica, sentinel = sentinel_pair
    url = f"sentinel://127.0.0.1:{sentinel.port}/{MASTER}/0"
    env = CourierEnv(tmp_path / "env", url)
    try:
        env.start_worker(queues="delivery", concurrency=1)
        for chat, text in (("before", "sent before the failover"), ("after", "sent after it")):
            res = env.cli("send", f"outbox:{chat}", "--text", text, "--wait", "--json", "--timeout", "90")
            assert res.returncode == 0, res.stdout + res.stderr
            job = json.loads(res.stdout)["job"]
            st = env.cli("status", job, "--json")
            assert st.returncode == 0 and json.loads(st.stdout)["deliveries"][0]["state"] == "delivered", st.stdout
            assert read_log(env.outbox, chat)[0]["text"] == text
            if chat == "before":
                sentinel.client.execute_command("SENTINEL", "failover", MASTER)
                wait_until(lambda: sentinel.master_port() == replica.port, timeout_s=60, what="the failover")
    finally:
        env.stop()
