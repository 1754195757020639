"""ModalSandbox against a stand-in for the modal SDK's Sandbox object.

Modal's cloud is unreachable from here, so these tests replace `modal.Sandbox`
(the SDK boundary; the real `modal` package and its exception classes stay)
with `FakeSandbox`, which has the same methods the backend calls:
`from_id(id)`, `open(path, mode)` (the file API of the SDKs that have one),
`exec(*argv, text=False)` returning a process with `.stdout` / `.stderr`
(iterables of byte chunks), `.stdin` (`write` / `drain` / `write_eof`),
`.wait()` and `.returncode`, and `terminate()`. Its "sandbox filesystem" is
a local directory tree and its exec runs the real command (argv, no shell)
on this machine, so resolve, streaming `cat` and the put scripts run for
real. Variants: with the file API, without it (modal 1.x has no
`Sandbox.open`), and with a file API that fails (exec fallback).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.services import bounded, need  # noqa: E402

try:
    import modal
except ImportError:  # laptop: skip; CI: fail (need)
    modal = None

from adapters.errors import ConfigError, FileChanging, SandboxGone, TooLarge, UnsafePath  # noqa: E402
from adapters.sandboxes import modal as modal_backend  # noqa: E402
from adapters.sandboxes.base import PathPolicy, SandboxRef  # noqa: E402
from adapters.sandboxes.modal import INSTALL_HINT, ModalSandbox  # noqa: E402
from tests.fixtures._files import InterruptingStore, assert_store_empty, make_area, write_random  # noqa: E402

BIG = 50 * 1000 * 1000
VARIANTS = ["file_api", "exec_only", "file_api_fails"]


# -- the stand-in ---------------------------------------------------------------------
class _Stream:
    def __init__(self, pipe, box: "FakeSandbox") -> None:
        self.pipe, self.box = pipe, box

    def __iter__(self):
        while True:
            self.box.check_alive()
            data = os.read(self.pipe.fileno(), 256 * 1024)
            if not data:
                return
            yield data

    def read(self) -> bytes:
        return b"".join(self)


class _Stdin:
    def __init__(self, pipe, box: "FakeSandbox") -> None:
        self.pipe, self.box = pipe, box

    def write(self, data: bytes) -> None:
        self.box.check_alive()
        self.pipe.write(data)

    def drain(self) -> None:
        if not self.pipe.closed:
            self.pipe.flush()

    def write_eof(self) -> None:
        self.pipe.close()


class FakeProcess:
    def __init__(self, argv, box: "FakeSandbox") -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout, self.stderr = _Stream(self.proc.stdout, box), _Stream(self.proc.stderr, box)
        self.stdin = _Stdin(self.proc.stdin, box)
        self.returncode: int | None = None

    def wait(self) -> int:
        self.returncode = self.proc.wait()
        for p in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if not p.closed:
                p.close()
        return self.returncode

    def poll(self):
        return self.proc.poll()


class _FakeFile:
    def __init__(self, f, box: "FakeSandbox") -> None:
        self.f, self.box = f, box

    def read(self, n: int = -1) -> bytes:
        self.box.check_alive()
        return self.f.read(n)

    def write(self, data: bytes) -> int:
        self.box.check_alive()
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class FakeSandbox:
    """modal.Sandbox stand-in (with the file API)."""

    registry: dict[str, "FakeSandbox"] = {}
    from_id_calls = 0

    def __init__(self, sandbox_id: str, open_fails: bool = False) -> None:
        self.object_id = sandbox_id
        self.open_fails = open_fails
        self.terminated = False
        self.procs: list[FakeProcess] = []
        self.opened: list[str] = []
        self.execs: list[list[str]] = []

    @classmethod
    def from_id(cls, sandbox_id: str, client=None):
        FakeSandbox.from_id_calls += 1
        box = FakeSandbox.registry.get(sandbox_id)
        if box is None or box.terminated:
            raise modal.exception.NotFoundError(f"Sandbox {sandbox_id} not found")
        return box

    def check_alive(self) -> None:
        if self.terminated:
            raise modal.exception.SandboxTerminatedError("Sandbox was terminated")

    def terminate(self) -> None:
        self.terminated = True
        for p in self.procs:  # the sandbox's processes die with it
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()

    def exec(self, *argv: str, text: bool = True, **kw):
        assert text is False, "binary streams need text=False"
        assert all(isinstance(a, str) for a in argv)
        self.check_alive()
        self.execs.append(list(argv))
        p = FakeProcess(list(argv), self)
        self.procs.append(p)
        return p

    def open(self, path: str, mode: str = "r"):
        self.check_alive()
        if self.open_fails:
            raise modal.exception.SandboxFilesystemError("file API unavailable")
        self.opened.append(path)
        return _FakeFile(builtins.open(path, mode), self)


class FakeSandboxNoFileApi(FakeSandbox):
    """Like modal 1.x: no `Sandbox.open`."""

    def __getattribute__(self, name):
        if name == "open":
            raise AttributeError(name)
        return super().__getattribute__(name)


# -- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def area(tmp_path_factory):
    return make_area(tmp_path_factory.mktemp("modalsb"), BIG, etc_link=False)


@pytest.fixture(autouse=True)
def fake_sdk(monkeypatch):
    """Replace modal.Sandbox at the SDK boundary (and forget cached handles)."""
    need(modal is not None, "the modal SDK is not installed (pip install modal)")
    monkeypatch.setattr(modal, "Sandbox", FakeSandbox)
    FakeSandbox.registry.clear()
    FakeSandbox.from_id_calls = 0
    modal_backend.forget_handles()
    yield
    modal_backend.forget_handles()


def make_box(variant: str, sid: str = "sb-test") -> FakeSandbox:
    box = (FakeSandboxNoFileApi(sid) if variant == "exec_only"
           else FakeSandbox(sid, open_fails=variant == "file_api_fails"))
    FakeSandbox.registry[sid] = box
    return box


def make(area, sid: str = "sb-test", home: Path | None = None) -> ModalSandbox:
    ref = SandboxRef("modal", sid, roots=(str(area["root"]),))
    policy = PathPolicy(roots=(str(area["root"]),), home=str(home) if home else None)
    return ModalSandbox(ref, policy)


# -- extraction ----------------------------------------------------------------------------
def test_default_roots_and_denylist(area, store):
    """No roots: /workspace, /tmp and $HOME (here /root: denylisted, so not a root)."""
    make_box("file_api")
    sb = ModalSandbox(SandboxRef("modal", "sb-test"), None)
    assert sb.extract(str(area["root"] / "one_kb.bin"), store, "files/ok").sha256 == area["sums"]["one_kb.bin"]
    for path in ("/etc/passwd", "/root/.ssh/authorized_keys", "/proc/self/environ"):
        with pytest.raises(UnsafePath):
            sb.extract(path, store, "files/no")
    assert [b.key for b in store.list()] == ["files/ok"]


def test_handle_reused(area, store):
    make_box("file_api")
    a = make(area)
    a.extract(str(area["root"] / "one_kb.bin"), store, "files/a")
    a.extract(str(area["root"] / "empty.bin"), store, "files/b")
    b = make(area)
    b.extract(str(area["root"] / "one_kb.bin"), store, "files/c")
    assert FakeSandbox.from_id_calls == 1
    assert a.handle() is b.handle()


def test_unknown_sandbox_is_gone(area, store):
    with pytest.raises(SandboxGone):
        make(area, sid="sb-nope").extract(str(area["root"] / "one_kb.bin"), store, "files/x")


def test_sdk_missing_has_an_install_hint(area, store, monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # import modal -> ImportError
    with pytest.raises(ConfigError, match="pip install"):
        make(area).extract(str(area["root"] / "one_kb.bin"), store, "files/x")
    assert "modal" in INSTALL_HINT


@pytest.mark.parametrize("variant", VARIANTS)
def test_terminated_mid_transfer(area, tmp_path, variant):
    box = make_box(variant)
    store = InterruptingStore(tmp_path / "store", box.terminate)
    sb = make(area)
    with pytest.raises(SandboxGone):
        sb.extract(str(area["root"] / "big.bin"), store, "files/big")
    assert store.chunks >= 1
    assert_store_empty(store)
    with pytest.raises(SandboxGone):  # the cached handle was dropped; from_id now says gone
        make(area).extract(str(area["root"] / "one_kb.bin"), store, "files/x")


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_growing_mid_transfer(area, tmp_path, variant):
    src = area["root"] / f"growing-{variant}.bin"
    write_random(src, 4 * 1024 * 1024)
    make_box(variant)

    def grow():
        with open(src, "ab") as f:
            f.write(b"more")

    store = InterruptingStore(tmp_path / "store", grow)
    with pytest.raises(SandboxGone):
        make(area).extract(str(src), store, "files/g")
    assert_store_empty(store)


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_rewritten_in_place_mid_transfer(area, tmp_path, variant):
    """The same size, other bytes, while it is read: FileChanging (read again
    later), nothing stored; the file API included (its stat is asked by
    exec before the first byte and after the last)."""
    src = area["root"] / f"rewritten-{variant}.bin"
    src.write_bytes(b"a" * (4 * 1024 * 1024))
    past = time.time_ns() - 2_000_000_000  # written a while ago: the rewrite's mtime differs at any granularity
    os.utime(src, ns=(past, past))
    make_box(variant)

    def rewrite():
        with open(src, "r+b") as f:
            f.write(b"b" * (4 * 1024 * 1024))

    store = InterruptingStore(tmp_path / "store", rewrite, streamed=True)
    with pytest.raises(FileChanging):
        make(area).extract(str(src), store, "files/r")
    assert_store_empty(store)
    store.after_first = lambda: None  # the writer is done: the new version, whole
    make(area).extract(str(src), store, "files/r")
    assert store.local_path("files/r").read_bytes() == src.read_bytes()


# -- inbound ----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["file_api", "exec_only"])
def test_put_over_cap_and_interrupted(area, store, variant):
    box = make_box(variant)
    store.put_bytes("files/in", b"x" * 100)
    inbox = area["root"] / f"capped-{variant}"
    inbox.mkdir(exist_ok=True)
    with pytest.raises(TooLarge):
        make(area).put(store, "files/in", str(inbox / "capped.bin"), max_bytes=99)
    # the sandbox vanishing during the upload never publishes the file (a
    # temp may stay behind in the stand-in; a real terminated sandbox is gone)
    store.put_bytes("files/big", os.urandom(3 * 1024 * 1024))
    real_iter = store.iter_chunks

    def iter_then_terminate(key, *a, **kw):
        for i, chunk in enumerate(real_iter(key, *a, **kw)):
            if i == 1:
                box.terminate()
            yield chunk

    store.iter_chunks = iter_then_terminate
    with pytest.raises(SandboxGone):
        make(area).put(store, "files/big", str(inbox / "big.bin"))
    assert not (inbox / "big.bin").exists() and not (inbox / "capped.bin").exists()


# -- a stalled sandbox costs one attempt, never the worker ----------------------------------
def test_fifo_swapped_in_after_resolve_never_blocks(area, store, tmp_path):
    """The file API opening a FIFO put in place of the checked file blocks
    in the sandbox: the read deadline ends the attempt, nothing is stored."""
    from adapters.sandboxes.base import ReadTimeout

    make_box("file_api")
    victim = area["root"] / "fifo_swap.bin"
    victim.write_bytes(b"harmless")

    class Racing(ModalSandbox):
        def _resolve(self, path):
            out = super()._resolve(path)
            victim.unlink()
            os.mkfifo(victim)
            return out

    sb = Racing(SandboxRef("modal", "sb-test", roots=(str(area["root"]),)),
                PathPolicy(roots=(str(area["root"]),)), io_timeout_s=1)
    try:
        _res, exc, _took = bounded(lambda: sb.extract(str(victim), store, "files/x"), 12,
                                   unblock=lambda: os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK)))
        assert isinstance(exc, ReadTimeout), exc
        assert_store_empty(store)
    finally:
        with contextlib.suppress(OSError):  # the fake's open still waits: release it
            os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))
        victim.unlink()


@pytest.mark.parametrize("variant", ["file_api", "exec_only"])
def test_put_makes_the_missing_inbox(area, store, variant):
    """An attachment into <workspace>/inbox/ that does not exist yet: the
    directory is made in the sandbox (old code: FileMissing)."""
    make_box(variant)
    store.put_bytes("files/in", b"attachment")
    dest = area["root"] / f"turn-{variant}" / "inbox" / "photo.jpg"
    assert make(area).put(store, "files/in", str(dest)) == str(dest)
    assert dest.read_bytes() == b"attachment"


@pytest.mark.parametrize("variant", VARIANTS)
def test_hard_link_to_a_file_outside_the_roots_is_refused(area, store, variant):
    make_box(variant)
    hl = area["root"] / f"hl-{variant}.txt"
    os.link(area["outside"] / "secret.txt", hl)
    try:
        with pytest.raises(UnsafePath, match="hard links"):
            make(area).extract(str(hl), store, "files/x")
        assert_store_empty(store)
    finally:
        hl.unlink()


def test_exec_stdin_into_a_sandbox_that_stops_reading_times_out(area):
    """An upload through exec stdin to a command that never reads: each
    write has a deadline too (old code: blocked until the command ended)."""
    from adapters.sandboxes.base import ReadTimeout

    make_box("exec_only")
    sb = ModalSandbox(SandboxRef("modal", "sb-test", roots=(str(area["root"]),)), None, io_timeout_s=1)
    chunks = (b"\0" * (1 << 20) for _ in range(16))
    _res, exc, _took = bounded(lambda: sb.exec_channel().exec_stdin(["sleep", "20"], chunks), 12)
    assert isinstance(exc, ReadTimeout)
