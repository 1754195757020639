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
"""

from __future__ import annotations

import os
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


def main(args: list[str] | None = None) -> None:
    argv = worker_argv(list(sys.argv[1:] if args is None else args))
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
