"""The ssh sandbox: files on a remote host, over SFTP (paramiko) or OpenSSH.

Default channel: paramiko SFTP on a pooled connection (one per user, host,
port and credentials in a process; re-opened when dead), TCP_NODELAY on the
socket, AES-GCM preferred, an 8 MiB window with 256 KiB packets and a
channel input buffer that does not shift on every read, and a window's worth
of 255 KiB READ requests in flight (OpenSSH servers; 32 KiB elsewhere), read
by a helper thread so that hashing and writing overlap the SSH parsing.
Bytes stream into storage in 1 MiB chunks; nothing is held whole in memory.

Option `use_openssh`: the `ssh` client over a ControlMaster socket
(`ControlPersist=60`, AES-GCM preferred); an extraction is ONE ssh run of
execstream's gated stream script (:mod:`adapters.sandboxes.execstream`):
it answers the resolve, waits for this side's check of the answer, then
streams (`cat` of the descriptor its stream script checked); into a volume
the client's stdout pipe is spliced into the file in the kernel. ssh joins its arguments into one
remote shell command line, so the argv is quoted with `shlex.join` (a POSIX
login shell is assumed on the host).

Commands (``Sandbox.exec``): the argv, quoted with `shlex.join` into one
remote command line, runs under execstream's run script (working directory
resolved and checked first, GNU `timeout` on the host as a backstop) on a
session channel of the pooled connection (OpenSSH mode: an `ssh` client
that joins the control master but never starts one, so no master inherits
its output pipes); stdout and stderr are read apart as they arrive; on a
timeout one more remote command kills every process of the run and the
channel is closed. In OpenSSH mode an exit code of 255 is ssh's own failure
and raises (the command's own 255 cannot be told apart), and the exit is
only known when the channel closes: a background job still holding the
output keeps exec waiting until the timeout (124; paramiko sees the exit
and kills such a job after the drain time, as the local backend does).

Safety: the path is resolved on the host (SFTP realpath; `readlink -f` over
exec where the server's realpath is not trusted), checked against the roots
and the denylist; the SFTP handle is opened first and its fstat must be the
checked file (type, owner, group, mode, size, mtime), with the path still
resolving to itself right after the open and after the transfer (OpenSSH
mode: the stream script checks the descriptor it opened, and the byte
count); a file with several hard links is refused; else nothing is stored.
Every read has a deadline (``io_timeout_s``); OpenSSH control sockets are
named by a hash of the trust settings. Host keys are checked against a known_hosts file and an unknown
key is refused, never added. Every paramiko / socket / ssh error is
translated in ONE place (:meth:`SshSandbox._map_error`, and
:meth:`SshSandbox._ssh_error` for the ssh client's exit status 255).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import hashlib
import os
import posixpath
import queue
import select
import selectors
import shlex
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.errors import (
    ConfigError, CourierError, FileMissing, NotAFile, SandboxError, SandboxGone, TooLarge, UnsafePath,
)
from adapters.sandboxes.base import (
    DEFAULT_EXEC_OUTPUT_BYTES, DEFAULT_MAX_BYTES, BoundedOutput, PathPolicy, ReadTimeout, Sandbox, SandboxRef,
    check_lexical,
)
from adapters.sandboxes.execstream import (
    ExecStream, Resolved, default_roots, exec_command, exec_gated_extract, exec_iter_file, exec_resolve,
    kill_argv,
)

CHUNK = 1024 * 1024
#: SSH channel window: bounds what the server may send ahead (and our buffer).
#: Measured on loopback: 2-8 MiB best; 32-64 MiB slower (paramiko's buffers).
WINDOW_SIZE = 8 * 1024 * 1024
#: largest SSH packet we accept (RFC 4253 lets a peer go to 256 KiB)
MAX_PACKET_SIZE = 256 * 1024
#: SFTP read/write request size on OpenSSH servers (its max is 256 KiB - 1 KiB);
#: other servers keep paramiko's 32 KiB, which every server honours
OPENSSH_REQUEST_SIZE = 261120
#: AES-GCM first: one AEAD pass instead of AES-CTR plus an HMAC-SHA256 pass
#: over every packet (measured faster on loopback; both use AES-NI via cryptography)
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
#: the OpenSSH client's cipher order: its defaults with AES-GCM first (chacha20-poly1305
#: leads them, and costs ~1.5x the CPU per byte where AES-NI is there, as on x86-64 and arm64)
OPENSSH_CIPHERS = ("aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
                   "aes128-ctr,aes192-ctr,aes256-ctr")
#: default roots, plus the remote user's home (unless denylisted, e.g. /root)
DEFAULT_ROOTS = ("/workspace", "/tmp")


class SshAccessDenied(ConfigError, SandboxError):
    """Authentication failed, or the host key is unknown / changed: a
    configuration problem, not retried."""


class FileChanged(SandboxGone):
    """The file changed (size, mtime or resolved path) during the transfer:
    probably still being written, so worth a retry (as execstream reports it)."""


# -- the connection pool ------------------------------------------------------
@dataclass
class _Pooled:
    client: Any  # paramiko.SSHClient
    pid: int


_pool: dict[tuple, _Pooled] = {}
_pool_lock = threading.Lock()
_connect_locks: dict[tuple, threading.Lock] = {}


def _paramiko():
    from adapters.extras import needs

    with needs("ssh", "ssh:// sandboxes (paramiko SFTP; or COURIER_SSH_USE_OPENSSH=1)"):
        import paramiko
    return paramiko


def close_pool() -> None:
    """Close every pooled connection of this process (tests, shutdown)."""
    with _pool_lock:
        entries = list(_pool.values())
        _pool.clear()
    for e in entries:
        if e.pid == os.getpid():
            with contextlib.suppress(Exception):
                e.client.close()


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


def _temp_beside(dest: str) -> str:
    """A hidden temp name next to `dest` (short enough for NAME_MAX)."""
    return posixpath.join(posixpath.dirname(dest),
                          f".{posixpath.basename(dest)[:64]}.{uuid.uuid4().hex[:8]}.courier-part")


class _Replies:
    """Collects the SFTP replies paramiko routes to us by request number."""

    def __init__(self) -> None:
        self.got: dict[int, tuple[int, Any]] = {}

    def _async_response(self, t: int, msg, num: int) -> None:  # paramiko's callback name
        self.got[num] = (t, msg)


def _sftp_pipeline(sftp, handle: bytes, size: int, req: int, depth: int) -> Iterator[bytes]:
    """1 MiB chunks of a remote file, with `depth` READ requests of `req`
    bytes in flight, consumed in order.

    Not paramiko's `SFTPFile.prefetch()`: its helper thread marks the
    prefetch done whenever replies overtake the requests it has registered,
    after which every later reply is parked in memory unread (a 1 GiB file
    measured 1 GiB RSS) and the rest is read one round trip at a time. This
    uses the same SFTPClient primitives (`_async_request`, `_read_response`)
    the SFTPFile is built on, bounded by `depth`. A short read asks again for
    the remainder; the end of the file before `size` is a change."""
    from paramiko.sftp import CMD_DATA, CMD_READ, CMD_STATUS, int64

    replies = _Replies()
    pending: deque[tuple[int, int, int]] = deque()  # (request number, offset, length)
    next_off = 0

    def ask(off: int, length: int) -> tuple[int, int, int]:
        return sftp._async_request(replies, CMD_READ, handle, int64(off), int(length)), off, length

    parts: list[bytes] = []
    ready = 0
    try:
        while next_off < size or pending:
            while next_off < size and len(pending) < depth:
                length = min(req, size - next_off)
                pending.append(ask(next_off, length))
                next_off += length
            num, off, length = pending[0]
            while num not in replies.got:
                sftp._read_response()  # one reply, handed to replies._async_response
            t, msg = replies.got.pop(num)
            pending.popleft()
            if t == CMD_STATUS:
                try:
                    sftp._convert_status(msg)
                except EOFError:
                    raise FileChanged(f"file shrank during the transfer (end of file at {off:,})") from None
            if t != CMD_DATA:
                raise SandboxError(f"unexpected SFTP reply {t} to a read")
            data = msg.get_string()
            if not data:
                raise FileChanged(f"file shrank during the transfer (end of file at {off:,})")
            if len(data) < length:  # a short read: ask again for the rest, first in line
                pending.appendleft(ask(off + len(data), length - len(data)))
            parts.append(data)
            ready += len(data)
            if ready >= CHUNK:
                yield b"".join(parts)
                parts, ready = [], 0
        if parts:
            yield b"".join(parts)
    finally:
        with sftp._lock:  # stopped early: replies still coming are dropped by paramiko
            for num, _, _ in pending:
                sftp._expecting.pop(num, None)


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


def read_ahead(chunks: Iterator[bytes], *, depth: int = 4, abort=None) -> Iterator[bytes]:
    """Iterate `chunks` in a helper thread, at most `depth` chunks ahead.

    Errors raised by the producer are re-raised here. When the consumer stops
    early, `abort()` (e.g. closing the channel) unblocks the producer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for chunk in chunks:
                if not put(chunk):
                    return
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Failed(exc))
        finally:
            with contextlib.suppress(Exception):
                chunks.close()  # type: ignore[attr-defined]

    t = threading.Thread(target=run, name="courier-read-ahead", daemon=True)
    t.start()
    finished = False
    try:
        while True:
            item = q.get()
            if item is _DONE:
                finished = True
                return
            if isinstance(item, _Failed):
                finished = True
                raise item.exc
            yield item
    finally:
        stop.set()
        if not finished and abort is not None:
            with contextlib.suppress(Exception):
                abort()
        t.join()


def _prefer(available: tuple[str, ...], first: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(c for c in first if c in available) + tuple(c for c in available if c not in first)


def _fast_pipe_class():
    """A paramiko BufferedPipe that does not move the whole buffer on every read.

    paramiko's pipe is one array that `del buf[:n]` shifts on each read; SFTP
    reads a 4-byte length and then the body of every response, so with a full
    multi-MiB window each 255 KiB response cost two buffer-sized memmoves.
    This keeps the fed chunks in a deque and an offset into the first one:
    the same interface and locking, O(bytes read) per read."""
    from paramiko.buffered_pipe import BufferedPipe, PipeTimeout

    class FastPipe(BufferedPipe):
        def __init__(self) -> None:
            super().__init__()
            self._chunks: deque[bytes] = deque()
            self._off = 0
            self._size = 0

        def set_event(self, event) -> None:
            with self._lock:
                self._event = event
                if self._closed or self._size > 0:
                    event.set()
                else:
                    event.clear()

        def feed(self, data) -> None:
            data = bytes(data) if not isinstance(data, bytes) else data
            with self._lock:
                if self._event is not None:
                    self._event.set()
                if data:
                    self._chunks.append(data)
                    self._size += len(data)
                self._cv.notify_all()

        def read_ready(self) -> bool:
            with self._lock:
                return self._size > 0

        def _take(self, n: int) -> bytes:
            first = self._chunks[0]
            avail = len(first) - self._off
            if n < avail:  # part of the first chunk
                out = first[self._off:self._off + n]
                self._off += n
            elif n == avail or len(self._chunks) == 1:
                out = first[self._off:] if self._off else first
                self._chunks.popleft()
                self._off = 0
            else:
                parts = [memoryview(first)[self._off:]]
                self._chunks.popleft()
                self._off = 0
                need = n - avail
                while need and self._chunks:
                    c = self._chunks[0]
                    if len(c) <= need:
                        parts.append(c)
                        self._chunks.popleft()
                        need -= len(c)
                    else:
                        parts.append(memoryview(c)[:need])
                        self._off = need
                        need = 0
                out = b"".join(parts)
            self._size -= len(out)
            return out

        def read(self, nbytes, timeout=None):
            with self._lock:
                if self._size == 0:
                    if self._closed:
                        return b""
                    if timeout == 0.0:
                        raise PipeTimeout()
                    while self._size == 0 and not self._closed:
                        then = time.time()
                        self._cv.wait(timeout)
                        if timeout is not None:
                            timeout -= time.time() - then
                            if timeout <= 0.0:
                                raise PipeTimeout()
                    if self._size == 0:
                        return b""
                out = self._take(min(nbytes, self._size))
                if self._size == 0 and self._event is not None and not self._closed:
                    self._event.clear()
                return out

        def empty(self) -> bytes:
            with self._lock:
                out = self._take(self._size) if self._size else b""
                if self._event is not None and not self._closed:
                    self._event.clear()
                return out

        def __len__(self) -> int:
            with self._lock:
                return self._size

    return FastPipe


def _use_fast_pipe(chan) -> None:
    """Swap a quiet channel's input pipe (no request outstanding, nothing buffered)."""
    global _FastPipe
    if _FastPipe is None:
        _FastPipe = _fast_pipe_class()
    old = chan.in_buffer
    if not all(hasattr(old, a) for a in ("_lock", "_buffer", "_event")):
        return  # a paramiko whose pipe looks different: keep it
    new = _FastPipe()
    with old._lock:
        left = old._buffer.tobytes() if len(old._buffer) else b""
        if old._event is not None:
            new.set_event(old._event)
        chan.in_buffer = new
    if left:
        new.feed(left)


_FastPipe = None


def _ready(fd: int, events: int, timeout_s: float) -> bool:
    """Whether `fd` is ready for `events` (or hung up) within `timeout_s` (poll: any fd number)."""
    p = select.poll()
    p.register(fd, events | select.POLLHUP | select.POLLERR)
    return bool(p.poll(max(0.0, timeout_s) * 1000))


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has data or EOF within `timeout_s`."""
    return _ready(fd, select.POLLIN, timeout_s)


def _nlink_from_listing(sftp, resolved: str, fst) -> int | None:
    """The link count of `resolved` from its directory's SFTP listing (the
    long name, `-rw-r--r--  2 user group ...`), reading entries only until
    the name is found. None when the long name cannot be parsed."""
    from paramiko.sftp import CMD_CLOSE, CMD_HANDLE, CMD_NAME, CMD_OPENDIR, CMD_READDIR
    from paramiko.sftp_attr import SFTPAttributes

    parent, name = posixpath.split(resolved)
    want = name.encode("utf-8", "surrogateescape")
    t, msg = sftp._request(CMD_OPENDIR, parent)
    if t != CMD_HANDLE:
        return None
    handle = msg.get_binary()
    try:
        while True:
            try:
                t, msg = sftp._request(CMD_READDIR, handle)
            except EOFError:
                break
            if t != CMD_NAME:
                return None
            for _ in range(msg.get_int()):
                filename, longname = msg.get_string(), msg.get_string()
                attr = SFTPAttributes._from_msg(msg)
                if filename != want:
                    continue
                _check_same(fst, attr, resolved, "while counting its links")
                fields = longname.split()
                if len(fields) > 1 and longname[:1] == b"-" and fields[1].isdigit():
                    return int(fields[1])
                return None
        raise FileChanged(f"{resolved}: gone from its directory while open")
    finally:
        with contextlib.suppress(Exception):
            sftp._request(CMD_CLOSE, handle)


def _check_same(a, b, resolved: str, when: str) -> None:
    """SFTP attributes `b` must describe the file `a` did: type, owner, group
    and mode (else it is another file: UnsafePath), size and mtime (else it
    changed: FileChanged, worth a retry)."""
    if (b.st_mode, b.st_uid, b.st_gid) != (a.st_mode, a.st_uid, a.st_gid):
        raise UnsafePath(f"{resolved}: another file was read than the one checked ({when})")
    if (b.st_size, b.st_mtime) != (a.st_size, a.st_mtime):
        raise FileChanged(f"{resolved}: changed {when}")


def _strip_nl(s: bytes) -> bytes:
    return s[:-1] if s.endswith(b"\n") else s


class SshSandbox(Sandbox):
    kind = "ssh"

    def __init__(
        self,
        ref: SandboxRef,
        policy: PathPolicy,
        *,
        key_path: str | None,
        known_hosts: str | None,
        user: str | None = None,
        port: int = 22,
        use_openssh: bool = False,
        control_dir: str | None = None,
        connect_timeout_s: float = 10,
        io_timeout_s: float = 60,
        window_size: int = WINDOW_SIZE,
        max_packet_size: int = MAX_PACKET_SIZE,
        request_size: int | None = None,
    ) -> None:
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
        self.window_size = window_size
        self.max_packet_size = max_packet_size
        self.request_size = request_size
        #: trust the server's SFTP realpath to resolve links (OpenSSH does);
        #: when False every resolve runs `readlink -f` over exec
        self.trust_sftp_realpath: bool | None = None
        #: replace paramiko's channel input buffer on SFTP channels (see _fast_pipe_class)
        self.fast_pipe = True
        self._checked_policy: PathPolicy | None = None
        #: exec working directories as resolved on the host (re-proved on every run)
        self._exec_cwds: dict[str | None, str] = {}
        for name, p in (("key", key_path), ("known_hosts", known_hosts)):
            if p is not None and not os.path.isfile(p):
                raise ConfigError(f"ssh sandbox: {name} file {p} does not exist")

    @property
    def where(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    # -- errors: every paramiko / socket / ssh failure is translated here ------
    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except CourierError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated or re-raised
            mapped = self._map_error(exc, what)
            if mapped is None:
                raise
            raise mapped from exc

    def _map_error(self, exc: BaseException, what: str) -> CourierError | None:
        paramiko = _paramiko()
        if isinstance(exc, paramiko.AuthenticationException):
            return SshAccessDenied(
                f"ssh {self.where}: authentication failed for user {self.user!r}"
                f"{f' with key {self.key_path}' if self.key_path else ''}: {exc}"
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            return SshAccessDenied(
                f"ssh {self.where}: host key does not match {self.known_hosts or 'known_hosts'} "
                "(possible man-in-the-middle; refusing)"
            )
        if isinstance(exc, paramiko.SSHException) and "known_hosts" in str(exc):
            return SshAccessDenied(
                f"ssh {self.where}: unknown host key; add it to {self.known_hosts or '~/.ssh/known_hosts'} "
                f"(e.g. ssh-keyscan -p {self.port} {self.host}) - host keys are never trusted automatically"
            )
        code = getattr(exc, "errno", None)
        if isinstance(exc, OSError) and code == errno.ENOENT:
            return FileMissing(f"{what}: no such file on {self.where}")
        if isinstance(exc, OSError) and code in (errno.EACCES, errno.EPERM):
            return UnsafePath(f"{what}: permission denied on {self.where}")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            self._evict()
            return SandboxGone(f"ssh {self.where}: timed out ({what})")
        if isinstance(exc, (EOFError, paramiko.SSHException, ConnectionError, OSError)):
            if isinstance(exc, (ConnectionError, EOFError, paramiko.SSHException)) or not self._alive():
                self._evict()
                return SandboxGone(f"ssh {self.where}: connection lost ({what}): {exc or type(exc).__name__}")
            return SandboxError(f"{what}: {exc} on {self.where}")
        return None

    # -- pool -----------------------------------------------------------------
    def _pool_key(self) -> tuple:
        # the trust key hashes the known_hosts and identity files' content: a connection
        # made under other trust (a known_hosts rewritten in place) is never reused
        return (self.user, self.host, self.port, self.key_path, self.known_hosts, self._trust_key(),
                self.window_size, self.max_packet_size)

    def _alive(self) -> bool:
        e = _pool.get(self._pool_key())
        t = e.client.get_transport() if e else None
        return bool(t and t.is_active())

    def _evict(self) -> None:
        with _pool_lock:
            e = _pool.pop(self._pool_key(), None)
        if e is not None and e.pid == os.getpid():
            with contextlib.suppress(Exception):
                e.client.close()

    def transport(self):
        """The pooled paramiko Transport (connecting or reconnecting as needed)."""
        return self._client().get_transport()

    def _client(self):
        key = self._pool_key()
        with _pool_lock:
            key_lock = _connect_locks.setdefault(key, threading.Lock())
        with key_lock:  # one connect per destination at a time; other hosts are not held up
            with _pool_lock:
                e = _pool.get(key)
            if e is not None:
                t = e.client.get_transport()
                if e.pid == os.getpid() and t is not None and t.is_active():
                    return e.client
                with _pool_lock:
                    _pool.pop(key, None)
                if e.pid == os.getpid():  # a forked child must not touch the parent's socket
                    with contextlib.suppress(Exception):
                        e.client.close()
            client = self._connect()
            with _pool_lock:
                _pool[key] = _Pooled(client, os.getpid())
            return client

    def _connect(self):
        paramiko = _paramiko()
        client = paramiko.SSHClient()
        if self.known_hosts:
            client.load_host_keys(self.known_hosts)
        else:
            client.load_system_host_keys()
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as exc:
            raise SandboxGone(f"ssh {self.where}: cannot connect: {exc.strerror or exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        window, packet = self.window_size, self.max_packet_size

        def factory(s, **kw):
            t = paramiko.Transport(s, default_window_size=window, default_max_packet_size=packet, **kw)
            opts = t.get_security_options()
            opts.ciphers = _prefer(opts.ciphers, PREFERRED_CIPHERS)
            return t

        try:
            client.connect(
                self.host, port=self.port, username=self.user, key_filename=self.key_path, sock=sock,
                timeout=self.connect_timeout_s, banner_timeout=self.connect_timeout_s,
                auth_timeout=self.connect_timeout_s, allow_agent=self.key_path is None,
                look_for_keys=self.key_path is None, transport_factory=factory,
            )
        except BaseException:
            client.close()
            sock.close()
            raise
        client.get_transport().set_keepalive(30)
        return client

    @contextlib.contextmanager
    def _sftp(self) -> Iterator[Any]:
        """A fresh SFTP channel on the pooled connection (channels are cheap;
        an SFTPClient is not safe to share between threads)."""
        paramiko = _paramiko()
        try:
            t = self.transport()
            sftp = paramiko.SFTPClient.from_transport(t, window_size=self.window_size,
                                                      max_packet_size=self.max_packet_size)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if isinstance(exc, (paramiko.AuthenticationException, paramiko.BadHostKeyException)) \
                    or "known_hosts" in str(exc):
                raise
            self._evict()  # stale pooled transport: one reconnect
            t = self.transport()
            sftp = paramiko.SFTPClient.from_transport(t, window_size=self.window_size,
                                                      max_packet_size=self.max_packet_size)
        if sftp is None:
            raise SandboxGone(f"ssh {self.where}: could not open an SFTP channel")
        sftp.get_channel().settimeout(self.io_timeout_s)
        if self.fast_pipe:
            _use_fast_pipe(sftp.get_channel())
        try:
            yield sftp
        finally:
            with contextlib.suppress(Exception):
                sftp.close()

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

    # -- policy ---------------------------------------------------------------
    def _policy(self, home: str | None) -> PathPolicy:
        if self._checked_policy is None:
            roots = self.policy.roots or default_roots(home, DEFAULT_ROOTS)
            self._checked_policy = PathPolicy(roots=tuple(roots), home=self.policy.home or home,
                                              denylist=self.policy.denylist,
                                              home_denylist=self.policy.home_denylist, links_ok=self.policy.links_ok)
        return self._checked_policy

    def _sftp_policy(self, sftp) -> PathPolicy:
        if self._checked_policy is None:
            home = None if (self.policy.roots and self.policy.home) else sftp.normalize(".")
            return self._policy(home)
        return self._checked_policy

    def _deny_lexical(self, policy: PathPolicy, path: str) -> None:
        """For a path that does not resolve: refuse it if denylisted as written."""
        policy.check_lexical_denied(path)

    # -- resolve ----------------------------------------------------------------
    def resolve(self, path: str) -> tuple[str, int]:
        check_lexical(path)
        if self.use_openssh:
            r = self._resolve_openssh(path)
            return r.path, r.size
        with self._errors(path), self._sftp() as sftp:
            resolved, st = self._resolve_sftp(sftp, path)
            return resolved, st.st_size

    def _trusts_realpath(self, sftp) -> bool:
        """OpenSSH's SFTP realpath resolves every link; other servers' may be lexical."""
        if self.trust_sftp_realpath is None:
            return "OpenSSH" in (sftp.get_channel().get_transport().remote_version or "")
        return self.trust_sftp_realpath

    def _resolve_sftp(self, sftp, path: str):
        policy = self._sftp_policy(sftp)
        try:
            if self._trusts_realpath(sftp):
                real = sftp.normalize(path)
            else:
                real = self._readlink_f(path)
        except FileNotFoundError:
            # the server says only "no such file" (for a link loop too): ONE exec says what the
            # path would name (a denied one is refused as if it existed) or that it loops
            self._deny_lexical(policy, path)
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

    def _readlink_f(self, path: str) -> str:
        rc, out, err = self._exec(shlex.join(["readlink", "-f", "--", path]), limit=65536)
        if rc != 0 or not out:
            raise FileNotFoundError(errno.ENOENT, f"readlink -f failed: {err.decode(errors='replace').strip()}")
        return _strip_nl(out).decode("utf-8", "surrogateescape")

    # -- stream -----------------------------------------------------------------
    def _request_size(self, sftp) -> int:
        if self.request_size:
            return self.request_size
        version = sftp.get_channel().get_transport().remote_version or ""
        return OPENSSH_REQUEST_SIZE if "OpenSSH" in version else 32768

    def _stream_sftp(self, sftp, resolved: str, st0) -> Iterator[bytes]:
        """Pipelined SFTP read of an already resolved file, checked on the
        open handle: SFTP has no inode, so the handle's fstat must be the
        file the resolve saw (type, owner, group, mode: else another file;
        size, mtime: else it changed), and right after the open the path must
        still resolve to itself, with the same attributes. After the
        transfer the handle and the path are checked again."""
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
            # READ requests pipelined (a window's worth in flight), read by a helper
            # thread: paramiko's parsing holds the GIL while hashing and writing (in
            # put_stream) mostly release it, so they overlap
            depth = max(4, self.window_size // req)
            for chunk in read_ahead(_sftp_pipeline(sftp, f.handle, fst.st_size, req, depth),
                                    abort=sftp.get_channel().close):
                total += len(chunk)
                yield chunk
            if total != fst.st_size:
                raise FileChanged(f"{resolved}: changed during the transfer ({total:,} of {fst.st_size:,} bytes read)")
            _check_same(fst, f.stat(), resolved, "during the transfer")
            self._check_path(sftp, resolved, fst)
        finally:
            with contextlib.suppress(Exception):
                f.close()

    def _nlink(self, sftp, resolved: str, fst) -> int:
        """The file's hard link count. OpenSSH's SFTP server puts it in the
        `ls -l` line of each directory entry: the parent is listed until the
        name is found (an entry that is not the open handle's file is a
        change); other servers: one `stat` over exec (~100 ms)."""
        if self._trusts_realpath(sftp):
            n = _nlink_from_listing(sftp, resolved, fst)
            if n is not None:
                return n
        rc, out, err = self._exec(shlex.join(["stat", "-L", "-c", "%h", "--", resolved]), limit=4096)
        if rc == 0 and out.strip().isdigit():
            return int(out.strip())
        raise FileChanged(f"{resolved}: cannot count its links ({err.decode(errors='replace').strip()[:200]})")

    def _check_path(self, sftp, resolved: str, fst) -> None:
        """`resolved` still leads to itself (no link swapped in) and to a file
        like the open handle's."""
        if self._trusts_realpath(sftp) and sftp.normalize(resolved) != resolved:
            raise UnsafePath(f"{resolved}: a link was swapped in on the way")
        _check_same(fst, sftp.lstat(resolved), resolved, "while open")

    def _guarded(self, chunks: Iterator[bytes], what: str) -> Iterator[bytes]:
        """Translate errors inside the stream: put_stream runs it within the
        store's write, where a raw OSError would pass for a storage failure."""
        with self._errors(what):
            yield from chunks

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

    def extract(self, path: str, store, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        """Resolve, check and stream on one SFTP channel; nothing stored on failure."""
        check_lexical(path)
        if self.use_openssh:
            # ONE ssh run resolves, waits for our check of the answer, then streams; into a
            # volume its output is spliced into the file in the kernel (see exec_gated_extract)
            def check(r: Resolved) -> PathPolicy:
                policy = self._policy(r.home)
                policy.check(r.path, shown=path)
                self._cap(path, r.size, max_bytes)
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
        with self._errors(path), self._sftp() as sftp:
            resolved, st = self._resolve_sftp(sftp, path)
            self._cap(path, st.st_size, max_bytes)
            return store.put_stream(key, self._guarded(self._stream_sftp(sftp, resolved, st), path),
                                    max_bytes=max_bytes)

    @staticmethod
    def _cap(path: str, size: int, max_bytes: int) -> None:
        if size > max_bytes:
            raise TooLarge(f"{path}: {size:,} bytes is over the {max_bytes:,} byte cap",
                           size_bytes=size, limit_bytes=max_bytes)

    # -- inbound ------------------------------------------------------------------
    def put(self, store, key: str, dest_path: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        """Stream a stored blob to `dest_path` on the host: written to a temp
        name beside it, size-checked, then renamed over the destination."""
        check_lexical(dest_path)
        size = store.stat(key).size_bytes
        if size > max_bytes:
            raise TooLarge(f"{key}: {size:,} bytes is over the {max_bytes:,} byte cap",
                           size_bytes=size, limit_bytes=max_bytes)
        if self.use_openssh:
            return self._put_openssh(store, key, dest_path, size, max_bytes)
        with self._errors(dest_path), self._sftp() as sftp:
            policy = self._sftp_policy(sftp)
            self._deny_lexical(policy, dest_path)
            # deepest existing ancestor, resolved on the host; the rest is created
            missing: list[str] = []
            cur = posixpath.dirname(dest_path)
            while True:
                try:
                    real_anc = sftp.normalize(cur) if self._trusts_realpath(sftp) else self._readlink_f(cur)
                    sftp.stat(real_anc)
                    break
                except FileNotFoundError:
                    if cur == "/":
                        raise
                    missing.insert(0, posixpath.basename(cur))
                    cur = posixpath.dirname(cur)
            parent = posixpath.join(real_anc, *missing)
            dest = posixpath.join(parent, posixpath.basename(dest_path))
            policy.check(dest, shown=dest_path)
            if not stat.S_ISDIR(sftp.stat(real_anc).st_mode or 0):
                raise NotAFile(f"{dest_path}: {real_anc} is not a directory")
            for i in range(len(missing)):
                d = posixpath.join(real_anc, *missing[: i + 1])
                try:
                    sftp.mkdir(d, 0o755)
                except OSError:
                    if not stat.S_ISDIR(sftp.lstat(d).st_mode or 0):
                        raise NotAFile(f"{dest_path}: {d} is not a directory") from None
            try:
                st = sftp.lstat(dest)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode or 0):
                raise UnsafePath(f"{dest_path}: is a symbolic link")
            if st is not None and not stat.S_ISREG(st.st_mode or 0):
                raise NotAFile(f"{dest_path}: exists and is not a regular file")
            tmp = _temp_beside(dest)
            try:
                sent = 0
                with sftp.open(tmp, "wbx") as f:
                    f.MAX_REQUEST_SIZE = self._request_size(sftp)
                    f.set_pipelined(True)
                    for chunk in store.iter_chunks(key):
                        sent += len(chunk)
                        if sent > max_bytes:
                            raise TooLarge(f"{key}: over the {max_bytes:,} byte cap", limit_bytes=max_bytes)
                        f.write(chunk)
                if sent != size or sftp.stat(tmp).st_size != sent:
                    raise FileChanged(f"{dest_path}: short write ({sent:,} of {size:,} bytes)")
                try:
                    sftp.posix_rename(tmp, dest)
                except OSError as exc:
                    if getattr(exc, "errno", None) is not None:
                        raise
                    sftp.rename(tmp, dest)  # no posix-rename extension, and dest absent
            except BaseException:
                if self._alive():
                    with contextlib.suppress(Exception):
                        sftp.remove(tmp)
                raise
            return dest

    # -- exec ---------------------------------------------------------------------
    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """Run `argv` on the host (see Sandbox.exec and the module docstring);
        `cwd` None: the first allowed root that is a directory."""
        if self.use_openssh:
            ch: Any = self._openssh()

            def start(wrapped: list[str], run_id: str, **_: Any) -> _OpenSshRun:
                return _OpenSshRun(self, wrapped, run_id)
        else:
            ch = _SshSmall(self)

            def start(wrapped: list[str], run_id: str, **_: Any) -> _SshRun:  # type: ignore[misc]
                return _SshRun(self, wrapped, run_id)
        known = self.policy.roots or (self._checked_policy.roots if self._checked_policy else DEFAULT_ROOTS)
        return exec_command(ch, self._policy, start, argv, timeout_s=timeout_s, cwd=cwd,
                            max_output_bytes=max_output_bytes, defaults=known, cwd_cache=self._exec_cwds)

    # -- OpenSSH ------------------------------------------------------------------
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

    def _trust_key(self) -> str:
        """The control socket's name: a hash of everything the connection's
        trust rests on (host, port, user, the known_hosts file's content, the
        identity file's path and content). A master started under other trust
        settings (a worker restarted with another known_hosts) is never
        reused: a new connection checks the host key again."""
        h = hashlib.sha256()
        for part in (self.host, str(self.port), self.user, self.known_hosts or "", self.key_path or ""):
            h.update(part.encode("utf-8", "surrogateescape") + b"\0")
        for path in (self.known_hosts, self.key_path):
            if path:
                try:
                    with open(path, "rb") as f:
                        h.update(hashlib.sha256(f.read(1 << 20)).digest())
                except OSError:
                    h.update(b"unreadable")
            h.update(b"\0")
        return h.hexdigest()[:20]

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

    def _put_openssh(self, store, key: str, dest_path: str, size: int, max_bytes: int) -> str:
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
                    raise TooLarge(f"{key}: over the {max_bytes:,} byte cap", limit_bytes=max_bytes)
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

    def home_dir(self) -> str | None:
        """The configured home, else the remote user's (SFTP's `.`, or $HOME
        over the control master), asked once."""
        if self.policy.home:
            return self.policy.home
        if getattr(self, "_home_cache", None) is None:
            if self.use_openssh:
                rc, out, err = self._openssh().exec_small(["sh", "-c", 'printf "%s" "$HOME"'])
                if rc != 0:
                    raise self._ssh_error(rc, err, "home")
                self._home_cache = out.decode("utf-8", "surrogateescape")
            else:
                with self._errors("home"), self._sftp() as sftp:
                    self._home_cache = sftp.normalize(".")
        return self._home_cache or None

    def _remote_home(self) -> str | None:
        if self._checked_policy is not None or (self.policy.roots and self.policy.home):
            return None
        rc, out, err = self._openssh().exec_small(["sh", "-c", 'printf "%s" "$HOME"'])
        if rc != 0:
            raise self._ssh_error(rc, err, "home")
        return out.decode("utf-8", "surrogateescape") or None

    def close(self) -> None:
        """Stop this sandbox's OpenSSH control master, if any (pooled paramiko
        connections stay for reuse; see close_pool)."""
        if not self.use_openssh:
            return
        cdir = self.control_dir or _default_control_dir
        if not cdir:
            return
        argv = self._ssh_argv("true")
        argv = argv[: argv.index("--")] + ["-O", "exit", "--", self.host]
        with contextlib.suppress(Exception):
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=10)


class _OpenSshChannel:
    """execstream's ExecChannel over the OpenSSH client and its control master.

    ssh joins the remote argv into one string for the remote login shell, so
    the argv is quoted with shlex (POSIX quoting) and parsed back there. A
    255 exit (ssh's own failure) is translated here; other exit codes are
    the command's and go back to the caller."""

    binary_safe = True

    def __init__(self, sb: SshSandbox) -> None:
        self.sb = sb

    def _popen(self, argv, stdin, stderr) -> subprocess.Popen:
        try:
            # stderr goes to a file: a ControlPersist master forked by this
            # ssh would keep an inherited stderr pipe open for a minute
            return subprocess.Popen(self.sb._ssh_argv(shlex.join(argv)), stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=stderr, bufsize=0)
        except FileNotFoundError as exc:
            raise ConfigError("use_openssh needs the OpenSSH client: apt-get install openssh-client") from exc

    def _finish(self, proc: subprocess.Popen, errf, what: str) -> tuple[int, bytes]:
        try:
            rc = proc.wait(timeout=self.sb.io_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SandboxGone(f"ssh {self.sb.where}: timed out ({what})") from exc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errf.seek(0)
        err = errf.read(65536)
        if rc == 255:
            raise self.sb._ssh_error(rc, err, what)
        return rc, err

    def _read(self, proc: subprocess.Popen, n: int, what: str) -> bytes:
        """Up to `n` bytes of the client's stdout (b"" at the end), waiting at
        most io_timeout_s for them: a stalled remote (a FIFO's open, a stuck
        shell) ends this client with ReadTimeout instead of holding the worker."""
        fd = proc.stdout.fileno()
        if not _readable(fd, self.sb.io_timeout_s):
            proc.kill()
            raise ReadTimeout(f"ssh {self.sb.where}: nothing received for {self.sb.io_timeout_s:g} s ({what})")
        return os.read(fd, n)

    def exec_small(self, argv) -> tuple[int, bytes, bytes]:
        what = argv[-1] if argv else "ssh"
        with tempfile.TemporaryFile() as errf:
            proc = self._popen(argv, subprocess.DEVNULL, errf)
            out = bytearray()
            try:
                with proc.stdout:
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

    def exec_gated(self, argv) -> ExecStream:
        """exec_stream with a stdin pipe for one line (``ExecStream.gate``)."""
        return self.exec_stream(argv, gated=True)

    def exec_stream(self, argv, *, gated: bool = False) -> ExecStream:
        errf = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = self._popen(argv, subprocess.PIPE if gated else subprocess.DEVNULL, errf)
        with contextlib.suppress(OSError, AttributeError):  # a 1 MiB pipe: fewer stalls of ssh while we hash
            fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, CHUNK)
        state: dict[str, Any] = {"rc": None, "err": b""}
        what = argv[-2] if len(argv) > 1 else "ssh"

        fd = proc.stdout.fileno()

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
            try:
                proc.stdin.write(line)  # a line: far below the pipe's size, never blocks
            except BrokenPipeError:
                pass  # the remote script ended: its exit status says why
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()

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

    def exec_stdin(self, argv, chunks) -> tuple[int, bytes, bytes]:
        with tempfile.TemporaryFile() as errf:
            proc = subprocess.Popen(self.sb._ssh_argv(shlex.join(argv)), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=errf, bufsize=0)
            what = argv[-1] if argv else "ssh"
            try:
                fd = proc.stdin.fileno()
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
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the remote side ended early: its exit code says why
            except BaseException:
                proc.kill()  # aborted: the remote sees a short stream and refuses it
                raise
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            rc, err = self._finish(proc, errf, what)
        return rc, b"", err


# -- exec runs ----------------------------------------------------------------------
class _SshSmall:
    """Short remote commands on the pooled paramiko connection (argv quoted
    with shlex), errors translated: the exec_small of execstream's channel."""

    binary_safe = True

    def __init__(self, sb: SshSandbox) -> None:
        self.sb = sb

    def exec_small(self, argv: Sequence[str]) -> tuple[int, bytes, bytes]:
        with self.sb._errors("exec"):
            return self.sb._exec(shlex.join(argv))


class _SshRun:
    """One ``Sandbox.exec`` command on a paramiko session channel (an ExecRun)."""

    def __init__(self, sb: SshSandbox, argv: Sequence[str], run_id: str) -> None:
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


class _OpenSshRun:
    """One ``Sandbox.exec`` command through the OpenSSH client (an ExecRun);
    the client joins the control master but never forks one."""

    def __init__(self, sb: SshSandbox, argv: Sequence[str], run_id: str) -> None:
        self.sb, self.run_id = sb, run_id
        try:
            self.proc = subprocess.Popen(sb._ssh_argv(shlex.join(argv), master=False), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        except FileNotFoundError as exc:
            raise ConfigError("use_openssh needs the OpenSSH client: apt-get install openssh-client") from exc
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ, "out")
        self.sel.register(self.proc.stderr, selectors.EVENT_READ, "err")
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
