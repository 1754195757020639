"""The harness of each backend (module-scoped: one container, one tree per
backend for the whole table) and the leak check every row ends with."""

from __future__ import annotations

import os

import pytest

from storage.volume import VolumeStore
from tests.attacks.harness import TOKEN, DockerHarness, LocalHarness, ModalHarness, SingularityHarness, SshHarness


@pytest.fixture(scope="module")
def h(request, tmp_path_factory):
    name = request.param
    base = tmp_path_factory.mktemp(f"attacks-{name}")
    if name == "local":
        harness = LocalHarness(base)
    elif name == "singularity":
        harness = SingularityHarness(base)
    elif name.startswith("docker"):
        harness = DockerHarness(base, request.getfixturevalue("docker_api"), name)
    elif name.startswith("ssh-"):
        harness = SshHarness(base, request.getfixturevalue("sshd_server"), name[4:])
    elif name == "modal":
        from tests.fixtures.services import need

        try:
            import modal  # noqa: F401
        except ImportError:
            need(False, "the modal SDK is not installed (pip install modal)")
        harness = ModalHarness(base)
    else:  # pragma: no cover
        raise AssertionError(name)
    yield harness
    harness.close()


@pytest.fixture
def store(tmp_path):
    """The store every row extracts into; after the row, no byte of any
    secret may be in it (blobs, temp files, anything under its root)."""
    s = VolumeStore(tmp_path / "store")
    yield s
    for dirpath, _dirs, files in os.walk(s.root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                assert TOKEN not in fh.read(), f"a secret leaked into the store: {os.path.join(dirpath, f)}"
