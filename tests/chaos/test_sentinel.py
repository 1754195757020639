"""Redis high availability: COURIER_REDIS_URL names a Sentinel-managed master,
and a failover in the middle of a run loses nothing. Real redis-server
processes on loopback: a master, a replica, and a sentinel (redis-server
--sentinel)."""

from __future__ import annotations

import contextlib
import subprocess
import time

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
    def __init__(self, tmp, master_port: int, down_after_ms: int = 1000) -> None:
        self.dir = tmp
        self.port = free_port()
        self.conf = tmp / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {tmp}\nlogfile {tmp / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} {down_after_ms}\n"
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


@contextlib.contextmanager
def _sentinel_pair(tmp, down_after_ms: int = 1000):
    """A master, its replica (AOF, fsync always) and a sentinel watching them."""
    for d in ("m", "r", "s"):
        (tmp / d).mkdir(parents=True)
    master = RedisServer(tmp / "m", appendonly=True, appendfsync="always").start()
    replica = RedisServer(tmp / "r", appendonly=True, appendfsync="always",
                          extra_args=("--replicaof", "127.0.0.1", str(master.port))).start()
    _wait_in_sync(replica)
    sentinel = Sentinel(tmp / "s", master.port, down_after_ms)
    try:
        wait_until(lambda: sentinel.client.execute_command("SENTINEL", "replicas", MASTER), timeout_s=30,
                   what="the sentinel to see the replica")
        yield master, replica, sentinel
    finally:
        sentinel.stop()
        replica.stop()
        master.stop()


def _wait_in_sync(replica: RedisServer) -> None:
    rep = replica.client()
    try:
        wait_until(lambda: rep.info("replication").get("master_link_status") == "up", timeout_s=60,
                   what=f"the replica on {replica.port} in sync")
    finally:
        rep.close()


@pytest.fixture
def sentinel_pair(tmp_path):
    with _sentinel_pair(tmp_path) as pair:
        yield pair


def test_ten_restarts_and_three_failovers_lose_nothing(tmp_path, fake_telegram):
    """Issue 24's fleet row: 300 deliveries (150 jobs of a text and a sandbox file, to 15 chats)
    through 3 workers started as the Procfile starts them (`courier worker`: two prefork workers on
    every queue, one threads worker on `delivery`), connected through a sentinel, while Redis's
    master is restarted 10 times (SHUTDOWN, or SIGKILL and AOF replay) and fails over 3 times
    (two graceful `SENTINEL FAILOVER`s, one hard: the master SIGKILLed and left down until the
    replica is promoted). 0 lost, each chat's order kept, 0 `courier worker` exits, and no chat waits
    more than 60 s between its messages. (e82a350: 4 worker exits in 6 Redis restarts.)"""
    events = ["restart", "kill", "failover", "restart", "kill", "restart", "hard failover", "restart",
              "kill", "restart", "failover", "kill", "restart"]
    assert events.count("failover") + events.count("hard failover") == 3 and len(events) == 13
    # down-after 5 s: a restart (well under it) is not taken for a failure; a hard kill is, after it
    with _sentinel_pair(tmp_path / "redis", down_after_ms=5000) as (first, second, sentinel):
        servers = {s.port: s for s in (first, second)}
        url = f"sentinel://127.0.0.1:{sentinel.port}/{MASTER}/0"
        env = CourierEnv(tmp_path / "env", url, TELEGRAM_BOT_TOKEN=fake_telegram.token,
                         COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
        r = redis_client(url)
        try:
            workers = [env.start_worker(concurrency=2, supervised=True),
                       env.start_worker(concurrency=2, supervised=True),
                       env.start_worker(queues="delivery", pool="threads", concurrency=8, supervised=True)]
            chats = [f"telegram:{7400 + i}" for i in range(8)] + [f"outbox:f{i}" for i in range(7)]
            run = Run(env, r, fake_telegram, chats, jobs_per_chat=10)
            t0 = time.time()
            run.enqueue_all()
            assert len(run.ids) == 300
            for n, event in enumerate(events):
                at = 10 + n * 18
                wait_until(lambda: run.delivered() >= at, timeout_s=180, interval_s=0.1,
                           what=lambda: f"{at} deliveries before {event} #{n + 1} (now {run.states()})")
                master = servers[sentinel.master_port()]
                other = next(s for s in servers.values() if s is not master)
                if event in ("restart", "kill"):
                    if event == "restart":
                        with contextlib.suppress(redis.ConnectionError):
                            master.client().shutdown()  # AOF fsynced on every write: nothing is lost
                    else:
                        master.proc.kill()
                    master.proc.wait(timeout=20)
                    master.extra_args = ()  # back as the master it was
                    master.start()
                elif event == "failover":
                    sentinel.client.execute_command("SENTINEL", "failover", MASTER)
                    wait_until(lambda: sentinel.master_port() == other.port, timeout_s=60, what="the failover")
                else:
                    master.proc.kill()
                    master.proc.wait(timeout=20)
                    wait_until(lambda: sentinel.master_port() == other.port, timeout_s=60,
                               what="the sentinel to promote the replica")
                    master.extra_args = ("--replicaof", "127.0.0.1", str(other.port))
                    master.start()
                # the next fault starts from a healthy pair: the replica in sync with the master
                new_master = servers[sentinel.master_port()]
                _wait_in_sync(next(s for s in servers.values() if s is not new_master))
                assert all(w.poll() is None for w in workers), f"a courier worker exited after {event} #{n + 1}"
            # what was done on the old master between a graceful failover's promotion and the
            # sentinel's announcement is replayed from the new master's history (see
            # test_failover_mid_run...): duplicates bounded, first arrivals exact
            run.check(max_duplicates=120)
            idle, chat = run.longest_idle(t0)
            print(f"longest a chat waited: {idle:.1f} s ({chat})")
            assert idle <= 60, f"{chat} waited {idle:.1f} s between two of its messages"
            assert all(w.poll() is None for w in workers)  # 0 `courier worker` exits
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


def test_a_platform_that_stops_answering_during_a_failover_holds_its_chat_under_a_minute(
        tmp_path, sentinel_pair, fake_telegram):
    """Issue 24's lease row: after a graceful failover a pool child stopped working while its
    heartbeat kept renewing its lane's lease, and 9 deliveries waited 12.5 minutes. Here the
    platform stops answering in the middle of a send and Redis fails over meanwhile: the stuck drive
    makes no progress, loses the chat's lane, its pool process is replaced, and once the platform
    answers again the chat moves on, in order, through the new master, within a minute; the
    `courier worker` never exits."""
    import json

    from tests.fixtures.faults import children_of

    master, replica, sentinel = sentinel_pair
    url = f"sentinel://127.0.0.1:{sentinel.port}/{MASTER}/0"
    env = CourierEnv(tmp_path / "env", url, COURIER_LEASE_STALL_S="5", TELEGRAM_BOT_TOKEN=fake_telegram.token,
                     COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    r = redis_client(url)
    try:
        w = env.start_worker(queues="delivery", concurrency=1, supervised=True)
        fake_telegram.latency_s = 50.0  # the platform stops answering (under the SDK's read timeout)
        jobs = []
        for text in ("first", "second", "third"):
            res = env.cli("send", "telegram:4343", "--text", text, "--json")
            assert res.returncode == 0, res.stdout + res.stderr
            jobs.append(json.loads(res.stdout)["job"])
        from tasks.ledger import keys, receipts

        lease = keys.lease("lane", "telegram:4343")
        wait_until(lambda: r.exists(lease), 30, what="the drive to hold the lane")

        def pool() -> set[int]:  # `courier worker` -> its Celery worker -> the pool process
            return {pid for celery in children_of(w.pid) for pid in children_of(celery)}

        stuck = pool()
        assert stuck
        sentinel.client.execute_command("SENTINEL", "failover", MASTER)
        wait_until(lambda: sentinel.master_port() == replica.port, timeout_s=60, what="the failover")
        # no progress: the lease lapses (5 s without progress + its 20 s), the stuck process goes
        wait_until(lambda: not r.exists(lease), 60, what="the stuck drive to lose the lane")
        wait_until(lambda: pool() and not (stuck & pool()), 60, what="the stuck pool process to be replaced")
        fake_telegram.latency_s = 0.0  # the platform answers again
        wait_until(lambda: all((receipts.job_deliveries(r, j) or [{}])[0].get("state") == "delivered" for j in jobs),
                   60, what="the chat to move on within a minute")
        texts = list(dict.fromkeys(c.text for c in fake_telegram.calls_for("sendMessage", chat="4343", ok=True)))
        assert texts == ["first", "second", "third"]
        assert w.poll() is None  # the `courier worker` outlived the failover and the recycle
        assert master.client().info("replication")["role"] == "slave"
    finally:
        fake_telegram.latency_s = 0.0
        env.stop()
        r.close()
