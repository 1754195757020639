"""DockerSandbox against an agent that attacks (real podman, see tests/fixtures/podman.py):
what the attack table (tests/attacks/) does not cover — a deterministic
swap between check and read, podman's stat header alphabet, writes as a
non-root user, the kill of a blocked stream run.

Each test states what must hold; files are made inside the container and
expected digests come from the container's own `sha256sum`.
"""

from __future__ import annotations


import pytest

from adapters.errors import SandboxError, SandboxGone, UnsafePath
from adapters.sandboxes.base import ReadTimeout, SandboxRef
from adapters.sandboxes.docker import DockerSandbox
from tests.fixtures._exec import start_streams_at_the_open
from tests.fixtures._files import run_in, sha_in_container, stored
from tests.fixtures.services import bounded, wait_until

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


def test_decode_stat_header_accepts_both_alphabets():
    import base64
    import json

    from adapters.sandboxes.docker import decode_stat_header

    st = {"name": "файл?~.txt", "size": 3}
    raw = json.dumps(st, ensure_ascii=False).encode()
    for enc in (base64.b64encode(raw), base64.urlsafe_b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"=")):
        assert decode_stat_header(enc.decode()) == st


# -- 8. hard links --------------------------------------------------------------------------------


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
    assert run_in(user_ctr, ["ls", "-A", "/workspace/rootdir"]) == b""  # not even a temp file (a whole, empty answer)
    final = s.put(store, "in/a", "/workspace/turn/inbox/a.txt")
    assert sha_in_container(user_ctr, final) == info.sha256
    assert run_in(user_ctr, ["stat", "-c", "%u", final]).strip() == b"1000"
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
        seen = start_streams_at_the_open(ch)
        _res, exc, took = bounded(lambda: b"".join(exec_iter_file(ch, "/tmp/pipe")), 30)
        assert isinstance(exc, ReadTimeout), exc
        assert len(seen) == 1
        probe = ["sh", "-c", 'grep -lzxF "$1" /proc/[0-9]*/environ 2>/dev/null | grep -v self || true', "sh", seen[0]]
        wait_until(lambda: run_in(c, probe).strip() == b"", timeout_s=10,
                   what="the blocked stream run to be killed")
        client.close()
    finally:
        docker_api.remove_container(c.id)


def test_archive_channel_in_an_image_without_stat(docker_api, store):
    """The archive channel counts a file's hard links with one `stat` exec;
    an image without `stat` (distroless) still gets its files delivered —
    its root agent can read and copy out any file in it anyway."""
    c = docker_api.run_container()
    try:
        assert c.exec_run(["sh", "-c", "echo data > /workspace/f.txt && rm /bin/stat"]).exit_code == 0
        client = docker_api.client()
        s = DockerSandbox(SandboxRef("docker", c.name), None, client=client)
        assert s.extract("/workspace/f.txt", store, "files/f").size_bytes == 5
        assert s.stats["archive"] == 1
        client.close()
    finally:
        docker_api.remove_container(c.id)
