"""The OpenSSH transport (option ``use_openssh``): the `ssh` client over a
ControlMaster socket (``ControlPersist=60``, AES-GCM preferred; the socket is
named by :func:`adapters.sandboxes.ssh.pool.trust_key`, a hash of the trust
settings).

An extraction is ONE ssh run of execstream's gated stream script
(:mod:`adapters.sandboxes.execstream`): it answers the resolve, waits for
this side's check of the answer, then streams (`cat` of the descriptor its
stream script checked, and the byte count); into a volume the client's
stdout pipe is spliced into the file in the kernel. ssh joins its arguments
into one remote shell command line, so the argv is quoted with `shlex.join`
(a POSIX login shell is assumed on the host). Every read and write has a
deadline (``io_timeout_s``).

Commands (``Sandbox.exec``) run through an `ssh` client that joins the
control master but never starts one, so no master inherits its output
pipes. An exit code of 255 is ssh's own failure and raises (the command's
own 255 cannot be told apart), and the exit is only known when the channel
closes: a background job still holding the output keeps exec waiting until
the timeout (124).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import select
import selectors
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from adapters.errors import ConfigError, FileMissing, NotAFile, SandboxError, SandboxGone, UnsafePath
from adapters.sandboxes.base import BoundedOutput, PathPolicy, ReadTimeout, grew_over_cap
from adapters.sandboxes.execstream import ExecStream, Resolved, exec_gated_extract, exec_resolve, kill_argv
from adapters.sandboxes.ssh.core import (
    CHUNK, FileChanged, SshCore, _readable, _ready, _strip_nl, _temp_beside,
)

if TYPE_CHECKING:
    from storage.base import BlobInfo, BlobStore

#: the OpenSSH client's cipher order: its defaults with AES-GCM first (chacha20-poly1305
#: leads them, and costs ~1.5x the CPU per byte where AES-NI is there, as on x86-64 and arm64)
OPENSSH_CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
                   "aes128-ctr,aes192-ctr,aes256-ctr")

_control_dir_lock = threading.Lock()
_default_control_dir: str | None = None


def _control_dir() -> str:
    """A short private directory for ControlPath sockets (sun_path is ~104 bytes)."""
    global _default_control_dir
    with _control_dir_lock:
        if _default_control_dir is None or not os.path.isdir(_default_control_dir):
            _default_control_dir = tempfile.mkdtemp(prefix="courier-ssh-", dir="/tmp")
        return _default_control_dir


# -- remote shell snippets (inbound put in OpenSSH mode) ---------------------------
# Resolve and stream in OpenSSH mode use adapters.sandboxes.execstream; put keeps
# its own script because it verifies the received size before the rename (a
# dropped connection ends `cat` with EOF, which must not publish a short file).
#: prints "$HOME\0<deepest existing ancestor of $1>\0<it resolved>\n"
_ANCESTOR_SH = (
    'd=$1; while [ ! -e "$d" ] && [ "$d" != / ]; do d=${d%/*}; [ -n "$d" ] || d=/; done; '
    'printf "%s\\0%s\\0" "$HOME" "$d"; readlink -f -- "$d"'
)
#: $1 resolved parent, $2 dest, $3 temp name, $4 expected size: write, verify, rename
_PUT_SH = (
    'umask 022; mkdir -p -- "$1" || exit 7; '
    'if [ -L "$2" ]; then echo "is a symbolic link" >&2; exit 5; fi; '
    'if [ -d "$2" ]; then echo "is a directory" >&2; exit 4; fi; '
    'cat > "$3" || { rm -f -- "$3"; exit 8; }; '
    'if [ "$(stat -c %s -- "$3")" != "$4" ]; then rm -f -- "$3"; echo "short write" >&2; exit 6; fi; '
    'mv -f -- "$3" "$2" || { rm -f -- "$3"; exit 8; }'
)


class OpenSshTransport(SshCore):
    """The OpenSSH half of :class:`adapters.sandboxes.ssh.sandbox.SshSandbox`."""

    def _ssh_argv(self, command: str, *, master: bool = True) -> list[str]:
        """`master` False: use a running control master but never fork one
        (a forked master would inherit this client's output pipes)."""
        cdir = self.control_dir or _control_dir()
        argv = [
            "ssh", "-T", "-e", "none", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={max(1, int(self.connect_timeout_s))}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3",
            "-o", f"ControlMaster={'auto' if master else 'no'}", "-o", f"ControlPath={cdir}/cm-{self._trust_key()}",
            "-o", "ControlPersist=60", "-o", f"Ciphers={OPENSSH_CIPHERS}",
            "-p", str(self.port), "-l", self.user,
        ]
        if self.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null"]
        if self.key_path:
            argv += ["-i", self.key_path, "-o", "IdentitiesOnly=yes"]
        return [*argv, "--", self.host, command]

    def _openssh(self) -> "_OpenSshChannel":
        return _OpenSshChannel(self)

    def _resolve_openssh(self, path: str) -> Resolved:
        """ONE exec through the control master (execstream's resolve script)."""
        try:
            r = exec_resolve(self._openssh(), path, policy_for=self._policy)
        except (FileMissing, NotAFile):
            self._deny_lexical(self._policy(self._remote_home()), path)  # denied paths say so, existing or not
            raise
        self._policy(r.home).check(r.path, shown=path)
        return r

    def _copy_out_openssh(self, path: str, store: BlobStore, key: str, *, max_bytes: int) -> BlobInfo:
        """ONE ssh run resolves, waits for our check of the answer, then streams; into a
        volume its output is spliced into the file in the kernel (see exec_gated_extract)."""
        def check(r: Resolved) -> PathPolicy:
            policy = self._policy(r.home)
            policy.check(r.path, shown=path)
            self.check_size(path, r.size, max_bytes)
            return policy

        try:
            info = exec_gated_extract(self._openssh(), path, store, key, max_bytes=max_bytes, check=check,
                                      guard=lambda chunks: self._guarded(chunks, path))
        except (FileMissing, NotAFile):
            self._deny_lexical(self._policy(self._remote_home()), path)  # denied paths say so, existing or not
            raise
        if info is None:  # it did not resolve: the resolve's own answer (missing, denied, ...)
            self._resolve_openssh(path)
            raise FileChanged(f"{path}: appeared while it was resolved; read again")
        return info

    def _copy_in_openssh(self, store: BlobStore, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """Stream a stored blob to `dest_path` on the host (_PUT_SH): written to a
        temp name beside it, size-checked, then renamed over the destination."""
        parent_lex = posixpath.dirname(dest_path)
        rc, out, err = self._openssh().exec_small(["sh", "-c", _ANCESTOR_SH, "sh", parent_lex])
        if rc != 0 or out.count(b"\0") < 2:
            raise self._ssh_error(rc, err, dest_path)
        home, anc_lex, anc_real = out.split(b"\0", 2)
        policy = self._policy(home.decode("utf-8", "surrogateescape") or None)
        self._deny_lexical(policy, dest_path)
        anc_lex_s = anc_lex.decode("utf-8", "surrogateescape")
        anc_real_s = _strip_nl(anc_real).decode("utf-8", "surrogateescape")
        rest = parent_lex[len(anc_lex_s):].lstrip("/") if parent_lex.startswith(anc_lex_s) else None
        if rest is None or not anc_real_s.startswith("/"):
            raise SandboxError(f"{dest_path}: unexpected answer from {self.where}")
        parent = posixpath.join(anc_real_s, rest) if rest else anc_real_s
        dest = posixpath.join(parent, posixpath.basename(dest_path))
        policy.check(dest, shown=dest_path)
        tmp = _temp_beside(dest)
        sent = 0

        def chunks() -> Iterator[bytes]:
            nonlocal sent
            for chunk in store.iter_chunks(key):
                sent += len(chunk)
                if sent > max_bytes:
                    raise grew_over_cap(key, sent, max_bytes)
                yield chunk

        # an aborted upload reaches the remote `cat` as a short stream: the
        # size check in _PUT_SH refuses it, so no partial file is published
        rc, _, err = self._openssh().exec_stdin(["sh", "-c", _PUT_SH, "sh", parent, dest, tmp, str(size)], chunks())
        if rc == 5:
            raise UnsafePath(f"{dest_path}: is a symbolic link")
        if rc == 4:
            raise NotAFile(f"{dest_path}: exists and is not a regular file")
        if rc == 6:
            raise FileChanged(f"{dest_path}: short write ({sent:,} of {size:,} bytes)")
        if rc != 0:
            raise self._ssh_error(rc, err, dest_path)
        return dest

    def _home_openssh(self) -> str:
        """The remote user's $HOME, asked over the control master ("" when unset)."""
        rc, out, err = self._openssh().exec_small(["sh", "-c", 'printf "%s" "$HOME"'])
        if rc != 0:
            raise self._ssh_error(rc, err, "home")
        return out.decode("utf-8", "surrogateescape")

    def _remote_home(self) -> str | None:
        if self._checked_policy is not None or (self.policy.roots and self.policy.home):
            return None
        return self._home_openssh() or None

    def _close_openssh(self) -> None:
        """Stop this sandbox's OpenSSH control master, if any."""
        cdir = self.control_dir or _default_control_dir
        if not cdir:
            return
        argv = self._ssh_argv("true")
        argv = argv[: argv.index("--")] + ["-O", "exit", "--", self.host]
        with contextlib.suppress(Exception):
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=10)


def _pipe(f: IO[bytes] | None) -> IO[bytes]:
    """A stream the client was started with as a pipe (so never None)."""
    if f is None:
        raise SandboxError("ssh: the client's pipe is missing")
    return f


class _OpenSshChannel:
    """execstream's ExecChannel over the OpenSSH client and its control master.

    ssh joins the remote argv into one string for the remote login shell, so
    the argv is quoted with shlex (POSIX quoting) and parsed back there. A
    255 exit (ssh's own failure) is translated here; other exit codes are
    the command's and go back to the caller."""

    binary_safe = True

    def __init__(self, sb: OpenSshTransport) -> None:
        self.sb = sb

    def _popen(self, argv: Sequence[str], stdin: int, stderr: IO[bytes]) -> subprocess.Popen[bytes]:
        try:
            # stderr goes to a file: a ControlPersist master forked by this
            # ssh would keep an inherited stderr pipe open for a minute
            return subprocess.Popen(self.sb._ssh_argv(shlex.join(argv)), stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=stderr, bufsize=0)
        except FileNotFoundError as exc:
            raise ConfigError("use_openssh needs the OpenSSH client: apt-get install openssh-client") from exc

    def _finish(self, proc: subprocess.Popen[bytes], errf: IO[bytes], what: str) -> tuple[int, bytes]:
        try:
            rc = proc.wait(timeout=self.sb.io_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise ReadTimeout(f"ssh {self.sb.where}: timed out ({what})") from exc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errf.seek(0)
        err = errf.read(65536)
        if rc == 255:
            raise self.sb._ssh_error(rc, err, what)
        return rc, err

    def _read(self, proc: subprocess.Popen[bytes], n: int, what: str) -> bytes:
        """Up to `n` bytes of the client's stdout (b"" at the end), waiting at
        most io_timeout_s for them: a stalled remote (a FIFO's open, a stuck
        shell) ends this client with ReadTimeout instead of holding the worker."""
        fd = _pipe(proc.stdout).fileno()
        if not _readable(fd, self.sb.io_timeout_s):
            proc.kill()
            raise ReadTimeout(f"ssh {self.sb.where}: nothing received for {self.sb.io_timeout_s:g} s ({what})")
        return os.read(fd, n)

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        what = argv[-1] if argv else "ssh"
        with tempfile.TemporaryFile() as errf:
            proc = self._popen(argv, subprocess.DEVNULL, errf)
            out = bytearray()
            try:
                with _pipe(proc.stdout):
                    while data := self._read(proc, 65536, what):  # raw pipe: read to EOF
                        if len(out) < (1 << 20):
                            out += data
            except BaseException:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                raise
            rc, err = self._finish(proc, errf, what)
        return rc, bytes(out), err

    def exec_gated(self, argv: Sequence[str]) -> ExecStream:
        """exec_stream with a stdin pipe for one line (``ExecStream.gate``)."""
        return self.exec_stream(argv, gated=True)

    def exec_stream(self, argv: Sequence[str], *, gated: bool = False) -> ExecStream:
        errf = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = self._popen(argv, subprocess.PIPE if gated else subprocess.DEVNULL, errf)
        stdout = _pipe(proc.stdout)
        with contextlib.suppress(OSError, AttributeError):  # a 1 MiB pipe: fewer stalls of ssh while we hash
            fcntl.fcntl(stdout.fileno(), fcntl.F_SETPIPE_SZ, CHUNK)
        state: dict[str, Any] = {"rc": None, "err": b""}
        what = argv[-2] if len(argv) > 1 else "ssh"

        fd = stdout.fileno()

        def wait() -> None:
            idle = self.sb.io_timeout_s
            if not _readable(fd, idle):  # a read deadline: a stalled remote costs this attempt, not the worker
                proc.kill()
                raise ReadTimeout(f"ssh {self.sb.where}: nothing received for {idle:g} s ({what})")

        def end() -> None:
            state["rc"], state["err"] = self._finish(proc, errf, what)

        def chunks() -> Iterator[bytes]:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            fill = 0
            while True:
                wait()
                n = os.readv(fd, [view[fill:]])
                if not n:
                    break
                fill += n
                if fill == CHUNK:
                    yield bytes(buf)
                    fill = 0
            if fill:
                yield bytes(view[:fill])
            end()

        def gate(line: bytes) -> None:
            stdin = _pipe(proc.stdin)
            try:
                stdin.write(line)  # a line: far below the pipe's size, never blocks
            except BrokenPipeError:
                pass  # the remote script ended: its exit status says why
            finally:
                with contextlib.suppress(OSError):
                    stdin.close()

        def close() -> None:
            if proc.poll() is None:  # consumer stopped early: end our client (the master stays)
                proc.kill()
                proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            errf.close()

        return ExecStream(chunks=chunks(), exit_code=lambda: state["rc"], stderr=lambda: state["err"], close=close,
                          pipe_fd=fd, wait=wait, end=end, gate=gate if gated else None)

    def exec_stdin(self, argv: Sequence[str], chunks: Iterable[bytes]) -> tuple[int, bytes, bytes]:
        with tempfile.TemporaryFile() as errf:
            proc = subprocess.Popen(self.sb._ssh_argv(shlex.join(argv)), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=errf, bufsize=0)
            what = argv[-1] if argv else "ssh"
            stdin = _pipe(proc.stdin)
            try:
                fd = stdin.fileno()
                os.set_blocking(fd, False)
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        # a write deadline too: a remote that stops reading costs this attempt
                        if not _ready(fd, select.POLLOUT, self.sb.io_timeout_s):
                            raise ReadTimeout(f"ssh {self.sb.where}: nothing taken for "
                                              f"{self.sb.io_timeout_s:g} s ({what})")
                        try:
                            view = view[os.write(fd, view):]
                        except BlockingIOError:
                            continue
                stdin.close()
            except BrokenPipeError:
                pass  # the remote side ended early: its exit code says why
            except BaseException:
                proc.kill()  # aborted: the remote sees a short stream and refuses it
                raise
            finally:
                with contextlib.suppress(OSError):
                    stdin.close()
            rc, err = self._finish(proc, errf, what)
        return rc, b"", err


class _OpenSshRun:
    """One ``Sandbox.exec`` command through the OpenSSH client (an ExecRun);
    the client joins the control master but never forks one."""

    def __init__(self, sb: OpenSshTransport, argv: Sequence[str], run_id: str) -> None:
        self.sb, self.run_id = sb, run_id
        try:
            self.proc = subprocess.Popen(sb._ssh_argv(shlex.join(argv), master=False), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        except FileNotFoundError as exc:
            raise ConfigError("use_openssh needs the OpenSSH client: apt-get install openssh-client") from exc
        self.sel = selectors.DefaultSelector()
        self.sel.register(_pipe(self.proc.stdout), selectors.EVENT_READ, "out")
        self.sel.register(_pipe(self.proc.stderr), selectors.EVENT_READ, "err")
        self.err_head = bytearray()  # for ssh's own failure messages (exit 255)
        self.closed = False

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        if not self.sel.get_map():
            return False
        for key, _ in self.sel.select(timeout=wait_s):
            chunk = os.read(key.fd, CHUNK)
            if not chunk:
                self.sel.unregister(key.fileobj)
            elif key.data == "out":
                out.add(chunk)
            else:
                err.add(chunk)
                if len(self.err_head) < 4096:
                    self.err_head += chunk[:4096 - len(self.err_head)]
        return bool(self.sel.get_map())

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc == 255:
            raise self.sb._ssh_error(rc, bytes(self.err_head), "exec")
        return rc

    def wait(self, timeout_s: float) -> int | None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the host's `timeout` is the backstop
            self.sb._openssh().exec_small(kill_argv(self.run_id))
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sel.close()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
