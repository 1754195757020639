"""adapters/platforms/_ogg.py: an Ogg Opus stream's duration from its first
page (OpusHead) and its last page's granule, read without reading the file
whole; anything else is a clear `OggError`.

`opus_stream` builds a valid Ogg Opus stream by hand (pages with Ogg's own
CRC, computed here bit by bit, independently of the module under test); a
real encoder's file (opusenc) is checked too."""

from __future__ import annotations

import io
import os
import struct
import subprocess
from pathlib import Path

import pytest

from adapters.platforms._ogg import TAIL_BYTES, OggError, crc32, opus_info

#: one 20 ms CELT frame of silence (TOC 0xf8: fullband, 20 ms, mono, one frame)
SILENT_FRAME = b"\xf8\xff\xfe"
FRAME_SAMPLES = 960  # 20 ms at 48 kHz


def ogg_crc(data: bytes) -> int:
    """Ogg's CRC (polynomial 0x04c11db7, initial 0, unreflected, no final xor), bit by bit."""
    crc = 0
    for b in data:
        crc ^= b << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def ogg_page(packets: list[bytes], *, granule: int, serial: int, seq: int, header_type: int = 0) -> bytes:
    lacing = b""
    for p in packets:
        lacing += b"\xff" * (len(p) // 255) + bytes([len(p) % 255])
    assert len(lacing) <= 255
    head = struct.pack("<4sBBqIIIB", b"OggS", 0, header_type, granule, serial, seq, 0, len(lacing))
    page = head + lacing + b"".join(packets)
    return page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:]


def opus_head(*, channels: int = 1, pre_skip: int = 312, rate: int = 48000) -> bytes:
    return b"OpusHead" + struct.pack("<BBHIhB", 1, channels, pre_skip, rate, 0, 0)


def opus_stream(duration_s: float, *, pre_skip: int = 312, serial: int = 0x5EED, frame: bytes = SILENT_FRAME,
                frames_per_page: int = 50, eos: bool = True, head: bytes | None = None) -> bytes:
    """A valid Ogg Opus stream of `duration_s` (to the sample): OpusHead, OpusTags, then
    pages of 20 ms frames, the last granule trimmed to the exact length (as encoders do)."""
    samples = round(duration_s * 48000)
    n_frames = -(-samples // FRAME_SAMPLES)
    out = [ogg_page([head if head is not None else opus_head(pre_skip=pre_skip)], granule=0, serial=serial, seq=0,
                    header_type=0x02),
           ogg_page([b"OpusTags" + struct.pack("<I", 7) + b"courier" + struct.pack("<I", 0)], granule=0,
                    serial=serial, seq=1)]
    seq, done = 2, 0
    while done < n_frames:
        k = min(frames_per_page, n_frames - done)
        done += k
        last = done == n_frames
        granule = pre_skip + (samples if last else done * FRAME_SAMPLES)
        out.append(ogg_page([frame] * k, granule=granule, serial=serial, seq=seq,
                            header_type=0x04 if last and eos else 0))
        seq += 1
    return b"".join(out)


def write_opus(path: Path, duration_s: float, **kw) -> Path:
    path.write_bytes(opus_stream(duration_s, **kw))
    return path


class Counting(io.RawIOBase):
    """A file that counts the bytes read from it (seekable or not)."""

    def __init__(self, data: bytes, *, seekable: bool = True) -> None:
        self._f = io.BytesIO(data)
        self._seekable = seekable
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("seek")
        return self._f.seek(offset, whence)

    def readinto(self, b) -> int:
        data = self._f.read(len(b))
        b[: len(data)] = data
        self.read_bytes += len(data)
        return len(data)


def info_of(data: bytes, **kw):
    return opus_info(Counting(data, **kw))


# -- the checksum -------------------------------------------------------------------------------
def test_crc_is_oggs_not_zlibs():
    import zlib

    assert crc32(b"123456789") == 0x89A1897F  # CRC-32/CKSUM's check value without its final xor
    assert crc32(b"123456789") != zlib.crc32(b"123456789")
    data = os.urandom(3000)
    assert crc32(data) == ogg_crc(data)


# -- sound streams ----------------------------------------------------------------------------------
@pytest.mark.parametrize("duration_s,pre_skip", [(3.27, 312), (0.5, 0), (61.0, 3840)])
def test_duration_is_last_granule_less_pre_skip(duration_s, pre_skip):
    info = info_of(opus_stream(duration_s, pre_skip=pre_skip))
    assert info.pre_skip == pre_skip and info.channels == 1 and info.input_rate == 48000
    assert info.last_granule == pre_skip + round(duration_s * 48000)
    assert info.duration_s == pytest.approx(duration_s, abs=1e-6)


def test_a_stream_without_end_of_stream_mark_still_has_its_duration():
    assert info_of(opus_stream(2.0, eos=False)).duration_s == pytest.approx(2.0, abs=1e-6)


def test_only_the_first_page_and_the_tail_are_read():
    # ~1.2 MB: 400-byte packets, 100 pages of 30
    data = opus_stream(60.0, frame=b"\xf8" + os.urandom(399), frames_per_page=30)
    assert len(data) > 10 * TAIL_BYTES
    f = Counting(data)
    assert opus_info(f).duration_s == pytest.approx(60.0, abs=1e-6)
    assert f.read_bytes <= 200 + TAIL_BYTES


def test_a_stream_that_cannot_seek_is_read_through_keeping_only_its_tail():
    data = opus_stream(30.0, frame=b"\xf8" + os.urandom(299), frames_per_page=40)
    assert len(data) > 2 * TAIL_BYTES
    f = Counting(data, seekable=False)
    assert opus_info(f).duration_s == pytest.approx(30.0, abs=1e-6)
    assert f.read_bytes == len(data)


def test_an_oggs_inside_packet_data_is_not_taken_for_a_page():
    # the last page's audio holds a capture pattern with a page header after it
    fake_header = struct.pack("<4sBBqIIIB", b"OggS", 0, 0, 10**9, 0x5EED, 99, 0, 0)
    data = opus_stream(4.0, frame=b"\xf8" + fake_header + b"\x00" * 8, frames_per_page=25)
    assert data.rfind(b"OggS") > data.rfind(b"OggS", 0, len(data) - 100)
    assert info_of(data).duration_s == pytest.approx(4.0, abs=1e-6)


def test_a_real_encoders_file(tmp_path):
    """opusenc's (opus-tools, installed by scripts/setup) Ogg Opus file of a
    2.5 s tone: its duration, pre-skip and CRC-checked pages as a real encoder
    writes them."""
    import math
    import wave

    from tests.fixtures.services import need_binary

    opusenc = need_binary("opusenc")
    wav, out = tmp_path / "tone.wav", tmp_path / "tone.ogg"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / 48000)))
                               for i in range(int(2.5 * 48000))))
    subprocess.run([opusenc, "--quiet", str(wav), str(out)], check=True, capture_output=True, timeout=60)
    with open(out, "rb") as f:
        info = opus_info(f)
    assert info.duration_s == pytest.approx(2.5, abs=0.05) and info.pre_skip > 0


# -- malformed input: a clear OggError, nothing else -----------------------------------------------
def _vorbis_stream() -> bytes:
    ident = b"\x01vorbis" + struct.pack("<IBIiiiBB", 0, 1, 44100, 0, 128000, 0, 0xB8, 1)
    return ogg_page([ident], granule=0, serial=7, seq=0, header_type=0x02) + \
        ogg_page([b"\x00" * 40], granule=44100, serial=7, seq=1, header_type=0x04)


def _corrupt_last_page(data: bytes) -> bytes:
    b = bytearray(data)
    b[-2] ^= 0xFF
    return bytes(b)


def _only_headers(pre_skip: int = 312) -> bytes:
    data = opus_stream(1.0, pre_skip=pre_skip)
    second = data.index(b"OggS", 1)
    third = data.index(b"OggS", second + 1)
    return data[:third]


@pytest.mark.parametrize("data,words", [
    (b"", "not an Ogg file"),
    (b"\x89PNG\r\n\x1a\n" + os.urandom(500), "not an Ogg file"),
    (os.urandom(1500).replace(b"OggS", b"Ogg_"), "not an Ogg file"),
    (b"OggS\x00\x02", "first page header is incomplete"),
    (opus_stream(1.0)[:40], "first page is incomplete"),
    (_vorbis_stream(), "no OpusHead"),
    (opus_stream(1.0, head=b"OpusHead\x01"), "under 19 bytes"),
    (opus_stream(1.0, head=b"OpusHead" + struct.pack("<BBHIhB", 0x21, 1, 312, 48000, 0, 0)), "version"),
    (opus_stream(3.0)[:-7], "does not end on a complete page"),
    (_corrupt_last_page(opus_stream(3.0)), "does not end on a complete page"),
    (opus_stream(3.0) + b"trailing junk", "does not end on a complete page"),
    (_only_headers(), "holds no audio"),
    (_only_headers(pre_skip=3840) + ogg_page([SILENT_FRAME], granule=960, serial=0x5EED, seq=2, header_type=4),
     "holds no audio"),
], ids=["empty", "png", "random", "short-header", "cut-first-page", "vorbis", "short-opushead", "opus-v2",
        "cut-last-page", "bad-crc", "trailing-junk", "headers-only", "shorter-than-pre-skip"])
def test_malformed_input_is_a_clear_error(data, words):
    for seekable in (True, False):
        with pytest.raises(OggError) as ei:
            info_of(data, seekable=seekable)
        assert words in ei.value.reason and str(ei.value) == ei.value.reason


def test_a_bad_crc_on_the_first_page():
    data = bytearray(opus_stream(1.0))
    data[30] ^= 0x01
    with pytest.raises(OggError, match="CRC"):
        info_of(bytes(data))
