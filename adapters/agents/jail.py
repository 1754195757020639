"""The local sandbox's isolation boundary: every agent command courier starts
on its own host runs in a bubblewrap (``bwrap``) namespace sandbox.

An agent is untrusted code: unconfined it would run as the worker's uid, read
the worker's secrets from ``/proc/<pid>/environ``, reach Redis on loopback and
send as the bot. A :class:`Jail` gives it:

* **its own identity**: under a root worker the sandbox's init
  (``_jail_init.py``) drops to the turn's own uid and gid (``uid_base`` + a
  hash of the turn id), no groups, no capabilities, ``no_new_privs``; a worker
  that is not root cannot switch uids, so the agent gets a user namespace and
  the namespaces below are the boundary;
* **its own namespaces**: PID, IPC, UTS, cgroup and an empty network (no Redis,
  no metadata service); ``--die-with-parent``, a new session;
* **its own filesystem**: read-only system directories, a few files of ``/etc``
  and courier's Python; the workspace read-write; read-only the roots its config
  and the files its command name; a private ``/tmp``; nothing of the worker's;
* **an allowlisted environment** (``--clearenv``);
* **network** ``none``, or ``proxy``: only through courier's egress proxy, over
  a unix socket bound in (a forwarder on ``127.0.0.1:3128``, ``HTTP(S)_PROXY``);
* **limits** per turn (processes, open files, address space, file and workspace
  size); hitting one ends the turn with a message naming it (:meth:`Jail.limit_hit`).

``"isolation": "host"`` runs an agent unconfined: an explicit opt-in, warned
about at worker start. Where bwrap cannot make namespaces a local agent is
refused naming that opt-in (:func:`unavailable`), never run unconfined by surprise.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from adapters.agents.egress.policy import EgressPolicy
from adapters.agents.egress.proxy import EgressProxy

__all__ = ["Jail", "JailConfig", "Limits", "Network", "bind_paths", "unavailable"]

log = logging.getLogger(__name__)

Network = Literal["none", "proxy"]

#: where the forwarder listens inside the sandbox (its own network namespace: no port is shared)
PROXY_PORT = 3128
INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jail_init.py")
#: system directories bound read-only (or re-made as the links they are on this host)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/conda")
#: the parts of /etc a program needs to run (certificates, time zone, the loader, name service config)
ETC = ("ssl", "ca-certificates", "ca-certificates.conf", "alternatives", "localtime", "timezone", "nsswitch.conf",
       "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "mime.types", "protocols", "services", "host.conf",
       "gai.conf", "fonts", "python3", f"python3.{sys.version_info.minor}", "magic", "papersize")
#: never bound from a command's arguments: the kernel's views and the host's root
_NEVER = ("/proc", "/sys", "/dev", "/run")
#: inner uid of a user-namespace sandbox (a worker that is not root)
INNER_UID = 1000
GIB = 1024 ** 3


@dataclass(frozen=True)
class Limits:
    """A turn's limits (0: none). `memory_bytes` is the address space of each
    process (RLIMIT_AS); `workspace_bytes` caps each file (RLIMIT_FSIZE) and
    the workspace as a whole (measured while the agent runs), and sizes the
    private /tmp."""

    processes: int = 256
    open_files: int = 1024
    memory_bytes: int = 4 * GIB
    workspace_bytes: int = 2 * GIB


@dataclass(frozen=True)
class JailConfig:
    """The process's sandbox settings (workers/settings.py builds it)."""

    bwrap: str = "bwrap"
    uid_base: int = 720_000
    uid_span: int = 65_536
    #: more read-only paths every sandbox sees (tools installed outside /usr)
    ro_paths: tuple[str, ...] = ()
    #: the egress proxy's allowlist (as the browser's: host[:port], address or CIDR)
    allowed_hosts: tuple[str, ...] = ()


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


@lru_cache(maxsize=8)
def _probe(bwrap: str, euid: int) -> str | None:
    path = shutil.which(bwrap)
    if path is None:
        return f"{bwrap!r} is not installed (apt-get install bubblewrap)"
    argv = [path, *_namespace_flags(euid), "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]
    try:
        res = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    if res.returncode != 0:
        why = res.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bwrap cannot create namespaces here ({why[-1] if why else f'exit {res.returncode}'})"
    return None


def unavailable(config: JailConfig) -> str | None:
    """Why agents cannot be sandboxed on this host (None: they can). Tried
    once per process."""
    return _probe(config.bwrap, os.geteuid())


def _namespace_flags(euid: int) -> list[str]:
    flags = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session"]
    if euid != 0:  # no uid switch without root: a user namespace of its own instead
        flags += ["--unshare-user", "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--disable-userns"]
    return flags


def bind_paths(command: Sequence[str]) -> tuple[str, ...]:
    """The absolute paths a command names (its program, its script, its
    config files) that exist here: the sandbox sees them read-only."""
    paths = (os.path.normpath(a) for a in command if a.startswith("/") and a != "/" and "\x00" not in a)
    return tuple(p for p in paths if not any(p == n or p.startswith(n + "/") for n in _NEVER) and os.path.exists(p))


def _python_paths() -> tuple[str, ...]:
    """The interpreter courier runs on (the sandbox's init and Python agents use it)."""
    out = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix),
           os.path.dirname(os.path.realpath(sys.executable))}
    keep = sorted(p for p in out if not p.startswith("/usr/"))
    return tuple(p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep))


@dataclass
class Jail:
    """One turn's sandbox: its workspace, identity, network and limits.
    `argv` wraps a command; `start`/`close` (or ``with``) own the turn's
    egress proxy and the small files the sandbox sees (passwd, group)."""

    config: JailConfig
    workspace: str
    turn: str
    ro_paths: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    extra_allowed_hosts: tuple[str, ...] = ()
    _dir: str | None = field(default=None, init=False, repr=False)
    _proxy: EgressProxy | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def privileged(self) -> bool:
        return os.geteuid() == 0

    @property
    def uid(self) -> int:
        """The agent's uid on the host (root workers) or inside its user namespace."""
        if not self.privileged:
            return INNER_UID
        return self.config.uid_base + zlib.crc32(self.turn.encode()) % self.config.uid_span

    def own(self, path: str) -> None:
        """Give a file the worker put in the workspace (an attachment, a spill,
        a tool's write), and the directories above it up to the workspace, to
        the agent's uid: the agent can read and change what it was given."""
        if not self.privileged:
            return
        ws = os.path.realpath(self.workspace)
        p = os.path.realpath(path)
        if p != ws and not p.startswith(ws + "/"):
            return
        while True:
            with suppress(FileNotFoundError):
                os.chown(p, self.uid, self.uid, follow_symlinks=False)
            if p == ws:
                return
            p = os.path.dirname(p)

    def start(self) -> "Jail":
        if self._dir is None:
            d = tempfile.mkdtemp(prefix="courier-jail-")
            os.chmod(d, 0o711)
            passwd = ("root:x:0:0:root:/root:/bin/sh\n"
                      f"agent:x:{self.uid}:{self.uid}:agent:{self.workspace}:/bin/sh\n"
                      "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
            group = f"root:x:0:\nagent:x:{self.uid}:\nnogroup:x:65534:\n"
            for name, text in (("passwd", passwd), ("group", group)):
                with open(os.path.join(d, name), "w") as f:
                    f.write(text)
                os.chmod(os.path.join(d, name), 0o644)
            self._dir = d
            self.own(self.workspace)
        return self

    def close(self) -> None:
        with self._lock:
            proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "Jail":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _proxy_socket(self) -> str:
        """The turn's egress proxy (started on first use), listening on a unix socket."""
        assert self._dir is not None
        path = os.path.join(self._dir, "proxy.sock")
        with self._lock:
            if self._proxy is None:
                policy = EgressPolicy((*self.config.allowed_hosts, *self.extra_allowed_hosts))
                self._proxy = EgressProxy(policy).start(unix_path=path)
        return path

    @property
    def refusals(self) -> list:
        """What the turn's egress proxy refused (host, port, reason)."""
        return list(self._proxy.refusals) if self._proxy is not None else []

    def argv(self, command: Sequence[str], env: dict[str, str], *, network: Network = "none",
             writable: bool = True, cwd: str | None = None, also_ro: Sequence[str] = ()) -> list[str]:
        """`command` wrapped in bwrap: run this list instead (its own
        environment is `env`, nothing of the caller's). `writable`: the
        workspace (else read-only, as for hooks); `also_ro`: more paths this
        command sees read-only."""
        self.start()
        assert self._dir is not None
        bwrap = shutil.which(self.config.bwrap) or self.config.bwrap
        a = [bwrap, *_namespace_flags(os.geteuid()), "--hostname", "sandbox"]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        a += [x for e in (f"/etc/{n}" for n in ETC) if os.path.lexists(e) for x in ("--ro-bind-try", e, e)]
        a += ["--ro-bind", os.path.join(self._dir, "passwd"), "/etc/passwd",
              "--ro-bind", os.path.join(self._dir, "group"), "/etc/group",
              "--proc", "/proc", "--dev", "/dev"]
        tmp_bytes = self.limits.workspace_bytes
        for t in ("/tmp", "/var/tmp"):
            a += (["--size", str(tmp_bytes)] if tmp_bytes else []) + ["--perms", "1777", "--tmpfs", t]
        wanted = (os.path.normpath(p) for p in (*_python_paths(), *self.config.ro_paths, *self.ro_paths, *also_ro))
        ro = [p for p in dict.fromkeys(wanted) if not p.startswith("/usr/") and os.path.exists(p)]  # in order, once
        ws = os.path.normpath(self.workspace)
        # the directories above each bound path are made traversable (bwrap would make them 0700 as root)
        made = {"/", "/tmp", "/var/tmp", "/etc", "/run", "/proc", "/dev", *SYSTEM_DIRS}
        for target in (*ro, ws):
            for anc in _ancestors(target):
                if anc not in made:
                    made.add(anc)
                    a += ["--perms", "0755", "--dir", anc]
        for rp in ro:
            a += ["--ro-bind", rp, rp]
        a += ["--bind" if writable else "--ro-bind", ws, ws]
        a += ["--perms", "0755", "--dir", "/run/courier", "--ro-bind", INIT, "/run/courier/init.py"]
        lim = self.limits
        ident = [str(self.uid), str(self.uid)] if self.privileged else ["-", "-"]
        init = [*ident, *(str(v) if v else "-" for v in (lim.processes, lim.open_files, lim.memory_bytes,
                                                           lim.workspace_bytes))]
        full_env = {"HOME": self.workspace, "TMPDIR": "/tmp", "USER": "agent", "LOGNAME": "agent", **env}
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy",
                  "NO_PROXY", "no_proxy"):
            full_env.pop(k, None)
        if network == "proxy":
            a += ["--bind", self._proxy_socket(), "/run/courier/proxy.sock"]
            url = f"http://127.0.0.1:{PROXY_PORT}"
            full_env.update(HTTP_PROXY=url, HTTPS_PROXY=url, http_proxy=url, https_proxy=url)
        a += ["--chdir", cwd or self.workspace, "--clearenv"]
        for k, v in full_env.items():
            a += ["--setenv", k, v]
        a += ["--", sys.executable, "-I", "-S", "/run/courier/init.py", *init,
              str(PROXY_PORT) if network == "proxy" else "-", *command]
        return a

    def runnable(self, program: str, path: str | None) -> str | None:
        """Why `program` cannot start in the sandbox (None: it can): a bare
        name must be on PATH inside (the system directories), a path must be
        a file the sandbox sees."""
        if "/" in program:
            return None if os.path.isfile(program) and os.access(program, os.X_OK) else f"{program}: no such program"
        if shutil.which(program, path=path or "/usr/local/bin:/usr/bin:/bin") is None:
            return f"{program}: not found on PATH"
        return None

    def over_workspace(self) -> str | None:
        """The chat's words once the workspace is past its limit (None: within it). It is measured on
        disk (blocks, so a sparse file counts what it uses); the walk stops once past the limit."""
        cap = self.limits.workspace_bytes
        if not cap:
            return None
        total = 0
        for d, dirs, files in os.walk(self.workspace):  # symlinks not followed, unreadable entries skipped
            for name in (*dirs, *files):
                with suppress(OSError):
                    total += os.lstat(os.path.join(d, name)).st_blocks * 512
                if total > cap:
                    return f"the agent's workspace passed its limit of {_fmt_bytes(cap)}"
        return None

    def limit_hit(self, returncode: int | None, stderr_tail: str) -> str | None:
        """The limit an agent that failed ran into, in the chat's words (None: none that shows)."""
        lim = self.limits
        if returncode is not None and returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) and lim.workspace_bytes:
            return f"a file in the agent's workspace passed the limit of {_fmt_bytes(lim.workspace_bytes)}"
        t = stderr_tail.lower()
        if lim.open_files and "too many open files" in t:
            return f"the agent hit its limit of {lim.open_files:,} open files"
        if lim.processes and ("resource temporarily unavailable" in t or "errno 11]" in t) and (
                "fork" in t or "thread" in t or "blockingioerror" in t):
            return f"the agent hit its limit of {lim.processes:,} processes"
        if lim.memory_bytes and ("memoryerror" in t or "cannot allocate memory" in t or "out of memory" in t
                                 or "bad_alloc" in t):
            return f"the agent ran out of memory (its limit is {_fmt_bytes(lim.memory_bytes)})"
        if lim.workspace_bytes and ("file too large" in t or "no space left on device" in t):
            return f"a file in the agent's workspace passed the limit of {_fmt_bytes(lim.workspace_bytes)}"
        return None


def _ancestors(path: str) -> list[str]:
    """/a/b/c -> [/a, /a/b] (outermost first)."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def maybe(jail: Jail | None) -> AbstractContextManager:
    """``with maybe(jail):`` starts and closes a jail when there is one."""
    return nullcontext() if jail is None else jail
