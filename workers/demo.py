"""`courier demo`: the whole pipeline on embedded defaults: Redis (COURIER_REDIS_URL, else an
embedded one), a worker serving every queue, the demo agent, live phases, deliveries to the
outbox (or `--to`) and a table of what arrived. What it started is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workers.embedded import stop_worker


def worker_options(name: str, *, queues: str = "turns,sandbox,delivery,janitor", concurrency: int = 2,
                   pool: str = "prefork") -> list[str]:
    """A worker's options in the demo (and the tests): after `celery -A workers.celery_app worker`
    or `python -m workers.worker`."""
    return ["-Q", queues, f"--pool={pool}", f"--concurrency={concurrency}", "-n", name, "--loglevel=WARNING",
            "--without-mingle", "--without-gossip"]


def start_worker(env: dict[str, str], name: str, *, queues: str = "turns,sandbox,delivery,janitor",
                 concurrency: int = 2, log_path: str | None = None, pool: str = "prefork") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker",
           *worker_options(name, queues=queues, concurrency=concurrency, pool=pool)]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL,
                            cwd=str(Path(__file__).resolve().parent.parent))


def wait_worker(app, name: str, proc: subprocess.Popen, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if app.control.ping(destination=[name], timeout=0.5):
                return True
        except Exception:  # noqa: BLE001 - broker still starting
            time.sleep(0.2)
    return False


def run_demo(*, to: str | None, message: str, timeout_s: float, console: Console, err: Console) -> int:
    from workers.embedded import ensure_redis, redact_url
    from workers.settings import get_settings, reset_settings

    settings = get_settings()
    try:
        redis_srv = ensure_redis(settings.redis_url)
    except RuntimeError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return 3
    worker = None
    try:
        if redis_srv.embedded:
            console.print(f"Redis at {escape(redact_url(settings.redis_url))} is not answering: "
                          f"started an embedded one at {escape(redact_url(redis_srv.url))}", highlight=False)
        else:
            console.print(f"using Redis at {escape(redact_url(redis_srv.url))}", highlight=False)
        os.environ["COURIER_REDIS_URL"] = redis_srv.url
        if not os.environ.get("COURIER_DATA_DIR"):
            os.environ["COURIER_DATA_DIR"] = tempfile.mkdtemp(prefix="courier-demo-")
        reset_settings()
        settings = get_settings()
        target = to or "outbox:demo"
        from adapters.errors import ConfigError
        from adapters.platforms.base import split_target
        from workers.wiring import check_platform

        try:
            check_platform(split_target(target)[0], settings)
        except ConfigError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            return 2

        import workers.celery_app as celery_app
        from workers.redis_url import celery_ssl, celery_url

        celery_app.app.conf.broker_url = celery_app.app.conf.result_backend = celery_url(settings.redis_url)[0]
        celery_app.app.conf.broker_use_ssl = celery_app.app.conf.redis_backend_use_ssl = celery_ssl(settings.redis_url)
        import tasks.celery_tasks  # noqa: F401
        from tasks.dispatch import chains
        from tasks.states import DeliveryState
        from workers.console import deliveries_table, wait_deliveries, watch_job
        from workers.wiring import redis_client

        name = f"demo-{os.getpid()}@localhost"
        console.print("starting a worker …")
        worker = start_worker(dict(os.environ), name)
        if not wait_worker(celery_app.app, name, worker):
            err.print("[bold red]error:[/] the worker did not start (run `celery -A workers.celery_app worker` "
                      "to see why)")
            return 3
        r = redis_client(settings.redis_url)
        job_id = chains.enqueue_turn(r, target, message, agent="demo")
        console.print(f"turn [bold]{job_id}[/]: “{escape(message)}” → {escape(target)}", highlight=False)
        ok = watch_job(r, job_id, timeout_s)
        if ok is None:
            err.print(f"[bold red]error:[/] timed out after {timeout_s:g}s")
            return 4
        rows, done = wait_deliveries(r, job_id, timeout_s)
        console.print(deliveries_table(job_id, rows))
        if target.startswith("outbox:"):
            console.print(_arriveddeliveries_table(settings.outbox, split_target(target)[1]))
            console.print(f"outbox: {escape(str(settings.outbox / split_target(target)[1]))}", highlight=False)
        return 1 if not ok or not done or any(row.get("state") == DeliveryState.FAILED for row in rows) else 0
    except KeyboardInterrupt:
        err.print("interrupted: shutting down")
        return 130
    finally:
        if worker is not None:
            stop_worker(worker)
        redis_srv.stop()


def _arriveddeliveries_table(outbox: Path, chat: str) -> Table:
    from adapters.platforms.outbox import read_log

    t = Table(title=f"arrived in outbox:{chat}", title_justify="left")
    for col in ("kind", "file / text", "size", "sha256"):
        t.add_column(col, overflow="fold")
    for rec in read_log(outbox, chat):
        if rec["kind"] == "text":
            t.add_row("text", escape(rec["text"][:70]), str(len(rec["text"].encode())), "")
        else:
            t.add_row(rec["kind"], escape(rec["file"]), f"{rec['size_bytes']:,}", rec["sha256"][:16] + "…")
    return t
