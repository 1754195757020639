"""Sandboxes: where agents make files. A serialisable :class:`SandboxRef`
names one; a backend opens it and extracts files into storage, streaming.

The sandbox is untrusted: every path is resolved *inside* the sandbox
(following links) and checked against the allowed roots and the denylist
before a byte moves, and checked again after transfer where the backend can.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import posixpath
import queue
import selectors
import subprocess
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar
from urllib.parse import parse_qsl, quote, unquote_to_bytes, urlparse

from adapters.defaults import MAX_FILE_BYTES
from adapters.errors import (
    ConfigError, FileChanging, FileMissing, SandboxError, SandboxGone, TooLarge, UnsafePath,
)
from adapters.sandboxes.routing import host_of

if TYPE_CHECKING:
    from storage.base import BlobInfo, BlobStore

DEFAULT_MAX_BYTES = MAX_FILE_BYTES
T = TypeVar("T")
#: Sandbox.exec: bytes kept per output stream, and the exit code of a timeout
DEFAULT_EXEC_OUTPUT_BYTES = 1024 * 1024
EXEC_TIMEOUT_EXIT = 124
#: how long exec keeps reading after the command exited (its children may still write)
EXEC_DRAIN_S = 1.0
#: how often exec asks whether a quiet command has exited
EXEC_POLL_S = 0.25

#: never read or delivered, whatever the roots say
DENYLIST: tuple[str, ...] = (
    "/etc", "/proc", "/sys", "/dev", "/root", "/boot", "/var/log", "/var/lib", "/var/run", "/run",
)
#: denied even below a root configured inside them (special files, not data)
NEVER_WAIVED: tuple[str, ...] = ("/proc", "/sys", "/dev")
#: relative to the sandbox user's home; each entry is a pattern of path
#: components (fnmatch: `*`, `?`, `[...]`) and covers everything under what it matches
HOME_DENYLIST: tuple[str, ...] = (
    ".ssh", ".aws", ".gnupg", ".kube", ".docker", ".config", ".netrc", ".git-credentials",
    ".password-store", ".azure", ".gcloud", ".npmrc", ".pypirc",
    # credentials of other tools, and shell / REPL histories (they hold pasted secrets)
    ".pgpass", ".my.cnf", ".s3cfg", ".boto", ".vault-token", ".dockercfg", ".terraformrc", ".databrickscfg",
    ".cargo/credentials*", ".terraform.d/credentials*", ".m2/settings*.xml", ".gem/credentials",
    ".composer/auth.json", ".local/share/keyrings", ".local/share/*history*", ".oci", ".mc",
    ".*history", ".env",
)

KINDS = ("local", "docker", "ssh", "modal", "singularity")


@dataclass(frozen=True)
class SandboxRef:
    """Where a file lives. `kind` picks the backend; `target` names the
    container / host / sandbox id / instance ('' for local)."""

    kind: str
    target: str = ""
    #: allowed roots; empty means the backend's defaults
    roots: tuple[str, ...] = ()
    #: extra backend options (user, port, host of a container, ...)
    options: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "roots": list(self.roots), "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SandboxRef":
        return cls(kind=d["kind"], target=d.get("target", ""), roots=tuple(d.get("roots") or ()),
                   options=dict(d.get("options") or {}))


def _text(part: str, what: str, uri: str) -> str:
    """A %-escaped part of a sandbox URI, decoded: UTF-8 or refused. A path's
    bytes that are not UTF-8 (`%FF`) would otherwise decode to U+FFFD and name
    another file, one that may exist; courier never guesses which file is meant."""
    try:
        return unquote_to_bytes(part).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} of sandbox URI {uri!r} is not UTF-8 once its %-escapes are decoded: "
                          "name the file by its UTF-8 name") from None


def parse_uri(uri: str) -> tuple[SandboxRef, str]:
    """`local:///abs/path`, `docker://ctr/abs/path`, `ssh://user@host:port/abs/path`,
    `modal://sb-id/abs/path`, `singularity://instance/abs/path` -> (ref, path);
    `?host=<worker host>` pins a sandbox to the queue `sandbox.<host>`. Every
    part is %-decoded as UTF-8; one that is not (`%FF`) is refused."""
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        # urlparse drops tabs and newlines silently: the URI would name another file
        raise ConfigError(f"control character in sandbox URI {uri!r}")
    try:
        uri.encode("utf-8")
    except UnicodeEncodeError:  # a command line's undecodable bytes (surrogate escapes)
        raise ConfigError(f"sandbox URI {uri!r} is not UTF-8 text: name the file by its UTF-8 name") from None
    p = urlparse(uri)
    kind = p.scheme.lower()
    if kind not in KINDS:
        raise ConfigError(f"unknown sandbox {kind!r} in {uri!r}: use one of {', '.join(KINDS)}")
    path = _text(p.path, "path", uri)
    if not path.startswith("/"):
        raise ConfigError(f"sandbox URI needs an absolute path: {uri!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ConfigError(f"control character in the path of sandbox URI {uri!r}")
    if kind == "local":
        if p.netloc not in ("", "localhost"):
            raise ConfigError(f"local sandbox URI is local:///abs/path, got {uri!r}")
        return SandboxRef("local"), path
    if not p.netloc:
        raise ConfigError(f"{kind} sandbox URI needs a {'host' if kind == 'ssh' else 'name'}: {uri!r}")
    options: dict[str, str] = {}
    try:
        pairs = parse_qsl(p.query, keep_blank_values=False, errors="strict")
    except UnicodeDecodeError:
        raise ConfigError(f"the options of sandbox URI {uri!r} are not UTF-8 once decoded") from None
    for k, v in pairs:
        if k != "host":
            raise ConfigError(f"unknown sandbox URI option {k!r} in {uri!r} (known: host)")
        options["host"] = v
    target = _text(p.netloc, "name", uri)
    if kind == "ssh":
        target = p.hostname or ""
        if p.username:
            options["user"] = _text(p.username, "user", uri)
        try:
            port = p.port
        except ValueError as exc:  # urlparse's "Port out of range" / "invalid literal"
            raise ConfigError(f"bad port in sandbox URI {uri!r}: {exc}") from None
        if port:
            options["port"] = str(port)
    ref = SandboxRef(kind, target, options=options)
    host_of(ref)  # a `?host=` that cannot name a queue is bad input here, before anything is registered
    return ref, path


def format_uri(ref: SandboxRef, path: str) -> str:
    if ref.kind == "local":
        return f"local://{quote(path)}"
    netloc = ref.target
    if ref.kind == "ssh":
        if "user" in ref.options:
            netloc = f"{quote(ref.options['user'])}@{netloc}"
        if "port" in ref.options:
            netloc = f"{netloc}:{ref.options['port']}"
    query = f"?host={quote(ref.options['host'])}" if ref.options.get("host") else ""
    return f"{ref.kind}://{netloc}{quote(path)}{query}"


@dataclass(frozen=True)
class PathPolicy:
    """Allowed roots and the denylist, applied to *resolved* paths: allowed
    under a root and under no denied prefix, except below a root configured
    strictly inside a denied system prefix (`/root/.local/share/courier`: the
    explicit root is the more specific rule); NEVER_WAIVED and the home's
    secrets (`home_denylist`) stay denied whatever the roots say. `links_ok`:
    roots under which a file with several hard links is still delivered."""

    roots: tuple[str, ...]
    home: str | None = None
    denylist: tuple[str, ...] = DENYLIST
    home_denylist: tuple[str, ...] = HOME_DENYLIST
    links_ok: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # normalised once: a check runs for every file, twice
        object.__setattr__(self, "_denied", tuple((d, _prefix(d)) for d in self.denylist))
        object.__setattr__(self, "_roots", tuple(_prefix(r) for r in self.roots))
        waivable = tuple(_prefix(d) for d in self.denylist if not _under(d, NEVER_WAIVED))
        roots = self._roots  # type: ignore[attr-defined]
        object.__setattr__(self, "_waives", tuple(frozenset(d for d in waivable if r.startswith(d) and r != d)
                                                  for r in roots))
        home = posixpath.normpath(self.home) if self.home and self.home.startswith("/") else None
        object.__setattr__(self, "_home", _prefix(home) if home and home != "/" else None)
        object.__setattr__(self, "_home_pats", tuple(
            tuple(c for c in d.split("/") if c) for d in self.home_denylist if d.strip("/")))
        object.__setattr__(self, "_links_ok", tuple(_prefix(r) for r in self.links_ok))

    def denied_reason(self, path: str) -> str | None:
        """The denylist entry that covers `path` (normalised, absolute), else None."""
        probe = _dir_form(path)
        waived = frozenset().union(*(w for r, w in zip(self._roots, self._waives)  # type: ignore[attr-defined]
                                     if probe.startswith(r)))
        for d, prefix in self._denied:  # type: ignore[attr-defined]
            if probe.startswith(prefix) and prefix not in waived:
                return str(d)
        home = self._home  # type: ignore[attr-defined]
        if home and probe.startswith(home):
            parts = [c for c in probe[len(home):].split("/") if c]
            for pat in self._home_pats:  # type: ignore[attr-defined]
                if len(parts) >= len(pat) and all(fnmatch.fnmatchcase(c, q) for c, q in zip(parts, pat)):
                    return str(posixpath.join(home, *pat))
        return None

    def check(self, resolved: str, *, shown: str | None = None) -> str:
        """Raise UnsafePath unless `resolved` (absolute, links resolved) is allowed."""
        shown = shown or resolved
        if not resolved.startswith("/") or "\x00" in resolved:
            raise UnsafePath(f"{shown}: not an absolute path")
        norm = posixpath.normpath(resolved)
        if norm != resolved.rstrip("/") and resolved != "/":
            raise UnsafePath(f"{shown}: path is not normalised")
        d = self.denied_reason(norm)
        if d is not None:
            raise UnsafePath(f"{shown}: {d} is never readable")
        if not _dir_form(norm).startswith(self._roots):  # type: ignore[attr-defined]
            raise UnsafePath(f"{shown}: outside the allowed roots ({', '.join(self.roots) or 'none'})")
        return norm

    def check_lexical_denied(self, path: str) -> None:
        """For a path that does not resolve: refuse it if denylisted as written."""
        d = self.denied_reason(posixpath.normpath(path)) if path.startswith("/") else None
        if d is not None:
            raise UnsafePath(f"{path}: {d} is never readable")

    def links_allowed(self, resolved: str) -> bool:
        """Whether a file with several hard links may be delivered from `resolved`."""
        return _dir_form(resolved).startswith(self._links_ok or ("\x00",))  # type: ignore[attr-defined]

    def check_links(self, resolved: str, nlink: int, *, shown: str | None = None) -> None:
        """Refuse a regular file with more than one hard link (another name of
        the same file may lie outside the roots), unless under `links_ok`."""
        if nlink > 1 and not self.links_allowed(resolved):
            raise UnsafePath(f"{shown or resolved}: has {nlink} hard links (another name may be outside the "
                             "allowed roots); refused")


def _dir_form(path: str) -> str:
    return path if path.endswith("/") else path + "/"


def _prefix(root: str) -> str:
    """`root` normalised with one trailing slash: `_dir_form(p)` starts with it
    exactly when p is root or under it."""
    return _dir_form(posixpath.normpath(root))


def _under(path: str, root: str | tuple[str, ...]) -> bool:
    roots = (root,) if isinstance(root, str) else root
    return _dir_form(path).startswith(tuple(_prefix(r) for r in roots))


def check_lexical(path: str) -> str:
    """Reject obviously hostile input before any I/O (relative, `..`, NUL)."""
    if not path.startswith("/"):
        raise UnsafePath(f"{path}: not an absolute path")
    if "\x00" in path:
        raise UnsafePath("path holds a NUL byte")
    if ".." in path.split("/"):
        raise UnsafePath(f"{path}: '..' is not allowed")
    return path


def check_size(shown: str, size: int, max_bytes: int) -> None:
    """The size cap, checked before a transfer (the one place its words are written)."""
    if size > max_bytes:
        raise TooLarge(f"{shown}: {size:,} bytes is over the {max_bytes:,} byte cap", size_bytes=size,
                       limit_bytes=max_bytes)


def grew_over_cap(shown: str, size: int | None, max_bytes: int) -> TooLarge:
    """The size cap, counted during a transfer: what to raise once `size`
    bytes arrived of a file that was within `max_bytes` when it was checked."""
    return TooLarge(f"{shown}: larger than the {max_bytes:,} byte cap", size_bytes=size, limit_bytes=max_bytes)


def os_error(exc: OSError, shown: str) -> SandboxError:
    """One clear, permanent courier error for what the OS said about `shown`
    (never a raw OSError as a chat's reason)."""
    code, why = exc.errno, exc.strerror or str(exc)
    if code in (errno.ENOENT, errno.ENOTDIR):
        return FileMissing(f"{shown}: no such file ({why})")
    if code == errno.ENAMETOOLONG:
        return FileMissing(f"{shown}: no such file (a name or the path is too long)")
    if code == errno.ELOOP:
        return UnsafePath(f"{shown}: a symbolic link loop (too many levels of symbolic links)")
    if code in (errno.EACCES, errno.EPERM):
        return UnsafePath(f"{shown}: permission denied")
    return SandboxError(f"{shown}: cannot be read ({why})")


#: default read deadline: a sandbox channel that sends nothing for this long is given up
DEFAULT_IO_TIMEOUT_S = 60.0


class ReadTimeout(SandboxGone):
    """A sandbox channel sent nothing within its read deadline (a stalled
    shell, a FIFO opened after the check): this attempt fails, not the worker."""


def with_deadline(chunks: Iterable[T], idle_s: float | None, what: str = "", *, ahead: int = 2,
                  abort: Callable[[], object] | None = None) -> Iterator[T]:
    """`chunks` (a blocking stream) read by a daemon thread, at most `ahead` ahead; none for
    `idle_s` seconds (None: no deadline): ReadTimeout. With `abort`: a consumer that stops
    early calls it, and the reader is closed and joined (a channel not safe to share)."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                q.put(item, timeout=0.1)
                return True
        return False

    def run() -> None:
        try:
            for chunk in chunks:
                if not put(("c", chunk)):
                    return
            put(("d", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(("e", exc))
        finally:
            if abort is not None:
                with contextlib.suppress(Exception):
                    chunks.close()  # type: ignore[attr-defined]

    t = threading.Thread(target=run, name="courier-read-ahead", daemon=True)
    t.start()
    kind = "c"
    try:
        while True:
            try:
                kind, item = q.get(timeout=idle_s)
            except queue.Empty:
                raise ReadTimeout(f"{what}: nothing received for {idle_s:g} s; given up") from None
            if kind == "d":
                return
            if kind == "e":
                raise item
            yield item
    finally:
        stop.set()
        if abort is not None:
            if kind == "c":  # the consumer stopped early
                with contextlib.suppress(Exception):
                    abort()
            t.join()


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()`'s result (or exception), run by a helper thread; ReadTimeout if
    it has not returned within `timeout_s` (the thread is left to end on its own)."""
    return next(with_deadline((fn() for _ in (0,)), timeout_s, what))


def temp_beside(path: str) -> str:
    """A private hidden temp name beside `path` (a bare name: in its directory), short enough for NAME_MAX."""
    parent, name = posixpath.split(path)
    return posixpath.join(parent, f".{name[:64]}.{uuid.uuid4().hex[:8]}.courier-part")


def deepest_existing(path: str, resolve: Callable[[str], T]) -> tuple[T, list[str]]:
    """`resolve` of the deepest of `path` and its ancestors that exists (`resolve` raises
    FileNotFoundError or FileMissing for one that does not), and the names below it, to be made."""
    missing: list[str] = []
    while True:
        try:
            return resolve(path), missing
        except (FileNotFoundError, FileMissing):
            if path == "/":
                raise
            missing.insert(0, posixpath.basename(path))
            path = posixpath.dirname(path) or "/"


def store_fd(fd: int, before: os.stat_result, store: BlobStore, key: str, *, max_bytes: int, shown: str,
             check: Callable[[], None] | None = None, kernel: bool = True) -> BlobInfo:
    """The file open as `fd` (`before`: its fstat at the open) into `store`, in
    the kernel where the store can and `kernel` (``put_fd``: no sha256), else
    streamed; kept only if `check()` passes and it is that version, whole: the
    same size, mtime and ctime at the end as at the open, and exactly its size
    copied (else FileChanging: a file still being written is never stored torn)."""
    def verdict(copied: int) -> None:
        if check is not None:
            check()
        after = os.fstat(fd)
        if not (before.st_size == after.st_size == copied and before.st_mtime_ns == after.st_mtime_ns
                and before.st_ctime_ns == after.st_ctime_ns):
            raise FileChanging(f"{shown}: changed while it was read ({before.st_size:,} -> {after.st_size:,} "
                               "bytes); read again later")

    put_fd = getattr(store, "put_fd", None) if kernel else None  # a store wrapper may have none
    info: BlobInfo | None = put_fd(key, fd, max_bytes=max_bytes) if put_fd is not None else None
    if info is not None:
        try:
            verdict(info.size_bytes)
        except BaseException:
            with contextlib.suppress(Exception):
                store.delete(key)
            raise
        return info

    def chunks() -> Iterator[bytes]:  # checked before the store publishes the blob
        n = 0
        while data := os.pread(fd, 1024 * 1024, n):
            n += len(data)
            yield data
        verdict(n)

    return store.put_stream(key, chunks(), max_bytes=max_bytes)


def write_blob_at(dfd: int, name: str, tmp: str, store: BlobStore, key: str, *, owner_of_dir: bool = False) -> None:
    """Stream blob `key` into `name` in the directory open as `dfd`, under the
    private temp name `tmp` (O_EXCL, no link followed) renamed over `name`
    once complete. `owner_of_dir`: the file takes the directory's owner."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
    try:
        if owner_of_dir:
            dst = os.fstat(dfd)
            with contextlib.suppress(PermissionError):
                os.fchown(fd, dst.st_uid, dst.st_gid)
        with os.fdopen(fd, "wb") as out:
            for chunk in store.iter_chunks(key):
                out.write(chunk)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise


class NoInbound(SandboxError, NotImplementedError):
    """A backend that does not take inbound files (:meth:`Sandbox.put`)."""


class Sandbox(ABC):
    """An opened sandbox. Backends implement `resolve`, `open_stream` (and
    may override `_copy_out` with a faster channel) and `_copy_in`; the
    templates `extract` and `put` hold the shared checks, never overridden."""

    kind: str = ""

    def __init__(self, ref: SandboxRef, policy: PathPolicy) -> None:
        self.ref = ref
        self.policy = policy

    @abstractmethod
    def resolve(self, path: str) -> tuple[str, int]:
        """(resolved path, size) of `path` resolved inside the sandbox (links
        followed) and checked. Raises FileMissing, NotAFile, UnsafePath."""

    @abstractmethod
    def open_stream(self, resolved: str) -> Iterable[bytes]:
        """Stream the bytes of an already resolved and checked regular file."""

    # -- the flow of a transfer: templates, the same for every backend ------------------
    def check_size(self, shown: str, size: int, max_bytes: int) -> None:
        """TooLarge when `size` is over `max_bytes` (see :func:`check_size`)."""
        check_size(shown, size, max_bytes)

    def extract(self, path: str, store: BlobStore, key: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> BlobInfo:
        """Copy one sandbox file into `store` at `key`. The size cap holds
        before and during the transfer; on any failure nothing is stored."""
        check_lexical(path)
        return self._copy_out(path, store, key, max_bytes=max_bytes)

    def _copy_out(self, path: str, store: BlobStore, key: str, *, max_bytes: int) -> BlobInfo:
        """`path` (lexically checked) resolved, checked, size-capped (an
        override calls :meth:`check_size` itself) and streamed into `store`."""
        resolved, size = self.resolve(path)
        self.check_size(path, size, max_bytes)
        return store.put_stream(key, self.open_stream(resolved), max_bytes=max_bytes)

    def home_dir(self) -> str | None:
        """The sandbox user's home (absolute, inside the sandbox), or None if not known."""
        return self.policy.home

    def expand_home(self, path: str) -> str:
        """`~/x` (an agent's `MEDIA:~/x`) under the sandbox's own home; any
        other path as is. The result is checked like any path."""
        if not path.startswith("~/"):
            return path
        home = self.home_dir()
        if not home or not home.startswith("/") or "\x00" in home:
            raise UnsafePath(f"{path}: the home of this {self.kind or 'sandbox'} sandbox is not known")
        return posixpath.join(posixpath.normpath(home), path[2:])

    def put(self, store: BlobStore, key: str, dest_path: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
        """Inbound: copy a stored blob into the sandbox at `dest_path`; the path written (resolved)."""
        check_lexical(dest_path)
        size = store.stat(key).size_bytes
        self.check_size(key, size, max_bytes)
        return self._copy_in(store, key, dest_path, size=size, max_bytes=max_bytes)

    def _copy_in(self, store: BlobStore, key: str, dest_path: str, *, size: int, max_bytes: int) -> str:
        """The blob `key` (`size` bytes, within the cap) written at
        `dest_path` (lexically checked), all or nothing."""
        raise NoInbound(f"{self.kind or type(self).__name__} sandbox does not take inbound files yet")

    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """(exit code, stdout, stderr) of `argv` (a list, no shell) run in the
        sandbox, stdin empty, in `cwd` (None: the backend's default) checked
        against the roots, with :func:`run_exec`'s rules; else SandboxError."""
        raise SandboxError(f"{self.kind or type(self).__name__} sandbox does not support running commands (exec)")

    def close(self) -> None:
        return None


# -- exec: the rules every backend shares ------------------------------------------------
class BoundedOutput:
    """One output stream of an exec: keeps the first half and the last half
    of `cap` bytes and counts what falls between (shown as one marker line)."""

    def __init__(self, cap: int) -> None:
        self.cap = max(0, int(cap))
        self.head_cap = self.cap - self.cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        over = len(self.tail) - (self.cap - self.head_cap)
        if over > 0:
            del self.tail[:over]
            self.dropped += over

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        return bytes(self.head) + f"\n[... {self.dropped:,} bytes omitted ...]\n".encode() + bytes(self.tail)


def exec_argv(argv: Sequence[str | bytes]) -> list[str]:
    """The argv of an exec as strings (bytes decoded as the OS would); never empty."""
    if isinstance(argv, (str, bytes)):
        raise SandboxError("exec takes an argv list, not a command string")
    args = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv]
    if not args:
        raise SandboxError("exec needs a command")
    if any("\x00" in a for a in args):
        raise SandboxError("exec: an argument holds a NUL byte")
    return args


class ExecRun(Protocol):
    """A started command as :func:`run_exec` drives it. `pump` adds what output
    is available (waiting up to `wait_s`), False once both streams ended;
    `poll` never blocks long; `wait` gives None if still running; `kill` ends
    the command and all it started (never raises); `close` is idempotent."""

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout_s: float) -> int | None: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


class PipeRun:
    """An :class:`ExecRun` of a local process with stdout and stderr as pipes
    (`err_head`: stderr's first 4 KiB); `end()` ends it where `kill` does not."""

    read_size = 65536

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        self.sel.register(proc.stdout, selectors.EVENT_READ, "out")
        self.sel.register(proc.stderr, selectors.EVENT_READ, "err")
        self.err_head = bytearray()
        self.closed = False

    def pump(self, wait_s: float, out: BoundedOutput, err: BoundedOutput) -> bool:
        if not self.sel.get_map():
            return False
        for key, _ in self.sel.select(timeout=wait_s):
            chunk = os.read(key.fd, self.read_size)
            if not chunk:
                self.sel.unregister(key.fileobj)
            elif key.data == "out":
                out.add(chunk)
            else:
                err.add(chunk)
                self.err_head += chunk[:4096 - len(self.err_head)]
        return bool(self.sel.get_map())

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int | None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def end(self) -> None:
        self.proc.kill()

    def kill(self) -> None:
        self.end()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sel.close()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        if self.proc.poll() is None:
            self.end()
        self.proc.wait()


def run_exec(run: ExecRun, *, timeout_s: float, max_output_bytes: int) -> tuple[int, bytes, bytes]:
    """Drive a started command to (exit code, stdout, stderr): output bounded
    per stream; past `timeout_s` it is killed, exit 124 with a note on stderr;
    once it exited, output is read for EXEC_DRAIN_S more, then what still holds
    it is killed too. A command killed by signal N exits 128 + N, as in a shell."""
    out, err = BoundedOutput(max_output_bytes), BoundedOutput(max_output_bytes)
    deadline = time.monotonic() + max(0.0, float(timeout_s))
    timed_out = False
    rc: int | None = None
    drain_until: float | None = None
    next_poll = time.monotonic() + min(EXEC_POLL_S, 0.05)  # quick commands: one early look
    streaming = True
    try:
        while streaming:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if rc is None and now >= next_poll:
                rc = run.poll()
                next_poll = now + EXEC_POLL_S
                if rc is not None:
                    drain_until = now + EXEC_DRAIN_S
            if drain_until is not None and now >= drain_until:
                break
            until = min(deadline, drain_until or deadline, next_poll if rc is None else deadline)
            streaming = run.pump(min(0.2, max(0.0, until - now)), out, err)
        held = streaming  # something the command started still holds its output
        if not timed_out and rc is None:
            rc = run.wait(max(0.0, deadline - time.monotonic()))
            timed_out = rc is None
        if timed_out or held:
            run.kill()
    except BaseException:
        run.kill()
        raise
    finally:
        run.close()
    if timed_out:
        err.add(f"\n[courier: timed out after {float(timeout_s):g}s; the command was killed]\n".encode())
        return EXEC_TIMEOUT_EXIT, out.value(), err.value()
    assert rc is not None
    if rc < 0:  # killed by signal N: reported as a shell does, 128 + N
        rc = 128 - rc
    return rc, out.value(), err.value()
