"""The platform interface: a chat platform declares `name` and `limits` and implements a few send
methods; the shared flow (routing, splitting, retries, rate limits, idempotency) is
`tasks.delivery.delivery`. Adapters raise only courier's errors, mapped in one place: `map_error`."""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from adapters.errors import ConfigError, CourierError, DeliveryError, ErrorTable, Permanent, Transient

T = TypeVar("T")

MB = 1000 * 1000
MiB = 1024 * 1024


class Kind(str, Enum):
    TEXT = "text"
    PHOTO = "photo"
    ANIMATION = "animation"
    VIDEO = "video"
    AUDIO = "audio"
    VOICE = "voice"
    DOCUMENT = "document"


@dataclass(frozen=True)
class Limits:
    text_chars: int
    caption_chars: int
    upload_bytes: int
    #: photos over this go as documents (None: no separate photo limit)
    photo_bytes: int | None = None
    #: per-kind upload limits where they differ from `upload_bytes`
    kind_upload_bytes: dict[Kind, int] = field(default_factory=dict)
    #: shared rate limits, enforced across all workers through Redis (`tasks.delivery.ratelimit`):
    #: a chat's sends start 1 / per_chat_per_s apart; per group and per bot, moving windows
    per_chat_per_s: float | None = None
    per_group_per_min: float | None = None
    per_bot_per_s: float | None = None
    #: kinds the platform shows natively; others fall back (animation -> photo, voice -> audio)
    native_kinds: frozenset[Kind] = frozenset(Kind)
    #: how many files one album (one message) may hold (0: no albums)
    album_max: int = 0

    def upload_limit(self, kind: Kind) -> int:
        return self.kind_upload_bytes.get(kind, self.upload_bytes)


@dataclass(frozen=True)
class FileSource:
    """A stored file handed to a platform: bytes come from storage, never a sandbox."""

    name: str
    size_bytes: int
    sha256: str
    #: opens a readable binary stream of the bytes (streamed; never read whole)
    opener: Callable[[], AbstractContextManager[BinaryIO]]
    #: a local filesystem path holding the bytes, when the store has one
    path: Path | None = None
    mime: str | None = None

    def open(self) -> AbstractContextManager[BinaryIO]:
        return self.opener()


class FileRefused(Permanent):
    """This file cannot go to this platform (a type or size it refuses, an empty file): the chat is
    told `notice` (short words for a person), with a download link when it can. `too_large`: a size refusal."""

    def __init__(self, reason: str, *, notice: str | None = None, too_large: bool = False) -> None:
        super().__init__(reason)
        self.notice = notice
        self.too_large = too_large


#: a row's rule: the vendor error (and the adapter's context) -> courier's error, or None
ErrorRule = Callable[..., "DeliveryError | None"]


class ErrorMap(ErrorTable[DeliveryError]):
    """An adapter's `map_error(exc, *context)`: an `ErrorTable`; courier's own errors pass as they are,
    what no row takes is `unexpected`'s (a Transient by default)."""

    def __init__(self, platform: str, rows: Sequence[tuple[type | tuple[type, ...], ErrorRule]], *,
                 unexpected: ErrorRule | None = None) -> None:
        super().__init__(rows)
        self.platform = platform
        self._unexpected = unexpected

    def __call__(self, exc: object, *context: Any) -> DeliveryError:
        if isinstance(exc, DeliveryError):
            return exc
        out = self.map(exc, *context)
        if out is None and self._unexpected is not None:
            out = self._unexpected(exc, *context)
        return out or Transient(f"{self.platform}: unexpected {type(exc).__name__}: {exc}")

    def call(self, fn: Callable[[], T], *context: Any) -> T:
        """`fn()`, with every error not courier's own raised as what the table makes of it."""
        try:
            return fn()
        except CourierError:
            raise  # ours already (a bad chat id, a storage error while streaming)
        except Exception as exc:  # noqa: BLE001 - every vendor error is translated here
            raise self(exc, *context) from exc


@contextlib.contextmanager
def dropping(*words: str) -> Iterator[None]:
    """Run the block; a Permanent whose reason holds one of `words` ends it quietly (a message gone, a no-op edit)."""
    try:
        yield
    except Permanent as exc:
        if not any(w in exc.reason for w in words):
            raise


@dataclass(frozen=True)
class Sent:
    """What a platform returned for one send."""

    message_id: str
    #: a reusable platform file id (Telegram's file_id), for upload-once-send-many
    file_id: str | None = None
    #: the kind the chat shows when it is not the kind asked for (Discord: a voice message it
    #: refused, sent as an audio attachment): what the receipt records
    kind: Kind | None = None


class Platform(ABC):
    """A chat platform: every capability the delivery flow asks about has its default here."""

    name: str = ""
    limits: Limits
    #: the bot account this adapter sends as, as a hash of its token (never the token):
    #: it keys the shared rate limits and the upload-once file-id cache (None: no cache)
    cache_key: str | None = None
    #: whether a 0-byte file can be sent (the outbox, a directory: yes; chat platforms: no)
    takes_empty_files: bool = False
    #: whether the platform reports a message's fate after accepting it (WhatsApp's status webhook:
    #: delivered, read, or failed); else a receipt is final at acceptance
    confirms_later: bool = False

    @classmethod
    def limits_for(cls, **options: Any) -> Limits:
        """The `limits` an adapter built with these options has, read without building one (no client)."""
        return cls.limits

    def is_group(self, chat: str) -> bool:
        """Whether `chat` is a group (the platform's per-group limit applies)."""
        return False

    def caption_chars_for(self, kind: Kind, file: FileSource) -> int:
        """The caption room of this file sent as `kind` (Discord's voice message: 0)."""
        return self.limits.caption_chars

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        """The kind the file goes as by the platform's own type rules; FileRefused when it cannot go at all."""
        return kind

    @abstractmethod
    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent: ...

    @abstractmethod
    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        """Send one file as `kind`; `file_id`: a cached platform id for the same bytes, sent instead of uploading."""

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        raise NotImplementedError

    # -- activity (optional; default: nothing) ---------------------------
    def typing(self, chat: str) -> None:
        return None

    def start_progress(self, chat: str, text: str) -> str | None:
        """Post a progress message; returns its id or None if unsupported."""
        return None

    def edit_progress(self, chat: str, message_id: str, text: str) -> None:
        return None

    def end_progress(self, chat: str, message_id: str) -> None:
        return None

    def close(self) -> None:
        return None

    def sweep_partial(self, older_than_s: float = 3600) -> int:
        """Remove partial writes a killed worker left (the outbox's); returns how many went."""
        return 0


#: what a chat id looks like on each platform (checked when a target is parsed, before
#: anything is enqueued), and how to say it
CHAT_IDS: dict[str, tuple[re.Pattern[str], str]] = {
    "telegram": (re.compile(r"-?\d{1,20}|@[A-Za-z][A-Za-z0-9_]{3,31}"),
                 "a numeric chat id (e.g. -100123) or a public channel's @username"),
    "discord": (re.compile(r"\d{1,20}"), "a numeric channel id (e.g. 1234567890123456789)"),
    "whatsapp": (re.compile(r"\+?\d{6,15}"), "a phone number in international format (e.g. +15551234567)"),
    "slack": (re.compile(r"[CGD][A-Z0-9]{2,}|#?[a-z0-9][a-z0-9._-]{0,79}"),
              "a channel id (e.g. C0123ABCD) or a channel name (e.g. #general)"),
}


def split_target(target: str) -> tuple[str, str]:
    """`<platform>:<chat id>` -> (platform, chat); a chat id that cannot be one on its platform
    (`discord:not-a-number`, `whatsapp:hello`) is a ConfigError."""
    platform, sep, chat = target.partition(":")
    if not sep or not platform or not chat or not platform.isidentifier():
        raise ConfigError(f"malformed target {target!r}: write <platform>:<chat id>, "
                          "e.g. outbox:demo or telegram:-100123")
    platform = platform.lower()
    rule = CHAT_IDS.get(platform)
    if rule is not None and not rule[0].fullmatch(chat):
        raise ConfigError(f"malformed target {target!r}: a {platform} chat is {rule[1]}")
    return platform, chat


def iter_file(file: FileSource, chunk_bytes: int = MiB) -> Iterator[bytes]:
    with file.open() as f:
        while chunk := f.read(chunk_bytes):
            yield chunk
