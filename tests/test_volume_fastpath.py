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
