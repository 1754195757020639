"""Log lines (issue 24): `COURIER_LOG_FORMAT=json` gives one JSON object a line in every process
(ts, level, process, logger, message; the job, delivery or lane a task ran for; never chat text or a
secret), and the plain format has a time and a level everywhere (e82a350: the web process's lines
had neither)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx

from tests.fixtures.services import free_port, stop_process, wait_until
from tests.fixtures.workers import ROOT, CourierEnv

TEXT = "the chat's own words 7f3a"


def test_a_json_worker_logs_objects_with_the_tasks_ids_and_no_chat_text(tmp_path, redis_server):
    from workers.celery_app import make_app
    from workers.demo import stop_worker, wait_worker

    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_LOG_FORMAT="json")
    name = f"json{__import__('uuid').uuid4().hex[:8]}@localhost"
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-n", name,
                                 "--pool=prefork", "--concurrency=1", "--loglevel=DEBUG", "--without-mingle",
                                 "--without-gossip"], env=env.env, cwd=str(ROOT), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        assert wait_worker(make_app(env.settings()), name, proc, 60), log.read_text()[-3000:]
        res = env.cli("send", "outbox:logs", "--text", TEXT, "--wait", "--json")
        assert res.returncode == 0, res.stderr
        (env.sandbox / "x.txt").write_text("x")
        res = env.cli("send", "outbox:logs", f"local://{env.sandbox}/x.txt", "--wait", "--json")
        assert res.returncode == 0, res.stderr
        job = json.loads(res.stdout)["job"]
    finally:
        stop_worker(proc)
    text = log.read_text()
    objs = []
    for ln in text.splitlines():
        if ln.startswith("{"):
            o = json.loads(ln)
            assert {"ts", "level", "process", "pid", "logger", "message"} <= set(o), o
            objs.append(o)
    assert len(objs) > 10, text[-3000:]
    # Celery's banner goes to stdout before logging is set up; every logged line is an object
    logged = [ln for ln in text.splitlines() if re.match(r"^\[?\d{4}-\d\d-\d\d", ln)]
    assert not logged, logged[:5]
    assert TEXT not in text
    assert any(o.get("delivery") == f"{job}.0" and o.get("job") == job for o in objs), objs[-30:]
    assert any(o.get("lane") == "outbox:logs" for o in objs)


def test_the_web_process_lines_have_a_time_and_a_level(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    port = free_port()
    log = tmp_path / "web.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(port)],
                                env=env.env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code in (200, 503), 60,
                   what="the web process")
    finally:
        stop_process(proc)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    assert lines
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d{3}Z? (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+: ")
    assert all(stamp.match(ln) for ln in lines if not ln.startswith((" ", "Traceback"))), lines


def test_each_process_of_courier_worker_logs_under_its_own_name(tmp_path):
    """Issue 24: both delivery processes logged as `MainProcess`. `courier worker` names each
    (COURIER_PROCESS_NAME: `<node>-1`, `<node>-2`), and the worker takes the name once Celery has
    set up its logging. (A real 2-process worker's log: tests/test_metrics.py.)"""
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout); "
            "from workers import celery_app; celery_app._redact_logs(); "
            "logging.getLogger('courier.test').warning('hello')")
    env = CourierEnv(tmp_path / "env", "redis://127.0.0.1:1/0")
    for name, want in (("delivery-2", " delivery-2["), (None, " MainProcess[")):
        e = dict(env.env)
        if name:
            e["COURIER_PROCESS_NAME"] = name
        res = subprocess.run([sys.executable, "-c", code], env=e, cwd=str(ROOT), capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        line = next(ln for ln in res.stdout.splitlines() if ln.endswith("courier.test: hello"))
        assert want in line, line
