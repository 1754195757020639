"""Start a Celery worker with the pool chosen for its queues.

    python -m workers.worker -Q delivery [celery worker options]   # or: courier worker -Q delivery

A worker that consumes only the `delivery` queue runs COURIER_DELIVERY_POOL
(default `threads`) with COURIER_DELIVERY_CONCURRENCY (default 16) slots:
a delivery waits on the platform's answer, not on the CPU, so one process
sends many at once (and one Bot API connection pool, one Redis connection
pool serve them). A worker of any other queue (turns, sandbox, janitor, or a
mix) keeps Celery's prefork pool: agent turns and extractions run child
processes and heavy I/O, and a process each keeps them apart. A `--pool` /
`-P` or `--concurrency` / `-c` given on the command line wins.

One process holds one GIL: when the platform answers at once, a delivery is
CPU work (Celery's consumer, the SDK, courier's ledger), and one process
uses one core. So a threads-pool delivery worker runs
COURIER_DELIVERY_PROCESSES such Celery workers (default: one per CPU, at most
8), each with its own threads pool, under a small supervisor: the first keeps
the node name given (`-n delivery@%h`: healthchecks ping it), the others are
`delivery-2@%h`, `delivery-3@%h`, ... Signals (SIGTERM: warm shutdown,
SIGINT, SIGQUIT, SIGUSR1) go to every process once; when one exits by
itself, the others are stopped warm and the supervisor exits with its code,
so the orchestrator restarts the whole worker (nothing is lost either way:
messages are acknowledged late, and the ledger re-drives what a dead process
held). Only the first serves COURIER_METRICS_PORT (set
PROMETHEUS_MULTIPROC_DIR, as for prefork, to export every process's counts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

DELIVERY_QUEUES = frozenset({"delivery"})


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
    if queues and set(queues) <= DELIVERY_QUEUES:
        return settings.delivery_pool, settings.delivery_concurrency
    return None


def worker_argv(args: list[str], settings=None) -> list[str]:
    """The `celery worker` command line for `args` (the options given to `courier worker`)."""
    from workers.settings import get_settings

    s = settings or get_settings()
    argv = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", *args]
    chosen = pool_for(_queues(args), s)
    if chosen is not None:
        pool, concurrency = chosen
        if not _given(args, "-P", "--pool"):
            argv.append(f"--pool={pool}")
        if not _given(args, "-c", "--concurrency"):
            argv.append(f"--concurrency={concurrency}")
    return argv


#: a threads-pool delivery worker runs at most this many processes by default
MAX_DEFAULT_PROCESSES = 8
#: signals passed on to every worker process (Celery's warm/cold shutdown, traceback dump)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1)


def processes_for(args: list[str], settings) -> int:
    """How many Celery worker processes `courier worker <args>` runs: several
    only for a threads-pool delivery worker (prefork is many processes already)."""
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
    if index == 0:
        return list(argv)
    out = list(argv)
    found = _option(out, "-n", "--hostname")
    name = found[1] if found else "celery@%h"
    local, at, host = name.partition("@")
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
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the orchestrator's stop reaches them
        pass


def supervise(argvs: list[list[str]]) -> int:
    """Run one Celery worker per argv; signals go to each once; when one exits,
    the rest are stopped warm. Returns the first non-zero exit code (0: all clean)."""
    # each in its own process group: a terminal's Ctrl-C reaches them once, through here
    # (twice would be Celery's cold shutdown)
    procs: list[subprocess.Popen] = []
    for i, a in enumerate(argvs):
        child_env = dict(os.environ)
        if i > 0:
            child_env["COURIER_METRICS_PORT"] = "0"  # one exporter per worker (the first)
        procs.append(subprocess.Popen(a, env=child_env, process_group=0, preexec_fn=_die_with_parent))
    stopping: list[int] = []

    def forward(signum: int, _frame) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = 0
    left = {p.pid: p for p in procs}
    while left:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        p = left.pop(pid, None)
        if p is None:
            continue
        p.returncode = os.waitstatus_to_exitcode(status)
        rc = p.returncode if p.returncode >= 0 else 128 - p.returncode
        if rc and not code:
            code = rc
        if not stopping and left:  # one ended by itself: the worker is not whole, stop the rest
            print(f"courier worker: process {pid} exited ({p.returncode}); stopping the others",
                  file=sys.stderr, flush=True)
            stopping.append(signal.SIGTERM)
            for q in left.values():
                q.send_signal(signal.SIGTERM)
    return code


def main(args: list[str] | None = None) -> None:
    from workers.settings import get_settings

    given = list(sys.argv[1:] if args is None else args)
    settings = get_settings()
    argv = worker_argv(given, settings)
    n = processes_for(given, settings)
    if n <= 1:
        os.execv(argv[0], argv)
    pidfile = _option(given, "--pidfile", "--pidfile")
    if pidfile is not None and "%n" not in pidfile[1] and "%i" not in pidfile[1]:
        sys.exit(f"courier worker: {n} delivery processes share --pidfile {pidfile[1]!r}: put %n (the node "
                 f"name) in it, or set COURIER_DELIVERY_PROCESSES=1")
    sys.exit(supervise([node_argv(argv, i) for i in range(n)]))


if __name__ == "__main__":
    main()
