"""SingularitySandbox on a directory tree standing in for an instance rootfs.

There is no singularity/apptainer binary on these machines (Debian 12 packages
neither apptainer nor an installable singularity-container), so the instance root is a real directory laid out like
an unpacked rootfs / sandbox-dir instance; the code under test is the same
that reads a live instance's root. Instance discovery from
`apptainer instance list --json` is tested on its parsed output.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapters.errors import ConfigError, SandboxGone, UnsafePath
from adapters.sandboxes.base import SandboxRef, parse_uri
from adapters.sandboxes.singularity import (
    SingularitySandbox, find_instance_root, open_in_root, resolve_in_root, root_from_listing,
)
from tests.fixtures._files import MB, random_chunks, sha256_file, stored


def make_instances(base: Path) -> Path:
    """<instances_dir> = `base`: agent1/rootfs with files, links and decoys."""
    root = base / "agent1" / "rootfs"
    for d in ("workspace/dir", "tmp", "etc", "home/agent/.ssh", "bin"):
        (root / d).mkdir(parents=True)
    ws = root / "workspace"
    (ws / "f0").write_bytes(b"")
    (ws / "f1k").write_bytes(os.urandom(1024))
    with open(ws / "f50m", "wb") as f:
        for _ in range(50):
            f.write(os.urandom(MB))
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "home" / "agent" / ".ssh" / "id_rsa").write_text("secret")
    (root / "home" / "agent" / "notes.txt").write_text("hi")
    (ws / "pw").symlink_to("/etc/passwd")                       # -> the instance's /etc (denied)
    (ws / "abs_ok").symlink_to("/workspace/f1k")                # absolute, inside the instance
    (ws / "rel_ok").symlink_to("dir/../f1k")
    (ws / "climb").symlink_to("../../../../../../../../workspace/f1k")  # clamps at the instance root
    host_only = base / "host_only.txt"
    host_only.write_text("host file")
    (ws / "host").symlink_to(str(host_only))                    # a host path: absent in the instance
    (ws / "loop_a").symlink_to("loop_b")
    (ws / "loop_b").symlink_to("loop_a")
    (ws / "dirlink").symlink_to("/workspace/dir")
    (ws / "dir" / "inner").write_text("inner")
    (root / "tmp" / "t.txt").write_text("tmp file")
    return base


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    return make_instances(tmp_path_factory.mktemp("instances"))


def sandbox_of(instances: Path) -> SingularitySandbox:
    """The sandbox of instance agent1 (home /home/agent) under `instances`."""
    return SingularitySandbox(SandboxRef("singularity", "agent1", options={"home": "/home/agent"}), None,
                              instances_dir=str(instances))


@pytest.fixture
def root(instances):
    return str(instances / "agent1" / "rootfs")


@pytest.fixture
def sb(instances):
    return sandbox_of(instances)


@pytest.mark.parametrize("name", ["f0", "f1k", "f50m"])
def test_byte_identical(sb, root, store, name):
    info = sb.extract(f"/workspace/{name}", store, f"files/{name}", max_bytes=60 * MB)
    assert info.sha256 == sha256_file(os.path.join(root, "workspace", name)) \
        == sha256_file(store.local_path(f"files/{name}"))


@pytest.mark.parametrize("path", ["/workspace/abs_ok", "/workspace/rel_ok", "/workspace/climb"])
def test_links_resolved_inside_the_instance(sb, root, store, path):
    assert sb.resolve(path) == ("/workspace/f1k", 1024)
    assert sb.extract(path, store, "files/l").sha256 == sha256_file(os.path.join(root, "workspace", "f1k"))


def test_home_and_tmp_roots(sb, store):
    assert sb.extract("/home/agent/notes.txt", store, "files/n").size_bytes == 2
    assert sb.extract("/tmp/t.txt", store, "files/t").size_bytes == 8


def test_resolution_never_leaves_the_root(root):
    path, st = resolve_in_root(root, "/../../../workspace/./dir/../f1k")
    assert path == "/workspace/f1k" and st.st_size == 1024
    assert resolve_in_root(root, "/workspace/dirlink/inner")[0] == "/workspace/dir/inner"
    assert resolve_in_root(root, "/")[0] == "/"


def test_open_refuses_a_link_swapped_in_after_resolve(tmp_path):
    r = tmp_path / "r"
    (r / "workspace" / "d").mkdir(parents=True)
    (r / "workspace" / "d" / "f").write_text("ok")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_text("host secret")
    resolved, _ = resolve_in_root(str(r), "/workspace/d/f")
    os.close(open_in_root(str(r), resolved))
    # the agent swaps a directory for a link to the host between check and open
    (r / "workspace" / "d" / "f").unlink()
    (r / "workspace" / "d").rmdir()
    (r / "workspace" / "d").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePath):
        open_in_root(str(r), resolved)
    (r / "workspace" / "d").unlink()
    (r / "workspace" / "d").mkdir()
    (r / "workspace" / "d" / "f").symlink_to(tmp_path / "outside" / "f")
    with pytest.raises(UnsafePath):
        open_in_root(str(r), resolved)


@pytest.mark.parametrize("size", [0, 1024, 5 * MB])
def test_put_byte_identical(sb, root, store, size):
    info = store.put_stream("in/b", random_chunks(size))
    final = sb.put(store, "in/b", f"/workspace/up_{size}")
    assert final == f"/workspace/up_{size}"
    assert sha256_file(os.path.join(root, "workspace", f"up_{size}")) == info.sha256
    assert not [n for n in os.listdir(os.path.join(root, "workspace")) if "courier-part" in n]


def test_instance_discovery(instances, tmp_path):
    rootfs = str(instances / "agent1" / "rootfs")
    assert find_instance_root("agent1", instances_dir=str(instances)) == os.path.realpath(rootfs)
    assert find_instance_root("x", instance_root=rootfs) == os.path.realpath(rootfs)
    with pytest.raises(ConfigError):
        find_instance_root("../agent1", instances_dir=str(instances))
    listing = {"instances": [
        {"instance": "sbx", "pid": 0, "img": rootfs},
        {"instance": "sif", "pid": os.getpid(), "img": str(tmp_path / "image.sif")},
    ]}
    assert root_from_listing(listing, "sbx") == os.path.realpath(rootfs)
    assert root_from_listing(listing, "sif") == f"/proc/{os.getpid()}/root"
    with pytest.raises(SandboxGone):
        root_from_listing(listing, "stopped")


def test_wiring_opens_singularity_sandbox(instances, store):
    from workers.settings import Settings
    from workers.wiring import open_sandbox

    ref, path = parse_uri("singularity://agent1/workspace/f1k")
    s = open_sandbox(ref, Settings(singularity_instances_dir=str(instances)))
    assert isinstance(s, SingularitySandbox)
    assert s.extract(path, store, "files/w").size_bytes == 1024


def test_put_makes_the_missing_inbox(sb, root, store):
    """An attachment into <workspace>/inbox/ that does not exist yet: the
    directory is made (old code: FileMissing, the attachment failed)."""
    store.put_bytes("in/a", b"attachment")
    final = sb.put(store, "in/a", "/workspace/turn1/inbox/photo.jpg")
    assert final == "/workspace/turn1/inbox/photo.jpg"
    with open(os.path.join(root, "workspace", "turn1", "inbox", "photo.jpg"), "rb") as f:
        assert f.read() == b"attachment"


def test_hard_link_to_a_host_file_is_refused(sb, instances, root, store):
    """A hard link inside the instance to a host file outside its root
    (same filesystem): refused, nothing stored (old code: delivered)."""
    hl = os.path.join(root, "workspace", "hl.txt")
    os.link(instances / "host_only.txt", hl)
    try:
        with pytest.raises(UnsafePath, match="hard links"):
            sb.extract("/workspace/hl.txt", store, "files/x")
        assert stored(store) == []
    finally:
        os.unlink(hl)
