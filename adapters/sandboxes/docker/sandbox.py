"""The docker sandbox: the flow of a file through the channels (see the
package's docstring), on top of the engine calls (:mod:`.engine`), the
archive channel (:mod:`.tar`) and the host fast paths (:mod:`.hostfs`)."""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

from adapters.errors import FileMissing, NotAFile, SandboxGone, UnsafePath
from adapters.sandboxes.base import (
    DEFAULT_IO_TIMEOUT_S, DEFAULT_MAX_BYTES, PathPolicy, ReadTimeout, Sandbox, SandboxRef, check_lexical,
)
from adapters.sandboxes.docker.engine import DockerExec, DockerRun, Engine
from adapters.sandboxes.docker.hostfs import HOST_ROOT_MIN_BYTES, extract_bound, extract_host_root
from adapters.sandboxes.docker.tar import (
    _GO_MODE_DIR, _GO_MODE_SYMLINK, _GO_MODE_TYPE, has_glob, iter_archive, tar_stream,
)
from adapters.sandboxes.execstream import (
    ExecStreamMixin, Resolved, exec_extract, exec_iter_file, exec_put, exec_resolve,
)

#: a path of more components than this is resolved by one exec, not one engine stat per component
MAX_STAT_WALK = 32


# the mixin's policy may be None until the first resolve learns $HOME (Sandbox's never is)
class DockerSandbox(ExecStreamMixin, Engine, Sandbox):  # type: ignore[misc]
    kind = "docker"

    def __init__(self, ref: SandboxRef, policy: PathPolicy | None = None, *, client: Any,
                 prefer_bind_mounts: bool = True, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
                 prefer_host_root: bool = True) -> None:
        """`policy` None: roots from the ref, else /workspace, /tmp and the
        exec user's $HOME, minus the denylist. `io_timeout_s`: read deadline
        of every exec's output."""
        self.policy = policy  # type: ignore[assignment]
        if not ref.target:
            raise UnsafePath("docker sandbox needs a container name or id")
        Engine.__init__(self, ref, client=client, io_timeout_s=io_timeout_s)
        self.prefer_bind_mounts = prefer_bind_mounts
        #: a local engine's container file read from the host (/proc/<pid>/root) instead of the archive API
        self.prefer_host_root = prefer_host_root
        self._exec = DockerExec(self)
        #: which channel moved each file (observability and tests)
        self.stats = {"bind": 0, "archive": 0, "host_root": 0, "exec": 0, "resolve_stat": 0, "resolve_exec": 0}
        #: (path, the engine's stat of it) when the last resolve was a link-free stat walk
        self._walk_stat: tuple[str, dict] | None = None

    def exec_channel(self) -> DockerExec:
        return self._exec

    def exec_start(self, argv: list[str], run_id: str, *, backstop_s: int | None = None) -> DockerRun:
        return DockerRun(self._exec, argv, run_id)

    # -- resolving ----------------------------------------------------------------------
    def _resolve(self, path: str) -> Resolved:
        """Resolved and checked: a stat walk through the archive API when the
        path holds no links, else ONE exec (`readlink -f` + `stat`)."""
        check_lexical(path)
        self._walk_stat = None
        r = self._resolve_by_stat(path)
        if r is None:
            r = exec_resolve(self._exec, path, policy_for=self.policy_for)
            self.stats["resolve_exec"] += 1
        self.policy_for(r.home).check(r.path, shown=path)
        return r

    def _home(self) -> str | None:
        """$HOME of the exec user: the container's env, else one exec, once."""
        if self._home_cache is None:
            env = (self._attrs().get("Config") or {}).get("Env") or []
            self._home_cache = next((e[5:] for e in env if e.startswith("HOME=")), "") or None
        return super()._home()

    def _resolve_by_stat(self, path: str) -> Resolved | None:
        """Resolved without an exec when every component is a plain directory
        and the last a regular file (the path *is* its resolution). None: a
        link on the way, a path the lexical policy refuses (a link may lead
        somewhere allowed), an engine without the stat call."""
        api = self.client.api
        # the engine would expand glob characters, and stats as root: exec resolves literally, as the user
        if (not all(hasattr(api, a) for a in ("head", "_url", "_raise_for_status")) or has_glob(path)
                or not self.runs_as_root()):
            return None
        parts = [p for p in path.split("/") if p and p != "."]  # `.` is a no-op lexically (`..` never gets here)
        if not parts or len(parts) > MAX_STAT_WALK:  # a deep path: ONE exec, not a request per component
            return None
        norm = "/" + "/".join(parts)
        home = self._home()
        try:
            self.policy_for(home).check(norm, shown=path)
        except UnsafePath:
            return None
        st: dict | None = None
        for i in range(len(parts)):
            try:
                st = self._stat("/" + "/".join(parts[: i + 1]))
            except SandboxGone:
                if not self.alive():
                    raise
                return None  # the engine failed on this path (a link loop: 500): exec says what it is
            if st is None:
                if not self.alive():
                    raise SandboxGone(f"container {self.ref.target} is gone")
                raise FileMissing(f"{path}: no such file")
            mode = int(st.get("mode", 0))
            if mode & _GO_MODE_SYMLINK:
                return None
            if i < len(parts) - 1 and not mode & _GO_MODE_DIR:
                raise FileMissing(f"{path}: {'/'.join(parts[: i + 1])} is not a directory")
        assert st is not None  # `mode`: the last component's
        if mode & _GO_MODE_DIR:
            raise NotAFile(f"{path}: is a directory")
        if mode & _GO_MODE_TYPE:
            raise NotAFile(f"{path}: not a regular file")
        self.stats["resolve_stat"] += 1
        self._walk_stat = (norm, st)
        return Resolved(path=norm, size=int(st.get("size", 0)), home=home)

    # -- outbound ------------------------------------------------------------------------
    def _copy_out(self, path: str, store, key: str, *, max_bytes: int):
        r = self._resolve(path)
        self.check_size(path, r.size, max_bytes)
        as_root = self.runs_as_root()
        if as_root and self.prefer_bind_mounts and self._engine_is_local():
            bound = self.bind_host_path(r.path)
            if bound is not None:
                return self._moved("bind", extract_bound(self, bound, path, store, key, max_bytes=max_bytes,
                                                         resolved=r.path))
        walked = self._walk_stat if self._walk_stat and self._walk_stat[0] == r.path else None
        if has_glob(r.path) or not as_root or walked is None:
            # the archive API would expand the name / read as root / follow a link swapped in:
            # exec reads the literal name as the container's user, from the fd it checked
            chunks = exec_iter_file(self._exec, r.path, expected_size=r.size, max_bytes=max_bytes,
                                    policy=self.policy_for(r.home))
            return self._moved("exec", store.put_stream(key, chunks, max_bytes=max_bytes))
        if self.prefer_host_root and r.size >= HOST_ROOT_MIN_BYTES and self._engine_is_local():
            # the archive API's read (as root, of a link-free path), from the host (see hostroot)
            info = extract_host_root(self, r, path, store, key, max_bytes=max_bytes, expect=walked[1])
            if info is not None:
                return self._moved("host_root", info)
        chunks = self.iter_archive(r.path, r.size, max_bytes=max_bytes, expect=walked[1])
        chunks = self._links_checked(chunks, r.path, self.policy_for(r.home))
        return self._moved("archive", store.put_stream(key, chunks, max_bytes=max_bytes))

    def _moved(self, channel: str, info):
        """`info`, counted as moved by `channel` (:attr:`stats`)."""
        self.stats[channel] += 1
        return info

    def _links_checked(self, chunks: Iterator[bytes], resolved: str, policy: PathPolicy) -> Iterator[bytes]:
        """`chunks` of the archive channel, whose stat carries no link count:
        ONE `stat` exec counts the file's hard links beside the transfer, and
        the last chunk is held back until it says 1 (else nothing is stored)."""
        if policy.links_allowed(resolved):
            yield from chunks
            return
        box: dict = {}

        def count() -> None:
            try:
                box["res"] = self._exec.exec_probe(["stat", "-c", "%h", "--", resolved])
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                box["exc"] = exc

        t = threading.Thread(target=count, name="courier-docker-nlink", daemon=True)
        t.start()
        held: bytes | None = None
        for chunk in chunks:
            if held is not None:
                yield held
            held = chunk
        t.join(self.io_timeout_s + 5)
        if t.is_alive():
            raise ReadTimeout(f"container {self.ref.target}: counting the links of {resolved} took too long")
        if "exc" in box:
            raise box["exc"]
        rc, out, err = box["res"]
        # rc 126/127, an image without `stat` (distroless): nothing counts the links there, and the
        # agent of a root container can read (and copy out) any file in it anyway
        if rc not in (126, 127):
            if rc != 0 or not out.strip().isdigit():
                raise SandboxGone(f"{resolved}: cannot count its links (exit {rc}: {err[:200]!r})")
            policy.check_links(resolved, int(out.strip()), shown=resolved)
        if held is not None:
            yield held

    def iter_archive(self, resolved: str, size: int | None, *, max_bytes: int,
                     expect: dict | None = None) -> Iterator[bytes]:
        """The file's bytes through ``get_archive``, member-checked (:func:`.tar.iter_archive`)."""
        return iter_archive(self, resolved, size, max_bytes=max_bytes, expect=expect)

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        if has_glob(resolved) or not self.runs_as_root():
            return exec_iter_file(self._exec, resolved, policy=self.policy)
        return self.iter_archive(resolved, None, max_bytes=DEFAULT_MAX_BYTES * 1000)

    def extract_via_exec(self, path: str, store, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES):
        """The universal fallback (one exec to resolve, one to stream)."""
        return self._moved("exec", exec_extract(self._exec, None, path, store, key, max_bytes=max_bytes,
                                                policy_for=self.policy_for))

    # -- inbound -------------------------------------------------------------------------
    def _copy_in(self, store, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """``put_archive`` of a tar generated on the fly under a temp name,
        then one exec renames it; in a container not running as root, exec
        stdin as its user (``put_archive`` writes as root: the user writes
        where it may and nowhere else)."""
        def put_archive(tmp: str, chunks: Iterator[bytes], uid: int, gid: int) -> bool:
            parent, name = posixpath.split(tmp)
            try:
                with self._errors("put_archive", path=parent):
                    self.client.api.put_archive(self.container_id, parent,
                                                tar_stream(name, size, chunks, uid=uid, gid=gid))
            except BaseException:
                # a cut upload may leave a partial temp file: best-effort removal (the original error matters)
                with suppress(Exception):
                    self._exec.exec_small(["rm", "-f", "--", tmp])
                raise
            return True

        return exec_put(self._exec, self.policy_for, store, key, dest_path, max_bytes=max_bytes,
                        write=put_archive if self.runs_as_root() else None)
