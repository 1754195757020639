"""Agent commands (``Sandbox.exec``) through a backend's exec channel: the
working directory resolved and checked (ONE exec, cached), the argv run
under :data:`RUN_SCRIPT`, a timeout killing every process of the run by
its id (:data:`KILL_SCRIPT`). A command is never run twice, except when
RUN_SCRIPT proves nothing ran (its checked directory changed)."""

from __future__ import annotations

import math
import posixpath
import uuid
from collections.abc import Callable, Sequence

from adapters.errors import FileMissing, SandboxError, UnsafePath
from adapters.sandboxes.base import ExecRun, PathPolicy, check_lexical, exec_argv, run_exec
from adapters.sandboxes.execstream.channel import EXIT_CHANGED, ExecChannel, _ask, _err_text, _fields

# $1.. = candidate directories; the first that resolves to a directory wins.
# Prints HOME NUL status NUL resolved: d directory, n not a directory, m missing
# (for the last candidate, resolved as far as it goes).
CWD_SCRIPT = r"""for c in "$@"; do
r=$(readlink -f -- "$c"; echo x)
r=${r%x}
r=${r%?}
if [ -n "$r" ] && [ -d "$r" ]; then printf '%s\0d\0%s' "$HOME" "$r"; exit 0; fi
done
if [ -n "$r" ] && [ -e "$r" ]; then t=n; else t=m; fi
printf '%s\0%s\0%s' "$HOME" "$t" "$r"
"""

# $1 = run id, $2 = checked working directory, $3 = backstop seconds ('' none),
# $4.. = the argv. Enters $2 and proves it is still that directory (else exit 97
# with a line naming the id), exports COURIER_EXEC_ID (KILL_SCRIPT finds every
# process of the run by it), runs the argv under the sandbox's `timeout` when
# that is GNU's (busybox's leaves a watcher holding the output for up to a
# second after the command ends), else as is. The argv is not exec'd, so a
# signal death is an exit status (128 + N) here too.
RUN_SCRIPT = r"""n=$1 d=$2 t=$3
shift 3
if cd -P "$d" 2>/dev/null; then p=$(pwd -P; echo x); p=${p%x}; p=${p%?}; else p=; fi
if [ "$p" != "$d" ]; then printf 'courier-exec-%s: cwd\n' "$n" >&2; exit 97; fi
COURIER_EXEC_ID=$n
export COURIER_EXEC_ID
if [ -n "$t" ] && timeout --version >/dev/null 2>&1; then timeout -s KILL -- "$t" "$@"; exit $?; fi
"$@"
exit $?
"""

# $1 = run id. SIGKILL every process whose environment holds COURIER_EXEC_ID=$1
# (one grep over /proc per round; rounds until none is left, for forks racing it).
KILL_SCRIPT = r"""i=0
while [ "$i" -lt 20 ]; do
l=$(grep -lzxF "COURIER_EXEC_ID=$1" /proc/[0-9]*/environ 2>/dev/null)
[ -n "$l" ] || exit 0
for f in $l; do p=${f#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; done
i=$((i+1))
done
"""

#: seconds past an exec's timeout after which the sandbox's own `timeout`
#: kills the command (only matters when the worker could not)
EXEC_BACKSTOP_S = 10


def kill_argv(run_id: str) -> list[str]:
    """The argv that kills every process of the run `run_id` (see KILL_SCRIPT)."""
    return ["sh", "-c", KILL_SCRIPT, "sh", run_id]


def exec_resolve_cwd(ch: ExecChannel, policy_for: Callable[[str | None], PathPolicy], cwd: str | None,
                     defaults: Sequence[str]) -> str:
    """ONE exec: the working directory resolved in the sandbox and checked
    against the policy (None: the first of `defaults` that is a directory).
    Raises UnsafePath (outside the roots, also when missing) or FileMissing."""
    if cwd is None:
        cands = [d for d in defaults if d]
        if not cands:
            raise UnsafePath("exec: no allowed roots to run in")
    else:
        cands = [check_lexical(cwd)]
    rc, out, err = _ask(ch, CWD_SCRIPT, *cands)
    if rc != 0:
        raise SandboxError(f"exec: cannot resolve the working directory (exit {rc}: {_err_text(err)})")
    home, kind, resolved = _fields(out, 3, "exec working directory")
    policy = policy_for(home or None)
    if kind == "d":
        return policy.check(resolved, shown=cwd or resolved)
    if cwd is None:
        raise FileMissing(f"exec: none of the allowed roots is a directory ({', '.join(cands)})")
    policy.check(posixpath.normpath(resolved or cwd), shown=cwd)
    raise FileMissing(f"{cwd}: no such directory")


def exec_command(ch: ExecChannel, policy_for: Callable[[str | None], PathPolicy],
                 start: Callable[..., ExecRun], argv: Sequence[str], *, timeout_s: float,
                 cwd: str | None, max_output_bytes: int, defaults: Sequence[str],
                 cwd_cache: dict) -> tuple[int, bytes, bytes]:
    """``Sandbox.exec`` for a backend with an exec channel. `start(wrapped_argv,
    run_id, backstop_s=...)` returns the backend's ExecRun (whose `kill` runs
    :func:`kill_argv`; `backstop_s`: for a channel with a deadline of its own).
    The working directory is cached in `cwd_cache`; RUN_SCRIPT proves it
    unchanged on every run, and a changed one is resolved and checked again."""
    args = exec_argv(argv)
    for attempt in (0, 1):
        workdir = cwd_cache.get(cwd) if attempt == 0 else None
        if workdir is None:
            workdir = exec_resolve_cwd(ch, policy_for, cwd, defaults)
            if len(cwd_cache) >= 64:
                cwd_cache.clear()
            cwd_cache[cwd] = workdir
        run_id = uuid.uuid4().hex
        backstop = math.ceil(max(0.0, float(timeout_s))) + EXEC_BACKSTOP_S
        run = start(["sh", "-c", RUN_SCRIPT, "sh", run_id, workdir, str(backstop), *args], run_id,
                    backstop_s=backstop)
        rc, out, err = run_exec(run, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
        if rc == EXIT_CHANGED and err == f"courier-exec-{run_id}: cwd\n".encode():
            cwd_cache.pop(cwd, None)  # nothing ran: resolve and check it again
            if attempt == 0:
                continue
            raise UnsafePath(f"{cwd or workdir}: changed while the command was starting")
        return rc, out, err
    raise AssertionError("unreachable")
