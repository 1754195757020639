"""LocalSandbox: paths on the worker's own host, into a real VolumeStore."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from adapters.errors import NotAFile, UnsafePath
from adapters.sandboxes.base import PathPolicy, SandboxRef, parse_uri
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tests.fixtures._files import assert_store_empty, make_area, sha256_file
from tests.fixtures.services import bounded

BIG = 50 * 1000 * 1000


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    return make_area(tmp_path_factory.mktemp("localsb"), BIG)


@pytest.fixture
def sb(area):
    return LocalSandbox.with_roots((str(area["root"]),), home=str(area["root"]))


def test_relative_and_nul_paths_refused(sb, store):
    for bad in ("relative/path", "/tmp/a\x00b"):
        with pytest.raises(UnsafePath):
            sb.extract(bad, store, "files/x")


def test_denylist_beats_roots(store, tmp_path):
    """Even with / as a root, /etc, /proc and ~/.ssh stay unreadable."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    s = LocalSandbox.with_roots(("/",), home=str(home))
    for path in ("/etc/hostname", "/proc/self/environ", str(home / ".ssh" / "id_ed25519")):
        with pytest.raises(UnsafePath):
            s.extract(path, store, "files/x")
    assert_store_empty(store)


def test_link_swapped_after_resolve(sb, area, store, tmp_path):
    """A file replaced by a link to outside between resolve and open is refused."""
    victim = area["root"] / "swap.bin"
    victim.write_bytes(b"harmless")
    resolved, _ = sb.resolve(str(victim))
    victim.unlink()
    os.symlink(area["outside"] / "secret.txt", victim)
    with pytest.raises(UnsafePath):
        store.put_stream("files/x", sb.open_stream(resolved))
    assert_store_empty(store)


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "no-openat2"])
def test_host_open_never_opens_a_special_file(tmp_path, monkeypatch, openat2):
    """hostopen.open_regular (every host-side read): a device node and a FIFO
    are refused (NotAFile) without being opened (no open counted on their
    inodes; a FIFO's open would block), a link at the last component is
    ELOOP; with openat2, a link anywhere on the way is too; without it (an
    old kernel, a seccomp filter) it is followed, and the callers check the
    descriptor's real path. A regular file reads; `check` runs before it is
    opened for reading, and refuses it."""
    import errno
    import stat

    from adapters.sandboxes import hostopen
    from tests.fixtures._files import OpenWatch

    if not openat2:
        monkeypatch.setattr(hostopen, "_has_openat2", False)
    dev, fifo, f = tmp_path / "dev", tmp_path / "fifo", tmp_path / "f.txt"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(fifo)
    f.write_bytes(b"data")
    (tmp_path / "link").symlink_to(f)
    (tmp_path / "dirlink").symlink_to(tmp_path)
    watches = [OpenWatch(dev), OpenWatch(fifo)]
    try:
        for special in (dev, fifo):
            _res, exc, _took = bounded(lambda: hostopen.open_regular(str(special)), 10)
            assert isinstance(exc, NotAFile), exc
        assert [w.opens() for w in watches] == [0, 0]
    finally:
        for w in watches:
            w.close()
    with pytest.raises(OSError) as err:
        hostopen.open_regular(str(tmp_path / "link"))
    assert err.value.errno == errno.ELOOP
    via = str(tmp_path / "dirlink" / "f.txt")
    if openat2:
        with pytest.raises(OSError) as err:
            hostopen.open_regular(via)
        assert err.value.errno == errno.ELOOP
    else:
        fd, _st = hostopen.open_regular(via)
        assert os.readlink(f"/proc/self/fd/{fd}") == str(f)  # what the callers check
        os.close(fd)
    seen = []
    fd, st = hostopen.open_regular(str(f), check=lambda o, st: seen.append(os.readlink(f"/proc/self/fd/{o}")))
    with os.fdopen(fd, "rb") as r:
        assert r.read() == b"data" and st.st_size == 4 and seen == [str(f)]
    def refuse(fd, st):
        raise UnsafePath("refused before any open for reading")

    with pytest.raises(UnsafePath):
        hostopen.open_regular(str(f), check=refuse)


# -- inbound ---------------------------------------------------------------------------------
def test_concurrent_puts_to_one_destination(sb, area, store):
    """Two puts racing for one path: the result is one of them, whole."""
    a, b = os.urandom(3 * 1024 * 1024), os.urandom(3 * 1024 * 1024)
    store.put_bytes("files/a", a)
    store.put_bytes("files/b", b)
    dest = area["root"] / "raced.bin"
    errors = []

    def put(key):
        try:
            for _ in range(5):
                sb.put(store, key, str(dest))
        except Exception as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(k,)) for k in ("files/a", "files/b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert dest.read_bytes() in (a, b)
    assert [p for p in os.listdir(area["root"]) if "courier-part" in p] == []


def test_wiring_builds_local_sandbox(area, store, monkeypatch):
    from workers.settings import Settings
    from workers.wiring import open_sandbox

    ref, path = parse_uri(f"local://{area['root']}/one_kb.bin")
    assert ref == SandboxRef("local")
    s = Settings(local_roots=[str(area["root"])])
    open_sandbox(ref, s).extract(path, store, "files/w")
    assert sha256_file(store.local_path("files/w")) == area["sums"]["one_kb.bin"]


def test_fifo_swapped_in_after_resolve_never_blocks(sb, area, store):
    """A FIFO put in place of the checked file between resolve and open is
    refused at once (old code: open() blocked the worker until a writer came)."""
    victim = area["root"] / "fifo_swap.bin"
    victim.write_bytes(b"harmless")

    class Racing(LocalSandbox):
        def resolve(self, path):
            out = super().resolve(path)
            victim.unlink()
            os.mkfifo(victim)  # the agent's swap, right after the check
            return out

    racing = Racing(sb.ref, sb.policy)

    def unblock():
        fd = os.open(victim, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    try:
        _res, exc, _took = bounded(lambda: racing.extract(str(victim), store, "files/x"), 10.0, unblock)
        assert isinstance(exc, NotAFile), exc
        assert_store_empty(store)
    finally:
        victim.unlink()


# -- hard links and the credentials denylist ------------------------------------------------
def test_hard_link_to_a_file_outside_the_roots_is_refused(area, store, tmp_path):
    """`ln outside/secret.txt root/hl`: the same file under an allowed name.
    Refused (old code: delivered); allowed only under `links_ok` roots."""
    hl = area["root"] / "hardlink.txt"
    os.link(area["outside"] / "secret.txt", hl)
    try:
        sb = LocalSandbox.with_roots((str(area["root"]),))
        with pytest.raises(UnsafePath, match="hard links"):
            sb.extract(str(hl), store, "files/x")
        assert_store_empty(store)
        trusted = LocalSandbox(sb.ref, PathPolicy(roots=sb.policy.roots, links_ok=sb.policy.roots))
        assert trusted.extract(str(hl), store, "files/ok").size_bytes == len("secret")
    finally:
        hl.unlink()


@pytest.mark.parametrize("rel", [
    ".pgpass", ".bash_history", ".zsh_history", ".s3cfg", ".vault-token", ".netrc", ".git-credentials",
    ".cargo/credentials", ".cargo/credentials.toml", ".terraform.d/credentials.tfrc.json", ".m2/settings.xml",
    ".local/share/keyrings/login.keyring",
])
def test_home_credentials_are_never_readable(store, tmp_path, rel):
    home = tmp_path / "home"
    (home / rel).parent.mkdir(parents=True, exist_ok=True)
    (home / rel).write_text("credential")
    sb = LocalSandbox.with_roots((str(home),), home=str(home))
    with pytest.raises(UnsafePath, match="never readable"):
        sb.extract(str(home / rel), store, "files/x")
    assert_store_empty(store)


def test_put_race_loop_never_writes_outside(area, store, tmp_path):
    """300 attachments into root/inbox while the agent swaps inbox for a link
    to a directory outside the roots in a loop: each lands in the real inbox
    or is refused; nothing is ever written outside (the opened directory is
    the one checked)."""
    from adapters.errors import SandboxError

    root, outside = tmp_path / "root", tmp_path / "out"
    (root / "inbox").mkdir(parents=True)
    outside.mkdir()
    sb = LocalSandbox.with_roots((str(root),))
    store.put_bytes("in/a", b"attachment")
    parked = root / "inbox.real"
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            try:
                os.rename(root / "inbox", parked)
                os.symlink(outside, root / "inbox")
                os.unlink(root / "inbox")
                os.rename(parked, root / "inbox")
            except OSError:  # the put made a new inbox meanwhile: put the real one back
                if parked.exists():
                    with contextlib.suppress(OSError):
                        os.unlink(root / "inbox") if (root / "inbox").is_symlink() else os.rmdir(root / "inbox")
                    with contextlib.suppress(OSError):
                        os.rename(parked, root / "inbox")

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    placed = 0
    try:
        for i in range(300):
            try:
                sb.put(store, "in/a", str(root / "inbox" / f"a{i}.txt"))
                placed += 1
            except (SandboxError, FileExistsError, FileNotFoundError):
                continue
    finally:
        stop.set()
        t.join(10)
    assert os.listdir(outside) == []
    assert placed > 0


class _WriterMidCopy(VolumeStore):
    """A real volume store whose copy is joined by the agent still writing:
    the source file grows after the copy has begun (a file still being
    written when the agent named it)."""

    def __init__(self, root, source) -> None:
        super().__init__(root)
        self.source = source

    def put_fd(self, key, fd, *, max_bytes=None):
        with open(self.source, "ab") as f:
            f.write(b"more")
        return super().put_fd(key, fd, max_bytes=max_bytes)


def test_a_file_still_being_written_is_not_stored_torn(sb, area, tmp_path):
    """It was delivered truncated and marked delivered: now the torn copy is
    deleted and FileChanging (transient: read again later) raised; once the
    writer is done, it goes whole."""
    from adapters.errors import FileChanging

    p = area["root"] / "growing.log"
    p.write_bytes(b"x" * 100_000)
    store = _WriterMidCopy(tmp_path / "torn", p)
    with pytest.raises(FileChanging) as got:
        sb.extract(str(p), store, "files/j/0-growing.log")
    assert got.value.transient and not store.exists("files/j/0-growing.log")
    # the writer is done: the next attempt reads it whole
    done = sb.extract(str(p), VolumeStore(tmp_path / "whole"), "files/j/0-growing.log")
    assert done.size_bytes == 100_004
