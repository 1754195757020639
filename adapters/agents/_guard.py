"""Runs one agent command (a bridge agent, a local ``terminal`` command); what
it starts ends with it, and with the worker that started it, even by SIGKILL.

    python -I -S _guard.py <worker pid>[:<deadline s>] <command> [args...]

It leads a new session; the command is its child in the same process group. As
a subreaper (``PR_SET_CHILD_SUBREAPER``) it inherits what the command leaves
behind, a double-forked ``setsid`` daemon too; when the command exits every
descendant is SIGKILLed and reaped, and the guard exits as the command did. The
group's SIGTERM (the turn's timeout) leaves :data:`TERM_GRACE_S` before every
descendant is SIGKILLed; past a deadline the same, then exit 124 with a note on
stderr; the worker's death (SIGHUP by ``PR_SET_PDEATHSIG``) SIGKILLs every
descendant and the group. Standard library only, isolated mode: nothing from
courier is imported.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CANNOT_START = 127
TIMED_OUT = 124
#: after a SIGTERM (the turn's timeout), how long the agent has before everything is killed
TERM_GRACE_S = 2.0
#: rounds of kill-what-is-left before giving up (each a /proc scan)
KILL_ROUNDS = 500


def _descendants(root: int) -> list[int]:
    """Live (not zombie) descendants of `root`, from /proc."""
    children: dict[int, list[int]] = {}
    state: dict[int, str] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in filter(str.isdigit, names):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2:].split()
        if len(rest) < 2:
            continue
        pid = int(name)
        state[pid] = rest[0].decode()
        children.setdefault(int(rest[1]), []).append(pid)
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return [p for p in out if state.get(p) not in ("Z", "X")]


def _kill_descendants(reap: bool) -> None:
    """SIGKILL every descendant (found in /proc by parent pid), round after round until none is left
    alive: a child forked meanwhile shows up in the next. `reap`: and wait for our own dead children
    (never while the agent's Popen may wait)."""
    me = os.getpid()
    for _ in range(KILL_ROUNDS):
        live = _descendants(me)
        for pid in live:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if reap:
            with suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
        if not live:
            return
        time.sleep(0.005)


def _worker_died(*_args) -> None:
    _kill_descendants(reap=False)
    os.killpg(0, signal.SIGKILL)


def _terminated(*_args) -> None:
    # the agent got the group's SIGTERM too; it has TERM_GRACE_S to go by itself
    signal.signal(signal.SIGALRM, lambda *_: _kill_descendants(reap=False))
    signal.setitimer(signal.ITIMER_REAL, TERM_GRACE_S)


_deadline_s: list[float] = []


def _deadline(*_args) -> None:
    _deadline_s.append(1.0)
    _kill_descendants(reap=False)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: _guard.py <worker pid>[:<deadline s>] <command> [args...]", file=sys.stderr)
        return 2
    worker_s, _, deadline_s = argv[1].partition(":")
    worker = int(worker_s)
    signal.signal(signal.SIGHUP, _worker_died)
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no parent-death signal, no subreaper; the agent still runs
        pass
    if os.getppid() != worker:  # the worker died before the signal was armed
        _worker_died()
    try:
        # the agent gets the default dispositions back (exec resets handled
        # signals; ignored ones are restored here)
        child = subprocess.Popen(argv[2:], preexec_fn=_default_signals)  # noqa: PLW1509 - single-threaded
    except OSError as exc:
        print(f"courier: agent could not start: {exc.strerror or exc}", file=sys.stderr)
        return CANNOT_START
    if deadline_s:
        signal.signal(signal.SIGALRM, _deadline)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, float(deadline_s)))
    rc = child.wait()
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_descendants(reap=True)  # nothing the agent started outlives it
    if _deadline_s:
        print(f"\n[courier: timed out after {float(deadline_s):g}s; the command was killed]", file=sys.stderr)
        return TIMED_OUT
    if rc < 0:  # die the way the agent died
        with suppress(OSError, ValueError):  # SIGKILL, SIGSTOP: always the default
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
        return 128 - rc
    return rc


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
