"""Runs one agent command for the bridge and ends the agent's whole process
group when the worker process that started it dies, even by SIGKILL.

    python -I _guard.py <worker pid> <command> [args...]

The bridge starts this script as the leader of a new session; the agent runs
as its child in the same process group, on the same stdin/stdout/stderr. The
kernel sends SIGHUP here when the worker dies (`PR_SET_PDEATHSIG`); then the
whole group gets SIGKILL, so no agent (or tool it started) outlives the
worker whose turn it was: the turn is redelivered and runs again elsewhere.

Otherwise this script is transparent: it ignores the SIGTERM the bridge sends
the group on a timeout (the agent gets it), waits for the agent and exits
the way the agent did (its exit code, or the same signal). Standard library
only, run in isolated mode: nothing from courier is imported.
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
CANNOT_START = 127


def _kill_group(*_args) -> None:
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: _guard.py <worker pid> <command> [args...]", file=sys.stderr)
        return 2
    worker = int(argv[1])
    signal.signal(signal.SIGHUP, _kill_group)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no parent-death signal, the agent still runs
        pass
    if os.getppid() != worker:  # the worker died before the signal was armed
        _kill_group()
    try:
        # the agent gets the default dispositions back (exec resets handled
        # signals; ignored ones are restored here)
        child = subprocess.Popen(argv[2:], preexec_fn=_default_signals)  # noqa: PLW1509 - single-threaded
    except OSError as exc:
        print(f"courier: agent could not start: {exc.strerror or exc}", file=sys.stderr)
        return CANNOT_START
    rc = child.wait()
    if rc < 0:  # die the way the agent died
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: always the default
            pass
        os.kill(os.getpid(), -rc)
        return 128 - rc
    return rc


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
