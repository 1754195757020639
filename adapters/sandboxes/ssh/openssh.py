"""The OpenSSH transport (option ``use_openssh``): the `ssh` client over a
ControlMaster socket (``ControlPersist=60``) named by
:func:`adapters.sandboxes.ssh.pool.trust_key`. An extraction is ONE ssh run
of execstream's gated stream script. ssh joins its arguments into one remote
command line, so the argv is quoted with `shlex.join` (a POSIX login shell is
assumed on the host). Every read and write has a deadline.

``Sandbox.exec`` runs through an `ssh` client that joins the control master
but never starts one (a master would inherit its output pipes). Exit 255 is
ssh's own failure and raises (a command's own 255 looks the same); the exit
is known only when the channel closes, so a background job still holding the
output keeps exec waiting until the timeout (124).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import select
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from adapters.errors import ConfigError, FileMissing, NotAFile, SandboxError, UnsafePath
from adapters.sandboxes.base import PathPolicy, PipeRun, ReadTimeout, temp_beside
from adapters.sandboxes.execstream import (
    Counted, ExecStream, Resolved, exec_gated_extract, exec_resolve, kill_argv, resolve_by_ancestor,
)
from adapters.sandboxes.ssh.core import CHUNK, FileChanged, SshCore, _ready

if TYPE_CHECKING:
    from storage.base import BlobInfo, BlobStore

#: the OpenSSH client's defaults with AES-GCM first (chacha20-poly1305 leads them, and costs
#: more CPU per byte where AES-NI is there, as on x86-64 and arm64)
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
        """`master` False: join a running control master, never fork one (see the module docstring)."""
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

    def _spawn(self, argv: Sequence[str], *, stdin: Any, stdout: Any = subprocess.PIPE, stderr: Any,
               master: bool = True) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(self._ssh_argv(shlex.join(argv), master=master), stdin=stdin, stdout=stdout,
                                    stderr=stderr, bufsize=0)
        except FileNotFoundError as exc:
            raise ConfigError("use_openssh needs the OpenSSH client: apt-get install openssh-client") from exc

    def _openssh(self) -> "_OpenSshChannel":
        return _OpenSshChannel(self)

    def _resolve_openssh(self, path: str) -> Resolved:
        """ONE exec through the control master (execstream's resolve script)."""
        try:
            r = exec_resolve(self._openssh(), path, policy_for=self._policy)
        except (FileMissing, NotAFile):
            self._policy(self._remote_home()).check_lexical_denied(path)  # denied paths say so, existing or not
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
            self._policy(self._remote_home()).check_lexical_denied(path)  # denied paths say so, existing or not
            raise
        if info is None:  # it did not resolve: the resolve's own answer (missing, denied, ...)
            self._resolve_openssh(path)
            raise FileChanged(f"{path}: appeared while it was resolved; read again")
        return info

    def _copy_in_openssh(self, store: BlobStore, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """The parent's deepest existing ancestor resolved, then _PUT_SH: a dropped
        connection ends its `cat` with EOF, so it checks the received size before the rename."""
        policy, dest = resolve_by_ancestor(self._openssh(), self._policy, dest_path)
        policy.check_lexical_denied(dest_path)
        body = Counted(store, key, max_bytes)
        rc, _, err = self._openssh().exec_stdin(
            ["sh", "-c", _PUT_SH, "sh", posixpath.dirname(dest), dest, temp_beside(dest), str(size)], body)
        if rc == 5:
            raise UnsafePath(f"{dest_path}: is a symbolic link")
        if rc == 4:
            raise NotAFile(f"{dest_path}: exists and is not a regular file")
        if rc == 6:
            raise FileChanged(f"{dest_path}: short write ({body.sent:,} of {size:,} bytes)")
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
    A 255 exit (ssh's own failure) is translated here; other exit codes are
    the command's and go back to the caller."""

    binary_safe = True

    def __init__(self, sb: OpenSshTransport) -> None:
        self.sb = sb

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

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        st = self._run(argv, what=argv[-1] if argv else "ssh")
        out = bytearray()
        try:
            for chunk in st.chunks:
                if len(out) < (1 << 20):
                    out += chunk
        finally:
            st.close()
        return st.exit_code(), bytes(out), st.stderr()  # type: ignore[return-value]  # known: the chunks ran out

    def exec_gated(self, argv: Sequence[str]) -> ExecStream:
        """exec_stream with a stdin pipe for one line (``ExecStream.gate``)."""
        return self._run(argv, gated=True)

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        return self._run(argv)

    def _run(self, argv: Sequence[str], *, gated: bool = False, what: str | None = None) -> ExecStream:
        # stderr goes to a file: a ControlPersist master forked by this ssh
        # would keep an inherited stderr pipe open for a minute
        errf = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = self.sb._spawn(argv, stdin=subprocess.PIPE if gated else subprocess.DEVNULL, stderr=errf)
        fd = _pipe(proc.stdout).fileno()
        with contextlib.suppress(OSError, AttributeError):  # a 1 MiB pipe: fewer stalls of ssh while we hash
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, CHUNK)
        state: dict[str, Any] = {"rc": None, "err": b""}
        what = what or (argv[-2] if len(argv) > 1 else "ssh")

        def wait() -> None:
            idle = self.sb.io_timeout_s
            if not _ready(fd, select.POLLIN, idle):  # a stalled remote costs this attempt, not the worker
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
            proc = self.sb._spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errf)
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


class _OpenSshRun(PipeRun):
    """One ``Sandbox.exec`` command through the OpenSSH client (an ExecRun);
    the client joins the control master but never forks one."""

    read_size = CHUNK

    def __init__(self, sb: OpenSshTransport, argv: Sequence[str], run_id: str) -> None:
        self.sb, self.run_id = sb, run_id
        super().__init__(sb._spawn(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, master=False))

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc == 255:  # ssh's own failure (its message: the head of stderr)
            raise self.sb._ssh_error(rc, bytes(self.err_head), "exec")
        return rc

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the host's `timeout` is the backstop
            self.sb._openssh().exec_small(kill_argv(self.run_id))
        if self.proc.poll() is None:
            self.proc.kill()
