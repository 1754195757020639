"""`courier worker`: start Celery workers with the pool chosen for their queues, and keep them running.

    python -m workers.worker -Q delivery [celery worker options]   # or: courier worker -Q delivery

A worker of only the `delivery` queue runs COURIER_DELIVERY_POOL with COURIER_DELIVERY_CONCURRENCY slots,
in COURIER_DELIVERY_PROCESSES Celery workers (`<name>-2@%h`, ...); any other keeps Celery's prefork pool;
a `-P` / `-c` given wins. `supervise` runs them as children and restarts them (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

from workers.metrics import prepare_multiproc_dir
from workers.settings import get_settings

def _queues(args: list[str]) -> list[str]:
    out: list[str] = []
    for i, a in enumerate(args):
        if a in ("-Q", "--queues") and i + 1 < len(args):
            out += args[i + 1].split(",")
        elif a.startswith("--queues="):
            out += a.split("=", 1)[1].split(",")
        elif a.startswith("-Q") and len(a) > 2:
            out += a[2:].split(",")
    return [q.strip() for q in out if q.strip()]


def _given(args: list[str], short: str, long: str) -> bool:
    return any(a in (short, long) or a.startswith(long + "=") or (a.startswith(short) and len(a) > 2)
               for a in args)


def pool_for(queues: list[str], settings) -> tuple[str, int] | None:
    """(pool, concurrency) for a worker of `queues`; None: Celery's defaults (prefork)."""
    if set(queues) == {"delivery"}:
        return settings.delivery_pool, settings.delivery_concurrency
    return None


def worker_argv(args: list[str], settings=None) -> list[str]:
    """The `celery worker` command line for `args` (the options given to `courier worker`)."""
    s = settings or get_settings()
    argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", *args]
    for (short, long), value in zip((("-P", "--pool"), ("-c", "--concurrency")), pool_for(_queues(args), s) or ()):
        if not _given(args, short, long):
            argv.append(f"{long}={value}")
    return argv


#: a threads-pool delivery worker runs at most this many processes by default
MAX_DEFAULT_PROCESSES = 8


def processes_for(args: list[str], settings) -> int:
    """How many Celery worker processes `courier worker <args>` runs (several only for threads)."""
    chosen = pool_for(_queues(args), settings)
    if chosen is None or _given(args, "-P", "--pool") or chosen[0] != "threads":
        return 1
    n = settings.delivery_processes
    return n if n > 0 else max(1, min(MAX_DEFAULT_PROCESSES, len(os.sched_getaffinity(0))))


def _option(args: list[str], short: str, long: str) -> tuple[int, str] | None:
    """(index of the value, value) of option `short`/`long` in `args`, or None."""
    for i, a in enumerate(args):
        if a in (short, long) and i + 1 < len(args):
            return i + 1, args[i + 1]
        if a.startswith(long + "="):
            return i, a.split("=", 1)[1]
    return None


def node_argv(argv: list[str], index: int) -> list[str]:
    """`argv` for worker process `index` (0: as given): its node name gets `-<index+1>`
    before the `@` (`delivery@%h` -> `delivery-2@%h`), so every process is its own node."""
    out = list(argv)
    if index == 0:
        return out
    found = _option(out, "-n", "--hostname")
    local, at, host = (found[1] if found else "celery@%h").partition("@")
    new = f"{local}-{index + 1}{at}{host}"
    if found is None:
        out += ["-n", new]
    elif out[found[0]].startswith("--hostname="):
        out[found[0]] = f"--hostname={new}"
    else:
        out[found[0]] = new
    return out


def _die_with_parent() -> None:
    """In a worker process (before exec): SIGTERM when the supervisor dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the orchestrator's stop reaches them
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


#: exit codes a restart cannot cure: a command line (click's usage error, EX_USAGE) or configuration
#: (EX_CONFIG) mistake
CONFIG_EXITS = frozenset({2, 64, 78})
EX_CONFIG = 78
#: exit codes of a deliberate recycle (workers/timelimits.py's hard limit, a lease without progress in
#: workers/celery_app.py): the child is started again at once
RECYCLE_EXITS = frozenset({70, 71})
BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 30.0
#: a child that ran this long before exiting is restarted after the first back-off again
STABLE_S = 60.0
#: signals that stop the worker (passed on to each child once), and the one only passed on
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
FORWARDED = (*STOPPING, signal.SIGUSR1)


def backoff_s(failures: int) -> float:
    """The wait before restart number `failures` (1, 2, ...) of a child that keeps exiting."""
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** max(0, failures - 1))


def _say(text: str) -> None:
    print(f"courier worker: {text}", file=sys.stderr, flush=True)


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.failures = 0  # exits in a row without a stable run (the back-off's exponent)
        self.restarts = 0
        self.due: float | None = None  # when to start it again (None while it runs)

    def start(self) -> None:
        # its own process group: a terminal's Ctrl-C reaches it once, through here (twice would be
        # Celery's cold shutdown)
        self.proc = subprocess.Popen(self.argv, env=self.env, process_group=0, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        self.due = None

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signum)


def supervise(argvs: list[list[str]], envs: list[dict[str, str]] | None = None,
              names: list[str] | None = None) -> int:
    """Run one Celery worker per argv and keep each running (docs/operations.md); returns the
    supervisor's exit code."""
    children = [_Child(names[i] if names and i < len(names) else f"worker-{i + 1}", a,
                       (envs[i] if envs else dict(os.environ))) for i, a in enumerate(argvs)]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    received: list[int] = []  # acted on by the loop below (woken through the pipe, SIGCHLD too)
    old_wakeup = signal.set_wakeup_fd(wake_w)
    handlers = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in FORWARDED}
    handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = False
    code = 0
    try:
        for c in children:
            c.start()
        while True:
            while received:
                signum = received.pop(0)
                stopping = stopping or signum in STOPPING
                for c in children:
                    c.signal(signum)
            _reap(children)
            now = time.monotonic()
            for c in children:
                if c.proc is None or c.proc.returncode is None:
                    continue
                rc = c.proc.returncode
                rc = rc if rc >= 0 else 128 - rc
                c.proc = None
                if stopping:
                    code = code or rc
                    continue
                if rc == 0:  # stopped on purpose (a remote `celery control shutdown`): not restarted
                    _say(f"{c.name} stopped (exit code 0): not restarted")
                    if all(o.proc is None and o.due is None for o in children):
                        return code
                    continue
                if rc in CONFIG_EXITS:
                    _say(f"{c.name} exited with code {rc} (a command line or configuration error): "
                         f"stopping the others")
                    code, stopping = rc, True
                    for o in children:
                        o.signal(signal.SIGTERM)
                    continue
                ran_s = now - c.started
                if rc not in RECYCLE_EXITS:  # a recycle is deliberate (it ran a task or drive that long)
                    c.failures = 1 if ran_s >= STABLE_S else c.failures + 1
                wait_s = 0.0 if rc in RECYCLE_EXITS else backoff_s(c.failures)
                c.restarts += 1
                c.due = now + wait_s
                _count_restart(c.name, rc)
                _say(f"{c.name} exited with code {rc} after {ran_s:.1f} s: restart {c.restarts} in {wait_s:.0f} s")
            if stopping and all(c.proc is None for c in children):
                return code
            for c in children:
                if not stopping and c.proc is None and c.due is not None and c.due <= now:
                    c.start()
                    _say(f"{c.name} started again (pid {c.proc.pid if c.proc else '?'}, restart {c.restarts})")
            dues = [c.due for c in children if c.proc is None and c.due is not None and not stopping]
            timeout = max(0.0, min(dues) - time.monotonic()) if dues else 5.0
            if not received:
                select.select([wake_r], [], [], timeout)
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, h in handlers.items():
            signal.signal(sig, h)
        os.close(wake_r)
        os.close(wake_w)


def _count_restart(name: str, code: int) -> None:
    """`courier_worker_restarts_total{worker,code}`, in the multiprocess directory shared with the children."""
    with contextlib.suppress(Exception):  # a metric never stops a restart
        from tasks import metrics

        metrics.record_worker_restart(name, code)


def _reap(children: list[_Child]) -> None:
    """Collect every exited child process: ours (their exit codes noted on them) and any other
    (a container's PID 1 inherits orphans)."""
    mine = {c.proc.pid: c.proc for c in children if c.proc is not None and c.proc.returncode is None}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in mine:
            mine[pid].returncode = os.waitstatus_to_exitcode(status)


def main(args: list[str] | None = None) -> None:
    given = list(sys.argv[1:] if args is None else args)
    try:
        settings = get_settings()
    except Exception as exc:  # noqa: BLE001 - a bad setting: the same at every restart, so say it and stop
        _say(f"bad setting: {_setting_error(exc)}")
        sys.exit(EX_CONFIG)
    if any(a in ("-D", "--detach") for a in given):
        _say("--detach: courier worker runs its Celery workers as its children and restarts them; run it in "
             "the foreground under your process manager")
        sys.exit(EX_CONFIG)
    argv = worker_argv(given, settings)
    n = processes_for(given, settings)
    pidfile = _option(given, "--pidfile", "--pidfile")
    if n > 1 and pidfile is not None and "%n" not in pidfile[1] and "%i" not in pidfile[1]:
        _say(f"{n} delivery processes share --pidfile {pidfile[1]!r}: put %n (the node name) in it, or set "
             f"COURIER_DELIVERY_PROCESSES=1")
        sys.exit(EX_CONFIG)
    mpdir, warning = prepare_multiproc_dir(settings)
    if warning:
        _say(warning)
    # for its processes, and for this one (its restart counter), before prometheus_client is imported here
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(mpdir)
    found = _option(argv, "-n", "--hostname")
    local = (found[1] if found else "celery@%h").partition("@")[0] or "celery"
    names = [f"{local}-{i + 1}" for i in range(n)] if n > 1 else [local]
    # several processes: each named in its log lines (workers/logformat.py)
    envs = [dict(os.environ, COURIER_PROCESS_NAME=name) if n > 1 else dict(os.environ) for name in names]
    for env in envs[1:]:
        env["COURIER_METRICS_PORT"] = "0"  # one exporter per worker (the first): it reads every process's
    sys.exit(supervise([node_argv(argv, i) for i in range(n)], envs, names))


def _setting_error(exc: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(str(x) for x in first['loc']).upper()}: {first['msg']}"
    return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    main()
