"""The local sandbox: paths on the worker's own host, resolved (`realpath`)
and checked, then opened through :mod:`adapters.sandboxes.hostopen` (no link
followed, never a special file; real path and link count checked on the
descriptor), and that very descriptor copied (in the kernel into a volume).
No hard link is made: the agent could change a stored file."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
from collections.abc import Iterator, Sequence

from adapters.errors import FileMissing, NotAFile, UnsafePath
from adapters.sandboxes.base import (
    DEFAULT_EXEC_OUTPUT_BYTES, PathPolicy, PipeRun, Sandbox, SandboxRef, check_lexical,
    exec_argv, os_error, run_exec, store_fd, temp_beside, write_blob_at,
)
from adapters.sandboxes.hostopen import open_checked

CHUNK = 1024 * 1024
#: where an open descriptor's real path is read back from
_PROC_FD = os.path.isdir("/proc/self/fd")


class LocalSandbox(Sandbox):
    kind = "local"

    @classmethod
    def with_roots(cls, roots: tuple[str, ...], home: str | None = None) -> "LocalSandbox":
        resolved = tuple(os.path.realpath(r) for r in roots)
        return cls(SandboxRef("local", roots=resolved), PathPolicy(roots=resolved, home=home))

    def resolve(self, path: str) -> tuple[str, int]:
        check_lexical(path)
        try:
            real = os.path.realpath(path)
        except OSError as exc:  # a link swapped for a file between realpath's lstat and readlink (EINVAL)
            raise UnsafePath(f"{path}: changed while resolving ({exc.strerror})") from exc
        self.policy.check(real, shown=path)
        try:
            st = os.stat(real)
        except FileNotFoundError as exc:
            raise FileMissing(f"{path}: no such file") from exc
        except OSError as exc:  # EACCES, ENOTDIR (a file as a directory), ELOOP (a link cycle), ...
            raise os_error(exc, path) from exc
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(f"{path}: not a regular file")
        return real, st.st_size

    def _open(self, resolved: str) -> tuple[int, os.stat_result]:
        """The checked file open for reading (its real path and link count
        checked on the O_PATH descriptor first, see hostopen), and its fstat
        at the open: the version the copy must still be at its end."""
        def check(real: str, st: os.stat_result) -> None:
            self.policy.check(real, shown=resolved)
            self.policy.check_links(real, st.st_nlink, shown=resolved)

        return open_checked(resolved, shown=resolved, check=check)

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        with os.fdopen(self._open(resolved)[0], "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def _copy_out(self, path: str, store, key: str, *, max_bytes: int):
        resolved, size = self.resolve(path)
        self.check_size(path, size, max_bytes)
        fd, before = self._open(resolved)  # `before`: its fstat at the open, no byte read yet
        try:
            return store_fd(fd, before, store, key, max_bytes=max_bytes, shown=path)
        finally:
            os.close(fd)

    def _copy_in(self, store, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        parent = os.path.realpath(os.path.dirname(dest_path))
        name = os.path.basename(dest_path)
        dest = os.path.join(parent, name)
        self.policy.check(dest, shown=dest_path)
        if os.path.islink(dest):
            raise UnsafePath(f"{dest_path}: is a symbolic link")
        if os.path.isdir(dest):
            raise NotAFile(f"{dest_path}: is a directory")
        os.makedirs(parent, exist_ok=True)
        # the directory is opened once and what was opened is checked: a parent
        # swapped for a link after the check above cannot move the write elsewhere
        try:
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UnsafePath(f"{dest_path}: {parent} changed while opening ({exc.strerror})") from exc
        try:
            real = os.readlink(f"/proc/self/fd/{dfd}") if _PROC_FD else parent
            dest = self.policy.check(os.path.join(real, name), shown=dest_path)
            try:  # a temp name of our own (O_EXCL): concurrent puts never share or truncate one
                write_blob_at(dfd, name, temp_beside(name), store, key)
            except IsADirectoryError as exc:  # a directory appeared there meanwhile
                raise NotAFile(f"{dest_path}: is a directory") from exc
        finally:
            os.close(dfd)
        return dest

    # -- exec -------------------------------------------------------------------
    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """Run `argv` on this host in its own process group (see Sandbox.exec),
        in `cwd` (default: the first allowed root that is a directory), with a
        minimal environment (never the worker's own, which holds tokens). Not
        an isolation boundary: commands run as the worker's user."""
        args = exec_argv(argv)
        workdir = self._exec_cwd(cwd)
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir, env=_exec_env(self.policy.home), start_new_session=True,
            )
        except FileNotFoundError:
            return 127, b"", f"{args[0]}: command not found\n".encode()
        except PermissionError:
            return 126, b"", f"{args[0]}: permission denied\n".encode()
        return run_exec(_LocalRun(proc), timeout_s=timeout_s, max_output_bytes=max_output_bytes)

    def _exec_cwd(self, cwd: str | None) -> str:
        if cwd is None:
            if not self.policy.roots:
                raise UnsafePath("exec: no allowed roots to run in")
            cwd = next((r for r in self.policy.roots if os.path.isdir(r)), self.policy.roots[0])
        check_lexical(cwd)
        real = os.path.realpath(cwd)
        self.policy.check(real, shown=cwd)
        if not os.path.isdir(real):
            raise FileMissing(f"{cwd}: no such directory")
        return real


class _LocalRun(PipeRun):
    """A local process group: ended, all of it, by SIGKILL."""

    def end(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _exec_env(home: str | None) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
           "HOME": home or os.environ.get("HOME") or "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb"}
    env.update({k: os.environ[k] for k in ("USER", "LOGNAME", "TMPDIR", "TZ") if os.environ.get(k)})
    return env
