"""What both ssh transports (mixins over :class:`SshCore`) share: a host's
settings, the path policy, and the ONE place every paramiko / socket / ssh
error is translated (the table `_ssh_errors`, and :meth:`SshCore._ssh_error`
for the ssh client's exit status 255)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import getpass
import os
import select
import socket
from collections.abc import Iterator
from typing import Any

from adapters.errors import (
    ConfigError, CourierError, ErrorTable, FileMissing, SandboxError, SandboxGone, UnsafePath, translating,
)
from adapters.sandboxes.base import PathPolicy, ReadTimeout, Sandbox, SandboxRef
from adapters.sandboxes.execstream import default_roots
from adapters.sandboxes.ssh.pool import PoolKey, _paramiko, alive, connect, evict, pooled, trust_key

#: paramiko ships no type information: its objects are named here for the reader
SFTPClient = Any  # paramiko.SFTPClient
SFTPAttributes = Any  # paramiko.SFTPAttributes (an fstat / lstat answer)

CHUNK = 1024 * 1024
#: default roots, plus the remote user's home (unless denylisted, e.g. /root)
DEFAULT_ROOTS = ("/workspace", "/tmp")


class SshAccessDenied(ConfigError, SandboxError):
    """Authentication failed, or the host key is unknown / changed: a
    configuration problem, not retried."""


class FileChanged(SandboxGone):
    """The file changed (size, mtime or resolved path) during the transfer:
    probably still being written, so worth a retry (as execstream reports it)."""


def _ready(fd: int, events: int, timeout_s: float) -> bool:
    """Whether `fd` is ready for `events` (or hung up) within `timeout_s` (poll: any fd number)."""
    p = select.poll()
    p.register(fd, events | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0.0, timeout_s) * 1000))


def _check_same(a: SFTPAttributes, b: SFTPAttributes, resolved: str, when: str) -> None:
    """SFTP attributes `b` must describe the file `a` did: type, owner, group
    and mode (else it is another file: UnsafePath), size and mtime (else it
    changed: FileChanged, worth a retry)."""
    if (b.st_mode, b.st_uid, b.st_gid) != (a.st_mode, a.st_uid, a.st_gid):
        raise UnsafePath(f"{resolved}: another file was read than the one checked ({when})")
    if (b.st_size, b.st_mtime) != (a.st_size, a.st_mtime):
        raise FileChanged(f"{resolved}: changed {when}")


class SshCore(Sandbox):
    """An ssh host's settings, policy and error translation (see the module docstring)."""

    kind = "ssh"

    def __init__(self, ref: SandboxRef, policy: PathPolicy, *, key_path: str | None, known_hosts: str | None,
                 user: str | None = None, port: int = 22, use_openssh: bool = False, control_dir: str | None = None,
                 connect_timeout_s: float = 10, io_timeout_s: float = 60) -> None:
        super().__init__(ref, policy)
        if not ref.target:
            raise ConfigError("ssh sandbox needs a host (ssh://user@host:port/path)")
        self.host = ref.target
        self.user = ref.options.get("user") or user or getpass.getuser()
        try:
            self.port = int(ref.options.get("port") or port)
        except ValueError as exc:
            raise ConfigError(f"ssh sandbox: bad port {ref.options.get('port')!r}") from exc
        self.key_path = key_path
        self.known_hosts = known_hosts
        self.use_openssh = use_openssh
        self.control_dir = control_dir
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        #: trust the server's SFTP realpath to resolve links (OpenSSH does);
        #: when False every resolve runs `readlink -f` over exec
        self.trust_sftp_realpath: bool | None = None
        self._checked_policy: PathPolicy | None = None
        #: exec working directories as resolved on the host (re-proved on every run)
        self._exec_cwds: dict[str | None, str] = {}
        for name, p in (("key", key_path), ("known_hosts", known_hosts)):
            if p is not None and not os.path.isfile(p):
                raise ConfigError(f"ssh sandbox: {name} file {p} does not exist")
        self._home_cache: str | None = None

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return translating(_ssh_errors, self, what)

    def _pool_key(self) -> PoolKey:
        return (self.user, self.host, self.port, self.key_path, self.known_hosts, self._trust_key())

    def _trust_key(self) -> str:
        """See :func:`adapters.sandboxes.ssh.pool.trust_key` (also the control socket's name)."""
        return trust_key(self.host, self.port, self.user, self.known_hosts, self.key_path)

    def _alive(self) -> bool:
        return alive(self._pool_key())

    def _evict(self) -> None:
        evict(self._pool_key())

    def transport(self) -> Any:
        """The pooled paramiko Transport (connecting or reconnecting as needed)."""
        return pooled(self._pool_key(), self._connect).get_transport()

    def _connect(self) -> Any:
        return connect(host=self.host, port=self.port, user=self.user, key_path=self.key_path,
                       known_hosts=self.known_hosts, timeout_s=self.connect_timeout_s, where=self.where)

    def _policy(self, home: str | None) -> PathPolicy:
        if self._checked_policy is None:
            roots = self.policy.roots or default_roots(home, DEFAULT_ROOTS)
            self._checked_policy = dataclasses.replace(self.policy, roots=tuple(roots), home=self.policy.home or home)
        return self._checked_policy

    def _guarded(self, chunks: Iterator[bytes], what: str) -> Iterator[bytes]:
        """Translate errors inside the stream: put_stream runs it within the
        store's write, where a raw OSError would pass for a storage failure."""
        with self._errors(what):
            yield from chunks

    def _ssh_error(self, rc: int, err: bytes, what: str) -> CourierError:
        text = err.decode("utf-8", "replace").strip()
        if rc == 255:
            low = text.lower()
            if "host key verification failed" in low or "remote host identification has changed" in low:
                return SshAccessDenied(f"ssh {self.where}: host key unknown or changed; refusing ({text[-300:]})")
            if "permission denied" in low:
                return SshAccessDenied(f"ssh {self.where}: authentication failed for user {self.user!r}: {text[-300:]}")
            return SandboxGone(f"ssh {self.where}: connection failed or lost ({what}): {text[-300:] or 'exit 255'}")
        if "no such file" in text.lower():
            return FileMissing(f"{what}: no such file on {self.where}")
        return SandboxError(f"{what}: remote command failed with exit {rc} on {self.where}: {text[-300:]}")


# -- the ONE table of paramiko / socket / OS errors (rules take the SshCore and what it was doing) --
#: what the SFTP status of a name the server's OS called too long (ENAMETOOLONG) reads as: OpenSSH's
#: sftp-server answers SSH2_FX_BAD_MESSAGE for it (paramiko: an IOError with no errno), others a failure
_TOO_LONG_STATUS = ("Bad message", "Failure")
#: NAME_MAX and PATH_MAX of the hosts courier reads from (Linux, the BSDs, macOS)
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4096


def _too_long(path: str) -> bool:
    """Whether `path` has a name over NAME_MAX bytes or is PATH_MAX bytes or more."""
    raw = os.fsencode(path)
    return len(raw) >= PATH_MAX_BYTES or any(len(part) > NAME_MAX_BYTES for part in raw.split(b"/"))


def _oserror(exc: OSError, sb: SshCore, what: str) -> CourierError | None:
    if exc.errno == errno.ENOENT:
        return FileMissing(f"{what}: no such file on {sb.where}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UnsafePath(f"{what}: permission denied on {sb.where}")
    if (exc.errno == errno.ENAMETOOLONG or (exc.errno is None and str(exc) in _TOO_LONG_STATUS)) \
            and _too_long(what):
        return FileMissing(f"{what}: no such file on {sb.where} (a name or the path is too long)")
    return None


def _timed_out(exc: BaseException, sb: SshCore, what: str) -> CourierError:
    """A read past the deadline: ReadTimeout (a SandboxGone), which opens the host's breaker (tasks/turn/breaker.py)."""
    sb._evict()
    return ReadTimeout(f"ssh {sb.where}: timed out ({what})")


def _lost(exc: BaseException, sb: SshCore, what: str) -> CourierError:
    if isinstance(exc, (ConnectionError, EOFError, _paramiko().SSHException)) or not sb._alive():
        sb._evict()
        return SandboxGone(f"ssh {sb.where}: connection lost ({what}): {exc or type(exc).__name__}")
    return SandboxError(f"{what}: {exc} on {sb.where}")


@functools.cache
def _ssh_errors() -> ErrorTable[CourierError]:
    paramiko = _paramiko()
    return ErrorTable([
        (paramiko.AuthenticationException, lambda exc, sb, what: SshAccessDenied(
            f"ssh {sb.where}: authentication failed for user {sb.user!r}"
            f"{f' with key {sb.key_path}' if sb.key_path else ''}: {exc}")),
        (paramiko.BadHostKeyException, lambda exc, sb, what: SshAccessDenied(
            f"ssh {sb.where}: host key does not match {sb.known_hosts or 'known_hosts'} "
            "(possible man-in-the-middle; refusing)")),
        (paramiko.SSHException, lambda exc, sb, what: SshAccessDenied(
            f"ssh {sb.where}: unknown host key; add it to {sb.known_hosts or '~/.ssh/known_hosts'} "
            f"(e.g. ssh-keyscan -p {sb.port} {sb.host}) - host keys are never trusted automatically"
        ) if "known_hosts" in str(exc) else None),
        (OSError, _oserror),
        ((socket.timeout, TimeoutError), _timed_out),
        ((EOFError, paramiko.SSHException, ConnectionError, OSError), _lost),
    ])
