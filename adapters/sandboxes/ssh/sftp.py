"""The SFTP transport (paramiko, the default): resolve, stream and put over
SFTP channels of the pooled connection, and exec runs on its session channels.
Reads keep a window's worth of READ requests in flight, read by a helper
thread so that hashing and writing overlap the SSH parsing."""

from __future__ import annotations

import contextlib
import errno
import posixpath
import select
import shlex
import stat
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from adapters.errors import FileMissing, NotAFile, SandboxError, SandboxGone, UnsafePath
from adapters.sandboxes.base import (
    BoundedOutput, PathPolicy, ReadTimeout, call_with_deadline, deepest_existing, temp_beside, with_deadline,
)
from adapters.sandboxes.execstream import Counted, ExecStream, exec_resolve, kill_argv
from adapters.sandboxes.ssh.core import CHUNK, FileChanged, SFTPAttributes, SFTPClient, SshCore, _check_same, _paramiko
from adapters.sandboxes.ssh.paramiko_internals import _nlink_from_listing, _sftp_pipeline, _use_fast_pipe
from adapters.sandboxes.ssh.pool import MAX_PACKET_SIZE, WINDOW_SIZE

if TYPE_CHECKING:
    from storage.base import BlobInfo, BlobStore

#: SFTP read/write request size on OpenSSH servers (its max is 256 KiB - 1 KiB);
#: other servers keep paramiko's 32 KiB, which every server honours
OPENSSH_REQUEST_SIZE = 261120


class SftpTransport(SshCore):
    """The SFTP half of :class:`adapters.sandboxes.ssh.sandbox.SshSandbox`."""

    @contextlib.contextmanager
    def _sftp(self) -> Iterator[SFTPClient]:
        """A fresh SFTP channel on the pooled connection (channels are cheap;
        an SFTPClient is not safe to share between threads)."""
        paramiko = _paramiko()
        try:
            sftp = self._open_sftp(self.transport())
        except ReadTimeout:
            self._evict()  # the host stopped answering: its connection goes (a blocked opener with it)
            raise
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if isinstance(exc, (paramiko.AuthenticationException, paramiko.BadHostKeyException)) \
                    or "known_hosts" in str(exc):
                raise
            self._evict()  # stale pooled transport: one reconnect
            sftp = self._open_sftp(self.transport())
        if sftp is None:
            raise SandboxGone(f"ssh {self.where}: could not open an SFTP channel")
        sftp.get_channel().settimeout(self.io_timeout_s)
        _use_fast_pipe(sftp.get_channel())
        try:
            yield sftp
        finally:
            with contextlib.suppress(Exception):
                sftp.close()

    def _open_sftp(self, t: Any) -> SFTPClient | None:
        """An SFTP channel on transport `t` within the read deadline: paramiko
        waits up to an hour for a channel's confirmation and without end for
        the subsystem's, so a host that stopped answering is a ReadTimeout here
        like any stalled read (the caller evicts the connection)."""
        paramiko = _paramiko()
        return call_with_deadline(lambda: paramiko.SFTPClient.from_transport(
            t, window_size=WINDOW_SIZE, max_packet_size=MAX_PACKET_SIZE), self.io_timeout_s,
            f"ssh {self.where}: opening an SFTP channel")

    def _exec(self, command: str, limit: int = 1 << 20) -> tuple[int, bytes, bytes]:
        """Run one small remote command on the pooled connection; (rc, stdout, stderr)."""
        chan = self.transport().open_session()
        try:
            chan.settimeout(self.io_timeout_s)
            chan.exec_command(command)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            for buf, recv in ((out, chan.recv), (err, chan.recv_stderr)):
                while data := recv(65536):
                    if len(buf) < limit:
                        buf += data
            return chan.recv_exit_status(), bytes(out), bytes(err)
        finally:
            chan.close()

    def _sftp_policy(self, sftp: SFTPClient) -> PathPolicy:
        if self._checked_policy is not None:
            return self._checked_policy
        return self._policy(None if (self.policy.roots and self.policy.home) else sftp.normalize("."))

    def _trusts_realpath(self, sftp: SFTPClient) -> bool:
        """OpenSSH's SFTP realpath resolves every link; other servers' may be lexical."""
        if self.trust_sftp_realpath is None:
            return "OpenSSH" in (sftp.get_channel().get_transport().remote_version or "")
        return self.trust_sftp_realpath

    def _resolve_sftp(self, sftp: SFTPClient, path: str) -> tuple[str, SFTPAttributes]:
        policy = self._sftp_policy(sftp)
        try:
            real = self._realpath(sftp, path)
        except FileNotFoundError:
            # the server says only "no such file" (for a link loop too): ONE exec says what the
            # path would name (a denied one is refused as if it existed) or that it loops
            policy.check_lexical_denied(path)
            exec_resolve(_SshSmall(self), path, policy_for=self._policy)
            raise FileMissing(f"{path}: no such file on {self.where}") from None
        policy.check(real, shown=path)
        try:
            st = sftp.lstat(real)
        except FileNotFoundError:
            raise FileMissing(f"{path}: no such file on {self.where}") from None
        if stat.S_ISLNK(st.st_mode or 0):  # the server's realpath left a link: resolve on the host
            real = self._readlink_f(real)
            policy.check(real, shown=path)
            st = sftp.lstat(real)
            if stat.S_ISLNK(st.st_mode or 0):
                raise UnsafePath(f"{path}: links keep changing")
        if not stat.S_ISREG(st.st_mode or 0):
            raise NotAFile(f"{path}: not a regular file")
        return real, st

    def _realpath(self, sftp: SFTPClient, path: str) -> str:
        """`path` resolved on the host: by the server's realpath where it is trusted, else `readlink -f`."""
        return sftp.normalize(path) if self._trusts_realpath(sftp) else self._readlink_f(path)

    def _readlink_f(self, path: str) -> str:
        rc, out, err = self._exec(shlex.join(["readlink", "-f", "--", path]), limit=65536)
        if rc != 0 or not out:
            raise FileNotFoundError(errno.ENOENT, f"readlink -f failed: {err.decode(errors='replace').strip()}")
        return out.removesuffix(b"\n").decode("utf-8", "surrogateescape")

    def _request_size(self, sftp: SFTPClient) -> int:
        version = sftp.get_channel().get_transport().remote_version or ""
        return OPENSSH_REQUEST_SIZE if "OpenSSH" in version else 32768

    def _stream_sftp(self, sftp: SFTPClient, resolved: str, st0: SFTPAttributes) -> Iterator[bytes]:
        """Pipelined SFTP read of a resolved file, checked on the open handle:
        SFTP has no inode, so the handle's fstat must be the file the resolve
        saw (:func:`_check_same`) and right after the open the path must still
        resolve to itself; both are checked again after the transfer."""
        f = sftp.open(resolved, "rb")
        try:
            req = self._request_size(sftp)
            f.MAX_REQUEST_SIZE = req  # per-file: fewer, larger READ requests
            fst = f.stat()
            if not stat.S_ISREG(fst.st_mode or 0):
                raise NotAFile(f"{resolved}: not a regular file")
            _check_same(st0, fst, resolved, "between resolve and open")
            self._check_path(sftp, resolved, fst)
            policy = self._sftp_policy(sftp)
            if not policy.links_allowed(resolved):  # SFTP attributes carry no link count
                policy.check_links(resolved, self._nlink(sftp, resolved, fst))
            total = 0
            # read by a helper thread: paramiko's parsing holds the GIL while hashing
            # and writing (in put_stream) mostly release it, so they overlap
            depth = max(4, WINDOW_SIZE // req)
            for chunk in with_deadline(_sftp_pipeline(sftp, f.handle, fst.st_size, req, depth), None,
                                       ahead=4, abort=sftp.get_channel().close):
                total += len(chunk)
                yield chunk
            if total != fst.st_size:
                raise FileChanged(f"{resolved}: changed during the transfer ({total:,} of {fst.st_size:,} bytes read)")
            _check_same(fst, f.stat(), resolved, "during the transfer")
            self._check_path(sftp, resolved, fst)
        finally:
            with contextlib.suppress(Exception):
                f.close()

    def _nlink(self, sftp: SFTPClient, resolved: str, fst: SFTPAttributes) -> int:
        """The file's hard link count: from its directory's listing on an OpenSSH
        server (:func:`_nlink_from_listing`), else one `stat` over exec."""
        if self._trusts_realpath(sftp):
            n = _nlink_from_listing(sftp, resolved, fst)
            if n is not None:
                return n
        rc, out, err = self._exec(shlex.join(["stat", "-L", "-c", "%h", "--", resolved]), limit=4096)
        if rc == 0 and out.strip().isdigit():
            return int(out.strip())
        raise FileChanged(f"{resolved}: cannot count its links ({err.decode(errors='replace').strip()[:200]})")

    def _check_path(self, sftp: SFTPClient, resolved: str, fst: SFTPAttributes) -> None:
        """`resolved` still leads to itself (no link swapped in) and to a file
        like the open handle's."""
        if self._trusts_realpath(sftp) and sftp.normalize(resolved) != resolved:
            raise UnsafePath(f"{resolved}: a link was swapped in on the way")
        _check_same(fst, sftp.lstat(resolved), resolved, "while open")

    def _copy_out_sftp(self, path: str, store: BlobStore, key: str, *, max_bytes: int) -> BlobInfo:
        """Resolve, check and stream on one SFTP channel; nothing stored on failure."""
        with self._errors(path), self._sftp() as sftp:
            resolved, st = self._resolve_sftp(sftp, path)
            self.check_size(path, st.st_size, max_bytes)
            return store.put_stream(key, self._guarded(self._stream_sftp(sftp, resolved, st), path),
                                    max_bytes=max_bytes)

    def _copy_in_sftp(self, store: BlobStore, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        with self._errors(dest_path), self._sftp() as sftp:
            policy = self._sftp_policy(sftp)
            policy.check_lexical_denied(dest_path)
            def found(cur: str) -> tuple[str, SFTPAttributes]:
                real = self._realpath(sftp, cur)
                return real, sftp.stat(real)

            (real_anc, anc_st), missing = deepest_existing(posixpath.dirname(dest_path), found)
            dest = posixpath.join(real_anc, *missing, posixpath.basename(dest_path))
            policy.check(dest, shown=dest_path)
            if not stat.S_ISDIR(anc_st.st_mode or 0):
                raise NotAFile(f"{dest_path}: {real_anc} is not a directory")
            for i in range(len(missing)):
                d = posixpath.join(real_anc, *missing[: i + 1])
                try:
                    sftp.mkdir(d, 0o755)
                except OSError:
                    if not stat.S_ISDIR(sftp.lstat(d).st_mode or 0):
                        raise NotAFile(f"{dest_path}: {d} is not a directory") from None
            with contextlib.suppress(FileNotFoundError):  # an existing dest must be a regular file
                mode = sftp.lstat(dest).st_mode or 0
                if stat.S_ISLNK(mode):
                    raise UnsafePath(f"{dest_path}: is a symbolic link")
                if not stat.S_ISREG(mode):
                    raise NotAFile(f"{dest_path}: exists and is not a regular file")
            tmp = temp_beside(dest)
            try:
                body = Counted(store, key, max_bytes)
                with sftp.open(tmp, "wbx") as f:
                    f.MAX_REQUEST_SIZE = self._request_size(sftp)
                    f.set_pipelined(True)
                    for chunk in body:
                        f.write(chunk)
                if body.sent != size or sftp.stat(tmp).st_size != body.sent:
                    raise FileChanged(f"{dest_path}: short write ({body.sent:,} of {size:,} bytes)")
                try:
                    sftp.posix_rename(tmp, dest)
                except OSError as exc:
                    if exc.errno is not None:
                        raise
                    sftp.rename(tmp, dest)  # no posix-rename extension, and dest absent
            except BaseException:
                if self._alive():
                    with contextlib.suppress(Exception):
                        sftp.remove(tmp)
                raise
            return dest


# -- exec runs ----------------------------------------------------------------------
class _SshSmall:
    """Short remote commands on the pooled paramiko connection (argv quoted
    with shlex), errors translated: the exec_small of execstream's channel."""

    binary_safe = True

    def __init__(self, sb: SftpTransport) -> None:
        self.sb = sb

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        with self.sb._errors("exec"):
            return self.sb._exec(shlex.join(argv))

    def exec_stream(self, argv: Sequence[str]) -> ExecStream:
        """Not offered: files move over SFTP (execstream's resolve and exec
        use only exec_small on this channel)."""
        raise SandboxError(f"ssh {self.sb.where}: no exec_stream on the SFTP transport")


class _SshRun:
    """One ``Sandbox.exec`` command on a paramiko session channel (an ExecRun)."""

    def __init__(self, sb: SftpTransport, argv: Sequence[str], run_id: str) -> None:
        self.sb, self.run_id = sb, run_id
        with sb._errors("exec"):
            self.chan = sb.transport().open_session()
            try:
                self.chan.exec_command(shlex.join(argv))
                self.chan.shutdown_write()  # stdin: empty
            except BaseException:
                self.chan.close()
                raise

    def _ended(self) -> bool:
        ch = self.chan
        return (ch.eof_received or ch.closed) and not ch.recv_ready() and not ch.recv_stderr_ready()

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        ch = self.chan
        with self.sb._errors("exec output"):
            if not (ch.recv_ready() or ch.recv_stderr_ready()):
                if self._ended():
                    return False
                select.select([ch], [], [], wait_s)  # readable: data on either stream, or EOF
            if ch.recv_ready():
                out.add(ch.recv(CHUNK))
            if ch.recv_stderr_ready():
                err.add(ch.recv_stderr(CHUNK))
        return not self._ended()

    def poll(self) -> int | None:
        if not self.chan.exit_status_ready():
            return None
        code = self.chan.recv_exit_status()
        if code == -1:  # no exit-status: the channel closed without one
            t = self.chan.get_transport()
            if t is None or not t.is_active():
                self.sb._evict()
                raise SandboxGone(f"ssh {self.sb.where}: connection lost during exec")
            return 255
        return code

    def wait(self, timeout_s: float) -> int | None:
        self.chan.status_event.wait(timeout_s)
        return self.poll()

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # best effort; the host's `timeout` is the backstop
            self.sb._exec(shlex.join(kill_argv(self.run_id)), limit=4096)
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chan.close()


