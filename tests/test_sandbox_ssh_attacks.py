"""SshSandbox against an agent that attacks (real OpenSSH server on 127.0.0.1):
what the attack table (tests/attacks/) does not cover — deterministic swaps
between check and open, the kill of a blocked stream run, a remote that
stops reading stdin.

Each test states what must hold. The "remote" host is this machine, so the
agent's moves (a FIFO swap, ...) are made with local file operations.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from adapters.errors import SandboxGone, UnsafePath
from adapters.sandboxes.base import ReadTimeout
from adapters.sandboxes.execstream import exec_iter_file
from adapters.sandboxes.ssh import close_pool
from tests.fixtures._exec import start_streams_at_the_open
from tests.fixtures.services import bounded, wait_until
from tests.test_sandbox_ssh import make

MODES = ["sftp", "openssh"]


@pytest.fixture(scope="module", autouse=True)
def _close_connections():
    yield
    close_pool()


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    os.chmod(tmp_path, 0o755)
    return r


@pytest.fixture
def control_dir():
    d = tempfile.mkdtemp(prefix="cm", dir="/tmp")  # ControlPath must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _runs_with_env(entry: str) -> list[int]:
    """Pids of processes on this host whose environment holds `entry` (NAME=value)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry.encode() in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


# -- 2/3. a stalled remote never holds the worker: every read has a deadline ------------


def test_openssh_fifo_open_is_killed_after_the_deadline(sshd_server, root, control_dir):
    """The stream script blocked opening a FIFO (what a swap after its type
    test leaves) is ended by the read deadline and killed on the host by its
    run id: nothing is left blocked behind."""
    fifo = root / "pipe"
    os.mkfifo(fifo)
    s = make(sshd_server, root, "openssh", control_dir, io_timeout_s=2)
    ch = s._openssh()
    seen = start_streams_at_the_open(ch)
    try:
        _res, exc, took = bounded(lambda: b"".join(exec_iter_file(ch, str(fifo))), 20,
                                  unblock=lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))
        assert isinstance(exc, ReadTimeout), exc
        assert len(seen) == 1
        wait_until(lambda: not _runs_with_env(seen[0]), timeout_s=10, what="the blocked stream run to be killed")
    finally:
        s.close()


# -- 5. TOCTOU (paramiko): a link swapped in for the open and out before the re-check ----------
class _OpenHook:
    """The real SFTPClient; `after_open()` runs right after each open (the agent's move)."""

    def __init__(self, sftp, after_open) -> None:
        self._sftp, self._after_open = sftp, after_open

    def __getattr__(self, name):
        return getattr(self._sftp, name)

    def open(self, *a, **kw):
        f = self._sftp.open(*a, **kw)
        self._after_open()
        return f


def test_sftp_link_swapped_for_the_open_only_is_refused(sshd_server, tmp_path, store):
    """The agent swaps root/d for a link to a directory it cannot otherwise
    reach right after the resolve, and back right after the open, with the
    target's size and mtime matched: the bytes would be the other file's
    (old code: 30 of 400 races delivered /etc/shadow). The open handle's
    owner / mode differ from the checked file's: refused, nothing stored."""
    os.chmod(tmp_path, 0o755)
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    legit, secret = root / "d" / "f.txt", outside / "f.txt"
    legit.write_bytes(b"legit content!!\n")
    secret.write_bytes(b"SECRET content!\n")
    os.chown(secret, 0, 65534)   # a file of another group, with another mode
    os.chmod(secret, 0o640)
    os.utime(secret, ns=(legit.stat().st_atime_ns, legit.stat().st_mtime_ns))
    parked = tmp_path / "root" / "d.real"

    def swap_in():
        os.rename(root / "d", parked)
        os.symlink(outside, root / "d")

    def swap_back():
        os.unlink(root / "d")
        os.rename(parked, root / "d")

    s = make(sshd_server, root, "sftp")

    class Racing(type(s)):
        def _resolve_sftp(self, sftp, path):
            out = super()._resolve_sftp(sftp, path)
            swap_in()
            return out

        def _stream_sftp(self, sftp, resolved, st0):
            return super()._stream_sftp(_OpenHook(sftp, swap_back), resolved, st0)

    s.__class__ = Racing
    with pytest.raises((UnsafePath, SandboxGone)):
        s.extract(str(legit), store, "files/x")
    assert [b.key for b in store.list()] == []


# -- 8. hard links ------------------------------------------------------------------------------


# -- 9. a ControlMaster never outlives a change of trust ------------------------------------------


def test_openssh_remote_that_stops_reading_stdin_times_out(sshd_server, root, control_dir):
    """An upload to a remote command that never reads: the write has a
    deadline too (old code: blocked until the command ended)."""
    s = make(sshd_server, root, "openssh", control_dir, io_timeout_s=2)
    try:
        ch = s._openssh()
        chunks = (b"\0" * (1 << 20) for _ in range(64))
        _res, exc, took = bounded(lambda: ch.exec_stdin(["sleep", "25"], chunks), 20)
        assert isinstance(exc, ReadTimeout), exc
        assert took < 10
    finally:
        s.close()


