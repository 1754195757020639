"""Sandbox.exec: one contract over every backend that runs commands.

local (this host), docker (rootful podman, busybox image), ssh (a private
sshd on loopback; paramiko and the OpenSSH client) and modal (the SDK
stand-in of tests/test_sandbox_modal.py, whose exec runs the real argv on
this host). Every sandbox has one allowed root; an existing directory
outside it is the "outside". Processes are looked for in this host's /proc
(podman's containers run on this host too).

Also here: the two execstream upload fixes (a cut upload publishes nothing)
and the OpenAI runtime's `terminal` tool in a docker sandbox.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from adapters.errors import (
    FileMissing,
    SandboxError,
    SandboxGone,
    StorageError,
    UnsafePath,
)
from adapters.sandboxes.base import (
    DEFAULT_EXEC_OUTPUT_BYTES,
    EXEC_TIMEOUT_EXIT,
    PathPolicy,
    Sandbox,
    SandboxRef,
)
from storage.volume import VolumeStore
from tests.fixtures._files import proc_cmdlines
from tests.fixtures.services import need, wait_until

BACKENDS = ["local", "docker", "ssh", "ssh-openssh", "modal"]
HOSTILE = [
    "with space", "quote'single", 'quote"double', "$(touch PWNED)", "`touch PWNED`", "new\nline", "; touch PWNED",
    "&& touch PWNED", "| touch PWNED", "*", "$HOME", "back\\slash", "-n", "", "trailing newline\n", "\t",
]


@dataclass
class Box:
    sb: Sandbox
    root: str     # the one allowed root, as the sandbox sees it
    outside: str  # an existing directory outside the roots (not denylisted)

    def sh(self, script: str, *args: str, cwd: str | None = None) -> bytes:
        """A setup step through the sandbox itself; must succeed."""
        rc, out, err = self.sb.exec(["sh", "-c", script, "sh", *args], timeout_s=30, cwd=cwd or self.root)
        assert rc == 0, (rc, out, err)
        return out


# -- one sandbox per backend ----------------------------------------------------------
def _host_dirs(tmp: Path) -> tuple[str, str]:
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    return os.path.realpath(root), os.path.realpath(outside)


@pytest.fixture(scope="module")
def docker_box(docker_api):
    from adapters.sandboxes.docker import DockerSandbox

    ctr = docker_api.run_container()
    client = docker_api.client()
    sb = DockerSandbox(SandboxRef("docker", ctr.name, roots=("/workspace",)), None, client=client)
    yield Box(sb, "/workspace", "/home")
    client.close()
    docker_api.remove_container(ctr.id)


@pytest.fixture(scope="module")
def ssh_control_dir():
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="cm", dir="/tmp")  # ControlPath must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _ssh_box(sshd, tmp: Path, control_dir: str, openssh: bool) -> Box:
    from adapters.sandboxes.ssh import SshSandbox

    root, outside = _host_dirs(tmp)
    ref = SandboxRef("ssh", sshd.host, roots=(root,), options={"user": sshd.user, "port": str(sshd.port)})
    sb = SshSandbox(ref, PathPolicy(roots=(root,)), key_path=sshd.key_path, known_hosts=sshd.known_hosts,
                    use_openssh=openssh, control_dir=control_dir)
    return Box(sb, root, outside)


@pytest.fixture
def modal_box(tmp_path, monkeypatch):
    try:
        import modal
    except ImportError:
        modal = None
    need(modal is not None, "the modal SDK is not installed (pip install modal)")
    from adapters.sandboxes import modal as modal_backend
    from adapters.sandboxes.modal import ModalSandbox
    from tests.test_sandbox_modal import FakeSandbox  # the SDK stand-in, shared

    monkeypatch.setattr(modal, "Sandbox", FakeSandbox)
    modal_backend.forget_handles()
    sid = f"sb-{uuid.uuid4().hex[:8]}"
    FakeSandbox.registry[sid] = FakeSandbox(sid)
    root, outside = _host_dirs(tmp_path)
    yield Box(ModalSandbox(SandboxRef("modal", sid, roots=(root,)), None), root, outside)
    FakeSandbox.registry.pop(sid, None)
    modal_backend.forget_handles()


@pytest.fixture(params=BACKENDS)
def box(request, tmp_path):
    kind = request.param
    if kind == "local":
        from adapters.sandboxes.local import LocalSandbox

        root, outside = _host_dirs(tmp_path)
        yield Box(LocalSandbox.with_roots((root,)), root, outside)
    elif kind == "docker":
        b = request.getfixturevalue("docker_box")
        sub = f"/workspace/t-{uuid.uuid4().hex[:8]}"  # a fresh root per test in the shared container
        b.sh('mkdir -p "$1"', sub)
        from adapters.sandboxes.docker import DockerSandbox

        sb = DockerSandbox(SandboxRef("docker", b.sb.ref.target, roots=(sub,)), None, client=b.sb.client)
        yield Box(sb, sub, b.outside)
    elif kind.startswith("ssh"):
        yield _ssh_box(request.getfixturevalue("sshd_server"), tmp_path,
                       request.getfixturevalue("ssh_control_dir"), kind == "ssh-openssh")
    else:
        yield request.getfixturevalue("modal_box")


@pytest.fixture(scope="module", autouse=True)
def _close_ssh():
    yield
    from adapters.sandboxes.ssh import close_pool

    close_pool()


def procs_with(arg: str) -> list[int]:
    """Live processes on this host with `arg` as one of their argv elements
    (zombies have an empty cmdline, so they do not count)."""
    want = arg.encode()
    return [pid for pid, argv in proc_cmdlines() if want in argv]


# -- the contract -------------------------------------------------------------------
def test_argv_reaches_the_command_verbatim(box):
    rc, out, err = box.sb.exec(["printf", "%s\\0", *HOSTILE], timeout_s=30)
    assert (rc, err) == (0, b"")
    assert out.split(b"\0")[:-1] == [a.encode() for a in HOSTILE]
    # nothing was run by a shell along the way
    rc, out, _ = box.sb.exec(["ls", "-a"], timeout_s=30)
    assert rc == 0 and b"PWNED" not in out
    # an argv element that looks like an option is still the command's own
    rc, out, _ = box.sb.exec(["sh", "-c", 'printf "%s|" "$@"', "-x", "-e", "--", "$1"], timeout_s=30)
    assert (rc, out) == (0, b"-e|--|$1|")


def test_exit_codes(box):
    for code in (0, 1, 3, 42, 126):
        assert box.sb.exec(["sh", "-c", "exit $1", "sh", str(code)], timeout_s=30)[0] == code
    assert box.sb.exec(["false"], timeout_s=30)[0] == 1
    rc, _, err = box.sb.exec([f"no-such-command-{uuid.uuid4().hex[:6]}"], timeout_s=30)
    assert rc == 127 and err
    assert box.sb.exec(["sh", "-c", "kill -9 $$"], timeout_s=30)[0] == 128 + 9  # a signal, as a shell says it


def test_stdout_and_stderr_are_separate_and_stdin_is_empty(box):
    rc, out, err = box.sb.exec(["sh", "-c", "echo out; echo err >&2; echo out2; printf 'no newline' >&2"],
                               timeout_s=30)
    assert (rc, out, err) == (0, b"out\nout2\n", b"err\nno newline")
    t0 = time.monotonic()
    assert box.sb.exec(["cat"], timeout_s=20) == (0, b"", b"")  # EOF at once, never waits for input
    assert time.monotonic() - t0 < 10


def test_cwd_inside_the_roots(box):
    box.sh('mkdir -p "sub dir/deep" && ln -s "sub dir/deep" inlink')
    assert box.sb.exec(["pwd"], timeout_s=30) == (0, f"{box.root}\n".encode(), b"")  # default: the root
    sub = f"{box.root}/sub dir"
    assert box.sb.exec(["pwd"], timeout_s=30, cwd=sub) == (0, f"{sub}\n".encode(), b"")
    # a link is resolved in the sandbox; the command runs in (and sees) its target
    rc, out, _ = box.sb.exec(["sh", "-c", "pwd; pwd -P"], timeout_s=30, cwd=f"{box.root}/inlink")
    assert (rc, out) == (0, f"{sub}/deep\n{sub}/deep\n".encode())
    with pytest.raises(FileMissing):
        box.sb.exec(["true"], timeout_s=30, cwd=f"{box.root}/missing")


def test_cwd_outside_the_roots_is_refused_before_anything_runs(box):
    box.sh('ln -s "$1" escape && mkdir real', box.outside)
    for cwd in (box.outside, f"{box.root}/escape", "/etc", "/", f"{box.root}/../", "relative", f"{box.root}/real/.."):
        with pytest.raises(UnsafePath):
            box.sb.exec(["touch", "RAN"], timeout_s=30, cwd=cwd)
    rc, out, _ = box.sb.exec(["ls", "-a", box.outside, "/", box.root], timeout_s=30)
    assert rc == 0 and b"RAN" not in out


def test_cwd_swapped_for_a_link_after_a_run_is_refused(box):
    box.sh("mkdir work")
    work = f"{box.root}/work"
    assert box.sb.exec(["pwd"], timeout_s=30, cwd=work)[0] == 0  # resolved (and cached, where cached)
    box.sh('rmdir work && ln -s "$1" work', box.outside)
    with pytest.raises(UnsafePath):
        box.sb.exec(["touch", "RAN"], timeout_s=30, cwd=work)
    rc, out, _ = box.sb.exec(["ls", "-a", box.outside], timeout_s=30)
    assert rc == 0 and b"RAN" not in out


def test_timeout_kills_the_command_and_everything_it_started(box):
    n = str(random.randrange(100_000, 999_999))
    t0 = time.monotonic()
    rc, out, err = box.sb.exec(["sh", "-c", 'echo started; sleep "$1" & sleep "$1"; echo never', "sh", n],
                               timeout_s=1.5)
    took = time.monotonic() - t0
    assert rc == EXEC_TIMEOUT_EXIT == 124
    assert out == b"started\n"
    assert err.endswith(b"[courier: timed out after 1.5s; the command was killed]\n")
    assert 1.5 <= took < 60, took  # killed: the sleeps ask for days (a loaded machine may take a while)
    wait_until(lambda: not procs_with(n), timeout_s=5, what=f"the sleeps ({n}) to be gone")


def test_output_is_bounded_head_and_tail(box):
    rc, out, err = box.sb.exec(
        ["sh", "-c", "yes 0123456789 | head -c 3000000; yes e | head -c 20000 >&2"], timeout_s=60,
        max_output_bytes=DEFAULT_EXEC_OUTPUT_BYTES)
    stream = (b"0123456789\n" * (3000000 // 11 + 1))[:3000000]
    half = DEFAULT_EXEC_OUTPUT_BYTES // 2  # 512 KiB each side
    assert rc == 0
    assert out == stream[:half] + f"\n[... {3000000 - 2 * half:,} bytes omitted ...]\n".encode() + stream[-half:]
    assert err == b"e\n" * 10000  # under the cap: whole
    rc, out, err = box.sb.exec(["sh", "-c", "yes 0123456789 | head -c 3000000 >&2"], timeout_s=60,
                               max_output_bytes=1000)
    assert (rc, out) == (0, b"")
    assert err == stream[:500] + f"\n[... {3000000 - 1000:,} bytes omitted ...]\n".encode() + stream[-500:]


def test_argv_must_be_a_non_empty_list(box):
    for bad in ([], "echo hi", ["echo", "nul\x00byte"]):
        with pytest.raises(SandboxError):
            box.sb.exec(bad, timeout_s=5)


# -- execstream uploads: a cut upload publishes nothing ------------------------------------
class _ShortStdin:
    """A channel whose upload simply ends early (the remote `cat` sees EOF)."""

    def __init__(self, ch, keep: int) -> None:
        self.ch, self.keep, self.binary_safe = ch, keep, ch.binary_safe

    def exec_small(self, argv):
        return self.ch.exec_small(argv)

    def exec_stdin(self, argv, chunks):
        def short():
            left = self.keep
            for c in chunks:
                if left <= 0:
                    return
                yield c[:left]
                left -= len(c)
        return self.ch.exec_stdin(argv, short())


def test_cut_upload_leaves_nothing(docker_box, tmp_path):
    from adapters.sandboxes.execstream import exec_put

    sb, d = docker_box.sb, "/workspace/cut"
    docker_box.sh('mkdir -p "$1"', d)
    store = VolumeStore(tmp_path / "store")
    store.put_bytes("in/b", os.urandom(3 * 1024 * 1024))
    policy = PathPolicy(roots=("/workspace",))
    ch = sb.exec_channel()

    def listing() -> bytes:
        return docker_box.sh('ls -a "$1"', d)

    # the channel ends the stream early and returns: refused by the size check
    with pytest.raises(SandboxGone, match="cut short"):
        exec_put(_ShortStdin(ch, 1024 * 1024), lambda home: policy, store, "in/b", f"{d}/short.bin")
    assert listing() == b".\n..\n"

    # the upload dies on our side mid-stream: the socket closes, the remote temp goes
    real = store.iter_chunks

    def failing(key, *a, **kw):
        for i, chunk in enumerate(real(key, *a, **kw)):
            if i == 1:
                raise OSError("storage went away")
            yield chunk

    store.iter_chunks = failing
    with pytest.raises(StorageError, match="storage went away"):
        exec_put(ch, lambda home: policy, store, "in/b", f"{d}/died.bin")
    wait_until(lambda: listing() == b".\n..\n", timeout_s=10, what="the partial temp to be removed")
    store.iter_chunks = real
    assert exec_put(ch, lambda home: policy, store, "in/b", f"{d}/whole.bin") == f"{d}/whole.bin"
    assert listing() == b".\n..\nwhole.bin\n"


# -- the OpenAI runtime's terminal tool in a docker sandbox --------------------------------
def test_terminal_tool_in_docker(docker_box, tmp_path):
    from adapters.agents.tools import Toolbox

    docker_box.sh("mkdir -p /workspace/agent")
    tools = Toolbox(sandbox=docker_box.sb, workdir="/workspace/agent", store=VolumeStore(tmp_path / "store"),
                    job_id="job-1")
    res = tools.call("terminal", {"command": "echo made > out.txt && cat out.txt && pwd && echo oops >&2; exit 3"})
    assert res.text == "made\n/workspace/agent\n[stderr]\noops\n[exit code 3]"
    assert not res.ok
    assert docker_box.sh("cat /workspace/agent/out.txt") == b"made\n"
    res = tools.call("terminal", {"command": "sleep 777", "timeout_s": 1})
    assert res.text.endswith("timed out after 1s; the command was killed]\n[exit code 124]")
    res = tools.call("terminal", {"command": "true"})
    assert (res.text, res.ok) == ("[exit code 0]", True)
    wait_until(lambda: not procs_with("777"), timeout_s=5, what="sleep 777 to be gone")


def test_a_silent_command_runs_once(docker_box):
    """An agent's command that prints nothing and exits 0 looks like an answer
    podman dropped, which the channel's read-only probes ask again: a command
    never is (it could do anything twice)."""
    d = f"/workspace/once-{uuid.uuid4().hex[:8]}"
    docker_box.sh('mkdir -p "$1"', d)
    rc, out, err = docker_box.sb.exec(["sh", "-c", 'echo ran >> "$1/count"', "sh", d], timeout_s=30)
    assert (rc, out, err) == (0, b"", b"")
    assert docker_box.sh('cat "$1/count"', d) == b"ran\n"
