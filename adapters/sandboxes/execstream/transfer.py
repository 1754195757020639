"""The exec channel's interface (:class:`ExecChannel`), what it hands back,
the scripts' exit codes, and files moved through it (see the package's docstring)."""

from __future__ import annotations

import binascii
import contextlib
import os
import posixpath
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from adapters.errors import FileChanging, FileMissing, NotAFile, SandboxError, SandboxGone, TooLarge, UnsafePath
from adapters.sandboxes.base import (
    DEFAULT_MAX_BYTES, PathPolicy, ReadTimeout, check_lexical, check_size, grew_over_cap, temp_beside,
)

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
    #: where the channel has one: stdout as a raw pipe, moved in the kernel instead of iterating `chunks`;
    #: `wait()` before each read (ReadTimeout past the deadline), `end()` once drained (exit status known)
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

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        """Run argv and stream its stdout (raw bytes, or text if not binary_safe)."""


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
    #: `stat -c` of :data:`VERSION_FORMAT` at the resolve (a read that cannot compare versions itself asks again)
    version: str = ""


#: what the file's version is made of (`stat -c`): any change between two of them is a write
VERSION_FORMAT = "%s %h %y %z %i"


def default_roots(home: str | None, base: Sequence[str] = ("/workspace", "/tmp")) -> tuple[str, ...]:
    """`base` plus the user's home when that is a sane, specific directory
    (never `/`, never a denylisted tree such as /root)."""
    roots = list(base)
    if home and home.startswith("/") and "\x00" not in home:
        h = posixpath.normpath(home)
        if h != "/" and h not in roots and PathPolicy(roots=(h,)).denied_reason(h) is None:
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


# $1 = path as given. Prints HOME NUL resolved NUL type (f regular file, d
# directory, o other) NUL its VERSION_FORMAT stat (a regular file; else "0 1").
# The `echo x` guard keeps readlink's trailing newlines. A path that does not
# resolve exits 2 after HOME NUL what it would name (empty if readlink gave up),
# or 40 for a link loop (`realpath` names it, opening nothing: no FIFO blocks it).
RESOLVE_SCRIPT = r"""r=$(readlink -f -- "$1"; echo x)
r=${r%x}
r=${r%?}
if [ -z "$r" ] || [ ! -e "$r" ]; then
case $(realpath "$1" 2>&1 >/dev/null) in *"ymbolic link"*|*[Ll]oop*) exit 40;; esac
printf '%s\0%s' "$HOME" "$r"; exit 2
fi
if [ -f "$r" ]; then t=f; elif [ -d "$r" ]; then t=d; else t=o; fi
s="0 1"
if [ "$t" = f ]; then s=$(stat -c '""" + VERSION_FORMAT + r"""' -- "$r") || exit 2; fi
printf '%s\0%s\0%s\0%s' "$HOME" "$r" "$t" "$s"
"""

# $1 = resolved path, $2 = "cat" or "base64", $3 = "1" when a file with several
# hard links may be read. Opens the file once on fd 3, checks that fd (its own
# link in /proc where there is one) is still the resolved path, a regular file
# and (unless $3) has one link, then streams from it. Its VERSION_FORMAT stat
# differs after the last byte from before the first: exit 75, the caller
# refuses what it received (FileChanging). A FIFO swapped in before the open
# blocks it: the reader's deadline ends it, and the run is killed by its id.
STREAM_SCRIPT = r"""[ -f "$1" ] || { [ -e "$1" ] && exit 4; exit 2; }
[ -r "$1" ] || exit 13
exec 3< "$1" || exit 2
if [ -e "/proc/$$/fd/3" ]; then
[ -f "/proc/$$/fd/3" ] || exit 4
f=/proc/$$/fd/3
r=$(readlink "$f"; echo x)
else f=$1; r=$(readlink -f -- "$1"; echo x); fi
r=${r%x}
r=${r%?}
[ "$r" = "$1" ] || exit 97
v=$(stat -L -c '""" + VERSION_FORMAT + r"""' -- "$f")
n=${v#* }
if [ "$3" != 1 ] && [ "${n%% *}" != 1 ]; then exit 15; fi
if [ "$2" = base64 ]; then base64 <&3 || exit; else cat <&3 || exit; fi
[ -z "$v" ] || [ "$(stat -L -c '""" + VERSION_FORMAT + r"""' -- "$f")" = "$v" ] || exit 75
"""

# $1 = path as given, $2 = "cat" or "base64". RESOLVE_SCRIPT's answer and one
# more NUL, then ONE line on stdin: "go" (or "go 1": several hard links allowed)
# streams the resolved path as STREAM_SCRIPT does (the same text); anything else
# (stdin closed: the caller refused the path) ends it before the file is opened.
GATED_STREAM_SCRIPT = RESOLVE_SCRIPT + r"""printf '\0'
IFS=' ' read -r go ok || exit 99
[ "$go" = go ] || exit 99
set -- "$r" "$2" "$ok"
""" + STREAM_SCRIPT

# $1 = destination dir (as given), $2 = base name. Prints HOME NUL resolved dir
# NUL uid NUL gid; exit 5 if not a directory, 97 if the name is a link or a dir.
PUT_RESOLVE_SCRIPT = r"""r=$(readlink -f -- "$1"; echo x)
r=${r%x}
[ -n "$r" ] || exit 2
r=${r%?}
[ -e "$r" ] || exit 2
[ -d "$r" ] || exit 5
if [ -L "$r/$2" ] || [ -d "$r/$2" ]; then exit 97; fi
printf '%s\0%s\0%s\0%s' "$HOME" "$r" "$(id -u)" "$(id -g)"
"""

# $1 = a directory that does not exist (as given). Prints HOME NUL its deepest
# existing ancestor (as given) NUL that ancestor resolved.
ANCESTOR_SCRIPT = r"""d=$1
while [ ! -e "$d" ] && [ "$d" != / ]; do d=${d%/*}; [ -n "$d" ] || d=/; done
r=$(readlink -f -- "$d"; echo x)
r=${r%x}
r=${r%?}
printf '%s\0%s\0%s' "$HOME" "$d" "$r"
"""

# $1 = temp path, $2 = final path, $3 = "cat" or "base64" (stdin into the temp), or "" (the
# temp is written already), $4 = expected size. A cut upload ends `cat` with a plain EOF: the
# size check refuses the short temp (exit 6) instead of publishing it.
PUT_SCRIPT = r"""umask 022
case $3 in
base64) base64 -d > "$1" || { rm -f -- "$1"; exit 3; };;
cat) cat > "$1" || { rm -f -- "$1"; exit 3; };;
esac
[ "$(stat -c %s -- "$1")" = "$4" ] || { rm -f -- "$1"; exit 6; }
[ -L "$2" ] || [ -d "$2" ] && { rm -f -- "$1"; exit 97; }
mv -f -- "$1" "$2" || { rm -f -- "$1"; exit 3; }
"""


def exec_resolve(ch: ExecChannel, path: str, *, policy_for: Callable[[str | None], PathPolicy] | None = None
                 ) -> Resolved:
    """Resolve `path` inside the sandbox with ONE exec (the caller checks the
    result against its policy). With `policy_for`, a path that does not
    resolve is first checked as what it would name: a denied one is refused
    exactly as an existing one is (no existence probe)."""
    check_lexical(path)
    rc, out, err = _ask(ch, RESOLVE_SCRIPT, path, answers=(0, EXIT_MISSING))  # a missing path: what it would be
    if rc == EXIT_LOOP:
        raise UnsafePath(f"{path}: a symbolic link loop (too many levels of symbolic links)")
    if rc == EXIT_MISSING:
        if policy_for is not None:
            home, _, would = (part.decode("utf-8", "surrogateescape") for part in out.partition(b"\0"))
            policy = policy_for(home or None)
            if would.startswith("/"):
                policy.check(posixpath.normpath(would), shown=path)
            else:
                policy.check_lexical_denied(path)
        raise FileMissing(f"{path}: no such file")
    if rc != 0:
        raise SandboxError(f"{path}: cannot resolve (exit {rc}: {_err_text(err)})")
    return _parse_resolved(out, path)


def _parse_resolved(out: bytes, path: str) -> Resolved:
    """RESOLVE_SCRIPT's answer; NotAFile unless it names a regular file."""
    home, resolved, kind, size = _fields(out, 4, path)
    if kind == "d":
        raise NotAFile(f"{path}: is a directory")
    if kind != "f":
        raise NotAFile(f"{path}: not a regular file")
    n, links, *version = size.split(" ", 2)
    try:
        return Resolved(path=resolved, size=int(n), home=home or None, nlink=int(links),
                        version=size if version else "")
    except ValueError as exc:
        raise SandboxError(f"{path}: bad size {size!r}") from exc


def _b64_decode(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Decode a base64 text stream (with line breaks) incrementally."""
    pending = b""
    for chunk in chunks:
        data = pending + chunk.translate(None, b" \t\r\n")
        cut = len(data) - len(data) % 4
        pending = data[cut:]
        if cut:
            try:
                yield binascii.a2b_base64(data[:cut])
            except binascii.Error as exc:
                raise SandboxError(f"corrupt base64 from the sandbox: {exc}") from exc
    if pending:
        raise SandboxError("truncated base64 from the sandbox")


def exec_iter_file(ch: ExecChannel, resolved: str, *, expected_size: int | None = None,
                   max_bytes: int | None = None, policy: PathPolicy | None = None) -> Iterator[bytes]:
    """Stream an already resolved and checked file with ONE exec. Raises (at
    the end, so an all-or-nothing store keeps nothing) when the command
    fails, the file changed, or more than `max_bytes` arrive. A file with
    several hard links is refused unless `policy` allows them there."""
    mode = "cat" if getattr(ch, "binary_safe", True) else "base64"
    links_ok = "1" if policy is not None and policy.links_allowed(resolved) else ""
    for attempt in range(3):
        # the run carries its id in its environment: a stalled one is killed by it (_kill)
        run_id = uuid.uuid4().hex
        st = ch.exec_stream(["env", f"COURIER_EXEC_ID={run_id}", "sh", "-c", STREAM_SCRIPT, "sh", resolved, mode,
                             links_ok])
        # podman's Docker-compatible attach can drop a stream's output under load (exit 0,
        # no byte of a non-empty file): nothing was yielded then, so the read runs again
        lost = yield from _iter_stream(ch, st, run_id, resolved, mode, expected_size=expected_size,
                                       max_bytes=max_bytes, lost_ok=attempt < 2)
        if not lost:
            return


def _iter_stream(ch: ExecChannel, st: ExecStream, run_id: str, resolved: str, mode: str, *,
                 expected_size: int | None, max_bytes: int | None, lost_ok: bool = False
                 ) -> Generator[bytes, None, bool]:
    """exec_iter_file's chunks of a started stream script. With `lost_ok`, a
    stream that exited 0 without a byte of a non-empty file (its output lost
    on the way) returns True instead of raising."""
    n = 0
    try:
        body = st.chunks if mode == "cat" else _b64_decode(st.chunks)
        for chunk in body:
            if not chunk:
                continue
            n += len(chunk)
            if max_bytes is not None and n > max_bytes:
                raise grew_over_cap(resolved, n, max_bytes)
            yield chunk
        rc = st.exit_code()
    except ReadTimeout:
        _kill(ch, st, run_id)
        raise
    finally:
        st.close()
    if lost_ok and n == 0 and rc == 0 and expected_size:
        return True
    _check_stream_end(st, rc, n, resolved, expected_size)
    return False


def _kill(ch: ExecChannel, st: ExecStream, run_id: str) -> None:
    """A stalled stream ended, and its run killed in the sandbox by its id."""
    st.close()
    with contextlib.suppress(Exception):  # best effort: the sandbox may be the stalled part
        ch.exec_small(kill_argv(run_id))


#: what the stream script's exit codes say about the file (it read nothing then)
_STREAM_EXITS: dict[int, tuple[type[SandboxError], str]] = {
    EXIT_MISSING: (FileMissing, "no such file"),
    EXIT_NOT_FILE: (NotAFile, "not a regular file"),
    EXIT_CHANGED: (UnsafePath, "changed while opening"),
    EXIT_DENIED: (UnsafePath, "not readable by the sandbox's user"),
    EXIT_LINKS: (UnsafePath, "has several hard links (another name may be outside the allowed roots); refused"),
}


def _check_stream_end(st: ExecStream, rc: int | None, n: int, resolved: str, expected_size: int | None) -> None:
    """The stream script's verdict once its output has ended: raises unless it
    exited 0 having sent exactly `expected_size` bytes of a file whose stat
    did not change while they were read (exit 75: FileChanging)."""
    if rc is None:
        raise SandboxGone(f"{resolved}: the transfer ended without an exit status")
    if rc in _STREAM_EXITS:
        error, why = _STREAM_EXITS[rc]
        raise error(f"{resolved}: {why}")
    if rc not in (0, EXIT_CHANGING):
        raise SandboxError(f"{resolved}: reading failed (exit {rc}: {_err_text(st.stderr())})")
    if expected_size is not None and n != expected_size:
        # the agent is probably still writing it: worth a retry
        raise SandboxGone(f"{resolved}: changed during transfer ({n:,} bytes read, {expected_size:,} expected)")
    if rc == EXIT_CHANGING:  # the same size, but rewritten while it was read: not one version
        raise FileChanging(f"{resolved}: changed while it was read (written meanwhile); read again later")


def _store_stream(ch: ExecChannel, st: ExecStream, run_id: str, resolved: str, mode: str, store, key: str, *,
                  expected_size: int | None, max_bytes: int,
                  guard: Callable[[Iterator[bytes]], Iterator[bytes]] | None = None):
    """The output of a started stream script into `store` at `key`, all or
    nothing, with :func:`exec_iter_file`'s checks: spliced in the kernel where
    the channel has a stdout pipe and the store ``put_pipe``, else through
    ``store.put_stream`` wrapped in `guard` (error mapping)."""
    put_pipe = getattr(store, "put_pipe", None)
    if st.pipe_fd is not None and mode == "cat" and put_pipe is not None:
        def finish(n: int) -> None:  # before the blob is published: the script's verdict, the byte count
            st.end()
            _check_stream_end(st, st.exit_code(), n, resolved, expected_size)

        try:
            info = put_pipe(key, st.pipe_fd, max_bytes=max_bytes, wait=st.wait, finish=finish)
        except ReadTimeout:
            _kill(ch, st, run_id)
            raise
        except TooLarge as exc:
            st.close()
            raise grew_over_cap(resolved, exc.size_bytes, max_bytes) from None
        except BaseException:
            st.close()
            raise
        if info is not None:
            st.close()
            return info
    # no pipe, or a store (or kernel) that cannot take one: nothing was read yet, stream it
    body = _iter_stream(ch, st, run_id, resolved, mode, expected_size=expected_size, max_bytes=max_bytes)
    return store.put_stream(key, guard(body) if guard else body, max_bytes=max_bytes)


def exec_gated_extract(ch: GatedChannel, path: str, store, key: str, *, max_bytes: int,
                       check: Callable[[Resolved], PathPolicy],
                       guard: Callable[[Iterator[bytes]], Iterator[bytes]] | None = None):
    """Resolve and store `path` with ONE exec (:data:`GATED_STREAM_SCRIPT`):
    `check(resolved)` refuses (raises: the file is never opened) or returns the
    policy, and only then is the file streamed. None when the path did not resolve."""
    check_lexical(path)
    mode = "cat" if getattr(ch, "binary_safe", True) else "base64"
    run_id = uuid.uuid4().hex
    st = ch.exec_gated(["env", f"COURIER_EXEC_ID={run_id}", "sh", "-c", GATED_STREAM_SCRIPT, "sh", path, mode])
    try:
        if st.gate is None or st.pipe_fd is None:
            raise SandboxError("exec_gated_extract needs a channel with a stdin gate and a stdout pipe")
        head = bytearray()
        while head.count(b"\0") < 4 and len(head) <= 3 * 65536:
            st.wait()
            data = os.read(st.pipe_fd, 65536)
            if not data:  # the script ended before its answer: the path did not resolve
                st.end()
                st.close()
                return None
            head += data
        # the script sends nothing more before `go`
        if len(head) > 3 * 65536 or not head.endswith(b"\0") or head.count(b"\0") != 4:
            raise SandboxError(f"{path}: unexpected reply from the sandbox ({bytes(head[:200])!r})")
        r = _parse_resolved(bytes(head[:-1]), path)
        policy = check(r)
        st.gate(b"go 1\n" if policy.links_allowed(r.path) else b"go\n")
    except BaseException:
        st.close()
        raise
    return _store_stream(ch, st, run_id, r.path, mode, store, key, expected_size=r.size, max_bytes=max_bytes,
                         guard=guard)


def exec_extract(ch: ExecChannel, policy: PathPolicy | None, path: str, store, key: str, *,
                 max_bytes: int = DEFAULT_MAX_BYTES, policy_for: Callable[[str | None], PathPolicy] | None = None):
    """resolve (1 exec) + policy check + stream (1 exec) into `store`. The
    policy is `policy`, or with `policy_for` the one for the sandbox's $HOME
    (which also checks a path that does not resolve, see exec_resolve)."""
    r = exec_resolve(ch, path, policy_for=policy_for)
    if policy_for is not None:
        policy = policy_for(r.home)
    if policy is None:
        raise SandboxError("exec_extract needs a policy or policy_for")
    policy.check(r.path, shown=path)
    check_size(path, r.size, max_bytes)
    return store.put_stream(key, exec_iter_file(ch, r.path, expected_size=r.size, max_bytes=max_bytes,
                                                policy=policy), max_bytes=max_bytes)


def resolve_put_dest(ch: ExecChannel, policy_for: Callable[[str | None], PathPolicy], dest_path: str
                     ) -> tuple[str, int, int]:
    """ONE exec: resolve the destination's directory, check the final path.
    Returns (final path, uid, gid) of the exec user."""
    check_lexical(dest_path)
    name = posixpath.basename(dest_path)
    if not name or name in (".", ".."):
        raise UnsafePath(f"{dest_path}: needs a file name")
    parent = posixpath.dirname(dest_path) or "/"
    rc, out, err = _ask(ch, PUT_RESOLVE_SCRIPT, parent, name)
    if rc == EXIT_MISSING:
        # e.g. <workspace>/inbox/ on a turn's first attachment: made as the sandbox's user once the
        # destination passed the policy (resolve_by_ancestor), then resolved again
        target = posixpath.dirname(resolve_by_ancestor(ch, policy_for, dest_path)[1])
        rc, _out, err = ch.exec_small(["mkdir", "-p", "--", target])
        if rc != 0:
            raise SandboxError(f"{dest_path}: cannot create {target} (exit {rc}: {_err_text(err)})")
        rc, out, err = _ask(ch, PUT_RESOLVE_SCRIPT, parent, name)
    if rc == EXIT_MISSING:
        raise FileMissing(f"{dest_path}: directory {parent} does not exist")
    if rc == EXIT_NOT_DIR:
        raise NotAFile(f"{dest_path}: {parent} is not a directory")
    if rc == EXIT_CHANGED:
        raise UnsafePath(f"{dest_path}: is a link or a directory")
    if rc != 0:
        raise SandboxError(f"{dest_path}: cannot resolve (exit {rc}: {_err_text(err)})")
    home, rdir, uid, gid = _fields(out, 4, dest_path)
    final = posixpath.join(rdir, name)
    policy_for(home or None).check(final, shown=dest_path)
    try:
        return final, int(uid), int(gid)
    except ValueError:
        return final, 0, 0


def resolve_by_ancestor(ch: ExecChannel, policy_for: Callable[[str | None], PathPolicy], dest_path: str
                        ) -> tuple[PathPolicy, str]:
    """ONE exec: `dest_path` under its parent's deepest existing ancestor
    resolved in the sandbox (the rest as written), checked: (policy, path)."""
    parent = posixpath.dirname(dest_path) or "/"
    rc, out, err = _ask(ch, ANCESTOR_SCRIPT, parent)
    if rc != 0:
        raise SandboxError(f"{dest_path}: cannot resolve (exit {rc}: {_err_text(err)})")
    home, anc, real = _fields(out, 3, dest_path)
    rest = [p for p in parent[len(anc):].split("/") if p not in ("", ".")] if parent.startswith(anc) else None
    if rest is None or not real.startswith("/"):
        raise SandboxError(f"{dest_path}: unexpected answer from the sandbox ({out[:200]!r})")
    policy = policy_for(home or None)
    return policy, policy.check(posixpath.join(real, *rest, posixpath.basename(dest_path)), shown=dest_path)


class Counted:
    """A stored blob's chunks for an upload, counted in `sent` (each pass from 0: a write path that gave up
    part way is followed by another whole pass): past `max_bytes`, TooLarge."""

    def __init__(self, store, key: str, max_bytes: int) -> None:
        self.store, self.key, self.max_bytes = store, key, max_bytes
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        self.sent = 0
        for chunk in self.store.iter_chunks(self.key):
            self.sent += len(chunk)
            if self.sent > self.max_bytes:
                raise grew_over_cap(self.key, self.sent, self.max_bytes)
            yield chunk


def exec_put(ch, policy_for: Callable[[str | None], PathPolicy], store, key: str, dest_path: str, *,
             max_bytes: int = DEFAULT_MAX_BYTES,
             write: Callable[[str, Iterator[bytes], int, int], bool] | None = None) -> str:
    """Inbound: the destination resolved (1 exec), the blob written to a temp
    name beside it by `write(tmp, chunks, uid, gid)` (False: it could not,
    nothing written) else through ``ch.exec_stdin``, then renamed by
    :data:`PUT_SCRIPT` only whole (its size checked): 2 or 3 execs in all."""
    size = store.stat(key).size_bytes
    check_size(key, size, max_bytes)
    final, uid, gid = resolve_put_dest(ch, policy_for, dest_path)
    tmp = temp_beside(final)
    body = Counted(store, key, max_bytes)
    if write is not None and write(tmp, iter(body), uid, gid):
        rc, _out, err = ch.exec_small(["sh", "-c", PUT_SCRIPT, "sh", tmp, final, "", str(size)])
    else:
        mode, data = ("cat", body) if getattr(ch, "binary_safe", True) else ("base64", _b64_encode(body))
        rc, _out, err = ch.exec_stdin(["sh", "-c", PUT_SCRIPT, "sh", tmp, final, mode, str(size)], data)
    if rc == EXIT_CHANGED:
        raise UnsafePath(f"{dest_path}: is a link or a directory")
    if rc == EXIT_SHORT:
        raise SandboxGone(f"{dest_path}: upload cut short; nothing written "
                          f"({size:,} bytes expected, {body.sent:,} sent)")
    if rc != 0:
        raise SandboxError(f"{dest_path}: writing failed (exit {rc}: {_err_text(err)})")
    return final


def _b64_encode(chunks: Iterable[bytes], line: int = 57 * 1024) -> Iterator[bytes]:
    pending = b""
    for chunk in chunks:
        data = pending + chunk
        cut = len(data) - len(data) % 3
        pending = data[cut:]
        for i in range(0, cut, line):
            yield binascii.b2a_base64(data[i:min(i + line, cut)])
    if pending:
        yield binascii.b2a_base64(pending)

