"""`courier worker` keeps its Celery workers running (issue 24, "workers outlive
Redis"): a Procfile runner stops every process when one exits, so the worker
process it starts must not exit while it is wanted.

- unit: the supervisor (`workers.worker.supervise`) restarts a child that exits,
  at once after a deliberate recycle (70, 71), after a back-off otherwise; a
  configuration exit (78) is not restarted and ends it with that code; SIGTERM
  reaches the child and the supervisor exits with the child's code.
- real: `courier worker -Q delivery` (`python -m workers.worker`) on its own
  Redis (AOF), which is restarted 5 times (shutdown and SIGKILL) and its Celery
  worker SIGKILLed once: the supervisor never exits and a delivery sent after
  each fault arrives. A prefork worker whose pool child is killed while it
  starts (Celery: `WorkerLostError('Could not start worker processes')`, exit 1)
  is started again and delivers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.fixtures.faults import children_of, outage
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.services import stop_process, wait_until
from tests.fixtures.workers import ROOT, CourierEnv
from workers.worker import BACKOFF_CAP_S, backoff_s

CHILD = """\
import pathlib, signal, sys
runs = pathlib.Path(sys.argv[1])
n = len(runs.read_text()) if runs.exists() else 0
runs.write_text("x" * (n + 1))
codes = sys.argv[2].split(",")
code = codes[n] if n < len(codes) else "wait"
if code == "wait":  # run until told to stop (Celery's warm shutdown ends with 0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pathlib.Path(sys.argv[1] + ".up").write_text(str(n + 1))
    while True:
        signal.pause()
sys.exit(int(code))
"""


def _supervisor(tmp_path: Path, codes: str) -> tuple[subprocess.Popen, Path, Path]:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    runs, log = tmp_path / "runs", tmp_path / "supervisor.log"
    code = ("import sys; from workers.worker import supervise; "
            f"sys.exit(supervise([[sys.executable, {str(child)!r}, {str(runs)!r}, {codes!r}]]))")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, runs, log


def test_the_back_off_doubles_up_to_its_cap():
    assert [backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, BACKOFF_CAP_S, BACKOFF_CAP_S]


def test_a_recycled_child_is_started_again_and_sigterm_ends_the_supervisor_with_its_code(tmp_path):
    proc, runs, log = _supervisor(tmp_path, "71,70,1")
    try:
        # 71 and 70 (a recycle) restart at once, 1 after the back-off; the fourth run stays up
        wait_until(lambda: Path(f"{runs}.up").exists(), timeout_s=60, what="the fourth run up")
        assert proc.poll() is None
        assert Path(f"{runs}.up").read_text() == "4"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        stop_process(proc)
    text = log.read_text()
    assert "exited with code 71" in text and "restart 1 in 0 s" in text
    assert "exited with code 70" in text and "restart 2 in 0 s" in text
    assert "exited with code 1 " in text and "restart 3 in 1 s" in text


def test_a_configuration_exit_is_not_restarted(tmp_path):
    proc, runs, log = _supervisor(tmp_path, "1,78,0")
    assert proc.wait(timeout=60) == 78
    assert runs.read_text() == "xx"  # started twice: after 1 (restarted), 78 ends it
    assert "configuration error" in log.read_text()


def test_a_worker_stopped_on_purpose_is_not_restarted(tmp_path):
    """Exit 0 by itself: `celery control shutdown` (Flower's button) was obeyed."""
    proc, runs, log = _supervisor(tmp_path, "0")
    assert proc.wait(timeout=60) == 0
    assert runs.read_text() == "x" and "not restarted" in log.read_text()


def test_a_bad_setting_ends_courier_worker_with_ex_config(tmp_path):
    env = CourierEnv(tmp_path / "env", "redis://127.0.0.1:1/0", COURIER_DELIVERY_POOL="eventlet")
    res = subprocess.run([sys.executable, "-m", "workers.worker", "-Q", "delivery"], env=env.env, cwd=str(ROOT),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 78, res.stderr[-2000:]
    assert "COURIER_DELIVERY_POOL" in res.stderr or "DELIVERY_POOL" in res.stderr
    env.env.pop("COURIER_DELIVERY_POOL")
    res = subprocess.run([sys.executable, "-m", "workers.worker", "-Q", "delivery", "--detach"], env=env.env,
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert res.returncode == 78 and "--detach" in res.stderr, res.stderr[-2000:]


# -- a real worker, a real Redis restarted under it -------------------------------------------------
@pytest.fixture
def own_redis(tmp_path):
    srv = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    srv.dir.mkdir()
    srv.start()
    yield srv
    srv.stop()


def _courier_worker(env: CourierEnv, *args: str) -> tuple[subprocess.Popen, str, Path]:
    name = f"sup{uuid.uuid4().hex[:6]}@localhost"
    log = env.tmp / f"{name.split('@')[0]}.log"
    argv = [sys.executable, "-m", "workers.worker", *args, "-n", name, "--loglevel=WARNING",
            "--without-mingle", "--without-gossip"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    env.workers.append(proc)
    return proc, name, log


def _send(env: CourierEnv, r, chat: str, text: str) -> None:
    from adapters.platforms.outbox import read_log
    from tasks.dispatch import chains

    with env.publishing():
        chains.enqueue(r, chains.Plan(job_id=f"sup_{uuid.uuid4().hex[:10]}", target=f"outbox:{chat}", text=text),
                       job_kind="send")
    wait_until(lambda: text in [row.get("text") for row in read_log(env.outbox, chat)], timeout_s=120,
               interval_s=0.1, what=f"{text!r} delivered")


def _stop_redis(srv: RedisServer, r, how: str) -> None:
    import redis

    assert srv.proc is not None
    if how == "shutdown":
        try:
            r.shutdown()
        except redis.ConnectionError:
            pass  # it went away while answering
    else:
        srv.proc.kill()
    srv.proc.wait(timeout=20)
    srv.proc = None


@pytest.mark.slow
def test_courier_worker_outlives_redis_restarts_and_its_worker_being_killed(tmp_path, own_redis):
    from workers.demo import wait_worker

    env = CourierEnv(tmp_path / "env", own_redis.url, COURIER_DELIVERY_PROCESSES="1",
                     COURIER_DELIVERY_CONCURRENCY="2")
    r = own_redis.client()
    proc, name, log = _courier_worker(env, "-Q", "delivery")
    try:
        assert wait_worker(env.celery_app(), name, proc, timeout_s=90), log.read_text()[-3000:]
        (celery_worker,) = children_of(proc.pid)  # the supervisor runs the Celery worker as its child
        _send(env, r, "sup", "before")
        for i in range(5):
            _stop_redis(own_redis, r, "shutdown" if i % 2 == 0 else "kill")
            outage(2.0)
            own_redis.start()
            _send(env, r, "sup", f"after restart {i + 1}")
            assert proc.poll() is None, log.read_text()[-3000:]
        # the Celery worker itself dies: the supervisor starts another (after its back-off)
        os.kill(children_of(proc.pid)[0], signal.SIGKILL)
        wait_until(lambda: children_of(proc.pid) and children_of(proc.pid)[0] != celery_worker, timeout_s=60,
                   what="a new Celery worker")
        _send(env, r, "sup", "after the kill")
        assert proc.poll() is None
        assert "exited with code 137" in log.read_text()
        # and counted, where the worker's processes count (its exporter and the web process read it)
        from prometheus_client.multiprocess import MultiProcessCollector

        from workers.metrics import default_multiproc_dir

        files = [str(p) for p in default_multiproc_dir(env.settings()).glob("*.db")]
        counted = {(s.name, s.labels.get("worker"), s.labels.get("code")): s.value
                   for m in MultiProcessCollector.merge(files) for s in m.samples}
        assert counted.get(("courier_worker_restarts_total", name.split("@")[0], "137")) == 1, counted
        proc.send_signal(signal.SIGTERM)  # warm shutdown, the child's code
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        env.stop()
        r.close()


@pytest.mark.slow
def test_a_pool_child_killed_while_the_worker_starts_is_recovered(tmp_path, own_redis):
    """Celery checks its pool once, when its consumer first runs: a pool child lost before that
    ends it (`WorkerLostError`, exit 1). Redis is down while the worker starts, so the pool is up
    and the consumer waits: the child is killed in that window, deterministically."""
    from workers.demo import wait_worker

    env = CourierEnv(tmp_path / "env", own_redis.url)
    r = own_redis.client()
    _stop_redis(own_redis, r, "shutdown")
    proc, name, log = _courier_worker(env, "-Q", "delivery", "-P", "prefork", "-c", "2")
    try:
        def a_pool_child() -> int | None:
            # the Celery worker (the supervisor's child, or the process itself once it execs celery)
            for top in [proc.pid, *children_of(proc.pid)]:
                kids = children_of(top)
                if len(kids) >= 2:  # its prefork pool (-c 2)
                    return kids[0]
            return None

        victim = wait_until(a_pool_child, timeout_s=60, what="the pool's children")
        os.kill(victim, signal.SIGKILL)
        own_redis.start()
        assert wait_worker(env.celery_app(), name, proc, timeout_s=120), log.read_text()[-3000:]
        _send(env, r, "pool", "after the pool child was lost")
        assert proc.poll() is None
        text = log.read_text()
        assert "Could not start worker processes" in text and "exited with code 1 " in text, text[-3000:]
    finally:
        env.stop()
        r.close()
