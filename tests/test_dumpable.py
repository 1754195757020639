"""Every courier process is non-dumpable (`prctl(PR_SET_DUMPABLE, 0)` when
`workers` is imported, before anything else): another process of the same
uid (an agent on the local sandbox, anything the worker's user runs) cannot
read its /proc/<pid>/environ, mem or fds. On main (e82a350) an agent read
COURIER_REDIS_URL and the bot tokens from its ancestors' environ.

For real: a worker (its main process and its prefork pool child) and the
web process run as an unprivileged uid on a data dir it owns; a second
process of that uid reads /proc/<pid>/environ of each: EACCES. A plain
process of that uid (the control) stays readable to it, so the refusal is
the processes' own doing.

The interpreter lives under /root (mode 0700) on the test machines: every
process here, readers included, runs with the one capability that lets it
reach the interpreter, CAP_DAC_READ_SEARCH (setpriv's ambient set). Same
uid, same capabilities: reading a dumpable process's environ is allowed,
reading a non-dumpable one's needs CAP_SYS_PTRACE, which none has."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from tests.fixtures.services import free_port, need, stop_process, wait_until
from tests.fixtures.workers import ROOT, CourierEnv

pytestmark = pytest.mark.slow

UID = 64000
SECRET = "bot-token-" + uuid.uuid4().hex


def _as_uid() -> list[str]:
    exe = shutil.which("setpriv")
    need(exe is not None, "setpriv is not installed (util-linux)")
    need(os.geteuid() == 0, "running processes as another uid needs root")
    return [exe, f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", "--"]


def _read_environ(pid: int, env: dict) -> str:
    """What a second process of the uid gets reading /proc/<pid>/environ: the errno's
    name, or "read <n> bytes" (and whether the secret was among them)."""
    code = ("import sys\n"
            f"try: data = open('/proc/{pid}/environ', 'rb').read()\n"
            "except OSError as e: print(__import__('errno').errorcode[e.errno]); sys.exit()\n"
            f"print('read', len(data), 'secret' if {SECRET.encode()!r} in data else '')")
    res = subprocess.run([*_as_uid(), sys.executable, "-I", "-S", "-c", code], env=env, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_worker_and_web_processes_cannot_be_read_by_their_own_uid(redis_server, redis_client, tmp_path):
    prefix = _as_uid()
    home = tmp_path / "home"
    env = CourierEnv(home, redis_server.url, TELEGRAM_BOT_TOKEN=SECRET, HOME=str(home),
                     PYTHONDONTWRITEBYTECODE="1")
    env.data_dir.mkdir(parents=True)
    for p in (home, env.data_dir, env.sandbox, *env.data_dir.parents):
        if p == tmp_path.parent:
            break
        os.chown(p, UID, UID)
    name = f"dump{uuid.uuid4().hex[:6]}@localhost"
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115
    web_port = free_port()
    procs = [
        subprocess.Popen([*prefix, sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q",
                          "turns", "--pool=prefork", "--concurrency=1", "-n", name, "--without-mingle",
                          "--without-gossip", "--loglevel=WARNING"],
                         env=env.env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT),
        subprocess.Popen([*prefix, sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1",
                          "--port", str(web_port)], env=env.env, cwd=str(ROOT), stdout=log,
                         stderr=subprocess.STDOUT),
        subprocess.Popen([*prefix, sys.executable, "-I", "-S", "-c", "import time; time.sleep(120)"], env=env.env),
    ]
    worker, web, control = procs
    try:
        from workers.demo import wait_worker

        assert wait_worker(env.celery_app(), name, worker, timeout_s=60), (tmp_path / "worker.log").read_text()
        child = wait_until(lambda: _children(worker.pid), timeout_s=30, what="the worker's pool child")[0]

        def web_up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{web_port}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(web_up, timeout_s=60, what=lambda: f"web: {(tmp_path / 'worker.log').read_text()[-2000:]}")
        for pid in (worker.pid, child, web.pid, control.pid):
            assert Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0] == str(UID), pid
        assert _read_environ(control.pid, env.env) == "read " + str(
            len(Path(f"/proc/{control.pid}/environ").read_bytes())) + " secret"  # same uid: readable
        seen = {what: _read_environ(pid, env.env) for what, pid in
                (("worker", worker.pid), ("pool child", child), ("web", web.pid))}
        assert seen == dict.fromkeys(seen, errno.errorcode[errno.EACCES]), seen
    finally:
        for p in procs:
            stop_process(p)
        log.close()
