"""SshSandbox against a real OpenSSH server on 127.0.0.1 (tests/fixtures/sshd.py).

Both channels: paramiko SFTP (default) and the OpenSSH client over a
ControlMaster socket (`use_openssh=True`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from adapters.errors import FileMissing, SandboxGone, UnsafePath
from adapters.sandboxes.base import PathPolicy, SandboxRef
from adapters.sandboxes.ssh import FileChanged, SshAccessDenied, SshSandbox, close_pool
from storage.volume import VolumeStore
from tests.fixtures._files import InterruptingStore, assert_store_empty, make_area, sha256_file, write_random
from tests.fixtures.services import wait_until

MODES = ["sftp", "openssh"]
BIG = 50 * 1000 * 1000
HOSTILE = [
    "with space.txt", "quote'single.txt", 'quote"double.txt', "$(touch PWNED).txt", "`touch PWNED`.txt",
    "new\nline.txt", "-rf", "semi;colon&amp|pipe.txt", "back\\slash*?.txt", "trailing newline\n",
]


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    """root/ (the allowed root) with files of every size; outside/ beside it."""
    return make_area(tmp_path_factory.mktemp("sshsb"), BIG)


@pytest.fixture(scope="module", autouse=True)
def _close_connections():
    yield
    close_pool()


@pytest.fixture(scope="module")
def control_dir(sshd_server):
    d = tempfile.mkdtemp(prefix="cm", dir="/tmp")  # ControlPath must stay short
    yield d
    make(sshd_server, None, "openssh", d).close()  # the master shared by this module's tests
    shutil.rmtree(d, ignore_errors=True)


def stored_sha(store, info) -> str:
    """The sha256 of an extracted blob: the one computed on the way, else (an
    OpenSSH transfer spliced into a volume hashes nothing) of the stored file."""
    assert info.sha256 is None or info.sha256 == sha256_file(store.local_path(info.key))
    return info.sha256 or sha256_file(store.local_path(info.key))


def make(sshd, root: Path | None, mode: str = "sftp", control_dir: str | None = None, home: Path | None = None,
         **kw) -> SshSandbox:
    roots = (str(root),) if root else ()
    ref = SandboxRef("ssh", sshd.host, roots=roots, options={"user": sshd.user, "port": str(sshd.port)})
    opts = dict(key_path=sshd.key_path, known_hosts=sshd.known_hosts, use_openssh=mode == "openssh",
                control_dir=control_dir)
    opts.update(kw)
    return SshSandbox(ref, PathPolicy(roots=roots, home=str(home) if home else None), **opts)


@pytest.fixture(params=MODES)
def sb(request, sshd_server, area, control_dir):
    s = make(sshd_server, area["root"], request.param, control_dir)
    yield s
    s.close()


# -- extraction ----------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_default_roots_and_denylist(sshd_server, area, control_dir, store, mode):
    """No roots given: /workspace, /tmp and the remote home (root: /root, denylisted)."""
    s = make(sshd_server, None, mode, control_dir)
    info = s.extract(str(area["root"] / "one_kb.bin"), store, "files/ok")  # under /tmp
    assert stored_sha(store, info) == area["sums"]["one_kb.bin"]
    for path in ("/etc/passwd", "/root/.ssh/authorized_keys", "/proc/self/environ",
                 f"{os.path.expanduser('~')}/.ssh/nothing-here"):
        with pytest.raises(UnsafePath):
            s.extract(path, store, "files/no")
    assert [b.key for b in store.list()] == ["files/ok"]


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("mode", ["sftp", "openssh", "readlink"])
def test_hostile_names(sshd_server, area, control_dir, store, tmp_path, mode, name):
    """Names with spaces, quotes, $(), backticks, newlines and a leading dash
    reach the remote shell only quoted: bytes identical and nothing executed."""
    d = Path(tempfile.mkdtemp(dir=area["root"]))
    src = d / name
    want = write_random(src, 4096)
    s = make(sshd_server, area["root"], "openssh" if mode == "openssh" else "sftp", control_dir)
    if mode == "readlink":
        s.trust_sftp_realpath = False  # resolve with `readlink -f` over exec
    info = s.extract(str(src), store, "files/h")
    assert stored_sha(store, info) == want
    s.put(store, "files/h", str(d / ("copy " + name)))
    assert sha256_file(d / ("copy " + name)) == want
    assert not list(Path("/").glob("PWNED*")) and not list(Path.home().glob("PWNED*"))
    assert sorted(os.listdir(d)) == sorted([name, "copy " + name])


@pytest.mark.parametrize("mode", ["sftp", "openssh", "readlink"])
def test_name_too_long_is_missing(sshd_server, area, control_dir, store, mode):
    """A name over NAME_MAX (and a path over PATH_MAX) names no file: FileMissing
    with a reason that says so, as on every other backend (SFTP servers answer
    a generic failure for it)."""
    s = make(sshd_server, area["root"], "openssh" if mode == "openssh" else "sftp", control_dir)
    if mode == "readlink":
        s.trust_sftp_realpath = False  # resolve with `readlink -f` over exec
    for path in (str(area["root"] / ("n" * 300)), str(area["root"]) + "/d" * 2100 + "/f"):
        with pytest.raises(FileMissing, match="too long" if mode == "sftp" else "no such file"):
            s.extract(path, store, "files/x")
    assert [b.key for b in store.list()] == []


# -- host keys and auth --------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_unknown_host_key_rejected(sshd_server, area, control_dir, store, tmp_path, mode):
    other = tmp_path / "other_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"[127.0.0.1]:{sshd_server.port} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    cdir = tempfile.mkdtemp(prefix="cm", dir="/tmp")
    try:
        for kh in (wrong, empty):
            s = make(sshd_server, area["root"], mode, cdir, known_hosts=str(kh))
            with pytest.raises(SshAccessDenied, match="host key"):
                s.extract(str(area["root"] / "one_kb.bin"), store, "files/x")
        assert empty.read_text() == ""  # never added
    finally:
        shutil.rmtree(cdir, ignore_errors=True)
    assert_store_empty(store)


@pytest.mark.parametrize("mode", MODES)
def test_auth_failure_is_clear(sshd_server, area, store, tmp_path, mode):
    stranger = tmp_path / "stranger_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    cdir = tempfile.mkdtemp(prefix="cm", dir="/tmp")
    try:
        s = make(sshd_server, area["root"], mode, cdir, key_path=str(stranger))
        with pytest.raises(SshAccessDenied, match="authentication failed"):
            s.extract(str(area["root"] / "one_kb.bin"), store, "files/x")
    finally:
        shutil.rmtree(cdir, ignore_errors=True)


def test_connection_refused_is_gone(sshd_server, area, store):
    from tests.fixtures.services import free_port

    s = make(sshd_server, area["root"])
    s.port = free_port()
    with pytest.raises(SandboxGone):
        s.extract(str(area["root"] / "one_kb.bin"), store, "files/x")


# -- connection reuse ---------------------------------------------------------------
def test_connection_reused_and_reopened(sshd_server, area, store):
    close_pool()
    s = make(sshd_server, area["root"])
    s.extract(str(area["root"] / "one_kb.bin"), store, "files/a")
    t1 = s.transport()
    s.extract(str(area["root"] / "empty.bin"), store, "files/b")
    assert s.transport() is t1
    sock = t1.sock
    assert sock.getsockopt(__import__("socket").IPPROTO_TCP, __import__("socket").TCP_NODELAY)
    # a second sandbox object for the same user/host/port shares it
    assert make(sshd_server, area["root"]).transport() is t1
    t1.close()
    s.extract(str(area["root"] / "one_kb.bin"), store, "files/c")  # dead transport: reconnect
    assert s.transport() is not t1 and s.transport().is_active()


def test_openssh_control_master(sshd_server, area, store):
    cdir = tempfile.mkdtemp(prefix="cm", dir="/tmp")
    s = make(sshd_server, area["root"], "openssh", cdir)
    try:
        s.extract(str(area["root"] / "one_kb.bin"), store, "files/a")
        sockets = [p for p in os.listdir(cdir) if p.startswith("cm-")]
        assert len(sockets) == 1
        before = set(sshd_server.session_pids())
        for i in range(3):
            s.extract(str(area["root"] / "one_kb.bin"), store, f"files/b{i}")
        assert os.listdir(cdir) == sockets  # the same master served them
        # no new connections: no session appeared (counting them raced with
        # connections of earlier tests still ending: "assert 3 == 4")
        assert set(sshd_server.session_pids()) - before == set()
    finally:
        s.close()
        wait_until(lambda: not os.listdir(cdir), timeout_s=10, what="control master exit")
        shutil.rmtree(cdir, ignore_errors=True)


# -- the sandbox vanishing mid-transfer ------------------------------------------------
def test_transport_closed_mid_transfer(sshd_server, area, tmp_path):
    s = make(sshd_server, area["root"])
    t = s.transport()
    store = InterruptingStore(tmp_path / "store", t.close)
    with pytest.raises(SandboxGone) as err:
        s.extract(str(area["root"] / "big.bin"), store, "files/big")
    assert not isinstance(err.value, FileChanged), err.value
    assert store.chunks >= 1
    assert_store_empty(store)
    assert s.transport() is not t  # the next use reconnects


@pytest.mark.parametrize("mode", MODES)
def test_sshd_session_killed_mid_transfer(sshd_server, area, tmp_path, mode):
    cdir = tempfile.mkdtemp(prefix="cm", dir="/tmp")
    s = make(sshd_server, area["root"], mode, cdir)
    try:
        s.resolve(str(area["root"] / "empty.bin"))  # connection (or master) up

        killed = []

        def kill_sessions():
            for pid in sshd_server.session_pids():
                try:  # an earlier test's session may be exiting as we list them
                    os.kill(pid, 9)
                    killed.append(pid)
                except ProcessLookupError:
                    pass

        store = InterruptingStore(tmp_path / "store", kill_sessions)
        with pytest.raises(SandboxGone) as err:
            s.extract(str(area["root"] / "big.bin"), store, "files/big")
        assert "connection" in str(err.value), err.value
        assert store.chunks >= 1 and killed
        assert_store_empty(store)
        # and it recovers on the next call
        s2 = VolumeStore(tmp_path / "s2")
        info = s.extract(str(area["root"] / "one_kb.bin"), s2, "files/ok")
        assert stored_sha(s2, info) == area["sums"]["one_kb.bin"]
    finally:
        s.close()
        shutil.rmtree(cdir, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_file_changed_mid_transfer(sshd_server, area, control_dir, tmp_path, mode):
    src = area["root"] / f"growing-{mode}.bin"
    write_random(src, 8 * 1024 * 1024)

    def grow():
        with open(src, "ab") as f:
            f.write(b"more")
        os.utime(src, (1, 1))

    s = make(sshd_server, area["root"], mode, control_dir)
    store = InterruptingStore(tmp_path / "store", grow)
    # sftp re-stats (size, mtime); OpenSSH mode counts bytes against the size
    with pytest.raises(FileChanged if mode == "sftp" else SandboxGone):
        s.extract(str(src), store, "files/g")
    assert_store_empty(store)


# -- inbound ------------------------------------------------------------------------
def test_wiring_builds_ssh_sandbox(sshd_server, area, store):
    from adapters.sandboxes.base import parse_uri
    from workers.settings import Settings
    from workers.wiring import open_sandbox

    s = Settings(ssh_key_path=sshd_server.key_path, ssh_known_hosts=sshd_server.known_hosts)
    ref, path = parse_uri(f"ssh://{sshd_server.user}@{sshd_server.host}:{sshd_server.port}{area['root']}/one_kb.bin")
    sb = open_sandbox(ref, s)
    assert isinstance(sb, SshSandbox) and not sb.use_openssh
    assert sb.extract(path, store, "files/w").sha256 == area["sums"]["one_kb.bin"]
    with pytest.raises(UnsafePath):  # default roots: /workspace, /tmp, home (/root is denylisted)
        sb.extract("/etc/hostname", store, "files/no")


@pytest.mark.parametrize("mode", MODES)
def test_store_failure_mid_transfer_leaves_connection_usable(sshd_server, area, control_dir, tmp_path, mode):
    """The consumer stopping early (storage full) ends the read-ahead thread and
    the transfer; the pooled connection keeps working."""
    from adapters.errors import StorageError

    def disk_full():
        raise StorageError("disk full")

    s = make(sshd_server, area["root"], mode, control_dir)
    s.resolve(str(area["root"] / "empty.bin"))
    threads = threading.active_count()
    store = InterruptingStore(tmp_path / "store", lambda: None)
    real = store.put_stream

    def failing_put(key, src, **kw):
        def chunks():
            for i, chunk in enumerate(src):
                if i == 1:
                    disk_full()
                yield chunk
        return real(key, chunks(), **kw)

    store.put_stream = failing_put
    real_pipe = store.put_pipe

    def failing_pipe(key, fd, *, wait=None, **kw):  # the OpenSSH channel splices into the volume
        calls = []

        def failing_wait():
            if wait is not None:
                wait()
            calls.append(1)
            if len(calls) == 2:
                disk_full()
        return real_pipe(key, fd, wait=failing_wait, **kw)

    store.put_pipe = failing_pipe
    with pytest.raises(StorageError):
        s.extract(str(area["root"] / "big.bin"), store, "files/big")
    assert_store_empty(store)
    wait_until(lambda: threading.active_count() <= threads, timeout_s=10, what="read-ahead thread exit")
    t = s.transport() if mode == "sftp" else None
    s2 = VolumeStore(tmp_path / "s2")
    info = s.extract(str(area["root"] / "one_kb.bin"), s2, "files/ok")
    assert stored_sha(s2, info) == area["sums"]["one_kb.bin"]
    if t is not None:
        assert s.transport() is t


def test_socket_error_mid_stream_is_gone_not_storage(sshd_server, area, tmp_path, monkeypatch):
    """An OSError from the sandbox side raised inside put_stream (within the
    store's write) must still read as SandboxGone, never as a StorageError."""
    from adapters.sandboxes.ssh import sftp as sftp_mod  # where _stream_sftp looks the pipeline up

    real = sftp_mod._sftp_pipeline
    s = make(sshd_server, area["root"])

    def dying(sftp, *a, **kw):
        it = real(sftp, *a, **kw)
        yield next(it)
        s.transport().close()
        raise OSError("Socket is closed")

    monkeypatch.setattr(sftp_mod, "_sftp_pipeline", dying)
    store = VolumeStore(tmp_path / "store")
    with pytest.raises(SandboxGone):
        s.extract(str(area["root"] / "big.bin"), store, "files/big")
    assert_store_empty(store)


def test_fast_pipe_keeps_bytes_and_order():
    """The channel buffer replacing paramiko's: any feed and read sizes give
    back the same bytes, in order; timeouts and close behave like paramiko's."""
    import random

    from paramiko.buffered_pipe import PipeTimeout

    from adapters.sandboxes.ssh import _fast_pipe_class

    rnd = random.Random(7)
    pipe = _fast_pipe_class()()
    data = os.urandom(3 * 1024 * 1024)
    i = 0
    while i < len(data):
        n = rnd.choice([1, 4, 13, 4096, 32768, 262144, 300000])
        pipe.feed(data[i:i + n])
        i += n
    assert len(pipe) == len(data) and pipe.read_ready()
    out = bytearray()
    while len(out) < len(data):
        out += pipe.read(rnd.choice([1, 4, 5, 1000, 65536, 261120, 10 ** 6]))
    assert bytes(out) == data and len(pipe) == 0 and not pipe.read_ready()
    with pytest.raises(PipeTimeout):
        pipe.read(10, timeout=0.01)
    pipe.feed(b"tail")
    assert pipe.empty() == b"tail"
    pipe.close()
    assert pipe.read(10) == b""


# -- the gated stream script (OpenSSH mode: resolve and stream in one run) -----------------
def _gated(path: Path, line: bytes | None) -> tuple[int, bytes]:
    """GATED_STREAM_SCRIPT under a local sh (dash + coreutils, as on ssh hosts),
    `line` written to its stdin (None: stdin closed at once)."""
    from adapters.sandboxes.execstream import GATED_STREAM_SCRIPT

    res = subprocess.run(["sh", "-c", GATED_STREAM_SCRIPT, "sh", str(path), "cat"], input=line or b"",
                         capture_output=True, timeout=30)
    return res.returncode, res.stdout


def test_gated_script_streams_only_after_go(tmp_path):
    data = os.urandom(300_000)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    def answer() -> bytes:  # the resolve's: HOME, the path, its type, its size, links and version
        from adapters.sandboxes.execstream import VERSION_FORMAT

        version = subprocess.run(["stat", "-c", VERSION_FORMAT, "--", str(f)], capture_output=True,
                                 check=True).stdout.rstrip(b"\n")
        return f"{os.environ.get('HOME', '')}\0{f}\0f\0".encode() + version + b"\0"

    head = answer()
    assert head.split(b"\0")[3].startswith(f"{len(data)} 1 ".encode())
    assert _gated(f, None) == (99, head)  # refused (stdin closed): the answer, not a byte of the file
    assert _gated(f, b"stop\n") == (99, head)
    assert _gated(f, b"go\n") == (0, head + data)
    os.link(f, tmp_path / "other-name")
    head = answer()
    assert head.split(b"\0")[3].startswith(f"{len(data)} 2 ".encode())
    rc, out = _gated(f, b"go\n")  # two names: refused unless the caller allows links there
    assert (rc, out) == (15, head)
    assert _gated(f, b"go 1\n") == (0, head + data)
    # missing: the resolve's answer (what the name would be, for the policy's existence-blind
    # refusal) and nothing streamed
    home = os.environ.get("HOME", "").encode()
    assert _gated(tmp_path / "missing", b"go\n") == (2, home + b"\0" + str(tmp_path / "missing").encode())
