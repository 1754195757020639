"""One harness per sandbox backend that runs here, with the same verbs for
the attack table (tests/attacks/test_attacks.py).

Every harness has a workspace `ws` (an allowed root), a home `home` (an
allowed root, holding denylisted secrets in `.ssh/id_rsa` and `.aws/credentials`)
and a directory `outside` that no root covers, holding `f.txt`: a secret of
the same length as the legit files the races use. Every secret holds
:data:`TOKEN`; the table asserts that no stored blob ever does.

Backends (what is real and what is not):

* ``local``: LocalSandbox on this host's filesystem.
* ``singularity``: SingularitySandbox on an instance root directory laid out
  like an unpacked rootfs (no apptainer binary on Debian 12); the code under
  test is the one reading a live instance's root.
* ``docker``: a root container on real rootful podman (Docker API socket):
  stat walk, archive API and exec channels; files made with ``exec_run``.
* ``docker-user``: a container running as uid 1000: every read through exec
  as that user.
* ``docker-bind``: a root container whose workspace is a bind-mounted host
  directory: the host-side bind channel (the one place a container's
  path reaches the host).
* ``ssh-sftp`` / ``ssh-openssh``: SshSandbox against a real OpenSSH server on
  127.0.0.1 (paramiko SFTP; the OpenSSH client with a ControlMaster). The
  "remote" host is this one, so the agent's moves are local file operations.
* ``modal``: ModalSandbox through its SDK boundary. Modal's cloud is not
  reachable from here: ``modal.Sandbox`` is replaced by the stand-in of
  tests/test_sandbox_modal.py (the real ``modal`` package and exception
  classes stay), whose exec runs the real command on this host, like
  modal 1.x without a file API.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

TOKEN = b"S3CR3T-" + uuid.uuid4().hex[:8].encode()   # 15 bytes, unique per run
SECRET = TOKEN + b"\n"                                 # 16 bytes
LEGIT = b"legit content!!\n"                           # 16 bytes: same size as SECRET
assert len(SECRET) == len(LEGIT)

HOST_VISIBLE = ("local", "singularity", "docker-bind", "ssh-sftp", "ssh-openssh", "modal")
ALL = ("local", "singularity", "docker", "docker-user", "docker-bind", "ssh-sftp", "ssh-openssh", "modal")


class Harness:
    """The verbs of the table for one backend. Paths given to the verbs are
    sandbox paths; host-visible backends map them to host paths (`hp`),
    the docker ones run a shell in the container."""

    name: str
    ws: str
    home: str
    outside: str
    #: extractions of the race rows (1000 where the race is a boundary)
    race_iterations = 1000

    @property
    def link_target(self) -> str:
        """What the link-swap race points the workspace's directory at: a
        directory outside the roots holding f.txt = SECRET."""
        return self.outside

    def sandbox(self, **kw):
        raise NotImplementedError

    # -- the agent's file operations ---------------------------------------------
    def hp(self, spath: str) -> Path | None:
        """Host path of a sandbox path (None: not visible from the host)."""
        return None

    def host_view(self, spath: str) -> Path:
        """Where this host's root reaches the agent's file `spath` (to act
        on it as the agent would, from the test's own thread): its host
        path, or (a container's own file) through the root of the
        container's process."""
        p = self.hp(spath)
        assert p is not None, f"{self.name}: no host view of {spath}"
        return p

    def sh(self, script: str, *args: str, user: str | None = None) -> bytes:
        """Run a shell script where the agent's files are (docker: in the container)."""
        res = subprocess.run(["sh", "-c", script, "sh", *args], capture_output=True)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def read_sh(self, script: str, *args: str) -> bytes:
        """A read-only script's output. Podman's Docker API can lose an exec's output on a loaded
        machine (exit 0, no bytes: an attach race of the engine, seen beside two CPU burners), so an
        empty answer is asked again (the script must print something)."""
        for _ in range(5):
            out = self.sh(script, *args)
            if out.strip():
                return out
        raise AssertionError(f"no output from {script!r} in 5 tries")

    def write(self, spath: str, data: bytes, mode: int = 0o644) -> str:
        p = self.hp(spath)
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            os.chmod(p, mode)
            return spath
        self._ctr_write(spath, data, mode)
        return spath

    def _ctr_write(self, spath: str, data: bytes, mode: int) -> None:
        raise NotImplementedError

    def write_repeated(self, spath: str, chunk: bytes, n: int) -> str:
        """`chunk` * `n` at `spath` (made in place: no big argument)."""
        p = self.hp(spath)
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as f:
                for _ in range(n):
                    f.write(chunk)
            return spath
        self.write(spath + ".chunk", chunk)
        self.sh('i=0; : > "$1"; while [ "$i" -lt "$2" ]; do cat "$1.chunk" >> "$1"; i=$((i+1)); done; rm "$1.chunk"',
                spath, str(n))
        return spath

    def symlink(self, target: str, spath: str) -> str:
        p = self.hp(spath)
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, p)
        else:
            self.sh('mkdir -p "$(dirname "$2")" && ln -s "$1" "$2"', target, spath)
        return spath

    def mkfifo(self, spath: str) -> str:
        p = self.hp(spath)
        if p is not None:
            os.mkfifo(p)
        else:
            self.sh('mkfifo "$1"', spath)
        return spath

    def mkdir(self, spath: str) -> str:
        p = self.hp(spath)
        if p is not None:
            p.mkdir(parents=True, exist_ok=True)
        else:
            self.sh('mkdir -p "$1"', spath)
        return spath

    def hardlink_secret(self, spath: str) -> str:
        """A hard link at `spath` (in the workspace) to a secret file outside the roots."""
        src, dst = self.hp(self.outside + "/f.txt"), self.hp(spath)
        if src is not None and dst is not None:
            os.link(src, dst)
        else:
            self.sh('ln "$1" "$2"', self.outside + "/f.txt", spath)
        return spath

    def remove(self, spath: str) -> None:
        p = self.hp(spath)
        if p is not None:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif os.path.lexists(p):
                p.unlink()
        else:
            self.sh('rm -rf -- "$1"', spath)

    def setup_common(self) -> None:
        """Secrets in the home and outside the roots."""
        self.mkdir(self.ws)
        self.write(self.home + "/.ssh/id_rsa", SECRET)
        self.write(self.home + "/.aws/credentials", SECRET)
        self.write(self.outside + "/f.txt", SECRET)

    def close(self) -> None:
        pass


# -- host-visible ---------------------------------------------------------------------------
class LocalHarness(Harness):
    name = "local"

    def __init__(self, base: Path) -> None:
        os.chmod(base, 0o755)
        self.ws, self.home, self.outside = str(base / "ws"), str(base / "home"), str(base / "outside")
        self.setup_common()
        # the secret outside is another user's, as /etc/shadow would be (SFTP tells files apart
        # by their attributes only: see docs/security.md, ssh)
        os.chown(self.outside + "/f.txt", 65534, 65534)
        os.chmod(self.outside + "/f.txt", 0o640)

    def hp(self, spath: str) -> Path | None:
        return Path(spath)

    def sandbox(self, **kw):
        from adapters.sandboxes.base import PathPolicy, SandboxRef
        from adapters.sandboxes.local import LocalSandbox

        roots = (self.ws, self.home)
        return LocalSandbox(SandboxRef("local", roots=roots), PathPolicy(roots=roots, home=self.home))


class SingularityHarness(Harness):
    name = "singularity"

    def __init__(self, base: Path) -> None:
        self.instances = base / "instances"
        self.root = self.instances / "agent1" / "rootfs"
        for d in ("workspace", "tmp", "etc", "home/agent", "opt/outside", "bin"):
            (self.root / d).mkdir(parents=True)
        (self.root / "etc" / "shadow").write_bytes(SECRET)
        self.ws, self.home, self.outside = "/workspace", "/home/agent", "/opt/outside"
        self.setup_common()

    def hp(self, spath: str) -> Path | None:
        return self.root / spath.lstrip("/")

    def sandbox(self, **kw):
        from adapters.sandboxes.base import SandboxRef
        from adapters.sandboxes.singularity import SingularitySandbox

        ref = SandboxRef("singularity", "agent1", options={"home": self.home})
        return SingularitySandbox(ref, None, instances_dir=str(self.instances))


class SshHarness(LocalHarness):
    def __init__(self, base: Path, sshd, mode: str) -> None:
        super().__init__(base)
        self.name = f"ssh-{mode}"
        self.sshd, self.mode = sshd, mode
        self.control_dir = tempfile.mkdtemp(prefix="cm", dir="/tmp")  # ControlPath must stay short
        self._opened: list = []
        # the reads run as the remote user (who can read and send on whatever the agent can):
        # the race is not a boundary here, as for modal
        self.race_iterations = 300
        if mode == "openssh":
            self.race_iterations = 50  # two ssh clients on the master an extraction

    def sandbox(self, *, home: bool = True, known_hosts: str | None = None, **kw):
        from adapters.sandboxes.base import PathPolicy, SandboxRef
        from adapters.sandboxes.ssh import SshSandbox

        roots = (self.ws, self.home)
        ref = SandboxRef("ssh", self.sshd.host, roots=roots,
                         options={"user": self.sshd.user, "port": str(self.sshd.port)})
        s = SshSandbox(ref, PathPolicy(roots=roots, home=self.home if home else None), key_path=self.sshd.key_path,
                       known_hosts=known_hosts or self.sshd.known_hosts, use_openssh=self.mode == "openssh",
                       control_dir=self.control_dir, **kw)
        self._opened.append(s)
        return s

    def close(self) -> None:
        from adapters.sandboxes.ssh import close_pool

        for s in self._opened:
            s.close()
        close_pool()
        shutil.rmtree(self.control_dir, ignore_errors=True)


class ModalHarness(LocalHarness):
    name = "modal"
    race_iterations = 300  # two host processes an extraction; the reads run as the sandbox's own user

    def __init__(self, base: Path) -> None:
        super().__init__(base)
        import modal

        from adapters.sandboxes import modal as modal_backend
        from tests.test_sandbox_modal import FakeSandbox, FakeSandboxNoFileApi

        self._saved = modal.Sandbox
        modal.Sandbox = FakeSandbox
        FakeSandbox.registry.clear()
        modal_backend.forget_handles()
        self.box = FakeSandboxNoFileApi("sb-attacks")
        FakeSandbox.registry["sb-attacks"] = self.box

    def sandbox(self, *, home: bool = True, **kw):
        from adapters.sandboxes.base import PathPolicy, SandboxRef
        from adapters.sandboxes.modal import ModalSandbox

        roots = (self.ws, self.home)
        return ModalSandbox(SandboxRef("modal", "sb-attacks", roots=roots),
                            PathPolicy(roots=roots, home=self.home) if home else None, **kw)

    def close(self) -> None:
        import modal

        from adapters.sandboxes import modal as modal_backend

        modal.Sandbox = self._saved
        modal_backend.forget_handles()


# -- docker -----------------------------------------------------------------------------------
class DockerHarness(Harness):
    """`variant`: "docker" (root), "docker-user" (uid 1000), "docker-bind"
    (root, the workspace a bind-mounted host directory)."""

    def __init__(self, base: Path, api, variant: str) -> None:
        self.name, self.api = variant, api
        self.home, self.outside = "/home/agent", "/opt/outside"
        self.bind: Path | None = None
        kw: dict = {}
        if variant == "docker-bind":
            self.bind = base / "bind"
            self.bind.mkdir()
            os.chmod(base, 0o755)
            os.chmod(self.bind, 0o777)
            kw["binds"] = {str(self.bind): "/workspace/bind"}
            self.ws = "/workspace/bind"
            # a host file outside the mount for hard links (the container cannot name it)
            self.host_secret = base / "host_secret.txt"
            self.host_secret.write_bytes(SECRET)
            (base / "hostout").mkdir()
            (base / "hostout" / "f.txt").write_bytes(SECRET)
            self._link_target = str(base / "hostout")  # a host path: what the bind channel would follow
        else:
            self.ws = "/workspace/w"
        if variant == "docker-user":
            kw["user"] = "1000:1000"
            # ~0.6 s an extraction (podman exec, twice); reads run as the container's own
            # user, inside it: a swap reaches nothing the agent cannot read and copy itself
            self.race_iterations = 30
        self.ctr = api.run_container(**kw)
        self.sh("mkdir -p /workspace/w /opt/outside /home/agent && chmod 1777 /workspace /workspace/w /tmp && "
                "chown 1000:1000 /home/agent && printf %s \"$1\" > /etc/shadow && chmod 600 /etc/shadow",
                SECRET.decode(), user="root")
        self.setup_common()
        self.client = api.client()

    @property
    def link_target(self) -> str:
        return getattr(self, "_link_target", None) or self.outside

    def hp(self, spath: str) -> Path | None:
        if self.bind is not None and (spath == self.ws or spath.startswith(self.ws + "/")):
            return self.bind / spath[len(self.ws):].lstrip("/")
        return None

    def host_view(self, spath: str) -> Path:
        p = self.hp(spath)
        if p is not None:
            return p
        if not getattr(self, "_pid", None):
            self.ctr.reload()
            self._pid = self.ctr.attrs["State"]["Pid"]
        return Path(f"/proc/{self._pid}/root") / spath.lstrip("/")

    def sh(self, script: str, *args: str, user: str | None = None) -> bytes:
        res = self.ctr.exec_run(["sh", "-c", script, "sh", *args], user=user or "root")
        assert res.exit_code == 0, res.output
        return res.output

    def _ctr_write(self, spath: str, data: bytes, mode: int) -> None:
        import base64

        self.sh('mkdir -p "$(dirname "$1")" && printf %s "$2" | base64 -d > "$1" && chmod "$3" "$1"',
                spath, base64.b64encode(data).decode(), oct(mode)[2:])

    def setup_common(self) -> None:
        self.mkdir(self.ws)
        for p in (self.home + "/.ssh/id_rsa", self.home + "/.aws/credentials", self.outside + "/f.txt"):
            self.write(p, SECRET)

    def hardlink_secret(self, spath: str) -> str:
        if self.bind is not None:
            os.link(self.host_secret, self.hp(spath))
            return spath
        return super().hardlink_secret(spath)

    def sandbox(self, **kw):
        from adapters.sandboxes.base import SandboxRef
        from adapters.sandboxes.docker import DockerSandbox

        return DockerSandbox(SandboxRef("docker", self.ctr.name), None, client=self.client, **kw)

    def close(self) -> None:
        self.client.close()
        self.api.remove_container(self.ctr.id)
