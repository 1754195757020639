"""DockerSandbox against an agent that attacks (real podman, see tests/fixtures/podman.py).

Each test states what must hold; files are made inside the container and
expected digests come from the container's own `sha256sum`.
"""

from __future__ import annotations

import pytest

from adapters.errors import FileMissing, UnsafePath
from adapters.sandboxes.base import SandboxRef
from adapters.sandboxes.docker import DockerSandbox
from storage.volume import VolumeStore
from tests.fixtures._files import sha_in_container, stored

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

