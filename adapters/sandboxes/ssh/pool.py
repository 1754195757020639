"""The paramiko connection pool: one connection per destination and trust in a process.

The key includes :func:`trust_key` (a hash of the known_hosts and identity
files' paths AND contents), so a connection made under other trust is never
reused: a new one checks the host key again (unknown keys are refused, never
added). A dead connection is re-opened; a forked child never touches its
parent's sockets.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from adapters.errors import SandboxGone

#: AES-GCM first: one AEAD pass instead of AES-CTR plus an HMAC-SHA256 pass over every packet
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
#: SSH channel window: bounds what the server may send ahead (and our buffer); 2-8 MiB is best
WINDOW_SIZE = 8 * 1024 * 1024
#: largest SSH packet we accept (RFC 4253 lets a peer go to 256 KiB)
MAX_PACKET_SIZE = 256 * 1024

#: (user, host, port, key path, known_hosts path, trust key)
PoolKey = tuple[str, str, int, str | None, str | None, str]


@dataclass
class _Pooled:
    client: Any  # paramiko.SSHClient
    pid: int


_pool: dict[PoolKey, _Pooled] = {}
_pool_lock = threading.Lock()
_connect_locks: dict[PoolKey, threading.Lock] = {}


def _paramiko() -> ModuleType:
    from adapters.extras import needs

    with needs("ssh", "ssh:// sandboxes (paramiko SFTP; or COURIER_SSH_USE_OPENSSH=1)"):
        import paramiko
    return paramiko


def close_pool() -> None:
    """Close every pooled connection of this process (tests, shutdown)."""
    with _pool_lock:
        keys = list(_pool)
    for key in keys:
        evict(key)


def trust_key(host: str, port: int, user: str, known_hosts: str | None, key_path: str | None) -> str:
    """A hash of everything a connection's trust rests on (host, port, user,
    the known_hosts and identity files' paths and contents): part of the
    pool key, and the name of an OpenSSH control socket."""
    h = hashlib.sha256()
    for part in (host, str(port), user, known_hosts or "", key_path or ""):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    for path in (known_hosts, key_path):
        if path:
            try:
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read(1 << 20)).digest())
            except OSError:
                h.update(b"unreadable")
        h.update(b"\0")
    return h.hexdigest()[:20]


def alive(key: PoolKey) -> bool:
    """Whether the pooled connection for `key` is there and active."""
    e = _pool.get(key)
    t = e.client.get_transport() if e else None
    return bool(t and t.is_active())


def evict(key: PoolKey) -> None:
    """Drop (and close, in the process that made it) the connection for `key`."""
    with _pool_lock:
        e = _pool.pop(key, None)
    if e is not None and e.pid == os.getpid():
        with contextlib.suppress(Exception):
            e.client.close()


def pooled(key: PoolKey, connect: Callable[[], Any]) -> Any:
    """The live pooled client for `key`, else a new one from `connect()`."""
    with _pool_lock:
        key_lock = _connect_locks.setdefault(key, threading.Lock())
    with key_lock:  # one connect per destination at a time; other hosts are not held up
        e = _pool.get(key)
        if e is not None and e.pid == os.getpid() and alive(key):
            return e.client
        evict(key)  # none, dead, or the parent's (a forked child must not touch its socket)
        client = connect()
        with _pool_lock:
            _pool[key] = _Pooled(client, os.getpid())
        return client


def connect(*, host: str, port: int, user: str, key_path: str | None, known_hosts: str | None,
            timeout_s: float, where: str) -> Any:
    """A new paramiko SSHClient: host key checked (unknown: refused), TCP_NODELAY,
    AES-GCM preferred, our window and packet sizes, keepalive every 30 s."""
    paramiko = _paramiko()
    client = paramiko.SSHClient()
    if known_hosts:
        client.load_host_keys(known_hosts)
    else:
        client.load_system_host_keys()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise SandboxGone(f"ssh {where}: cannot connect: {exc.strerror or exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def factory(s: socket.socket, **kw: Any) -> Any:
        t = paramiko.Transport(s, default_window_size=WINDOW_SIZE, default_max_packet_size=MAX_PACKET_SIZE, **kw)
        opts = t.get_security_options()
        first = tuple(c for c in PREFERRED_CIPHERS if c in opts.ciphers)
        opts.ciphers = first + tuple(c for c in opts.ciphers if c not in first)
        return t

    try:
        client.connect(host, port=port, username=user, key_filename=key_path, sock=sock, timeout=timeout_s,
                       banner_timeout=timeout_s, auth_timeout=timeout_s, allow_agent=key_path is None,
                       look_for_keys=key_path is None, transport_factory=factory)
    except BaseException:
        client.close()
        sock.close()
        raise
    client.get_transport().set_keepalive(30)
    return client
