"""The blob store interface: one contract, several stores (volume, S3).

Keys are relative, `/`-separated, by purpose: ``files/…``, ``screenshots/…``,
``hook_outputs/…``. Every transfer streams in chunks; nothing reads a whole
blob into memory. A write is all-or-nothing: a failed or interrupted write
leaves no partial blob behind.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from adapters.errors import ConfigError, TooLarge

CHUNK_BYTES = 1024 * 1024

_BAD_KEY = re.compile(r"(^/)|(\\)|(^|/)\.\.?(/|$)|//|\x00")


def check_key(key: str) -> str:
    """Reject keys that could escape the store's root or are ambiguous."""
    if not key or _BAD_KEY.search(key) or key.endswith("/"):
        raise ConfigError(f"invalid storage key: {key!r}")
    return key


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size_bytes: int
    modified_s: float = 0.0
    sha256: str | None = None


class Writer(Protocol):
    def write(self, data: bytes) -> int: ...


ProgressFn = Callable[[int], None]


class BlobStore(ABC):
    """A place for blobs. Subclasses implement the abstract methods only."""

    #: the URL the store was opened from (no secrets in it)
    url: str = ""
    #: whether :meth:`signed_url` can return a link
    can_sign: bool = False

    # -- writing -------------------------------------------------------
    @abstractmethod
    def open_write(self, key: str, *, private: bool = False) -> AbstractContextManager[Writer]:
        """A writer for `key`; committed on clean exit, discarded on error."""

    def put_stream(
        self,
        key: str,
        src: BinaryIO | Iterable[bytes],
        *,
        max_bytes: int | None = None,
        private: bool = False,
        progress: ProgressFn | None = None,
    ) -> BlobInfo:
        """Stream `src` (a binary file or an iterable of chunks) into `key`.

        Hashes on the way (sha256) and enforces `max_bytes` while copying:
        over the cap raises :class:`TooLarge` and nothing is stored.
        """
        check_key(key)
        digest = hashlib.sha256()
        size = 0
        with self.open_write(key, private=private) as out:
            for chunk in iter_chunks(src):
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise TooLarge(
                        f"file is larger than the {max_bytes:,} byte cap",
                        size_bytes=size,
                        limit_bytes=max_bytes,
                    )
                digest.update(chunk)
                out.write(chunk)
                if progress is not None:
                    progress(len(chunk))
        return BlobInfo(key=key, size_bytes=size, sha256=digest.hexdigest(), modified_s=0.0)

    def put_fd(self, key: str, fd: int, *, max_bytes: int | None = None) -> BlobInfo | None:
        """Store an open local file by a faster channel than streaming, where
        the store has one (the volume: an in-kernel copy). None: not here,
        stream instead. The result may carry no sha256."""
        return None

    def put_pipe(self, key: str, fd: int, *, max_bytes: int | None = None,
                 wait: Callable[[], None] | None = None,
                 finish: Callable[[int], None] | None = None) -> BlobInfo | None:
        """Store what arrives on the pipe `fd` (to its end) by a faster channel
        than streaming, where the store has one (the volume: spliced in the
        kernel). `wait()` runs before each read (a read deadline: it raises to
        give up); `finish(size)` runs once the pipe has ended, before the blob
        is published (it raises to refuse it: nothing is stored). None: not
        here, nothing was read from `fd`; stream instead. No sha256."""
        return None

    def put_bytes(self, key: str, data: bytes, *, private: bool = False) -> BlobInfo:
        """Small payloads only (spill previews, test fixtures)."""
        return self.put_stream(key, [data], private=private)

    # -- reading -------------------------------------------------------
    @abstractmethod
    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A readable binary stream of the blob; :class:`BlobMissing` if absent."""

    def iter_chunks(self, key: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        with self.open_read(key) as f:
            while chunk := f.read(chunk_bytes):
                yield chunk

    @abstractmethod
    def stat(self, key: str) -> BlobInfo:
        """Size and modification time; :class:`BlobMissing` if absent."""

    def exists(self, key: str) -> bool:
        from adapters.errors import BlobMissing

        try:
            self.stat(key)
        except BlobMissing:
            return False
        return True

    def local_path(self, key: str) -> Path | None:
        """A filesystem path holding the blob, where the store has one."""
        return None

    # -- listing and deleting -----------------------------------------
    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Every blob whose key starts with `prefix`, with size and age."""

    @abstractmethod
    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete keys (batched where the store allows); returns how many went."""

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def sweep_tmp(self, older_than_s: float = 3600) -> int:
        """Remove what writes killed mid-way left behind (temp files, unfinished
        multipart uploads) older than `older_than_s`; returns how many went."""
        return 0

    # -- links -----------------------------------------------------------
    def signed_url(self, key: str, expires_s: int = 3600) -> str | None:
        """A time-limited download link, or None where the store cannot sign."""
        return None

    def describe(self, key: str) -> str:
        """Where a key lives, for humans (logs, spill headers)."""
        return f"{self.url.rstrip('/')}/{key}"


def iter_chunks(src: BinaryIO | Iterable[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Chunks from a binary file object or from an iterable of bytes."""
    read = getattr(src, "read", None)
    if read is not None:
        while chunk := read(chunk_bytes):
            yield chunk
        return
    for chunk in src:  # not a file object: an iterable of bytes
        if chunk:
            yield bytes(chunk)


class IterStream:
    """A read-only file object over an iterable of byte chunks (for SDKs that want `.read`)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()
        self._done = False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        while not self._done and (n < 0 or len(self._buf) < n):
            try:
                self._buf += next(self._it)
            except StopIteration:
                self._done = True
        if n < 0:
            n = len(self._buf)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close:
            close()
