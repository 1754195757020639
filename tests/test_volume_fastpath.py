"""The volume's in-kernel copy (`put_fd`): identical bytes, the cap holds
during the copy, and a refused copy leaves nothing."""

from __future__ import annotations

import os

import pytest

from adapters.errors import TooLarge
from storage.volume import VolumeStore
from tests.fixtures.services import need
from tests.fixtures._files import sha256_file


def _put_file(store: VolumeStore, key: str, src, max_bytes: int):
    """store.put_fd of `src`, through a descriptor closed afterwards."""
    fd = os.open(src, os.O_RDONLY)
    try:
        return store.put_fd(key, fd, max_bytes=max_bytes)
    finally:
        os.close(fd)


def test_put_fd_copies_bytes(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3_000_000))
    store = VolumeStore(tmp_path / "store")
    info = _put_file(store, "files/a.bin", src, max_bytes=10_000_000)
    assert info is not None and info.size_bytes == 3_000_000
    assert sha256_file(store.local_path("files/a.bin")) == sha256_file(src)


def test_put_fd_cap_holds_during_copy(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2_000_000))
    store = VolumeStore(tmp_path / "store")
    with pytest.raises(TooLarge):
        _put_file(store, "files/b.bin", src, max_bytes=1_000_000)
    assert not store.exists("files/b.bin")
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []


def test_put_fd_across_filesystems(tmp_path):
    """/dev/shm is another filesystem than the tests' tmp dir on these machines."""
    need(os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev,
         "no second filesystem (/dev/shm) here")
    import tempfile

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1_500_000))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        store = VolumeStore(d)
        info = _put_file(store, "files/x.bin", src, max_bytes=2_000_000)
        assert info is not None and info.size_bytes == 1_500_000
        assert sha256_file(store.local_path("files/x.bin")) == sha256_file(src)


# -- put_pipe: a pipe spliced into the file ---------------------------------------------
def _writer(data: bytes):
    """A pipe whose write end a thread fills with `data` and closes; (read fd, thread)."""
    import threading

    r, w = os.pipe()

    def run():
        with os.fdopen(w, "wb") as f:
            try:
                f.write(data)
            except BrokenPipeError:  # the reader stopped at the cap
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return r, t


def test_put_pipe_moves_bytes_and_runs_finish(tmp_path):
    data = os.urandom(3_000_000)
    r, t = _writer(data)
    store = VolumeStore(tmp_path / "store")
    seen, waits = [], []
    try:
        info = store.put_pipe("files/p.bin", r, max_bytes=10_000_000, wait=lambda: waits.append(1),
                              finish=seen.append)
    finally:
        os.close(r)
    t.join(10)
    assert info is not None and info.size_bytes == 3_000_000 and info.sha256 is None
    assert seen == [3_000_000] and len(waits) >= 2
    assert store.local_path("files/p.bin").read_bytes() == data


def test_put_pipe_cap_and_refusal_leave_nothing(tmp_path):
    store = VolumeStore(tmp_path / "store")
    r, t = _writer(os.urandom(2_000_000))
    try:
        with pytest.raises(TooLarge):
            store.put_pipe("files/big.bin", r, max_bytes=1_000_000)
    finally:
        os.close(r)  # the writer, blocked on a full pipe, gets EPIPE
    t.join(10)

    def refuse(n):
        raise ValueError(f"refused at {n}")

    r, t = _writer(b"x" * 1000)
    try:
        with pytest.raises(ValueError, match="refused at 1000"):
            store.put_pipe("files/refused.bin", r, max_bytes=1_000_000, finish=refuse)
    finally:
        os.close(r)
    t.join(10)
    assert not store.exists("files/big.bin") and not store.exists("files/refused.bin")
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []


def test_put_pipe_of_a_non_pipe_is_none(tmp_path):
    """Not a pipe: None, nothing read, nothing left (the caller streams instead)."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    store = VolumeStore(tmp_path / "store")
    fd = os.open(src, os.O_RDONLY)
    try:
        assert store.put_pipe("files/n.bin", fd, max_bytes=10) is None
        assert os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)
    assert not store.exists("files/n.bin")
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []
