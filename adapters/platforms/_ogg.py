"""Just enough Ogg Opus to describe a voice note: its duration, read without reading the file whole.

The first page must hold the `OpusHead` packet (RFC 7845 §5.1). The duration is the last page's granule
position less the pre-skip, over 48000 (§4); that page is found in the file's last `TAIL_BYTES`: the last
`OggS` whose page checks out (CRC, the stream's serial, a granule set) and ends where the file does.
Anything else raises `OggError` with a reason a person can read.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["OggError", "OpusInfo", "crc32", "opus_info", "OPUS_RATE"]

#: Opus granule positions always count 48 kHz samples, whatever the input rate
OPUS_RATE = 48000
CAPTURE = b"OggS"
#: capture pattern, version, header type, granule, serial, sequence, CRC, segment count
_HEADER = struct.Struct("<4sBBqIIIB")
HEADER_BYTES = _HEADER.size  # 27
#: how much of the end of the file is read to find the last page (a page is at most 65,307 bytes)
TAIL_BYTES = 64 * 1024
_BOS = 0x02
#: a page on which no packet ends carries granule -1
_NO_GRANULE = -1


class OggError(ValueError):
    """Not a usable Ogg Opus stream; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class OpusInfo:
    channels: int
    pre_skip: int
    input_rate: int
    last_granule: int
    #: (last granule - pre-skip) / 48000
    duration_s: float


def _crc_entry(r: int) -> int:
    for _ in range(8):
        r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
    return r & 0xFFFFFFFF


_CRC = [_crc_entry(i << 24) for i in range(256)]


def crc32(data: bytes | bytearray | memoryview) -> int:
    """Ogg's page checksum: CRC-32, polynomial 0x04c11db7, initial value 0, not reflected, no final xor
    (not zlib's CRC-32). Computed with the page's CRC field zeroed."""
    crc = 0
    table = _CRC  # (a local: the loop runs once a byte)
    for b in bytes(data):
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ b]
    return crc


def _page_at(buf: bytes, start: int) -> tuple[int, int, int, int] | None:
    """The page at `buf[start:]` if it is whole there and its CRC holds: (header type, granule, serial,
    where it ends), else None."""
    if len(buf) - start < HEADER_BYTES:
        return None
    capture, version, header_type, granule, serial, _seq, crc, nsegs = _HEADER.unpack_from(buf, start)
    body = start + HEADER_BYTES + nsegs
    end = body + sum(buf[start + HEADER_BYTES:body])  # (a cut lacing table: body, so end, is past the buffer)
    if capture != CAPTURE or version != 0 or end > len(buf):
        return None
    ok = crc32(buf[start:start + 22] + bytes(4) + buf[start + 26:end]) == crc  # (its CRC field zeroed)
    return (header_type, granule, serial, end) if ok else None


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    out = bytearray()
    while len(out) < n and (chunk := f.read(n - len(out))):
        out += chunk
    return bytes(out)


def _first_page(f: BinaryIO) -> tuple[int, int, bytes, int]:
    """The first page's header type, serial, first packet (OpusHead, if Opus) and length."""
    head = _read_exactly(f, HEADER_BYTES)
    if head[:4] != CAPTURE:
        raise OggError("not an Ogg file (no OggS capture pattern at its start)")
    if len(head) < HEADER_BYTES:
        raise OggError("truncated Ogg file: its first page header is incomplete")
    if head[4] != 0:
        raise OggError(f"unsupported Ogg version {head[4]}")
    lacing = _read_exactly(f, head[26])
    body = _read_exactly(f, sum(lacing))
    if len(lacing) < head[26] or len(body) < sum(lacing):
        raise OggError("truncated Ogg file: its first page is incomplete")
    page = _page_at(head + lacing + body, 0)
    if page is None:
        raise OggError("corrupt Ogg file: the first page's CRC does not match")
    # the first packet: segments up to the first lacing value under 255
    n = 0
    for lace in lacing:
        n += lace
        if lace < 255:
            break
    return page[0], page[2], body[:n], page[3]


def _opus_head(header_type: int, packet: bytes) -> tuple[int, int, int]:
    if not header_type & _BOS:
        raise OggError("not the start of an Ogg stream (the first page is not marked beginning-of-stream)")
    if not packet.startswith(b"OpusHead"):
        what = "Vorbis" if packet[1:7] == b"vorbis" else "not Opus"
        raise OggError(f"not an Ogg Opus stream (no OpusHead; the first packet is {what})")
    if len(packet) < 19:
        raise OggError("corrupt OpusHead (under 19 bytes)")
    version, channels, pre_skip, input_rate = struct.unpack_from("<BBHI", packet, 8)
    if version >> 4:
        raise OggError(f"unsupported Opus version {version}")
    if channels == 0:
        raise OggError("corrupt OpusHead (0 channels)")
    return channels, pre_skip, input_rate


def _size_and_tail(f: BinaryIO, already_read: int) -> tuple[int, bytes]:
    """The stream's total size and its last TAIL_BYTES, seeking when the stream can, else reading
    through it keeping only the tail."""
    try:
        seekable = f.seekable()
    except (AttributeError, ValueError, OSError):
        seekable = False
    if seekable:
        size = f.seek(0, io.SEEK_END)
        start = max(0, size - TAIL_BYTES)
        f.seek(start)
        return size, _read_exactly(f, size - start)
    size, tail = already_read, b""
    while chunk := f.read(TAIL_BYTES):
        size += len(chunk)
        tail = (tail + chunk)[-TAIL_BYTES:]
    return size, tail


def opus_info(f: BinaryIO) -> OpusInfo:
    """Describe the Ogg Opus stream `f` (a binary stream at its start); `OggError` if it is not one."""
    header_type, serial, packet, read = _first_page(f)
    channels, pre_skip, input_rate = _opus_head(header_type, packet)
    size, tail = _size_and_tail(f, read)
    tail_offset = size - len(tail)  # (>= 0: the tail is at most what was counted)
    # the last page: search backward for a capture pattern whose page is sound (an "OggS" in packet data fails the CRC)
    ends_file = False
    granule: int | None = None
    pos = len(tail)
    while granule is None and (pos := tail.rfind(CAPTURE, 0, pos)) >= 0:
        page = _page_at(tail, pos)
        if page is None:
            continue
        if not ends_file and tail_offset + page[3] != size:
            raise OggError("truncated or corrupt Ogg file: it does not end on a complete page")
        ends_file = True
        if page[2] == serial and page[1] != _NO_GRANULE:
            granule = page[1]
    if not ends_file:
        raise OggError("truncated or corrupt Ogg file: no complete page at its end")
    if granule is None:
        raise OggError("corrupt Ogg Opus file: no granule position near its end")
    if granule - pre_skip <= 0:
        raise OggError("the Ogg Opus stream holds no audio")
    return OpusInfo(channels=channels, pre_skip=pre_skip, input_rate=input_rate, last_granule=granule,
                    duration_s=(granule - pre_skip) / OPUS_RATE)
