"""Task time limits for Celery's threads pool (only prefork and gevent enforce them): past the soft limit
`SoftTimeLimitExceeded` is raised inside the task's thread (as prefork's SIGUSR1 does: the ledger retries
the stage); past the hard one (a thread stuck in C code never sees it) the worker process ends, as
prefork ends a pool process, and the ledger re-drives its stages."""

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
    """Each running task's deadlines, keyed by its thread; one daemon thread waits for the earliest."""

    def __init__(self, *, on_hard: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.on_hard = on_hard or _end_process
        self.clock = clock
        # a plain lock, entered with `with self.lock` where a task thread takes it: its C-level
        # enter/exit run no bytecode, so a soft limit landing there cannot leave it held
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        #: thread ident -> (run number, task id, task name)
        self.running: dict[int, tuple[int, str, str]] = {}
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
            self.running[ident] = (run, task_id, name)
            for limit_s, which in ((soft_s, "soft"), (hard_s, "hard")):
                if limit_s:
                    heapq.heappush(self.heap, (now + limit_s, run, ident, which))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="courier-time-limits", daemon=True)
                self.thread.start()
            self.cond.notify()

    def end_task(self) -> None:
        """This thread's task ended: its deadlines no longer apply. A soft limit raised just as
        the task returned lands here and is dropped, and the deadlines are removed anyway: a
        finished task never keeps a hard deadline that would end an idle worker (a run's soft
        limit is raised once, so one retry ends it)."""
        while True:
            try:
                with self.lock:
                    self.running.pop(threading.get_ident(), None)
                return
            except SoftTimeLimitExceeded:
                log.info("a soft time limit landed as its task ended: dropped")

    def guard(self, call: Callable[[], T]) -> T:
        """Run a task's body (`call`) so that its deadlines end where the body ends: a soft limit
        landing in Celery's code between the body and `task_postrun` would skip `end_task` there,
        while here it lands in the body or in the `finally`, which ends the deadlines anyway."""
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
                        _, task_id, name = self.running[ident]
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
