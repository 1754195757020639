"""Task time limits for Celery's threads pool (it ignores them: only prefork
and gevent enforce `soft_time_limit` / `time_limit`).

`Watchdog` keeps each running task's deadlines, keyed by the thread that
runs it (Celery's `task_prerun` / `task_postrun` signals run in that
thread). One daemon thread waits for the earliest deadline:

- past the soft limit, `SoftTimeLimitExceeded` is raised inside the task's
  thread (`PyThreadState_SetAsyncExc`: at its next Python bytecode, as the
  prefork pool's SIGUSR1 does), so the stage is retried by the ledger like
  on prefork;
- past the hard limit (a thread stuck in C code never sees that exception),
  the worker process ends (exit status 70, logged), as prefork ends a pool
  process: its messages come back (acks late, reject on worker lost) and the
  reconciler re-drives the stages it leased once their leases lapse.
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from celery.exceptions import SoftTimeLimitExceeded

log = logging.getLogger("courier.timelimits")

T = TypeVar("T")

#: exit status of a worker ended by a task past its hard time limit
HARD_LIMIT_EXIT = 70


def raise_in_thread(ident: int, exc_type: type[BaseException]) -> bool:
    """Raise `exc_type` in the thread `ident` at its next bytecode (False: no such thread)."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type))
    if n > 1:  # never expected: undo rather than hit several threads
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
        return False
    return n == 1


class Watchdog:
    def __init__(self, *, on_hard: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.on_hard = on_hard or _end_process
        self.clock = clock
        # a plain lock, entered with `with self.lock` where a task thread takes it: its C-level
        # enter/exit run no bytecode, so a soft limit landing there cannot leave it held
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        #: thread ident -> (run number, task id, task name, soft deadline, hard deadline)
        self.running: dict[int, tuple[int, str, str, float | None, float | None]] = {}
        self.heap: list[tuple[float, int, int, str]] = []  # (when, run, ident, "soft"|"hard")
        self.runs = 0
        self.thread: threading.Thread | None = None

    def start_task(self, task_id: str, name: str, soft_s: float | None, hard_s: float | None) -> None:
        ident = threading.get_ident()
        if not soft_s and not hard_s:
            with self.lock:
                self.running.pop(ident, None)  # (an earlier run's deadlines never apply to this one)
            return
        now = self.clock()
        with self.lock:
            self.runs += 1
            run = self.runs
            soft = now + soft_s if soft_s else None
            hard = now + hard_s if hard_s else None
            self.running[ident] = (run, task_id, name, soft, hard)
            if soft is not None:
                heapq.heappush(self.heap, (soft, run, ident, "soft"))
            if hard is not None:
                heapq.heappush(self.heap, (hard, run, ident, "hard"))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="courier-time-limits", daemon=True)
                self.thread.start()
            self.cond.notify()

    def end_task(self) -> None:
        """This thread's task ended: its deadlines no longer apply.

        The watchdog may have raised the soft limit into this thread just as the
        task returned (it raises under `self.lock`, the task ends under it): the
        exception then lands here, at any bytecode. It is dropped (the task it
        was meant for has ended) and the deadlines are removed anyway, so a
        finished task never keeps a hard deadline that would later end an idle
        worker. The watchdog raises a run's soft limit once, so one retry ends it.
        """
        while True:
            try:
                with self.lock:
                    self.running.pop(threading.get_ident(), None)
                return
            except SoftTimeLimitExceeded:
                log.info("a soft time limit landed as its task ended: dropped")

    def guard(self, call: Callable[[], T]) -> T:
        """Run a task's body (`call`) so that its deadlines end where the body ends.

        The soft limit may land anywhere once raised, the moment the body returned
        included; landing in Celery's own code between the body and `task_postrun`
        would skip `end_task` there. Here the body runs inside this frame's `try`:
        a limit raised while it ran lands in the body, at its return (in the `try`)
        or in the `finally` below, which ends the task's deadlines in every case (a
        run's soft limit is raised once, so one retry ends them)."""
        try:
            return call()
        finally:
            while True:
                try:
                    self.end_task()
                    break
                except SoftTimeLimitExceeded:
                    continue

    def _run(self) -> None:
        while True:
            with self.cond:
                while True:
                    while self.heap and self.running.get(self.heap[0][2], (None,))[0] != self.heap[0][1]:
                        heapq.heappop(self.heap)  # that run ended
                    if self.heap and self.heap[0][0] <= self.clock():
                        _, run, ident, which = heapq.heappop(self.heap)
                        _, task_id, name, *_ = self.running[ident]
                        if which == "soft":
                            # under the lock: the thread cannot end this task (end_task) and
                            # start another in between, so only this run is interrupted
                            log.warning("task %s[%s] passed its soft time limit: interrupted", name, task_id)
                            raise_in_thread(ident, SoftTimeLimitExceeded)
                            continue
                        break
                    self.cond.wait(timeout=(self.heap[0][0] - self.clock()) if self.heap else None)
            self.on_hard(name, task_id)


def _end_process(name: str, task_id: str) -> None:
    log.critical("task %s[%s] passed its hard time limit: ending the worker process (its stages are "
                 "re-driven by the ledger)", name, task_id)
    logging.shutdown()
    os._exit(HARD_LIMIT_EXIT)
