"""courier's one error tree: every vendor error is translated into one of these in one place per
adapter, so the task layer decides retries from the class alone::

    CourierError
    ├── ConfigError            bad settings / URL / target (user input)
    ├── DeliveryError          raised by platform adapters
    │   ├── RateLimited        retry after `retry_after_s` (re-scheduled, never slept)
    │   ├── Transient          5xx, timeouts, dropped connections: back off and retry
    │   └── Permanent          bad chat, forbidden, too large, bad request: no retry
    ├── SandboxError           raised by sandbox backends
    │   ├── UnsafePath         outside the allowed roots / denylisted / link escape
    │   │   └── ControlInName  a control character (NUL, newline, ESC) in the path: refused before any I/O
    │   ├── FileMissing        no such file in the sandbox
    │   ├── NotAFile           a directory, device, fifo ...
    │   ├── TooLarge           over the size cap (before or during transfer)
    │   ├── FileChanging       still being written while it was read (transient: read again later)
    │   ├── SandboxGone        the sandbox vanished / connection lost (transient)
    │   └── SandboxStalled     its sandbox stopped answering lately: postponed, not tried (transient)
    └── StorageError           blob store failures
        └── BlobMissing        no such key

`chat_words`: what a chat is told when such a failure ends its file or its turn; never the reason,
which names buckets, keys, endpoints and paths and stays in the receipt and the log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar


class CourierError(Exception):
    """Root of every error courier raises on purpose."""

    #: whether retrying the same operation later may succeed
    transient: bool = False
    #: what a chat is told when this failure ends its file or its turn (no detail: that is the reason's)
    chat_words: str = "something went wrong on courier's side; the operator was told"

    @property
    def reason(self) -> str:
        return str(self) or type(self).__name__


class ConfigError(CourierError):
    """Bad configuration or bad user input (target, URL, path)."""

    chat_words = "courier's configuration does not allow it; the operator was told"


class DeliveryError(CourierError):
    chat_words = "the chat platform did not take it"


class RateLimited(DeliveryError):
    transient = True
    chat_words = "the chat platform kept asking to slow down"

    def __init__(self, retry_after_s: float, message: str = "") -> None:
        self.retry_after_s = max(0.0, float(retry_after_s))
        super().__init__(message or f"rate limited: retry after {self.retry_after_s:g}s")


class Transient(DeliveryError):
    transient = True
    chat_words = "the chat platform did not answer"


class Permanent(DeliveryError):
    chat_words = "the chat platform refused it"


class SandboxError(CourierError):
    chat_words = "the file could not be read from the agent's workspace"


class UnsafePath(SandboxError):
    chat_words = "the agent named a file it may not share"


class ControlInName(UnsafePath):
    """A path holding a control character (a NUL, a newline, an ESC): never read."""

    chat_words = "its name holds a control character (a newline or a NUL)"


class FileMissing(SandboxError):
    chat_words = "it is not in the agent's workspace"


class NotAFile(SandboxError):
    chat_words = "what the agent named is not a regular file"


class TooLarge(SandboxError):
    chat_words = "the file is too large"

    def __init__(self, message: str, *, size_bytes: int | None = None, limit_bytes: int | None = None) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class FileChanging(SandboxError):
    """The file changed (size or mtime) while it was read: what was read is not a whole version of it.
    Transient: the writer may finish; read again later."""

    transient = True
    chat_words = "the file kept changing while it was read"


class SandboxGone(SandboxError):
    transient = True
    chat_words = "the agent's workspace could not be reached"


class SandboxStalled(SandboxError):
    """The sandbox's circuit breaker is open (tasks/turn/breaker.py): the extraction is postponed to
    `until_s` (epoch seconds) without reaching it."""

    transient = True
    chat_words = "the agent's sandbox stopped answering; the operator was told"

    def __init__(self, message: str, *, until_s: float) -> None:
        super().__init__(message)
        self.until_s = until_s


class StorageError(CourierError):
    transient = True
    chat_words = "storage unavailable; the operator was told"


class BlobMissing(StorageError):
    transient = False
    chat_words = "the file is no longer in storage"


def in_chat_words(exc: BaseException) -> str:
    """What a chat is told of `exc` (any exception: one not courier's is its root's words)."""
    return exc.chat_words if isinstance(exc, CourierError) else CourierError.chat_words


E = TypeVar("E", bound=CourierError)


class ErrorTable(Generic[E]):
    """An adapter's vendor errors and the courier error each becomes: rows `(vendor types, rule)`, tried
    in order; the first row whose types match and whose `rule(exc, *context)` gives an error wins."""

    def __init__(self, rows: Sequence[tuple[type | tuple[type, ...], Callable[..., E | None]]]) -> None:
        self.rows = tuple((t if isinstance(t, tuple) else (t,), rule) for t, rule in rows)

    def map(self, exc: object, *context: Any) -> E | None:
        for types, rule in self.rows:
            if isinstance(exc, types):
                out = rule(exc, *context)
                if out is not None:
                    return out
        return None

    def covers(self, cls: type) -> bool:
        """Whether a row of the table takes errors of type `cls` (not only a fallback)."""
        return any(issubclass(cls, types) for types, _rule in self.rows)


@contextlib.contextmanager
def translating(table: Callable[[], ErrorTable[Any]], *context: Any,
                then: Callable[[CourierError], None] | None = None) -> Iterator[None]:
    """Run the block with its vendor errors translated by `table()` (built only when an error comes: the
    vendor's module is imported then); one no row takes is raised as it is; `then(error)` runs before a
    translated one is raised (e.g. to drop a broken connection)."""
    try:
        yield
    except CourierError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated or re-raised
        mapped = table().map(exc, *context)
        if mapped is None:
            raise
        if then is not None:
            then(mapped)
        raise mapped from exc

