"""Singularity / Apptainer instances: the instance's files are on this host.

The instance root is, in order: ``instance_root`` given to the constructor;
``<instances_dir>/<instance>/rootfs``; else ``apptainer|singularity instance
list --json`` (a sandbox-directory image is its own root; a SIF instance is
reached through ``/proc/<pid>/root``, its mount namespace, bind mounts included).

Paths are resolved *inside* that root component by component with directory
fds (``O_NOFOLLOW`` on every step): symlinks are followed by hand, an
absolute target restarts from the instance root and ``..`` never climbs above
it, so no link can reach the host. The checked, link-free path is opened by
the same walk, refusing any link found now, its last component through
:mod:`adapters.sandboxes.hostopen` (a device or FIFO swapped in is never
opened on the host).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import shutil
import stat as statmod
import subprocess
from collections import deque
from collections.abc import Callable, Iterator

from adapters.errors import ConfigError, FileMissing, NotAFile, SandboxGone, UnsafePath
from adapters.sandboxes.base import (
    PathPolicy, Sandbox, SandboxRef, check_lexical, deepest_existing, os_error, store_fd, temp_beside,
    write_blob_at,
)
from adapters.sandboxes.hostopen import open_regular

CHUNK = 1024 * 1024
MAX_LINKS = 40
SINGULARITY_DEFAULT_ROOTS = ("/workspace", "/tmp")

_O_PATH = getattr(os, "O_PATH", os.O_RDONLY)
_DIR_FLAGS = _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def find_instance_root(instance: str, *, instance_root: str | None = None, instances_dir: str | None = None,
                       binary: str | None = None) -> str:
    """The host directory that is `instance`'s `/` (see module doc)."""
    if instance_root:
        if not os.path.isdir(instance_root):
            raise SandboxGone(f"instance root {instance_root} does not exist")
        return os.path.realpath(instance_root)
    if not instance or instance in (".", "..") or "/" in instance or "\x00" in instance:
        raise ConfigError(f"invalid singularity instance name {instance!r}")
    if instances_dir:
        cand = os.path.join(instances_dir, instance, "rootfs")
        if os.path.isdir(cand):
            return os.path.realpath(cand)
    exe = binary or shutil.which("apptainer") or shutil.which("singularity")
    if exe is None:
        if instances_dir:
            raise SandboxGone(f"singularity instance {instance!r} not found under {instances_dir}")
        raise ConfigError("no singularity instance root: set the instances dir or install apptainer/singularity")
    try:
        out = subprocess.run([exe, "instance", "list", "--json"], capture_output=True, timeout=30, check=True).stdout
        listing = json.loads(out or b"{}")
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        raise SandboxGone(f"cannot list singularity instances: {exc}") from exc
    return root_from_listing(listing, instance)


def root_from_listing(listing: dict, instance: str) -> str:
    """Pick `instance` out of `instance list --json` output."""
    for inst in listing.get("instances") or []:
        if inst.get("instance") != instance:
            continue
        img = inst.get("img") or ""
        if img and os.path.isdir(img):
            return os.path.realpath(img)
        pid = inst.get("pid")
        if isinstance(pid, int) and pid > 0 and os.path.isdir(f"/proc/{pid}/root"):
            return f"/proc/{pid}/root"
        raise SandboxGone(f"singularity instance {instance!r} has no reachable root")
    raise SandboxGone(f"singularity instance {instance!r} is not running")


class _Walk(contextlib.AbstractContextManager["_Walk"]):
    """Directory fds from the instance root down to a path's parent, closed on exit."""

    def __init__(self, root: str) -> None:
        try:
            self.fds: list[int] = [os.open(root, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
        except FileNotFoundError as exc:
            raise SandboxGone(f"instance root {root} is gone") from exc
        self.names: list[str] = []

    @property
    def cur(self) -> int:
        return self.fds[-1]

    def up(self) -> None:
        if len(self.fds) > 1:
            os.close(self.fds.pop())
            self.names.pop()

    def down(self, name: str) -> None:
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.cur)
        self.fds.append(fd)
        self.names.append(name)

    def path(self, leaf: str | None = None) -> str:
        return "/" + "/".join([*self.names, leaf] if leaf else self.names)

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)


def resolve_in_root(root: str, path: str) -> tuple[str, os.stat_result]:
    """Resolve absolute `path` as the instance sees it, never leaving `root`:
    (the path inside the instance, lstat of the final entry). FileMissing's
    `resolved` is what the path would name (a denied one is refused as an
    existing one is); other OS errors are one courier error (base.os_error)."""
    try:
        parts = deque(p for p in path.split("/") if p)
        links = 0
        with _Walk(root) as w:
            final: os.stat_result | None = None
            leaf: str | None = None
            while parts:
                part = parts.popleft()
                if part == ".":
                    continue
                if part == "..":
                    w.up()
                    continue
                try:
                    st = os.stat(part, dir_fd=w.cur, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError) as exc:
                    missing = FileMissing(f"{path}: no such file")
                    would = posixpath.normpath(posixpath.join(w.path(part), *parts))
                    missing.resolved = would  # type: ignore[attr-defined]
                    raise missing from exc
                except PermissionError as exc:
                    raise UnsafePath(f"{path}: permission denied") from exc
                if statmod.S_ISLNK(st.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise UnsafePath(f"{path}: a symbolic link loop (too many levels of symbolic links)")
                    target = os.readlink(part, dir_fd=w.cur)
                    while target.startswith("/") and len(w.fds) > 1:  # an absolute target: from the root
                        w.up()
                    parts.extendleft(reversed([p for p in target.split("/") if p]))
                    continue
                if parts:
                    if not statmod.S_ISDIR(st.st_mode):
                        raise FileMissing(f"{path}: {w.path(part)} is not a directory")
                    try:
                        w.down(part)
                    except OSError as exc:  # swapped for a link between stat and open
                        raise UnsafePath(f"{path}: changed while resolving ({exc.strerror})") from exc
                else:
                    final, leaf = st, part
            if final is None:  # the root itself
                return "/", os.fstat(w.cur)
            return w.path(leaf), final
    except OSError as exc:  # a link or directory swapped mid-walk, a name too long, ...
        if exc.errno == errno.EINVAL:  # readlink of an entry swapped for a non-link after its lstat
            raise UnsafePath(f"{path}: changed while resolving") from exc
        raise os_error(exc, path) from exc


def open_in_root(root: str, resolved: str, check: Callable[[int, os.stat_result], None] | None = None) -> int:
    """Open a resolved (link-free) path under `root`, refusing any link on the
    way; the last component goes through hostopen.open_regular (`check`ed on
    its O_PATH descriptor, opened for reading only if a regular file)."""
    parts = [p for p in resolved.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise UnsafePath(f"{resolved}: not a resolved file path")
    with _Walk(root) as w:
        try:
            for part in parts[:-1]:
                w.down(part)
            fd, _st = open_regular(parts[-1], dir_fd=w.cur, shown=resolved, check=check)
        except FileNotFoundError as exc:
            raise FileMissing(f"{resolved}: no such file") from exc
        except OSError as exc:  # ELOOP / ENOTDIR: a component became a link
            raise UnsafePath(f"{resolved}: changed after it was checked ({exc.strerror})") from exc
    return fd


class SingularitySandbox(Sandbox):
    kind = "singularity"

    def __init__(self, ref: SandboxRef, policy: PathPolicy | None = None, *, instance_root: str | None = None,
                 instances_dir: str | None = None, binary: str | None = None) -> None:
        """`policy` None: roots from the ref, else /workspace and /tmp (plus
        ``options["home"]`` when the ref names the instance user's home)."""
        if policy is None:
            home = ref.options.get("home") or None
            roots = tuple(ref.roots) or SINGULARITY_DEFAULT_ROOTS + ((home,) if home else ())
            policy = PathPolicy(roots=roots, home=home)
        super().__init__(ref, policy)
        self.root = find_instance_root(ref.target, instance_root=instance_root, instances_dir=instances_dir,
                                       binary=binary)

    def resolve(self, path: str) -> tuple[str, int]:
        check_lexical(path)
        try:
            resolved, st = resolve_in_root(self.root, path)
        except FileMissing as exc:  # a denied path is refused the same way, existing or not
            self.policy.check(getattr(exc, "resolved", None) or posixpath.normpath(path), shown=path)
            raise
        self.policy.check(resolved, shown=path)
        if statmod.S_ISDIR(st.st_mode):
            raise NotAFile(f"{path}: is a directory")
        if not statmod.S_ISREG(st.st_mode):
            raise NotAFile(f"{path}: not a regular file")
        return resolved, st.st_size

    def _open_checked(self, resolved: str) -> int:
        self.policy.check(resolved)
        return open_in_root(self.root, resolved, check=lambda _fd, st: self.policy.check_links(resolved, st.st_nlink))

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        with os.fdopen(self._open_checked(resolved), "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def _copy_out(self, path: str, store, key: str, *, max_bytes: int):
        resolved, size = self.resolve(path)
        self.check_size(path, size, max_bytes)
        fd = self._open_checked(resolved)
        try:
            return store_fd(fd, os.fstat(fd), store, key, max_bytes=max_bytes, shown=path, kernel=False)
        finally:
            os.close(fd)

    def make_dirs(self, path: str) -> str:
        """``mkdir -p`` inside the instance (0700 for what it makes), for a
        turn's workspace: this backend has no exec. Checked against the roots
        first; walked down one directory fd at a time, never through a link
        (a link on the way is refused)."""
        check_lexical(path)
        norm = self.policy.check(posixpath.normpath(path), shown=path)
        with _Walk(self.root) as w:
            for part in (p for p in norm.split("/") if p):
                try:
                    try:
                        w.down(part)
                    except FileNotFoundError:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(part, 0o700, dir_fd=w.cur)
                        w.down(part)
                except OSError as exc:  # ELOOP / ENOTDIR: a link or a file on the way
                    raise UnsafePath(f"{path}: cannot make {w.path(part)} ({exc.strerror})") from exc
        return norm

    def _copy_in(self, store, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """Write a stored blob into the instance: temp file + rename in the
        resolved destination directory (owned like that directory)."""
        name = posixpath.basename(dest_path)
        if not name:
            raise UnsafePath(f"{dest_path}: needs a file name")
        # the deepest existing ancestor, resolved in the instance; the rest is made
        # (e.g. <workspace>/inbox/ on a turn's first attachment)
        (parent, pst), missing = deepest_existing(posixpath.dirname(dest_path) or "/",
                                                  lambda cur: resolve_in_root(self.root, cur))
        missing = [m for m in missing if m not in ("", ".")]
        final = posixpath.join(parent, *missing, name)
        self.policy.check(final, shown=dest_path)
        if not statmod.S_ISDIR(pst.st_mode):
            raise NotAFile(f"{dest_path}: {parent} is not a directory")
        parts = [p for p in parent.split("/") if p]
        with _Walk(self.root) as w:
            try:
                for part in parts:
                    w.down(part)
                for part in missing:  # made here, owned like the directory they are made in
                    # made meanwhile (FileExistsError): entered below only if a real directory (O_NOFOLLOW)
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=w.cur)
                        owner = os.fstat(w.cur)
                        with contextlib.suppress(PermissionError):
                            os.chown(part, owner.st_uid, owner.st_gid, dir_fd=w.cur, follow_symlinks=False)
                    w.down(part)
                dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=w.cur)
            except OSError as exc:
                raise UnsafePath(f"{dest_path}: changed after it was checked ({exc.strerror})") from exc
        try:
            with contextlib.suppress(FileNotFoundError):
                old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if statmod.S_ISLNK(old.st_mode) or statmod.S_ISDIR(old.st_mode):
                    raise UnsafePath(f"{dest_path}: is a link or a directory")
            write_blob_at(dfd, name, temp_beside(name), store, key, owner_of_dir=True)
        finally:
            os.close(dfd)
        return final
