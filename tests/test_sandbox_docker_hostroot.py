"""The docker sandbox's host-root channel (adapters/sandboxes/hostroot.py)
against a real container (rootful podman, tests/fixtures/podman.py): a big
file of a local engine's root container is opened through the container
process's root and copied in the kernel; anything that is not exactly the
file the engine stat'ed goes to the archive API, which checks it again."""

from __future__ import annotations

import os

import pytest

from adapters.errors import FileChanging, SandboxGone, TooLarge, UnsafePath
from adapters.sandboxes import hostroot
from adapters.sandboxes.base import SandboxRef
from adapters.sandboxes.docker import HOST_ROOT_MIN_BYTES, DockerSandbox
from storage.volume import VolumeStore
from tests.fixtures._files import MB, sha256_file, sha_in_container, stored
from tests.fixtures.services import need

BIG = HOST_ROOT_MIN_BYTES + 12345

SETUP = r"""set -e
mkdir -p /workspace/d /workspace/outside
head -c "$1" /dev/urandom > /workspace/big
head -c "$1" /dev/urandom > /workspace/outside/secret
head -c 1024 /dev/urandom > /workspace/small
"""


@pytest.fixture(scope="module")
def ctr(docker_api):
    need(hostroot.available(), "no pidfd_open / openat2 here")
    with docker_api.container(SETUP, str(BIG)) as c:
        yield c


@pytest.fixture
def sb(docker_api, ctr):
    with docker_api.sandbox(ctr) as s:
        yield s


def test_big_file_read_through_the_host_root(sb, ctr, store):
    info = sb.extract("/workspace/big", store, "files/big", max_bytes=2 * BIG)
    assert sb.stats["host_root"] == 1 and sb.stats["archive"] == 0
    assert info.size_bytes == BIG
    assert sha256_file(store.local_path("files/big")) == sha_in_container(ctr, "/workspace/big")


def test_small_file_and_opt_out_take_the_archive_api(sb, docker_api, ctr, store):
    sb.extract("/workspace/small", store, "files/small")
    assert (sb.stats["host_root"], sb.stats["archive"]) == (0, 1)
    client = docker_api.client()
    try:
        s = DockerSandbox(SandboxRef("docker", ctr.name), None, client=client, prefer_host_root=False)
        s.extract("/workspace/big", store, "files/big", max_bytes=2 * BIG)
        assert (s.stats["host_root"], s.stats["archive"]) == (0, 1)
    finally:
        client.close()


def test_cap_holds(sb, store):
    with pytest.raises(TooLarge):
        sb.extract("/workspace/big", store, "files/big", max_bytes=BIG - 1)
    assert stored(store) == []


def test_hard_link_refused(sb, ctr, store):
    assert ctr.exec_run(["busybox", "ln", "/workspace/outside/secret", "/workspace/d/hl"]).exit_code == 0
    try:
        with pytest.raises(UnsafePath, match="hard links"):
            sb.extract("/workspace/d/hl", store, "files/hl", max_bytes=2 * BIG)
        assert stored(store) == []
    finally:
        ctr.exec_run(["busybox", "rm", "-f", "/workspace/d/hl"])


def test_link_swapped_in_after_the_walk_is_never_followed(sb, ctr, store, monkeypatch):
    """The path is a plain file when the engine stats it, a link to another
    file by the open: openat2 follows no link, the archive API refuses it."""
    assert ctr.exec_run(["busybox", "cp", "/workspace/big", "/workspace/d/swap"]).exit_code == 0
    real = hostroot.open_in_container

    def swapped(pid_of, path, **kw):
        assert ctr.exec_run(["sh", "-c", "rm -f /workspace/d/swap && ln -s ../outside/secret /workspace/d/swap"]
                            ).exit_code == 0
        got = real(pid_of, path, **kw)
        assert got is None  # not followed
        return got

    monkeypatch.setattr("adapters.sandboxes.docker.hostfs.open_in_container", swapped)
    try:
        with pytest.raises((UnsafePath, SandboxGone)):
            sb.extract("/workspace/d/swap", store, "files/swap", max_bytes=2 * BIG)
        assert stored(store) == [] and sb.stats["host_root"] == 0
    finally:
        ctr.exec_run(["busybox", "rm", "-f", "/workspace/d/swap"])


def test_fifo_swapped_in_is_not_waited_on(sb, ctr):
    """A FIFO where the file was: opened without blocking, refused by type."""
    assert ctr.exec_run(["busybox", "mkfifo", "/workspace/d/fifo"]).exit_code == 0
    try:
        st = sb._stat("/workspace/d/fifo")  # the engine's own stat of it: only its type differs
        assert st is not None and sb._live_pid()
        assert hostroot.open_in_container(sb._live_pid, "/workspace/d/fifo", size=0, expect=st) is None
    finally:
        ctr.exec_run(["busybox", "rm", "-f", "/workspace/d/fifo"])


def test_another_file_than_the_engine_stat_is_not_read(sb):
    st = sb._stat("/workspace/big")
    assert st is not None and hostroot.engine_mtime_ns(st["mtime"]) is not None
    ok = hostroot.open_in_container(sb._live_pid, "/workspace/big", size=BIG, expect=st)
    assert ok is not None
    os.close(ok[0])
    for other in ({**st, "mtime": "2001-01-01T00:00:00.5Z"}, {**st, "mode": st["mode"] ^ 0o100}):
        assert hostroot.open_in_container(sb._live_pid, "/workspace/big", size=BIG, expect=other) is None
    assert hostroot.open_in_container(sb._live_pid, "/workspace/big", size=BIG - 1, expect=st) is None


def test_pid_that_is_not_the_containers_is_refused(sb):
    """The engine naming another pid after the root was opened (a pid reused
    meanwhile) makes the channel step aside."""
    st = sb._stat("/workspace/big")
    pids = iter([sb._live_pid(), os.getpid()])
    assert hostroot.open_in_container(lambda: next(pids), "/workspace/big", size=BIG, expect=st) is None
    assert hostroot.open_in_container(lambda: None, "/workspace/big", size=BIG, expect=st) is None


def test_file_changing_while_copied_is_not_stored(sb, ctr, store, monkeypatch):
    """The descriptor's size or times changing during the copy: FileChanging, nothing stored."""
    real_put_fd = VolumeStore.put_fd

    def growing(self, key, fd, **kw):
        info = real_put_fd(self, key, fd, **kw)
        assert ctr.exec_run(["sh", "-c", "echo more >> /workspace/d/grow"]).exit_code == 0
        return info

    assert ctr.exec_run(["busybox", "cp", "/workspace/big", "/workspace/d/grow"]).exit_code == 0
    monkeypatch.setattr(VolumeStore, "put_fd", growing)
    try:
        with pytest.raises(FileChanging):
            sb.extract("/workspace/d/grow", store, "files/grow", max_bytes=2 * BIG + MB)
        assert stored(store) == []
    finally:
        ctr.exec_run(["busybox", "rm", "-f", "/workspace/d/grow"])


def test_engine_mtime_parsing():
    assert hostroot.engine_mtime_ns("1970-01-01T00:00:01.000000002Z") == 1_000_000_002
    assert hostroot.engine_mtime_ns("1970-01-01T01:00:01.5+01:00") == 1_500_000_000
    for bad in (None, 5, "", "yesterday", "1970-01-01T00:00:01", "1970-01-01T00:00:01.1234567890Z"):
        assert hostroot.engine_mtime_ns(bad) is None
