"""Telegram over python-telegram-bot (Bot API over HTTP; no polling, no updater).

- One Bot per event loop (`_aio.PerLoop`), all calls on the process's one loop.
- No rate limiter that waits: a 429 becomes `RateLimited` (the shared limits are enforced in Redis).
- Uploads stream the open file to httpx, never read whole.
- A `file_id` Telegram returned for the same bytes is sent instead of uploading again (`cache_key`: a
  hash of the token, never the token).

The token is part of every Bot API URL; it never appears in a repr, a log line or an exception message
(`_redact`, and httpx's log lines are filtered).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from typing import Any, TypeVar

import httpx
from telegram import Bot, InputFile, InputMediaAudio, InputMediaDocument, InputMediaPhoto, InputMediaVideo, Message
from telegram.constants import ChatAction
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Conflict,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.request import HTTPXRequest

from adapters.defaults import TELEGRAM_API_URL
from adapters.errors import ConfigError, DeliveryError, Permanent, RateLimited, Transient
from adapters.platforms import _aio
from adapters.platforms.base import MB, ErrorMap, FileRefused, FileSource, Kind, Limits, Platform, Sent
from adapters.platforms.base import dropping

__all__ = ["TelegramPlatform", "map_error"]

T = TypeVar("T")

#: a 429 without `parameters.retry_after` (a proxy, an odd server): wait this long
DEFAULT_RETRY_AFTER_S = 3.0

_ALBUM_MEDIA = {Kind.PHOTO: InputMediaPhoto, Kind.VIDEO: InputMediaVideo, Kind.AUDIO: InputMediaAudio,
                Kind.DOCUMENT: InputMediaDocument}
_CHAT_ID = re.compile(r"-?\d+")
#: the formats Telegram shows as audio (sendAudio) and as a voice note (sendVoice); any other
#: file sent so shows as a document, so it goes as one on purpose (`route_file`)
_SHOWN_AS = {Kind.AUDIO: (".mp3", ".m4a"), Kind.VOICE: (".ogg", ".oga", ".opus", ".mp3", ".m4a")}


# -- errors -------------------------------------------------------------------------------
class _HTTPStatus(TelegramError):
    """An HTTP status python-telegram-bot folds into a generic NetworkError (raised for a 413 only)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "<token>") if secret else text


def _msg(exc: BaseException, secret: str) -> str:
    return _redact(getattr(exc, "message", None) or str(exc) or type(exc).__name__, secret)


def _retry_after(exc: RetryAfter, secret: str = "") -> DeliveryError:
    s = getattr(exc, "_retry_after", None) or exc.retry_after  # (a timedelta since v22.2)
    s = s.total_seconds() if hasattr(s, "total_seconds") else float(s)
    return RateLimited(s, f"telegram: flood control, retry after {s:g}s")


def _unexpected(exc: BaseException, secret: str = "") -> DeliveryError:
    return Transient(f"telegram: unexpected {type(exc).__name__}: {_msg(exc, secret)}")


#: The one place Telegram's errors become courier's (`map_error(exc, secret)`: `secret` is redacted)
map_error = ErrorMap("telegram", [
    (RetryAfter, _retry_after),
    (_HTTPStatus, lambda exc, secret="": FileRefused(f"telegram: too large for the Bot API server ({exc.status}): "
                                                     f"{_msg(exc, secret)}", too_large=True)),
    (ChatMigrated, lambda exc, secret="": Permanent(f"telegram: the group is now the supergroup {exc.new_chat_id}; "
                                                    f"send to telegram:{exc.new_chat_id}")),
    # chat not found, bad file, text too long, ...; blocked by the user, kicked from the group
    ((BadRequest, Forbidden), lambda exc, secret="": Permanent(f"telegram: {_msg(exc, secret)}")),
    # 401 / 404: the token, or the base URL, is wrong
    (InvalidToken, lambda exc, secret="": Permanent("telegram: the Bot API rejected the bot token (401/404): check "
                                                    "TELEGRAM_BOT_TOKEN and COURIER_TELEGRAM_BASE_URL")),
    (Conflict, lambda exc, secret="": Permanent(f"telegram: conflict: {_msg(exc, secret)}")),
    (TimedOut, lambda exc, secret="": Transient(f"telegram: timed out: {_msg(exc, secret)}")),
    (NetworkError, lambda exc, secret="": Transient(f"telegram: {_msg(exc, secret)}")),  # 5xx, refused/reset
    ((TimeoutError, OSError), lambda exc, secret="": Transient(f"telegram: {type(exc).__name__}: {_msg(exc, secret)}")),
    (TelegramError, _unexpected),  # any other of the SDK's (EndPointNotFound, PassportDecryptionError): retried
], unexpected=_unexpected)


#: an upload body up to this size is sent in one write (httpx's own read chunk: the file is read whole anyway)
ONE_WRITE_BYTES = 64 * 1024


class _OneWrite(httpx.AsyncHTTPTransport):
    """httpx's transport, sending a small body in one write (a multipart upload streams ~10 socket writes)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) <= ONE_WRITE_BYTES \
                and not isinstance(request.stream, httpx.ByteStream):
            request.stream = httpx.ByteStream(b"".join([chunk async for chunk in request.stream]))  # type: ignore[union-attr]
        return await super().handle_async_request(request)


class _Request(HTTPXRequest):
    """HTTPXRequest that keeps the HTTP status python-telegram-bot would fold away."""

    async def do_request(self, url, method, request_data=None, **kw):  # type: ignore[override]
        code, payload = await super().do_request(url, method, request_data, **kw)
        if code == 413:
            raise _HTTPStatus(413, str(_json(payload).get("description") or "Request Entity Too Large"))
        if code == 429 and not _json(_json(payload).get("parameters")).get("retry_after"):
            raise RetryAfter(int(DEFAULT_RETRY_AFTER_S))
        return code, payload


def _json(payload: Any) -> dict:
    """A JSON object (bytes, or one already parsed); {} for anything else."""
    try:
        data = json.loads(payload) if isinstance(payload, bytes) else payload
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _redacting(secret: str) -> Callable[[logging.LogRecord], bool]:
    """A log filter: httpx logs every request URL at INFO; the Bot API URL holds the token."""

    def redact(record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad record is not ours to fix
            return True
        if secret in text:
            record.msg, record.args = _redact(text, secret), None
        return True

    return redact


# -- the adapter --------------------------------------------------------------------------
class TelegramPlatform(Platform):
    name = "telegram"

    def __init__(self, token: str, *, base_url: str = TELEGRAM_API_URL, local_api: bool = False,
                 bot_per_s: float | None = 30.0, connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0,
                 media_write_timeout_s: float = 120.0, pool_size: int = 32) -> None:
        if not token:
            raise ConfigError("telegram: TELEGRAM_BOT_TOKEN is not set")
        self._token = token
        self._base = base_url.rstrip("/")
        #: names this bot in shared Redis keys (file ids, rate limits): a hash, never the token
        self.cache_key = hashlib.sha256(b"telegram-bot:" + token.encode()).hexdigest()[:20]
        self.limits = self.limits_for(local_api=local_api, bot_per_s=bot_per_s)
        self._timeouts = (connect_timeout_s, read_timeout_s, media_write_timeout_s)
        self._pool_size = pool_size
        self._bots: _aio.PerLoop[Bot] = _aio.PerLoop(self._new_bot)
        redactor = _redacting(token)  # (token is never empty here)
        for logger in ("httpx", "httpcore", "telegram"):
            logging.getLogger(logger).addFilter(redactor)

    @classmethod
    def limits_for(cls, *, local_api: bool = False, bot_per_s: float | None = 30.0, **options: Any) -> Limits:
        return Limits(text_chars=4096, caption_chars=1024, upload_bytes=(2000 if local_api else 50) * MB,
                      photo_bytes=10 * MB, per_chat_per_s=1.0, per_group_per_min=20, per_bot_per_s=bot_per_s or None,
                      album_max=10)

    def __repr__(self) -> str:
        return f"TelegramPlatform(base_url={self._base!r}, bot={self.cache_key})"

    # -- plumbing ----------------------------------------------------------------------------
    def is_group(self, chat: str) -> bool:
        """Groups, supergroups and channels have negative ids (20 messages a minute)."""
        return chat.startswith("-")

    def _new_bot(self) -> Bot:
        connect, read, media_write = self._timeouts
        # (with a transport of its own, httpx takes the pool's limits from it)
        tls = _aio.tls()
        transport = _OneWrite(limits=httpx.Limits(max_connections=self._pool_size), verify=tls)
        request = _Request(connection_pool_size=self._pool_size, connect_timeout=connect, read_timeout=read,
                           write_timeout=30.0, pool_timeout=30.0, media_write_timeout=media_write,
                           httpx_kwargs={"transport": transport, "verify": tls})
        return Bot(self._token, base_url=f"{self._base}/bot", base_file_url=f"{self._base}/file/bot",
                   request=request, get_updates_request=_Request(connection_pool_size=1,
                                                                 httpx_kwargs={"verify": tls}))

    def _call(self, fn: Callable[[Bot], Awaitable[T]], *, timeout_s: float = 300.0) -> T:
        async def go() -> T:
            return await fn(self._bots.get())  # this loop's Bot

        try:
            return _aio.run(go(), timeout_s)
        except TelegramError as exc:
            raise map_error(exc, self._token) from None
        except TimeoutError:
            raise Transient(f"telegram: no answer within {timeout_s:g}s") from None

    @staticmethod
    def _chat(chat: str) -> int | str:
        return int(chat) if _CHAT_ID.fullmatch(chat) else chat

    @staticmethod
    def _timeout_for(size_bytes: int) -> float:
        return 120.0 + size_bytes / (1 * MB)  # at worst ~1 MB/s

    # -- sends -------------------------------------------------------------------------------
    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        msg = self._call(lambda bot: bot.send_message(self._chat(chat), text))
        return Sent(message_id=str(msg.message_id))

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        """Audio or a voice note of a format Telegram shows as a document (`_SHOWN_AS`) goes as one."""
        return Kind.DOCUMENT if kind in _SHOWN_AS and not file.name.lower().endswith(_SHOWN_AS[kind]) else kind

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        kind = self.route_file(kind, file)  # (the shared flow has routed it already: the same answer)
        field = kind.value if kind != Kind.TEXT else "document"  # Bot.send_<kind>(chat, <kind>=...)
        method = f"send_{field}"
        cid = self._chat(chat)
        if file_id:
            try:
                msg = self._call(lambda bot: getattr(bot, method)(cid, **{field: file_id, "caption": caption}))
                return Sent(message_id=str(msg.message_id), file_id=_file_id(msg, kind) or file_id)
            except Permanent as exc:
                if "file" not in exc.reason.lower():
                    raise
                # a stale or foreign file id: upload the bytes once more

        with file.open() as f:
            upload = InputFile(f, filename=file.name, read_file_handle=False)
            msg = self._call(lambda bot: getattr(bot, method)(cid, **{field: upload, "caption": caption}),
                             timeout_s=self._timeout_for(file.size_bytes))
        return Sent(message_id=str(msg.message_id), file_id=_file_id(msg, kind))

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        """Up to 10 files as one media group; the caption goes on the first item."""
        if not 2 <= len(files) <= self.limits.album_max:
            raise Permanent(f"telegram: an album holds 2 to {self.limits.album_max} items, not {len(files)}")
        with ExitStack() as stack:
            media = []
            for i, (kind, src) in enumerate(files):
                cls = _ALBUM_MEDIA.get(kind, InputMediaDocument)
                f = stack.enter_context(src.open())
                upload = InputFile(f, filename=src.name, attach=True, read_file_handle=False)
                media.append(cls(media=upload, caption=caption if i == 0 else None))
            total = sum(src.size_bytes for _, src in files)
            msgs = self._call(lambda bot: bot.send_media_group(self._chat(chat), media),
                              timeout_s=self._timeout_for(total))
        return [Sent(message_id=str(m.message_id), file_id=_file_id(m, kind)) for m, (kind, _) in zip(msgs, files)]

    # -- activity ----------------------------------------------------------------------------
    def typing(self, chat: str) -> None:
        self._call(lambda bot: bot.send_chat_action(self._chat(chat), ChatAction.TYPING), timeout_s=30)

    def start_progress(self, chat: str, text: str) -> str | None:
        msg = self._call(lambda bot: bot.send_message(self._chat(chat), text, disable_notification=True),
                         timeout_s=30)
        return str(msg.message_id)

    def edit_progress(self, chat: str, message_id: str, text: str) -> None:
        with dropping("not modified"):
            self._call(lambda bot: bot.edit_message_text(text, chat_id=self._chat(chat),
                                                         message_id=int(message_id)), timeout_s=30)

    def end_progress(self, chat: str, message_id: str) -> None:
        with dropping("not found"):
            self._call(lambda bot: bot.delete_message(self._chat(chat), int(message_id)), timeout_s=30)

    def close(self) -> None:
        """Close the Bots of the loops that run here (this thread's, the shared one)."""
        self._bots.close(lambda bot: bot.shutdown())


def _file_id(msg: Message, kind: Kind) -> str | None:
    """The reusable file id of what a message carries (largest photo size)."""
    att = getattr(msg, kind.value, None)
    if att is None:
        att = msg.effective_attachment
    if isinstance(att, tuple):  # photo sizes
        att = att[-1] if att else None
    return getattr(att, "file_id", None)
