"""courier's one error tree.

Every vendor error (SDK, HTTP, boto3, docker, paramiko) is translated into
one of these in one place per adapter, so the task layer decides retries
from the class alone::

    CourierError
    ├── ConfigError            bad settings / URL / target (user input)
    ├── DeliveryError          raised by platform adapters
    │   ├── RateLimited        retry after `retry_after_s` (re-scheduled, never slept)
    │   ├── Transient          5xx, timeouts, dropped connections: back off and retry
    │   └── Permanent          bad chat, forbidden, too large, bad request: no retry
    ├── SandboxError           raised by sandbox backends
    │   ├── UnsafePath         outside the allowed roots / denylisted / link escape
    │   ├── FileMissing        no such file in the sandbox
    │   ├── NotAFile           a directory, device, fifo ...
    │   ├── TooLarge           over the size cap (before or during transfer)
    │   ├── FileChanging       still being written while it was read (transient: read again later)
    │   └── SandboxGone        the sandbox vanished / connection lost (transient)
    └── StorageError           blob store failures
        └── BlobMissing        no such key
"""

from __future__ import annotations


class CourierError(Exception):
    """Root of every error courier raises on purpose."""

    #: whether retrying the same operation later may succeed
    transient: bool = False

    @property
    def reason(self) -> str:
        return str(self) or type(self).__name__


class ConfigError(CourierError):
    """Bad configuration or bad user input (target, URL, path)."""


class DeliveryError(CourierError):
    pass


class RateLimited(DeliveryError):
    transient = True

    def __init__(self, retry_after_s: float, message: str = "") -> None:
        self.retry_after_s = max(0.0, float(retry_after_s))
        super().__init__(message or f"rate limited: retry after {self.retry_after_s:g}s")


class Transient(DeliveryError):
    transient = True


class Permanent(DeliveryError):
    pass


class SandboxError(CourierError):
    pass


class UnsafePath(SandboxError):
    pass


class FileMissing(SandboxError):
    pass


class NotAFile(SandboxError):
    pass


class TooLarge(SandboxError):
    def __init__(self, message: str, *, size_bytes: int | None = None, limit_bytes: int | None = None) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes


class FileChanging(SandboxError):
    """The file changed (size or mtime) while it was read: what was read is
    not a whole version of it. Transient: the writer may finish; read again later."""

    transient = True


class SandboxGone(SandboxError):
    transient = True


class StorageError(CourierError):
    transient = True


class BlobMissing(StorageError):
    transient = False


__all__ = [
    "CourierError", "ConfigError", "DeliveryError", "RateLimited", "Transient", "Permanent",
    "SandboxError", "UnsafePath", "FileMissing", "NotAFile", "TooLarge", "FileChanging", "SandboxGone",
    "StorageError", "BlobMissing",
]
