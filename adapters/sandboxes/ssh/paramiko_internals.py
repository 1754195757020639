"""The only code that reaches into paramiko's private internals, in one
module so a paramiko upgrade has one place to check (pyproject pins
``paramiko>=3.4,<6``; tests/test_sandbox_ssh.py and
bench/bench_extract_ssh.py exercise all of it); the rest of the package uses
only public paramiko API. Each function's docstring says why it exists:
:func:`_sftp_pipeline` (READ pipelining), :func:`_fast_pipe_class` /
:func:`_use_fast_pipe` (the channel buffer), :func:`_nlink_from_listing`
(link counts from the listing).
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from adapters.errors import SandboxError
from adapters.sandboxes.ssh.core import CHUNK, FileChanged, SFTPAttributes, SFTPClient, _check_same


class _Replies:
    """Collects the SFTP replies paramiko routes to us by request number."""

    def __init__(self) -> None:
        self.got: dict[int, tuple[int, Any]] = {}

    def _async_response(self, t: int, msg: Any, num: int) -> None:  # paramiko's callback name
        self.got[num] = (t, msg)


def _sftp_pipeline(sftp: SFTPClient, handle: bytes, size: int, req: int, depth: int) -> Iterator[bytes]:
    """1 MiB chunks of a remote file, with `depth` READ requests of `req`
    bytes in flight, consumed in order; the end of the file before `size` is
    a change. Not paramiko's `SFTPFile.prefetch()`: once replies overtake its
    requests it parks every later reply unread and reads one round trip at a time."""
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


@functools.cache
def _fast_pipe_class() -> type[Any]:
    """A paramiko BufferedPipe whose reads cost O(bytes read): paramiko's shifts
    its whole buffer on each read (two multi-MiB memmoves per SFTP response);
    this keeps the fed chunks in a deque and an offset into the first one."""
    from paramiko.buffered_pipe import BufferedPipe, PipeTimeout

    class FastPipe(BufferedPipe):
        def __init__(self) -> None:
            super().__init__()
            self._chunks: deque[bytes] = deque()
            self._off = 0
            self._size = 0

        def set_event(self, event: threading.Event) -> None:
            with self._lock:
                self._event = event
                if self._closed or self._size > 0:
                    event.set()
                else:
                    event.clear()

        def feed(self, data: bytes | bytearray | memoryview) -> None:
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
            """`n` bytes (at most what is buffered): a whole fed chunk as it is, else one copy."""
            parts: list[bytes | memoryview] = []
            while n and self._chunks:
                c = self._chunks[0]
                end = min(len(c), self._off + n)
                parts.append(c if self._off == 0 and end == len(c) else memoryview(c)[self._off:end])
                n -= end - self._off
                if end == len(c):
                    self._chunks.popleft()
                    self._off = 0
                else:
                    self._off = end
            out = b"".join(parts)  # one whole fed chunk: that very object, no copy
            self._size -= len(out)
            return out

        def read(self, nbytes: int, timeout: float | None = None) -> bytes:
            with self._lock:
                if self._size == 0 and not self._closed and timeout == 0.0:
                    raise PipeTimeout()
                while self._size == 0 and not self._closed:
                    then = time.time()
                    self._cv.wait(timeout)
                    if timeout is not None:
                        timeout -= time.time() - then
                        if timeout <= 0.0:
                            raise PipeTimeout()
                if self._size == 0:  # closed
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


def _use_fast_pipe(chan: Any) -> None:
    """Swap a quiet channel's input pipe (no request outstanding, nothing
    buffered); a paramiko whose pipe looks different keeps its own."""
    old = chan.in_buffer
    if not all(hasattr(old, a) for a in ("_lock", "_buffer", "_event")):
        return
    new = _fast_pipe_class()()
    with old._lock:
        left = old._buffer.tobytes() if len(old._buffer) else b""
        if old._event is not None:
            new.set_event(old._event)
        chan.in_buffer = new
    if left:
        new.feed(left)


def _nlink_from_listing(sftp: SFTPClient, resolved: str, fst: SFTPAttributes) -> int | None:
    """The link count of `resolved` from its directory's SFTP listing: SFTP
    attributes carry none, but OpenSSH's server puts it in each entry's long
    name (`-rw-r--r--  2 user group ...`); reading entries only until the
    name is found costs a round trip or two instead of a `stat` over exec.
    None when the long name cannot be parsed."""
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


