"""ONE table of extraction and put cases, run against every sandbox backend
that reads a host-visible tree (tests/fixtures/_files.py `make_area`):

* ``local``: LocalSandbox on this host's filesystem;
* ``ssh-sftp`` / ``ssh-openssh``: SshSandbox against a real OpenSSH server
  on 127.0.0.1 (tests/fixtures/sshd.py), over paramiko SFTP and over the
  OpenSSH client with a ControlMaster;
* ``modal-file_api`` / ``modal-exec_only`` / ``modal-file_api_fails``:
  ModalSandbox through its SDK boundary (Modal's cloud is unreachable from
  here: ``modal.Sandbox`` is the stand-in of tests/test_sandbox_modal.py,
  whose exec runs the real command on this host) with the file API, without
  it (modal 1.x), and with one that fails (the exec fallback).

and, for the refusals and the cap, the backends whose files are an image's
own tree (sandbox paths are not host paths there):

* ``docker``: DockerSandbox on a container of real rootful podman;
* ``singularity``: SingularitySandbox on an instance root directory.

Every backend gets every row, except where a row names its backends (what a
row checks means something there only); what one backend shows beyond the
contract (modal: which channel read the file) is checked by its `Backend`.
What is one backend's own (connections, host keys, the SDK's handles,
races that need its internals) stays in tests/test_sandbox_<backend>.py;
the attacks of an untrusted agent are tests/attacks/.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import NamedTuple

import pytest

from adapters.errors import FileMissing, NotAFile, TooLarge, UnsafePath
from adapters.sandboxes.local import LocalSandbox
from tests.fixtures._files import assert_store_empty, make_area, sha256_file, stored, write_random
from tests.fixtures.services import need

BIG = 50 * 1000 * 1000
SSH = ("ssh-sftp", "ssh-openssh")
MODAL = ("modal-file_api", "modal-exec_only", "modal-file_api_fails")
BACKENDS = ("local", *SSH, *MODAL)


@pytest.fixture(scope="module")
def area(tmp_path_factory):
    """root/ (the allowed root, also the home: ~/.ssh is denied under it) and
    outside/ beside it; root/ also holds a link loop and a FIFO."""
    return make_area(tmp_path_factory.mktemp("contract"), BIG, odd=True)


@pytest.fixture(scope="module")
def control_dir(request):
    """The OpenSSH channel's ControlMaster directory (ssh only), the master closed at the end."""
    from adapters.sandboxes.ssh import close_pool

    d = tempfile.mkdtemp(prefix="cm", dir="/tmp")  # ControlPath must stay short
    yield d
    from tests.test_sandbox_ssh import make

    make(request.getfixturevalue("sshd_server"), None, "openssh", d).close()
    close_pool()
    shutil.rmtree(d, ignore_errors=True)


class Backend:
    """One backend's sandbox over the area, and what it shows beyond the contract."""

    def __init__(self, name: str, area: dict) -> None:
        self.name, self.area, self.root = name, area, area["root"]

    def sandbox(self):
        return LocalSandbox.with_roots((str(self.root),), home=str(self.root))

    def after_extract(self, info, name: str) -> None:
        """After a file of the area (`name`) was extracted."""

    def after_link(self) -> None:
        """After inside_link.bin was extracted."""

    def after_put(self) -> None:
        """After a put was delivered."""

    def nothing_opened(self) -> None:
        """After a refused extract or put."""


class SshBackend(Backend):
    def __init__(self, name: str, area: dict, sshd, control_dir: str) -> None:
        super().__init__(name, area)
        self.sshd, self.control_dir, self.opened = sshd, control_dir, []

    def sandbox(self):
        from tests.test_sandbox_ssh import make

        s = make(self.sshd, self.root, self.name[4:], self.control_dir, home=self.root)
        self.opened.append(s)
        return s

    def close(self) -> None:
        for s in self.opened:
            s.close()


class ModalBackend(Backend):
    """The stand-in sandbox `sb-contract`, `variant` as in tests/test_sandbox_modal.py."""

    def __init__(self, name: str, area: dict) -> None:
        super().__init__(name, area)
        from tests.test_sandbox_modal import make_box

        self.variant = name[len("modal-"):]
        self.box = make_box(self.variant, "sb-contract")

    def sandbox(self):
        from adapters.sandboxes.base import PathPolicy, SandboxRef
        from adapters.sandboxes.modal import ModalSandbox

        roots = (str(self.root),)
        return ModalSandbox(SandboxRef("modal", "sb-contract", roots=roots), PathPolicy(roots=roots, home=str(self.root)))

    def after_extract(self, info, name: str) -> None:
        assert info.sha256 == self.area["sums"][name]
        assert bool(self.box.opened) == (self.variant == "file_api")
        # resolve is one exec; the exec variants stream with one more (cat, its version compared
        # in the same exec), the file API asks the file's version once more after its last byte
        assert len(self.box.execs) == 2

    def after_link(self) -> None:
        # the resolved path is what is opened
        assert self.box.opened == ([str(self.root / "one_kb.bin")] if self.variant == "file_api" else [])

    def after_put(self) -> None:
        assert bool(self.box.opened) == (self.variant == "file_api")

    def nothing_opened(self) -> None:
        assert self.box.opened == []


@pytest.fixture
def b(request, area, monkeypatch):
    name = request.param
    if name == "local":
        yield Backend(name, area)
    elif name in SSH:
        backend = SshBackend(name, area, request.getfixturevalue("sshd_server"),
                             request.getfixturevalue("control_dir"))
        yield backend
        backend.close()
    else:
        try:
            import modal
        except ImportError:
            need(False, "the modal SDK is not installed (pip install modal)")
        from adapters.sandboxes import modal as modal_backend
        from tests.test_sandbox_modal import FakeSandbox

        monkeypatch.setattr(modal, "Sandbox", FakeSandbox)
        FakeSandbox.registry.clear()
        modal_backend.forget_handles()
        yield ModalBackend(name, area)
        modal_backend.forget_handles()


class Row(NamedTuple):
    values: tuple
    #: the backends the row runs on (None: every backend of its table)
    on: tuple[str, ...] | None


def row(*values, on: tuple[str, ...] | None = None) -> Row:
    """A row of a table that runs on the backends `on` only."""
    return Row(values, on)


def cases(*rows, backends: tuple[str, ...] = BACKENDS) -> list:
    """Each row (a Row, a tuple of values, or one value) once per backend of
    `backends` it runs on (every one unless the row says), the backend first:
    the backend fixture's parameter."""
    rows_ = [r if isinstance(r, Row) else Row(r if isinstance(r, tuple) else (r,), None) for r in rows]
    assert all(set(r.on or ()) <= set(backends) for r in rows_), "a row names a backend its table does not run"
    return [pytest.param(backend, *r.values, id=f"{backend}-{r.values[0]}")
            for r in rows_ for backend in backends if backend in (r.on or backends)]


every_backend = pytest.mark.parametrize("b", BACKENDS, indirect=True)


# -- extraction ------------------------------------------------------------------------------
@pytest.mark.parametrize("b, name", cases("empty.bin", "one_kb.bin", "big.bin"), indirect=["b"])
def test_extract_byte_identical(b, store, name):
    src = b.root / name
    info = b.sandbox().extract(str(src), store, f"files/{name}")
    assert info.sha256 in (None, b.area["sums"][name])  # an in-kernel copy (splice, reflink) hashes nothing
    assert info.size_bytes == src.stat().st_size
    blob = store.local_path(f"files/{name}")
    assert sha256_file(blob) == b.area["sums"][name]
    # a copy, never a link: the agent changing its file later cannot change the blob
    assert blob.stat().st_ino != src.stat().st_ino
    b.after_extract(info, name)


@every_backend
def test_link_inside_roots_is_followed(b, store):
    sb = b.sandbox()
    info = sb.extract(str(b.root / "inside_link.bin"), store, "files/l")
    assert info.sha256 in (None, b.area["sums"]["one_kb.bin"])
    assert sha256_file(store.local_path("files/l")) == b.area["sums"]["one_kb.bin"]
    b.after_link()
    assert sb.resolve(str(b.root / "inside_link.bin"))[0] == str(b.root / "one_kb.bin")


@every_backend
def test_over_the_cap_stores_nothing(b, store):
    with pytest.raises(TooLarge):
        b.sandbox().extract(str(b.root / "one_kb.bin"), store, "files/x", max_bytes=999)
    assert_store_empty(store)


@pytest.mark.parametrize("b, rel, exc", cases(
    ("missing.bin", FileMissing),
    ("nodir/missing.bin", FileMissing),
    ("dir", NotAFile),
    ("escape.txt", UnsafePath),
    ("outdir/secret.txt", UnsafePath),
    ("../outside/secret.txt", UnsafePath),
    (".ssh/authorized_keys", UnsafePath),          # home == the root: ~/.ssh stays denied under a root
    row("etc_link", UnsafePath, on=("local", *SSH)),
    row("dir/../one_kb.bin", UnsafePath, on=("local", *SSH)),
    row("one_kb.bin/below", FileMissing, on=("local",)),
    row("loop_a", UnsafePath, on=("local",)),
    row("fifo", NotAFile, on=("local",)),
), indirect=["b"])
def test_refused(b, store, rel, exc):
    with pytest.raises(exc):
        b.sandbox().extract(f"{b.root}/{rel}", store, "files/x")
    b.nothing_opened()
    assert_store_empty(store)


# -- inbound -----------------------------------------------------------------------------------
@pytest.mark.parametrize("b, size", cases(0, 1000, 5 * 1000 * 1000), indirect=["b"])
def test_put_byte_identical(b, store, tmp_path, size):
    src = tmp_path / "src.bin"
    want = write_random(src, size)
    with open(src, "rb") as f:
        store.put_stream("files/in", f)
    sb = b.sandbox()
    dest = b.root / f"inbox-{b.name}" / "deep" / f"in-{size}.bin"
    assert sb.put(store, "files/in", str(dest)) == str(dest)
    assert sha256_file(dest) == want
    assert [p for p in os.listdir(dest.parent) if "courier-part" in p] == []
    b.after_put()
    assert sb.put(store, "files/in", str(dest)) == str(dest)  # overwrite in place
    assert sha256_file(dest) == want


@pytest.mark.parametrize("b, dest, exc", cases(
    ("/etc/courier-test", UnsafePath),
    ("{outside}/dropped", UnsafePath),
    ("{root}/outdir/dropped", UnsafePath),
    ("{root}/escape.txt", UnsafePath),
    ("{root}/.ssh/authorized_keys", UnsafePath),
    ("{root}/../outside/dropped", UnsafePath),
    row("{root}/dir", NotAFile, on=("local", *SSH)),
    row("{root}/dir", UnsafePath, on=MODAL),
    row("{root}/one_kb.bin/f", NotAFile, on=MODAL),
    row("{root}/outdir/sub/dropped", UnsafePath, on=MODAL),   # a missing dir under a link out of the roots
), indirect=["b"])
def test_put_refused(b, store, dest, exc):
    store.put_bytes("files/in", b"payload")
    with pytest.raises(exc):
        b.sandbox().put(store, "files/in", dest.format(root=b.root, outside=b.area["outside"]))
    b.nothing_opened()
    assert sorted(os.listdir(b.area["outside"])) == ["secret.txt"]
    assert (b.area["outside"] / "secret.txt").read_text() == "secret"
    assert not os.path.exists("/etc/courier-test")
    assert [p for p in os.listdir(b.root) if "courier-part" in p] == []


@every_backend
def test_put_over_cap(b, store):
    store.put_bytes("files/in", b"x" * 100)
    dest = b.root / f"capped-{b.name}.bin"
    with pytest.raises(TooLarge):
        b.sandbox().put(store, "files/in", str(dest), max_bytes=99)
    assert not dest.exists()


@every_backend
def test_put_long_name(b, store):
    store.put_bytes("files/in", b"payload")
    dest = b.root / f"long-{b.name}" / ("n" * 250)
    assert b.sandbox().put(store, "files/in", str(dest)) == str(dest)
    assert dest.read_bytes() == b"payload"


# == the backends whose files are an image's tree: sandbox paths are not host paths ============
#: docker: a container on real rootful podman made with tests/test_sandbox_docker.py's SETUP;
#: singularity: the instance root of tests/test_sandbox_singularity.py (no apptainer binary here)
IMAGES = ("docker", "singularity")


@pytest.fixture(scope="module")
def docker_ctr(docker_api):
    from tests.test_sandbox_docker import SETUP

    with docker_api.container(SETUP) as c:
        yield c


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    from tests.test_sandbox_singularity import make_instances

    return make_instances(tmp_path_factory.mktemp("instances"))


class Image(NamedTuple):
    sb: object
    #: after a refused put: asserts the bytes reached no file outside the roots
    untouched: object


@pytest.fixture
def image(request):
    """An image backend's sandbox (default roots: /workspace, /tmp, the home)."""
    if request.param == "docker":
        from tests.fixtures._files import run_in

        ctr = request.getfixturevalue("docker_ctr")

        def passwd_untouched() -> None:
            assert run_in(ctr, ["sh", "-c", "grep -c payload /etc/passwd || true"]).strip() == b"0"

        with request.getfixturevalue("docker_api").sandbox(ctr) as s:
            yield Image(s, passwd_untouched)
    else:
        from tests.test_sandbox_singularity import sandbox_of

        instances = request.getfixturevalue("instances")

        def host_file_untouched() -> None:
            assert (instances / "host_only.txt").read_text() == "host file"

        yield Image(sandbox_of(instances), host_file_untouched)


@pytest.mark.parametrize("image, path, exc", cases(
    ("/workspace/nope", FileMissing),
    ("/workspace/dir", NotAFile),
    ("/workspace/pw", UnsafePath),                 # symlink to /etc/passwd
    ("/etc/passwd", UnsafePath),                   # denylisted
    ("/workspace/../etc/passwd", UnsafePath),
    row("/workspace/nodir/nope", FileMissing, on=("docker",)),
    row("/bin/busybox", UnsafePath, on=("docker",)),         # outside the roots
    row("workspace/f1k", UnsafePath, on=("docker",)),
    row("/workspace/f1k/below", FileMissing, on=("singularity",)),
    row("/workspace/dirlink", NotAFile, on=("singularity",)),
    row("/home/agent/.ssh/id_rsa", UnsafePath, on=("singularity",)),   # home denylist
    row("/bin", UnsafePath, on=("singularity",)),                      # outside the roots
    row("/workspace/host", FileMissing, on=("singularity",)),          # a host path is not the instance's
    row("/workspace/loop_a", UnsafePath, on=("singularity",)),
    backends=IMAGES), indirect=["image"])
def test_image_refused(image, store, path, exc):
    with pytest.raises(exc):
        image.sb.extract(path, store, "files/x")
    assert stored(store) == []


@pytest.mark.parametrize("image", IMAGES, indirect=True)
def test_image_over_cap_nothing_stored(image, store):
    with pytest.raises(TooLarge) as ei:
        image.sb.extract("/workspace/f1k", store, "files/x", max_bytes=1000)
    assert ei.value.size_bytes == 1024 and ei.value.limit_bytes == 1000
    assert stored(store) == []


@pytest.mark.parametrize("image, dest, exc", cases(
    ("/etc/evil", UnsafePath),
    ("/bin/evil", UnsafePath),
    ("/home/agent/.ssh/authorized_keys", UnsafePath),
    ("/workspace/../etc/evil", UnsafePath),
    ("/workspace/pw", UnsafePath),          # a link (to /etc/passwd)
    ("/workspace/dir", UnsafePath),         # a directory
    ("/workspace/f1k/x", NotAFile),
    ("/workspace/pw/sub/x", UnsafePath),    # a missing dir under a link out of the roots
    row("/workspace/host", UnsafePath, on=("singularity",)),
    backends=IMAGES), indirect=["image"])
def test_image_put_refused(image, store, dest, exc):
    store.put_bytes("in/b", b"payload")
    with pytest.raises(exc):
        image.sb.put(store, "in/b", dest)
    image.untouched()
