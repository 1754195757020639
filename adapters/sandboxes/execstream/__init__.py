"""The universal fallback: move files through a sandbox's *exec* channel,
in a constant number of round trips whatever the file size (one streaming
``cat``; a base64 chunk per exec is ~500 times slower):

No shell string is ever built from input: scripts are constants and paths
travel as positional parameters (``sh -c SCRIPT sh "$path"``). A backend
provides an :class:`ExecChannel` (raising SandboxGone when the sandbox
vanishes); the scripts' exit codes map to FileMissing / NotAFile /
UnsafePath / TooLarge here.
"""

from __future__ import annotations

import math
import posixpath
import uuid
from collections.abc import Callable, Sequence

from adapters.errors import FileMissing, NotAFile, SandboxError, UnsafePath
from adapters.sandboxes.base import (
    DEFAULT_EXEC_OUTPUT_BYTES, ExecRun, PathPolicy, SandboxRef, check_lexical, exec_argv, run_exec,
)
from adapters.sandboxes.execstream.transfer import (
    EXIT_CHANGED, GATED_STREAM_SCRIPT, VERSION_FORMAT, Counted, ExecChannel, ExecStream, Resolved, _ask, _err_text,
    _fields, default_roots, exec_extract, exec_gated_extract, exec_iter_file, exec_put, exec_resolve, kill_argv,
    probe, resolve_by_ancestor,
)

__all__ = [
    "GATED_STREAM_SCRIPT", "VERSION_FORMAT", "Counted", "ExecChannel", "ExecStream", "ExecStreamMixin", "Resolved",
    "default_roots", "exec_command", "exec_extract", "exec_gated_extract", "exec_iter_file", "exec_put",
    "exec_resolve", "kill_argv", "probe", "resolve_by_ancestor",
]


# $1.. = candidate directories; the first that resolves to a directory wins. Prints HOME NUL
# status NUL resolved: d directory, n not a directory, m missing (the last candidate, as far as it goes).
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
# with a line naming the id), exports COURIER_EXEC_ID (for KILL_SCRIPT), runs the
# argv under GNU `timeout` where there is one (busybox's holds the output up to
# a second longer), not exec'd: a signal death is an exit status (128 + N).
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

#: seconds past an exec's timeout after which the sandbox's own `timeout` kills it (if the worker could not)
EXEC_BACKSTOP_S = 10


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
    backstop = math.ceil(max(0.0, float(timeout_s))) + EXEC_BACKSTOP_S
    for attempt in (0, 1):
        workdir = cwd_cache.get(cwd) if attempt == 0 else None
        if workdir is None:
            workdir = exec_resolve_cwd(ch, policy_for, cwd, defaults)
            if len(cwd_cache) >= 64:
                cwd_cache.clear()
            cwd_cache[cwd] = workdir
        run_id = uuid.uuid4().hex
        run = start(["sh", "-c", RUN_SCRIPT, "sh", run_id, workdir, str(backstop), *args], run_id,
                    backstop_s=backstop)
        rc, out, err = run_exec(run, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
        if rc != EXIT_CHANGED or err != f"courier-exec-{run_id}: cwd\n".encode():
            return rc, out, err
        cwd_cache.pop(cwd, None)  # nothing ran: resolve and check it again
    raise UnsafePath(f"{cwd or workdir}: changed while the command was starting")


class ExecStreamMixin:
    """Sandbox methods (``resolve``, ``home_dir``, ``exec``) on top of
    ``exec_channel()`` and ``exec_start(argv, run_id, backstop_s=...)`` (an
    ExecRun whose `kill` runs ``kill_argv(run_id)``); ``self.policy`` None:
    defaults built from the sandbox's $HOME on first use."""

    ref: SandboxRef
    policy: PathPolicy | None
    #: roots used when neither the ref nor the constructor gave any
    exec_default_roots: tuple[str, ...] = ("/workspace", "/tmp")
    exec_channel: Callable[[], ExecChannel]
    exec_start: Callable[..., ExecRun]
    _home_cache: str | None = None

    def policy_for(self, home: str | None) -> PathPolicy:
        if self.policy is None:
            self.policy = PathPolicy(roots=self.ref.roots or default_roots(home, self.exec_default_roots), home=home)
        return self.policy

    def resolve(self, path: str) -> tuple[str, int]:
        r = self._resolve(path)
        return r.path, r.size

    def _resolve(self, path: str) -> Resolved:
        """ONE exec resolves `path`, then the policy check; a path that does not
        resolve (or no regular file) is still refused if denylisted as written."""
        try:
            r = exec_resolve(self.exec_channel(), path, policy_for=self.policy_for)
        except (FileMissing, NotAFile):
            self._deny_lexical(path)
            raise
        self.policy_for(r.home).check(r.path, shown=path)
        return r

    def _deny_lexical(self, path: str) -> None:
        (self.policy or PathPolicy(roots=self.exec_default_roots)).check_lexical_denied(path)

    def home_dir(self) -> str | None:
        """The configured home, else the exec user's $HOME (one exec, once)."""
        if self.policy is not None and self.policy.home:
            return self.policy.home
        return self._home()

    def _home(self) -> str | None:
        if self._home_cache is None:
            rc, out, _err = self.exec_channel().exec_small(["sh", "-c", 'printf %s "$HOME"'])
            self._home_cache = out.decode("utf-8", "surrogateescape") if rc == 0 else ""
        return self._home_cache or None

    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """Sandbox.exec through the channel (:func:`exec_command`); `cwd`
        None: the first allowed root that is a directory."""
        defaults = self.policy.roots if self.policy is not None else (self.ref.roots or self.exec_default_roots)
        cache = self.__dict__.setdefault("_exec_cwds", {})
        return exec_command(self.exec_channel(), self.policy_for, self.exec_start, argv, timeout_s=timeout_s,
                            cwd=cwd, max_output_bytes=max_output_bytes, defaults=defaults, cwd_cache=cache)
