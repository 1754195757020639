"""The demultiplexer of a docker exec's attach stream: frames of an 8-byte
header (stream id, three zero bytes, the size as a big-endian u32), then
that many bytes, cut anywhere (:class:`FrameSplitter` keeps the state)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

from adapters.sandboxes.base import BoundedOutput

CHUNK = 1024 * 1024
STDOUT, STDERR = 1, 2
_HEADER = struct.Struct(">BxxxL")


class FrameSplitter:
    """A multiplexed stream fed in arbitrary pieces as (stream id, bytes)
    pieces (views of what was fed: use them before its buffer is reused)."""

    def __init__(self) -> None:
        self.kind = 0
        self.left = 0
        self.head = bytearray()

    def split(self, data: bytes | bytearray | memoryview) -> Iterator[tuple[int, memoryview]]:
        view = memoryview(data)
        pos, n = 0, len(view)
        while pos < n:
            if self.left == 0:
                take = min(_HEADER.size - len(self.head), n - pos)
                self.head += view[pos:pos + take]
                pos += take
                if len(self.head) < _HEADER.size:
                    break
                self.kind, self.left = _HEADER.unpack(self.head)
                self.head.clear()
                continue
            take = min(self.left, n - pos)
            yield self.kind, view[pos:pos + take]
            pos += take
            self.left -= take


def route(frames: FrameSplitter, data: bytes, out: BoundedOutput, err: BoundedOutput) -> None:
    """The pieces of `data` added to `out` (stdout) and `err` (stderr)."""
    for kind, piece in frames.split(data):
        if kind == STDOUT:
            out.add(bytes(piece))
        elif kind == STDERR:
            err.add(bytes(piece))


def read_all(recv: Callable[[int], bytes], out: BoundedOutput, err: BoundedOutput) -> None:
    """A short command's whole output, until the engine ends the stream."""
    frames = FrameSplitter()
    while data := recv(65536):
        route(frames, data, out, err)


def demux_stdout(recv_into: Callable[[memoryview], int], err: bytearray, *, block: int = CHUNK,
                 err_cap: int = 4096) -> Iterator[bytes]:
    """Stdout of a multiplexed exec stream as ~`block`-sized pieces, received
    into one reused buffer; stderr goes to `err` (capped)."""
    buf = bytearray(block)
    view = memoryview(buf)
    frames = FrameSplitter()
    out: list[bytes] = []
    have = 0
    while True:
        got = recv_into(view)
        if not got:
            break
        for kind, piece in frames.split(view[:got]):
            if kind == STDOUT:
                out.append(bytes(piece))
                have += len(piece)
            elif kind == STDERR and len(err) < err_cap:
                err.extend(piece[:err_cap - len(err)])
        if have >= block // 2:
            yield b"".join(out)  # of one piece: that very object, no copy
            out, have = [], 0
    if out:
        yield b"".join(out)
