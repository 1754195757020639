"""The volume's in-kernel copy (`put_fd`): identical bytes, the cap holds
during the copy, and a refused copy leaves nothing."""

from __future__ import annotations

import hashlib
import os

import pytest

from adapters.errors import TooLarge
from storage.volume import VolumeStore


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_put_fd_copies_bytes(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3_000_000))
    store = VolumeStore(tmp_path / "store")
    fd = os.open(src, os.O_RDONLY)
    try:
        info = store.put_fd("files/a.bin", fd, max_bytes=10_000_000)
    finally:
        os.close(fd)
    assert info is not None and info.size_bytes == 3_000_000
    assert _sha(store.local_path("files/a.bin")) == _sha(src)


def test_put_fd_cap_holds_during_copy(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2_000_000))
    store = VolumeStore(tmp_path / "store")
    fd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(TooLarge):
            store.put_fd("files/b.bin", fd, max_bytes=1_000_000)
    finally:
        os.close(fd)
    assert not store.exists("files/b.bin")
    assert list((tmp_path / "store" / ".tmp").iterdir()) == []


def test_put_fd_across_filesystems(tmp_path):
    """/dev/shm is another filesystem than the tests' tmp dir on these machines."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem here")
    import tempfile

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1_500_000))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        store = VolumeStore(d)
        fd = os.open(src, os.O_RDONLY)
        try:
            info = store.put_fd("files/x.bin", fd, max_bytes=2_000_000)
        finally:
            os.close(fd)
        assert info is not None and info.size_bytes == 1_500_000
        assert _sha(store.local_path("files/x.bin")) == _sha(src)
