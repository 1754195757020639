"""SshSandbox: the two transports behind one Sandbox, chosen by ``use_openssh``
(see the package docstring)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from adapters.sandboxes.base import DEFAULT_EXEC_OUTPUT_BYTES, ExecRun, check_lexical
from adapters.sandboxes.execstream import ExecChannel, exec_command, exec_iter_file
from adapters.sandboxes.ssh.core import DEFAULT_ROOTS
from adapters.sandboxes.ssh.openssh import OpenSshTransport, _OpenSshRun
from adapters.sandboxes.ssh.sftp import SftpTransport, _SshRun, _SshSmall

if TYPE_CHECKING:
    from storage.base import BlobInfo, BlobStore


class SshSandbox(SftpTransport, OpenSshTransport):
    """Files on a remote host over paramiko SFTP (default) or the OpenSSH
    client (``use_openssh``). `extract` and `put` are Sandbox's templates;
    this implements their `_copy_out` / `_copy_in` per transport."""

    def resolve(self, path: str) -> tuple[str, int]:
        check_lexical(path)
        if self.use_openssh:
            r = self._resolve_openssh(path)
            return r.path, r.size
        with self._errors(path), self._sftp() as sftp:
            resolved, st = self._resolve_sftp(sftp, path)
            return resolved, st.st_size

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        if self.use_openssh:
            policy = self._policy(self._remote_home())
            policy.check(resolved)
            yield from self._guarded(exec_iter_file(self._openssh(), resolved, policy=policy), resolved)
            return
        with self._errors(resolved), self._sftp() as sftp:
            policy = self._sftp_policy(sftp)
            policy.check(resolved)
            yield from self._guarded(self._stream_sftp(sftp, resolved, sftp.stat(resolved)), resolved)

    def _copy_out(self, path: str, store: BlobStore, key: str, *, max_bytes: int) -> BlobInfo:
        if self.use_openssh:
            return self._copy_out_openssh(path, store, key, max_bytes=max_bytes)
        return self._copy_out_sftp(path, store, key, max_bytes=max_bytes)

    def _copy_in(self, store: BlobStore, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """Written to a temp name beside `dest_path`, size-checked, then renamed over it."""
        if self.use_openssh:
            return self._copy_in_openssh(store, key, dest_path, size=size, max_bytes=max_bytes)
        return self._copy_in_sftp(store, key, dest_path, size=size, max_bytes=max_bytes)

    def home_dir(self) -> str | None:
        """The configured home, else the remote user's (SFTP's `.`, or $HOME
        over the control master), asked once."""
        if self.policy.home:
            return self.policy.home
        if self._home_cache is None:
            if self.use_openssh:
                self._home_cache = self._home_openssh()
            else:
                with self._errors("home"), self._sftp() as sftp:
                    self._home_cache = sftp.normalize(".")
        return self._home_cache or None

    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """Run `argv` on the host (see Sandbox.exec and the package docstring);
        `cwd` None: the first allowed root that is a directory."""
        ch: ExecChannel = self._openssh() if self.use_openssh else _SshSmall(self)

        def start(wrapped: list[str], run_id: str, **_: Any) -> ExecRun:
            return (_OpenSshRun if self.use_openssh else _SshRun)(self, wrapped, run_id)
        known = self.policy.roots or (self._checked_policy.roots if self._checked_policy else DEFAULT_ROOTS)
        return exec_command(ch, self._policy, start, argv, timeout_s=timeout_s, cwd=cwd,
                            max_output_bytes=max_output_bytes, defaults=known, cwd_cache=self._exec_cwds)

    def close(self) -> None:
        """Stop this sandbox's OpenSSH control master, if any (pooled paramiko
        connections stay for reuse; see close_pool)."""
        if self.use_openssh:
            self._close_openssh()
