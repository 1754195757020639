"""The exec channel's interface (:class:`ExecChannel`), what it hands back,
the scripts' exit codes, and the helpers the whole package shares."""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from adapters.errors import SandboxError, UnsafePath
from adapters.sandboxes.base import PathPolicy

#: exit codes of the constant scripts below
EXIT_MISSING = 2
EXIT_NOT_FILE = 4
EXIT_CHANGED = 97
EXIT_NOT_DIR = 5
EXIT_SHORT = 6
EXIT_DENIED = 13
EXIT_LINKS = 15
EXIT_LOOP = 40
#: the stream script's: the file changed while it was read (EX_TEMPFAIL)
EXIT_CHANGING = 75


@dataclass
class ExecStream:
    """A running command's stdout as raw byte chunks. `exit_code()` is valid
    once `chunks` is exhausted (None if unknown); `stderr()` is bounded;
    `close()` ends the command early and is idempotent."""

    chunks: Iterable[bytes]
    exit_code: Callable[[], int | None]
    stderr: Callable[[], bytes] = field(default=lambda: b"")
    close: Callable[[], None] = field(default=lambda: None)
    #: where the channel has one: stdout as a raw pipe, for a consumer that
    #: moves the bytes in the kernel instead of iterating `chunks` (never both);
    #: `wait()` before each read (raises ReadTimeout past the read deadline),
    #: `end()` once the pipe is drained (the exit status is then known)
    pipe_fd: int | None = None
    wait: Callable[[], None] = field(default=lambda: None)
    end: Callable[[], None] = field(default=lambda: None)
    #: where the channel streams stdin: write these bytes to the command's stdin and close it
    gate: Callable[[bytes], None] | None = None


@runtime_checkable
class ExecChannel(Protocol):
    """What a backend provides to reuse this module."""

    #: True when stdout of exec_stream carries arbitrary bytes unchanged
    binary_safe: bool

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        """Run argv, return (exit code, stdout, stderr); for short outputs."""
        ...

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        """Run argv and stream its stdout (raw bytes, or text if not binary_safe)."""
        ...


class GatedChannel(ExecChannel, Protocol):
    """A channel that can also send one line of stdin to a streaming command
    (``ExecStream.gate``) and hands out its stdout as a pipe (ssh)."""

    def exec_gated(self, argv: Sequence[str]) -> ExecStream:
        ...


@dataclass(frozen=True)
class Resolved:
    path: str          # resolved absolute path inside the sandbox
    size: int
    home: str | None   # $HOME of the exec user (for default roots)
    nlink: int = 1     # hard links of the file, where the resolve saw them
    #: the file's version where the resolve saw it: `stat -c` of :data:`VERSION_FORMAT` (size, links,
    #: mtime and ctime in ns, inode); a read that cannot compare them itself asks again after its last byte
    version: str = ""


#: what the file's version is made of (`stat -c`): any change between two of them is a write
VERSION_FORMAT = "%s %h %y %z %i"


def default_roots(home: str | None, base: Sequence[str] = ("/workspace", "/tmp")) -> tuple[str, ...]:
    """`base` plus the user's home when that is a sane, specific directory
    (never `/`, never a denylisted tree such as /root)."""
    roots = list(base)
    if home and home.startswith("/") and "\x00" not in home:
        h = posixpath.normpath(home)
        if h != "/" and h not in roots:
            try:
                PathPolicy(roots=(h,)).check(h)
            except UnsafePath:
                pass
            else:
                roots.append(h)
    return tuple(roots)


def probe(ch: ExecChannel, argv: Sequence[str], *, answers: Iterable[int] = (0,)) -> tuple[int, bytes, bytes]:
    """Run a short read-only command that prints its answer whenever it exits
    with one of `answers`, through ``exec_probe`` where the channel's
    transport can lose such an answer (docker), else ``exec_small``. Never
    for an agent's command, nor one that changes anything."""
    ask = getattr(ch, "exec_probe", None)
    if ask is not None:
        return ask(argv, answers=tuple(answers))
    return ch.exec_small(argv)


def _ask(ch: ExecChannel, script: str, *args: str, answers: Iterable[int] = (0,)) -> tuple[int, bytes, bytes]:
    """One of the constant read-only scripts, as a :func:`probe`."""
    return probe(ch, ["sh", "-c", script, "sh", *args], answers=answers)


def _fields(out: bytes, n: int, what: str) -> list[str]:
    parts = out.split(b"\0")
    if len(parts) != n:
        raise SandboxError(f"{what}: unexpected reply from the sandbox ({out[:200]!r})")
    return [p.decode("utf-8", "surrogateescape") for p in parts]


def _err_text(err: bytes) -> str:
    return err.decode("utf-8", "replace").strip()[:300]


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


def kill_argv(run_id: str) -> list[str]:
    """The argv that kills every process of the run `run_id` (see KILL_SCRIPT)."""
    return ["sh", "-c", KILL_SCRIPT, "sh", run_id]
