"""DockerSandbox against an agent that attacks (real podman, see tests/fixtures/podman.py).

Each test states what must hold; files are made inside the container and
expected digests come from the container's own `sha256sum`.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from adapters.errors import FileMissing, SandboxError, SandboxGone, UnsafePath
from adapters.sandboxes.base import ReadTimeout, SandboxRef
from adapters.sandboxes.docker import DockerSandbox
from storage.volume import VolumeStore
from tests.fixtures._files import sha_in_container, stored
from tests.fixtures.services import wait_until

SETUP = r"""set -e
mkdir -p /workspace /home/agent/.ssh /home/agent/.aws /home/agent/.config
echo ssh-secret > /home/agent/.ssh/id_rsa
echo aws-secret > /home/agent/.aws/credentials
echo cfg-secret > /home/agent/.config/app.ini
echo bracket > '/workspace/a[1]?.txt'
"""


@pytest.fixture(scope="module")
def ctr(docker_api):
    c = docker_api.run_container()
    res = c.exec_run(["sh", "-c", SETUP])
    assert res.exit_code == 0, res.output
    yield c
    docker_api.remove_container(c.id)


@pytest.fixture
def sb(docker_api, ctr):
    client = docker_api.client()
    s = DockerSandbox(SandboxRef("docker", ctr.name), None, client=client)
    yield s
    client.close()


@pytest.fixture
def store(tmp_path):
    return VolumeStore(tmp_path / "store")


# -- 1. the archive API expands globs: the literal checked path must be the one read --
@pytest.mark.parametrize("path", [
    "/home/agent/.ss[h]/id_rsa",
    "/home/agent/[.]ssh/id_rsa",
    "/home/agent/.ss?/id_rsa",
    "/home/agent/.s*/id_rsa",
    "/home/agent/.aw[s]/credentials",
    "/home/agent/.confi[g]/app.ini",
])
def test_glob_in_path_reads_nothing_else(sb, store, path):
    """A glob that the engine would expand to a denylisted file is taken
    literally: no such file, nothing stored."""
    with pytest.raises((FileMissing, UnsafePath)):
        sb.extract(path, store, "files/x")
    assert stored(store) == []


def test_file_named_with_glob_chars_is_delivered(sb, ctr, store):
    """A real file whose name holds glob characters is read literally (exec channel)."""
    path = "/workspace/a[1]?.txt"
    info = sb.extract(path, store, "files/b")
    assert info.sha256 == sha_in_container(ctr, path)



# -- 3. a container whose shell stalls costs one attempt, never a worker ----------------------
STALL = r"""set -e
echo data > /workspace/real.txt
ln -s real.txt /workspace/via_link.txt
rm /bin/sh
printf '#!/bin/busybox sh\nexec sleep 100000\n' > /bin/sh
/bin/busybox chmod +x /bin/sh
"""


def _bounded(fn, timeout_s: float):
    """Run `fn` in a thread; fail if it runs past `timeout_s` (the caller's
    cleanup then removes the container, which ends the stuck call)."""
    box: dict = {}

    def run():
        try:
            box["res"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        pytest.fail(f"blocked for more than {timeout_s} s")
    return box.get("exc"), time.monotonic() - t0


@pytest.mark.parametrize("how", ["resolve", "exec_stream", "put"])
def test_stalled_container_shell_times_out(docker_api, tmp_path, how):
    """Every exec read has a deadline: with the container's `sh` stalled, a
    resolve through exec, a stream and a put each end with ReadTimeout
    (SandboxGone: retried) within the deadline (old code: 828 s observed)."""
    c = docker_api.run_container()
    try:
        res = c.exec_run(["sh", "-c", STALL])
        assert res.exit_code == 0, res.output
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client, io_timeout_s=2)
        store = VolumeStore(tmp_path / "store")
        store.put_bytes("in/b", b"payload")
        call = {
            "resolve": lambda: s.extract("/workspace/via_link.txt", store, "files/x"),
            "exec_stream": lambda: b"".join(s._exec.exec_stream(["sh", "-c", "cat /workspace/real.txt"]).chunks),
            "put": lambda: s.put(store, "in/b", "/workspace/up.txt"),
        }[how]
        exc, took = _bounded(call, 30)
        assert isinstance(exc, ReadTimeout) and isinstance(exc, SandboxGone), exc
        assert took < 15
        assert [b.key for b in store.list()] == ["in/b"]
        client.close()
    finally:
        docker_api.remove_container(c.id)


# -- 4. reads happen with the container user's permissions ------------------------------------
AS_ROOT = r"""set -e
mkdir -p /workspace/private
chmod 1777 /workspace
echo agent-data > /workspace/ok.txt
chmod 644 /workspace/ok.txt
echo root-secret-1 > /workspace/rootonly.txt
chmod 600 /workspace/rootonly.txt
echo root-secret-2 > /tmp/rootonly.txt
chmod 600 /tmp/rootonly.txt
echo root-secret-3 > /workspace/private/f.txt
chmod 644 /workspace/private/f.txt
chmod 700 /workspace/private
"""


@pytest.fixture(scope="module")
def user_ctr(docker_api):
    c = docker_api.run_container(user="1000:1000")
    res = c.exec_run(["sh", "-c", AS_ROOT], user="root")
    assert res.exit_code == 0, res.output
    yield c
    docker_api.remove_container(c.id)


@pytest.mark.parametrize("path", ["/workspace/rootonly.txt", "/tmp/rootonly.txt", "/workspace/private/f.txt"])
def test_non_root_container_gets_nothing_its_user_cannot_read(docker_api, user_ctr, store, path):
    """A container running as uid 1000: a root-only file (or one in a root-only
    directory) is refused, never read as root by the archive API (old code:
    3 of 3 delivered)."""
    client = docker_api.client()
    s = DockerSandbox(SandboxRef("docker", user_ctr.name), None, client=client)
    assert user_ctr.exec_run(["cat", path]).exit_code != 0  # the agent itself cannot read it
    with pytest.raises((UnsafePath, FileMissing)):
        s.extract(path, store, "files/x")
    assert stored(store) == []
    assert s.stats["archive"] == 0
    client.close()


def test_non_root_container_reads_its_own_files_through_exec(docker_api, user_ctr, store):
    client = docker_api.client()
    s = DockerSandbox(SandboxRef("docker", user_ctr.name), None, client=client)
    info = s.extract("/workspace/ok.txt", store, "files/ok")
    assert info.sha256 == sha_in_container(user_ctr, "/workspace/ok.txt")
    assert (s.stats["archive"], s.stats["exec"], s.stats["resolve_stat"]) == (0, 1, 0)
    client.close()


# -- 5. TOCTOU: a directory swapped for a link between the check and the read ------------------
SWAP = r"""set -e
mkdir -p /workspace/d /workspace/fake
echo 'same-size-legit' > /workspace/d/secret
echo 'root-only-etc!!' > /etc/secret
chmod 600 /etc/secret
"""


def test_dir_swapped_for_link_after_resolve_is_refused(docker_api, store):
    """The agent swaps /workspace/d for a link to /etc right after the check;
    the archive GET would read /etc/secret (same name, same size). Refused,
    nothing stored (old code: delivered /etc/secret). A retry (SandboxGone)
    checks the path again and finds the link."""
    c = docker_api.run_container()
    try:
        assert c.exec_run(["sh", "-c", SWAP]).exit_code == 0
        client = docker_api.client()

        class Racing(DockerSandbox):
            def _resolve(self, path):
                r = super()._resolve(path)
                res = c.exec_run(["sh", "-c", "mv /workspace/d /workspace/d.real && ln -s /etc /workspace/d"])
                assert res.exit_code == 0, res.output
                return r

        s = Racing(SandboxRef("docker", c.name), None, client=client)
        with pytest.raises((UnsafePath, SandboxGone)):
            s.extract("/workspace/d/secret", store, "files/x")
        assert stored(store) == []
        plain = DockerSandbox(SandboxRef("docker", c.name), None, client=client)  # the retry
        with pytest.raises(UnsafePath):
            plain.extract("/workspace/d/secret", store, "files/x")
        assert stored(store) == []
        client.close()
    finally:
        docker_api.remove_container(c.id)


# -- 6. unicode names: podman's stat header is URL-safe base64 ---------------------------------
UNICODE_NAMES = ["файл.txt", "文件名.bin", "emoji-🎉.png", "Ünïcödé~ñ.txt", "日本語のファイル名.md", "ё~_-.txt"]


def test_decode_stat_header_accepts_both_alphabets():
    import base64
    import json

    from adapters.sandboxes.docker import decode_stat_header

    st = {"name": "файл?~.txt", "size": 3}
    raw = json.dumps(st, ensure_ascii=False).encode()
    for enc in (base64.b64encode(raw), base64.urlsafe_b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"=")):
        assert decode_stat_header(enc.decode()) == st


def test_unicode_names_byte_identical_through_the_archive(docker_api, store):
    """Files with Cyrillic, CJK and emoji names come through the archive
    channel byte-identical (old code: 'no such file', permanently)."""
    c = docker_api.run_container()
    try:
        for i, name in enumerate(UNICODE_NAMES):
            res = c.exec_run(["sh", "-c", 'head -c $2 /dev/urandom > "/workspace/$1"', "sh", name, str(1000 + i)])
            assert res.exit_code == 0, res.output
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client)
        for i, name in enumerate(UNICODE_NAMES):
            path = f"/workspace/{name}"
            info = s.extract(path, store, f"files/u{i}")
            assert info.sha256 == sha_in_container(c, path), name
        assert s.stats["archive"] == len(UNICODE_NAMES)
        client.close()
    finally:
        docker_api.remove_container(c.id)


# -- 8. hard links --------------------------------------------------------------------------------
def test_hard_link_in_a_bind_mount_is_refused(docker_api, tmp_path, store):
    """A hard link in a bind-mounted directory to a host file outside it
    (same filesystem): the bind channel reads the host file, refused."""
    bind = tmp_path / "bind"
    bind.mkdir()
    os.chmod(bind, 0o755)
    (tmp_path / "host_secret.txt").write_text("host secret")
    os.link(tmp_path / "host_secret.txt", bind / "hl.txt")
    c = docker_api.run_container(binds={str(bind): "/workspace/bind"})
    try:
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client)
        with pytest.raises(UnsafePath, match="hard links"):
            s.extract("/workspace/bind/hl.txt", store, "files/x")
        assert stored(store) == []
        client.close()
    finally:
        docker_api.remove_container(c.id)


def test_hard_link_in_a_non_root_container_is_refused(docker_api, user_ctr, store):
    """Read through exec (the container's user): the opened file's link count is checked."""
    res = user_ctr.exec_run(["sh", "-c", "echo mine > /workspace/mine.txt && ln /workspace/mine.txt /tmp/hl.txt"])
    assert res.exit_code == 0, res.output
    client = docker_api.client()
    s = DockerSandbox(SandboxRef("docker", user_ctr.name), None, client=client)
    with pytest.raises(UnsafePath, match="hard links"):
        s.extract("/tmp/hl.txt", store, "files/x")
    assert stored(store) == []
    client.close()



RACE_SETUP = r"""set -e
chmod 1777 /workspace
echo 'root-only-etc!!' > /etc/secret
chmod 644 /etc/secret
"""
RACE = r"""mkdir -p /workspace/r
echo 'same-size-legit' > /workspace/r/secret
touch -r /workspace/r/secret /etc/secret 2>/dev/null
cd /workspace
while :; do mv r r.real; ln -s /etc r; rm r; mv r.real r; done
"""


def test_link_swap_race_loop_never_leaks(docker_api, store):
    """60 extractions from a uid-1000 container whose agent swaps
    /workspace/r for a link to /etc in a loop (/etc/secret: same name and
    size, readable, denylisted): each delivers the real bytes or is refused;
    none leaks. (Reads go through exec from the opened, checked fd. A root
    container's archive channel cannot pin the file it reads: a race there
    reaches only files its root agent can read and copy out itself.)"""
    from adapters.errors import SandboxError

    c = docker_api.run_container(user="1000:1000")
    try:
        assert c.exec_run(["sh", "-c", RACE_SETUP], user="root").exit_code == 0
        c.exec_run(["sh", "-c", RACE], detach=True)
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client)
        wait_until(lambda: c.exec_run(["test", "-e", "/workspace/r.real"]).exit_code in (0, 1)
                   and c.exec_run(["test", "-e", "/workspace/r/secret"]).exit_code in (0, 1),
                   timeout_s=10, what="the swap loop")
        outcomes: dict[str, int] = {}
        deadline = time.monotonic() + 60
        for i in range(60):
            assert time.monotonic() < deadline, f"too slow: {i} extractions in 60 s"
            try:
                info = s.extract("/workspace/r/secret", store, f"files/r{i}")
            except SandboxError as exc:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                continue
            data = store.local_path(f"files/r{i}").read_bytes()
            assert data == b"same-size-legit\n", f"extraction {i} leaked {data!r} ({info})"
            outcomes["delivered"] = outcomes.get("delivered", 0) + 1
        assert sum(outcomes.values()) == 60, outcomes
        client.close()
    finally:
        docker_api.remove_container(c.id)


def test_non_root_container_put_writes_only_where_its_user_may(docker_api, user_ctr, store):
    """An attachment for a uid-1000 container is written as that user: not
    a byte into a root-owned directory (old code: put_archive wrote its temp
    file there as root and left it), and where the user may write, owned by it."""
    assert user_ctr.exec_run(["sh", "-c", "mkdir -p /workspace/rootdir && chmod 755 /workspace/rootdir"],
                             user="root").exit_code == 0
    client = docker_api.client()
    s = DockerSandbox(SandboxRef("docker", user_ctr.name), None, client=client)
    info = store.put_bytes("in/a", b"attachment")
    with pytest.raises(SandboxError):
        s.put(store, "in/a", "/workspace/rootdir/evil.txt")
    assert user_ctr.exec_run(["ls", "-A", "/workspace/rootdir"]).output == b""  # not even a temp file
    final = s.put(store, "in/a", "/workspace/turn/inbox/a.txt")
    assert sha_in_container(user_ctr, final) == info.sha256
    assert user_ctr.exec_run(["stat", "-c", "%u", final]).output.strip() == b"1000"
    client.close()


def test_fifo_open_in_the_stream_is_killed_after_the_deadline(docker_api, store):
    """The stream script blocked opening a FIFO (what a swap right after its
    type test leaves) ends with ReadTimeout after the read deadline, and the
    blocked run is killed in the container by its run id."""
    from adapters.sandboxes.execstream import exec_iter_file

    c = docker_api.run_container(user="1000:1000")
    try:
        assert c.exec_run(["mkfifo", "/tmp/pipe"]).exit_code == 0
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client, io_timeout_s=2)
        ch = s.exec_channel()
        real = ch.exec_stream
        seen: list[str] = []

        def stream_without_type_test(argv):
            argv = list(argv)
            i = argv.index("-c") + 1
            argv[i] = argv[i].split("\n", 1)[1]  # start the run at the open
            seen.extend(a for a in argv if a.startswith("COURIER_EXEC_ID="))
            return real(argv)

        ch.exec_stream = stream_without_type_test
        exc, took = _bounded(lambda: b"".join(exec_iter_file(ch, "/tmp/pipe")), 30)
        assert isinstance(exc, ReadTimeout), exc
        assert len(seen) == 1
        probe = ["sh", "-c", 'grep -lzxF "$1" /proc/[0-9]*/environ 2>/dev/null | grep -v self || true', "sh", seen[0]]
        wait_until(lambda: c.exec_run(probe).output.strip() == b"", timeout_s=10,
                   what="the blocked stream run to be killed")
        client.close()
    finally:
        docker_api.remove_container(c.id)
