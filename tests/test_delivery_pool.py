"""The delivery worker's pool (issue 14): `courier worker -Q delivery` runs
COURIER_DELIVERY_POOL (threads) x COURIER_DELIVERY_CONCURRENCY, and with it
many chats are sent to at once without losing a guarantee: each chat's
order, each part once, correct receipts, the file-id cache. Time limits hold
on the threads pool too (`workers.timelimits`).

Real parts: a real worker process (started the way `courier worker` starts
it), the test Redis, the Telegram fake (tests/fixtures/fake_telegram.py,
an aiohttp Bot API server) driven through python-telegram-bot.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
import uuid

import pytest

from tasks.dispatch import chains
from tasks.ledger import receipts
from tests.fixtures.services import wait_until
from workers.settings import Settings
from workers.worker import pool_for, worker_argv


# -- choosing the pool -------------------------------------------------------------------
def _opts(argv: list[str]) -> list[str]:
    return argv[argv.index("worker") + 1:]


def test_a_delivery_only_worker_gets_the_delivery_pool_from_settings(monkeypatch):
    monkeypatch.setenv("COURIER_DELIVERY_POOL", "threads")
    monkeypatch.setenv("COURIER_DELIVERY_CONCURRENCY", "24")
    s = Settings()
    assert _opts(worker_argv(["-Q", "delivery"], s)) == ["-Q", "delivery", "--pool=threads", "--concurrency=24"]
    assert _opts(worker_argv(["--queues=delivery", "-n", "d@h"], s))[-2:] == ["--pool=threads", "--concurrency=24"]
    # other queues, or a mix, keep Celery's prefork default
    for q in ("turns", "sandbox,janitor", "turns,sandbox,delivery,janitor", "sandbox.gpu1"):
        assert pool_for(q.split(","), s) is None
        assert not any(a.startswith(("--pool", "--concurrency")) for a in worker_argv(["-Q", q], s))
    # what the command line says wins
    assert _opts(worker_argv(["-Q", "delivery", "-P", "prefork", "-c", "3"], s)) == \
        ["-Q", "delivery", "-P", "prefork", "-c", "3"]
    assert _opts(worker_argv(["-Q", "delivery", "--concurrency=5"], s)) == \
        ["-Q", "delivery", "--concurrency=5", "--pool=threads"]


def test_the_delivery_pool_setting_is_checked(monkeypatch):
    from pydantic import ValidationError

    monkeypatch.setenv("COURIER_DELIVERY_POOL", "eventlet")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("COURIER_DELIVERY_POOL", "prefork")
    monkeypatch.setenv("COURIER_DELIVERY_CONCURRENCY", "0")
    with pytest.raises(ValidationError):
        Settings()


# -- time limits on the threads pool ---------------------------------------------------------
def test_the_watchdog_interrupts_a_task_past_its_soft_limit_and_reports_the_hard_one():
    from celery.exceptions import SoftTimeLimitExceeded

    from workers.timelimits import Watchdog

    hard: list[str] = []
    dog = Watchdog(on_hard=lambda name, task_id: hard.append(task_id))
    outcome: dict[str, object] = {}

    def task(task_id: str, soft_s: float, hard_s: float, work_s: float) -> None:
        dog.start_task(task_id, "courier.test", soft_s, hard_s)
        try:
            end = time.monotonic() + work_s
            while time.monotonic() < end:  # Python code: interruptible at any bytecode
                time.sleep(0.01)
            outcome[task_id] = "finished"
        except SoftTimeLimitExceeded:
            outcome[task_id] = "soft limit"
        finally:
            dog.end_task()

    threads = [threading.Thread(target=task, args=("slow", 0.3, 60, 30)),
               threading.Thread(target=task, args=("quick", 5, 60, 0.05))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert outcome == {"slow": "soft limit", "quick": "finished"}
    assert hard == []

    # a thread that ignores the soft limit (stuck, or swallowing it) meets the hard one
    stuck = threading.Event()

    def stubborn() -> None:
        dog.start_task("stuck", "courier.test", 0.1, 0.4)
        try:
            while not stuck.is_set():
                try:
                    time.sleep(0.01)
                except SoftTimeLimitExceeded:
                    pass
        finally:
            dog.end_task()

    t = threading.Thread(target=stubborn)
    t.start()
    try:
        wait_until(lambda: hard == ["stuck"], timeout_s=20, what="the hard limit reported")
    finally:
        stuck.set()
        t.join(timeout=10)
    # a task that ended before its deadlines is never interrupted afterwards
    dog.start_task("done", "courier.test", 0.05, 0.1)
    dog.end_task()
    time.sleep(0.3)  # past both deadlines: nothing may fire (a negative check has to wait)
    assert hard == ["stuck"]


def test_a_soft_limit_landing_inside_end_task_never_arms_a_kill(monkeypatch):
    """Issue 23: the watchdog raised a task's soft limit just as the task ended; the
    exception landed inside `end_task` before it dropped the run, so the finished
    task's hard deadline stayed armed and later ended the idle worker (exit 70).
    Driven deterministically: a fake clock, and a hook that lands the soft limit
    in the task's thread at the instant `end_task` asks for the thread's id
    (exactly what the watchdog's `raise_in_thread` does at the soft deadline)."""
    import types

    from celery.exceptions import SoftTimeLimitExceeded

    from workers import timelimits

    now = [0.0]
    hard: list[str] = []
    dog = timelimits.Watchdog(on_hard=lambda name, task_id: hard.append(task_id), clock=lambda: now[0])
    ending = threading.Event()
    landed: list[int] = []

    def get_ident() -> int:
        ident = threading.get_ident()
        if ending.is_set() and not landed:
            landed.append(ident)
            timelimits.raise_in_thread(ident, SoftTimeLimitExceeded)  # lands at the next bytecode
        return ident

    monkeypatch.setattr(timelimits, "threading", types.SimpleNamespace(**{**vars(threading), "get_ident": get_ident}))
    outcome: list[str] = []

    def task() -> None:
        dog.start_task("finished", "courier.test", 10, 20)
        ending.set()  # the task's work is done: it ends now
        try:
            dog.end_task()
            outcome.append("ended")
        except SoftTimeLimitExceeded:
            outcome.append("the soft limit escaped end_task")

    t = threading.Thread(target=task)
    t.start()
    t.join(timeout=30)
    ending.clear()
    assert landed, "the soft limit never landed inside end_task"
    assert outcome == ["ended"]

    # time passes both deadlines of the finished task, then a new task meets its soft limit:
    # once that one is interrupted, the watchdog has gone past the old deadlines (it is one thread)
    interrupted = threading.Event()
    release = threading.Event()
    started = threading.Event()

    def later() -> None:
        dog.start_task("later", "courier.test", 1, 60)
        started.set()
        try:
            while not release.is_set():
                time.sleep(0.01)
        except SoftTimeLimitExceeded:
            interrupted.set()
        finally:
            dog.end_task()

    u = threading.Thread(target=later)
    now[0] = 30.0
    u.start()
    try:
        wait_until(started.is_set, timeout_s=20, what="the next task started")
        with dog.cond:
            now[0] = 32.0
            dog.cond.notify()
        wait_until(lambda: interrupted.is_set(), timeout_s=20, what="the next task's soft limit")
    finally:
        release.set()
        u.join(timeout=10)
    assert hard == []  # the finished task armed no kill


def test_a_soft_limit_landing_after_the_body_before_postrun_never_arms_a_kill():
    """The same race one step earlier: the limit lands after the task's body returned, in
    Celery's code before `task_postrun` (which then never reaches `end_task`). On the threads
    pool courier's task class runs the body inside `Watchdog.guard`, whose `finally` ends the
    deadlines whatever lands where. Driven as above: a fake clock, and the limit landed by
    the code that runs between the body and the end (as `raise_in_thread` does at the soft
    deadline)."""
    from celery.exceptions import SoftTimeLimitExceeded

    from workers import timelimits

    now = [0.0]
    hard: list[str] = []
    dog = timelimits.Watchdog(on_hard=lambda name, task_id: hard.append(task_id), clock=lambda: now[0])
    outcome: list[str] = []

    def body() -> str:
        return "sent"

    def celery_after_the_body() -> str:  # Celery's trace, between the body and task_postrun
        result = body()
        timelimits.raise_in_thread(threading.get_ident(), SoftTimeLimitExceeded)  # lands right here
        outcome.append("never reached")
        return result

    def task() -> None:
        dog.start_task("finished", "courier.test", 10, 20)
        try:
            dog.guard(celery_after_the_body)
        except SoftTimeLimitExceeded:
            outcome.append("interrupted as it ended")  # the task failed at its soft limit: retried by the ledger

    t = threading.Thread(target=task)
    t.start()
    t.join(timeout=30)
    assert outcome == ["interrupted as it ended"]
    assert not dog.running  # its deadlines ended with it
    # past both deadlines, the watchdog interrupts the next task's soft limit and kills no one
    interrupted, release, started = threading.Event(), threading.Event(), threading.Event()

    def later() -> None:
        dog.start_task("later", "courier.test", 1, 60)
        started.set()
        try:
            while not release.is_set():
                time.sleep(0.01)
        except SoftTimeLimitExceeded:
            interrupted.set()
        finally:
            dog.end_task()

    now[0] = 30.0
    u = threading.Thread(target=later)
    u.start()
    try:
        wait_until(started.is_set, timeout_s=20, what="the next task started")
        with dog.cond:
            now[0] = 32.0
            dog.cond.notify()
        wait_until(interrupted.is_set, timeout_s=20, what="the next task's soft limit")
    finally:
        release.set()
        u.join(timeout=10)
    assert hard == []


# -- a real threads worker, many chats at once -------------------------------------------------
CHATS = 24
JOBS_PER_CHAT = 3
LATENCY_S = 0.1


def _start_delivery_worker(env, concurrency: int, processes: int = 0):
    """`courier worker -Q delivery` (workers.worker), COURIER_DELIVERY_* from the environment
    (processes 0: one per CPU, the default)."""
    from workers.demo import wait_worker

    name = f"pool{uuid.uuid4().hex[:6]}@localhost"
    log = env.tmp / f"worker-{name.split('@')[0]}.log"
    env.env.update(COURIER_DELIVERY_POOL="threads", COURIER_DELIVERY_CONCURRENCY=str(concurrency),
                   COURIER_DELIVERY_PROCESSES=str(processes))
    argv = [os.sys.executable, "-m", "workers.worker", "-Q", "delivery", "-n", name, "--loglevel=WARNING",
            "--without-mingle", "--without-gossip"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(env.env["PYTHONPATH"]))
    env.workers.append(proc)
    assert wait_worker(env.celery_app(), name, proc, timeout_s=90), log.read_text()[-3000:]
    stats = env.celery_app().control.inspect(destination=[name], timeout=5).stats() or {}
    pool = stats.get(name, {}).get("pool", {})
    assert pool.get("max-concurrency") == concurrency and "threads" in pool, pool  # the threads pool
    return proc, log


# -- several processes: one GIL each ---------------------------------------------------------
def test_a_threads_delivery_worker_runs_one_process_by_default_and_each_is_its_own_node(monkeypatch):
    from workers.worker import node_argv, processes_for

    monkeypatch.setenv("COURIER_DELIVERY_POOL", "threads")
    monkeypatch.delenv("COURIER_DELIVERY_PROCESSES", raising=False)
    assert processes_for(["-Q", "delivery"], Settings()) == 1  # the default: one reaches a bot's limit
    monkeypatch.setenv("COURIER_DELIVERY_PROCESSES", "0")
    s = Settings()
    assert processes_for(["-Q", "delivery"], s) == max(1, min(8, len(os.sched_getaffinity(0))))
    monkeypatch.setenv("COURIER_DELIVERY_PROCESSES", "3")
    s = Settings()
    assert processes_for(["-Q", "delivery"], s) == 3
    # prefork is many processes already; other queues are prefork; a pool given wins
    assert processes_for(["-Q", "turns"], s) == 1
    assert processes_for(["-Q", "delivery", "-P", "prefork"], s) == 1
    assert processes_for(["-Q", "delivery", "--pool=threads"], s) == 1
    monkeypatch.setenv("COURIER_DELIVERY_POOL", "prefork")
    assert processes_for(["-Q", "delivery"], Settings()) == 1
    # every process is its own node; the first keeps the name healthchecks ping
    argv = ["celery", "worker", "-Q", "delivery", "-n", "delivery@%h", "--pool=threads"]
    assert node_argv(argv, 0) == argv
    assert node_argv(argv, 1) == ["celery", "worker", "-Q", "delivery", "-n", "delivery-2@%h", "--pool=threads"]
    assert node_argv(["w", "--hostname=d@h"], 2) == ["w", "--hostname=d-3@h"]
    assert node_argv(["w", "-Q", "delivery"], 1) == ["w", "-Q", "delivery", "-n", "celery-2@%h"]


def _pids_of(node: str, supervisor: subprocess.Popen) -> list[int]:
    """Live worker processes of node `node` (not the supervisor, whose command names the first)."""
    out = subprocess.run(["pgrep", "-f", "--", f"celery.* -n {node} "], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != supervisor.pid]


def test_the_delivery_processes_stop_together_warm_on_sigterm_and_one_that_dies_is_restarted(
        courier_env, redis_client, fake_telegram):
    """SIGTERM to `courier worker` reaches each process once (warm shutdown, exit 0).
    A process that dies (SIGKILL) is started again by the supervisor (issue 24: a
    Procfile runner would stop everything if `courier worker` exited); the other
    runs on untouched (what the dead one held is re-driven as after any worker
    loss: tests/chaos). Their log lines name them apart (`<node>-1`, `<node>-2`)."""
    import signal

    from workers.demo import wait_worker

    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    proc, log = _start_delivery_worker(env, concurrency=4, processes=2)
    name = next(a for a in proc.args if "@localhost" in a)
    second = name.replace("@", "-2@")
    assert wait_worker(env.celery_app(), second, proc, timeout_s=90), log.read_text()[-3000:]
    (first_pid,) = _pids_of(name, proc)
    (victim,) = _pids_of(second, proc)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: _pids_of(second, proc) and _pids_of(second, proc) != [victim], timeout_s=60,
               what="the killed process started again")
    assert wait_worker(env.celery_app(), second, proc, timeout_s=90), log.read_text()[-3000:]
    assert proc.poll() is None and _pids_of(name, proc) == [first_pid]  # the other one untouched
    text = log.read_text()
    local = name.split("@")[0]
    assert f"{local}-2 exited with code 137" in text and "restart 1" in text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    wait_until(lambda: not _pids_of(name, proc) and not _pids_of(second, proc), timeout_s=30, what="both processes gone")
    assert "Traceback" not in log.read_text()


def _enqueue(env, r, st, target: str, job_id: str, text: str, name: str, data: bytes) -> None:
    import io

    key = chains.storage_key(job_id, 0, name)
    info = st.put_stream(key, io.BytesIO(data))
    receipts.create_job(r, job_id, kind="send", target=target)
    plan = chains.Plan(job_id=job_id, target=target, text=text, files=[
        chains.StoredFile(key=key, name=name, size=info.size_bytes, sha256=info.sha256 or "")])
    with env.publishing():
        chains.enqueue(r, plan)


def test_a_threads_worker_sends_to_many_chats_at_once_keeping_every_guarantee(courier_env, redis_client,
                                                                           fake_telegram):
    fake_telegram.latency_s = LATENCY_S  # a remote API: the worker's threads overlap their waits
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    from workers.wiring import store

    st = store(env.settings())
    r = redis_client
    _, log = _start_delivery_worker(env, concurrency=8)
    shared = os.urandom(2048)  # the same bytes to every chat: uploaded, then sent by file id
    chats = [str(910000 + i) for i in range(CHATS)]
    jobs: dict[str, list[str]] = {c: [] for c in chats}
    for k in range(JOBS_PER_CHAT):  # round robin: the chats interleave in the queue
        for chat in chats:
            job_id = f"pool_{chat}_{k}"
            data = shared if k == 0 else os.urandom(1024)
            _enqueue(env, r, st, f"telegram:{chat}", job_id, f"m {chat} {k}", f"{chat}-{k}.txt", data)
            jobs[chat].append(job_id)

    def all_final() -> bool:
        return all(rows and all(d.get("state") in receipts.TERMINAL for d in rows)
                   for rows in (receipts.job_deliveries(r, j) for js in jobs.values() for j in js))

    wait_until(all_final, timeout_s=240, interval_s=0.2, what="every delivery final")
    calls = fake_telegram.calls_for(ok=True)
    by_mid = {(c.chat, str(c.result["message_id"])): c for c in calls}
    assert len(by_mid) == len(calls) == CHATS * JOBS_PER_CHAT * 2, "each part sent once"
    for chat in chats:
        got = []
        for c in fake_telegram.calls_for(chat=chat, ok=True):
            if c.method == "sendMessage":
                got.append(c.text)
            else:  # an upload names the file; a send by file id (the shared bytes) does not
                got.append(next(iter(c.files.values())).filename if c.files else f"{chat}-0.txt (by file id)")
        want = []
        for k in range(JOBS_PER_CHAT):
            want += [f"m {chat} {k}", f"{chat}-{k}.txt"]
        if got[1:2] == [f"{chat}-0.txt (by file id)"]:
            want[1] = got[1]
        assert got == want, (chat, got)
        for k, job_id in enumerate(jobs[chat]):
            rows = receipts.job_deliveries(r, job_id)
            assert [d["state"] for d in rows] == ["delivered", "delivered"], rows
            for d in rows:
                assert d["attempts"] == "1", d
                call = by_mid[(chat, d["message_id"])]  # the receipt names the message the chat got
                assert call.method == ("sendMessage" if d["kind"] == "text" else "sendDocument"), (d, call)
    # the file-id cache: the shared bytes were uploaded by the first sends only, the rest went by file id
    sha = hashlib.sha256(shared).hexdigest()
    uploads = [p for p in fake_telegram.uploads() if p.sha256 == sha]
    by_id = [c for c in calls if c.method == "sendDocument" and not c.files]
    assert 1 <= len(uploads) and len(uploads) + len(by_id) == CHATS
    # and the worker did send to several chats at once (requests in flight together)
    times = sorted(c.t for c in calls)
    most = max(sum(1 for u in times if t <= u < t + LATENCY_S * 0.9) for t in times)
    assert most >= 3, f"at most {most} requests in flight at once"
    assert "Traceback" not in log.read_text()


def test_a_file_sent_again_to_every_chat_goes_by_file_id_on_the_threads_pool(courier_env, redis_client,
                                                                            fake_telegram):
    """Once the cache holds a file id, concurrent sends of the same bytes upload nothing."""
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    from workers.wiring import store

    st = store(env.settings())
    r = redis_client
    _start_delivery_worker(env, concurrency=6)
    data = os.urandom(4096)
    _enqueue(env, r, st, "telegram:920000", "fid_first", "first", "same.txt", data)
    wait_until(lambda: all(d.get("state") == "delivered" for d in receipts.job_deliveries(r, "fid_first") or [{}]),
               timeout_s=120, what="the first send")
    ids = [f"fid_{i}" for i in range(12)]
    for i, job_id in enumerate(ids):
        _enqueue(env, r, st, f"telegram:{920001 + i}", job_id, f"t{i}", "same.txt", data)
    wait_until(lambda: all(d.get("state") == "delivered" for j in ids for d in receipts.job_deliveries(r, j) or [{}]),
               timeout_s=120, what="the sends by file id")
    sha = hashlib.sha256(data).hexdigest()
    assert len([p for p in fake_telegram.uploads() if p.sha256 == sha]) == 1
    assert len([c for c in fake_telegram.calls_for("sendDocument", ok=True) if not c.files]) == len(ids)


def test_courier_worker_hands_every_option_to_the_launcher(monkeypatch):
    from typer.testing import CliRunner

    import workers.worker
    from workers.cli import app

    got: list[list[str]] = []
    monkeypatch.setattr(workers.worker, "main", lambda args: got.append(args))
    res = CliRunner().invoke(app, ["worker", "-Q", "delivery", "-n", "d@%h", "--concurrency=4"])
    assert res.exit_code == 0, res.output
    assert got == [["-Q", "delivery", "-n", "d@%h", "--concurrency=4"]]


def test_a_platform_call_waiting_on_the_loop_is_interrupted_by_the_soft_limit():
    """The adapters' calls wait in slices (`_aio.run`: the caller waits on the process's
    loop in slices), so the watchdog's exception reaches a thread blocked on a slow
    platform promptly."""
    import asyncio

    from celery.exceptions import SoftTimeLimitExceeded

    from adapters.platforms import _aio
    from workers.timelimits import Watchdog

    dog = Watchdog(on_hard=lambda *a: None)
    cancelled = threading.Event()
    outcome: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def task() -> None:  # a drive's platform call
        dog.start_task("t", "courier.test", 0.3, None)
        try:
            _aio.run(slow(), 120)
            outcome.append("finished")
        except SoftTimeLimitExceeded:
            outcome.append("soft limit")
        finally:
            dog.end_task()

    t = threading.Thread(target=task)
    started = time.monotonic()
    t.start()
    t.join(timeout=30)
    assert outcome == ["soft limit"] and time.monotonic() - started < 20
    assert cancelled.wait(10)  # the abandoned call's coroutine is cancelled on the loop
    assert _aio.run(asyncio.sleep(0, "still serving"), 10) == "still serving"


def test_a_hung_send_on_a_threads_worker_is_cut_at_the_soft_limit_and_retried(courier_env, redis_client,
                                                                            fake_telegram):
    """COURIER_DELIVERY_TIME_LIMIT_S on the threads pool: a send the Bot API does not
    answer is interrupted (as prefork's SIGUSR1 does), counted transient, and
    retried by the ledger; the worker lives on."""
    env = courier_env(TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url,
                      COURIER_DELIVERY_TIME_LIMIT_S="10")
    from workers.wiring import store

    st = store(env.settings())
    r = redis_client
    proc, log = _start_delivery_worker(env, concurrency=4)
    fake_telegram.latency_s = 25  # the first call hangs (past the 10 s soft limit)
    started = time.monotonic()
    _enqueue(env, r, st, "telegram:930000", "hung", "t", "hung.txt", os.urandom(512))
    # the count and the reason are two writes: wait for the reason the assertion reads
    rows = wait_until(lambda: [d for d in receipts.job_deliveries(r, "hung")
                               if d.get("transient_errors") and d.get("reason")] or None,
                      timeout_s=90, interval_s=0.2, what="the hung send cut")
    assert "SoftTimeLimitExceeded" in rows[0].get("reason", ""), rows
    assert time.monotonic() - started < 60
    fake_telegram.latency_s = 0.0
    wait_until(lambda: all(d.get("state") == "delivered" for d in receipts.job_deliveries(r, "hung") or [{}]),
               timeout_s=90, what="the retry delivered")
    assert proc.poll() is None  # the soft limit ended the task's run, not the worker
    assert "passed its soft time limit" in log.read_text()
    # the fake's abandoned handlers finish their wait before it stops
    wait_until(lambda: fake_telegram.in_flight == 0, timeout_s=60, what="the fake idle")
