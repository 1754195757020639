"""Discord over discord.py's REST client (no gateway websocket), on the process's one asyncio loop
(`_aio`): one client and one login per process. Files go as attachments of one message, streamed.

- A voice note that is Ogg Opus goes as a native voice message (IS_VOICE_MESSAGE, `duration_secs` read by
  `_ogg`, a `waveform`, no content: its caption follows as text); one that is not, or that Discord refuses
  as one (`_VOICE_REFUSED`), as an audio attachment. discord.py cannot send voice messages itself:
  `_VoiceFile` and `HTTPClient.send_message` with `MessageFlags(voice=True)` do.
- Every message carries a nonce derived from its delivery id with `enforce_nonce`: a rerun after a lost
  receipt gets the original message back. Agent text never pings anyone (`allowed_mentions` none).
- No sleeping in a worker: discord.py's buckets are no-ops (courier's limits live in Redis), its 429 wait
  is capped so a 429 raises, and its 5xx retries are cut short by raising from an aiohttp trace hook.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable
from contextlib import ExitStack, closing
from typing import Any, TypeVar

import aiohttp
import discord

from adapters.defaults import DISCORD_API_URL
from adapters.errors import ConfigError, DeliveryError, Permanent, RateLimited, Transient
from adapters.platforms import _aio, _ogg
from adapters.platforms.base import ErrorMap, FileRefused, FileSource, Kind, Limits, MiB, Platform, Sent, dropping

__all__ = ["DiscordPlatform", "DEFAULT_UPLOAD_BYTES", "map_error"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: the default attachment cap since 2025 (boosted guilds allow more)
DEFAULT_UPLOAD_BYTES = 10 * MiB
#: statuses discord.py retries itself, sleeping 1-9 s in between
_SDK_RETRIED = frozenset({500, 502, 504, 524})
#: names and media types that may hold Ogg Opus (what Discord plays as a voice message)
_OGG_EXT = frozenset({".ogg", ".opus", ".oga"})
_OGG_MIME = frozenset({"audio/ogg", "audio/opus", "application/ogg"})
#: Discord's answers that refuse a message as a voice message (then it goes as an audio attachment): extra
#: content, not one audio attachment, bad metadata, a channel without voice messages, no permission
_VOICE_REFUSED = frozenset({50159, 50160, 50161, 50173, 50013})


def nonce_for(delivery_id: str) -> str:
    """The message nonce of a delivery (stable, at most 25 characters)."""
    return hashlib.sha256(delivery_id.encode()).hexdigest()[:25]


class _NoWaitBucket:
    """Stands in for discord.py's per-process `Ratelimit` bucket: never waits (limits are shared
    across workers in Redis; a 429 re-schedules the task)."""

    remaining = 1

    async def __aenter__(self) -> "_NoWaitBucket":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def update(self, response: object, *, use_clock: bool = False) -> None:
        return None


def _server_errors_raise() -> aiohttp.TraceConfig:
    """discord.py retries `_SDK_RETRIED` five times, sleeping between: raise instead (the task backs off)."""

    async def on_end(session: object, ctx: object, params: aiohttp.TraceRequestEndParams) -> None:
        resp = params.response
        if resp.status in _SDK_RETRIED:
            text = await resp.text(errors="replace")
            try:
                body: Any = json.loads(text) if "json" in (resp.content_type or "") else text
            except ValueError:
                body = text
            raise discord.DiscordServerError(resp, body)

    tc = aiohttp.TraceConfig()
    tc.on_request_end.append(on_end)
    return tc


class _StoredReader(io.RawIOBase):
    """A stored file as `discord.File` wants it (readable, seekable): reads stream from storage;
    seeking back to the start reopens it (io's own `tell` is `seek(0, SEEK_CUR)`)."""

    def __init__(self, file: FileSource) -> None:
        super().__init__()
        self._file = file
        self._cm: Any = None
        self._f: Any = None
        self._pos = 0
        self.name = file.name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset, whence = self._pos + offset, io.SEEK_SET
        if whence != io.SEEK_SET or offset not in (0, self._pos):
            raise io.UnsupportedOperation("a stored stream only seeks back to its start")
        if offset != self._pos:
            self._release()
            self._pos = 0
        return self._pos

    def readinto(self, b: Any) -> int:
        if self._f is None:
            self._cm = self._file.open()
            self._f = self._cm.__enter__()
        readinto = getattr(self._f, "readinto", None)
        if readinto is not None:
            n = readinto(b) or 0
        else:
            data = self._f.read(len(b))
            n = len(data)
            b[:n] = data
        self._pos += n
        return n

    def _release(self) -> None:
        cm, self._cm, self._f = self._cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def close(self) -> None:
        self._release()
        super().close()


def waveform_for(duration_s: float) -> bytes:
    """A voice message's waveform: one amplitude (0-255) per 100 ms (as clients sample), at most 256:
    a flat mid-level line of the right length (a real envelope needs an Opus decoder)."""
    return bytes([128]) * min(256, max(1, math.ceil(duration_s / 0.1)))


def _may_be_ogg(file: FileSource) -> bool:
    ext = os.path.splitext(file.name)[1].lower()
    mime = (file.mime or "").split(";")[0].strip().lower()
    return ext in _OGG_EXT or mime in _OGG_MIME


def _voice_filename(name: str) -> str:
    """Discord takes a voice message's audio by its `.ogg` name (discord.py sends every part as octet-stream)."""
    stem, ext = os.path.splitext(os.path.basename(name) or "voice-message.ogg")
    return name if ext.lower() == ".ogg" else f"{stem or 'voice-message'}.ogg"


class _VoiceFile(discord.File):
    """A `discord.File` whose `payload_json` entry carries a voice message's `duration_secs` and `waveform`."""

    __slots__ = ("duration_secs", "waveform")

    def __init__(self, fp: Any, filename: str, *, duration_secs: float, waveform: bytes) -> None:
        super().__init__(fp, filename=filename)
        self.duration_secs = duration_secs
        self.waveform = waveform

    def to_dict(self, index: int) -> dict[str, Any]:
        out = super().to_dict(index)
        out["duration_secs"] = self.duration_secs
        out["waveform"] = base64.b64encode(self.waveform).decode("ascii")
        return out


class DiscordPlatform(Platform):
    name = "discord"

    def __init__(self, token: str, *, base_url: str = DISCORD_API_URL, upload_bytes: int = DEFAULT_UPLOAD_BYTES,
                 timeout_s: float = 300.0) -> None:
        if not token:
            raise ConfigError("discord: DISCORD_BOT_TOKEN is not set")
        self.__token = token
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.limits = self.limits_for(upload_bytes=upload_bytes)
        self._client: discord.Client | None = None
        self._pid: int | None = None
        self._login_lock: asyncio.Lock | None = None
        #: the last file probed as a voice note and what was found (asked twice of one FileSource)
        self._voice_memo: tuple[FileSource, _ogg.OpusInfo | None] | None = None

    @classmethod
    def limits_for(cls, *, upload_bytes: int = DEFAULT_UPLOAD_BYTES, **options: Any) -> Limits:
        return Limits(
            text_chars=2000,
            caption_chars=2000,  # a file's caption is its message content
            upload_bytes=upload_bytes,
            per_chat_per_s=1.0,  # a channel's message bucket is 5 per 5 s
            per_bot_per_s=50.0,  # the global limit
            # VOICE: a native voice message when the file is Ogg Opus, else an audio attachment
            native_kinds=frozenset(Kind) - {Kind.ANIMATION},
            album_max=10,
        )

    def __repr__(self) -> str:
        return f"DiscordPlatform(base_url={self.base_url!r})"

    # -- the client -----------------------------------------------------------------
    async def _ready(self) -> discord.Client:
        pid = os.getpid()
        if self._pid != pid:  # a forked child: the parent's client belongs to another loop
            self._client, self._login_lock, self._pid = None, asyncio.Lock(), pid
        if self._client is not None:
            return self._client
        assert self._login_lock is not None
        async with self._login_lock:
            if self._client is not None:
                return self._client
            discord.http.Route.BASE = self.base_url
            # courier never joins voice channels: no "davey / PyNaCl is not installed, voice will
            # NOT be supported" warning at every client start
            discord.VoiceClient.warn_dave = False
            discord.VoiceClient.warn_nacl = False
            # (no gateway connection: intents only quiet the "guilds intent disabled" warning)
            client = discord.Client(intents=discord.Intents(guilds=True), http_trace=_server_errors_raise())
            # discord.py raises RateLimited for a 429 wait longer than this (its constructor floors it
            # at 30 s); courier never waits in a worker
            client.http.max_ratelimit_timeout = 1e-6
            client.http.get_ratelimit = lambda key: _NoWaitBucket()  # type: ignore[method-assign,assignment,return-value]
            try:
                await client.login(self.__token)
            except BaseException:
                await client.close()
                raise
            self._client = client
            return client

    def _run(self, what: str, fn: Callable[[discord.Client], Awaitable[T]]) -> T:
        async def go() -> T:
            return await fn(await self._ready())

        return map_error.call(lambda: _aio.run(go(), timeout_s=self.timeout_s), what)

    @staticmethod
    def _channel(client: discord.Client, chat: str) -> discord.PartialMessageable:
        try:
            cid = int(chat)
        except ValueError:
            raise Permanent(f"discord: channel id must be a number, not {chat!r}") from None
        return client.get_partial_messageable(cid)

    # -- sending ------------------------------------------------------------------------
    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        msg = self._run("send a message", lambda client: self._channel(client, chat).send(
            content=text, nonce=nonce_for(delivery_id), allowed_mentions=discord.AllowedMentions.none()))
        return Sent(message_id=str(msg.id))

    # -- voice messages ----------------------------------------------------------------------
    def voice_info(self, file: FileSource) -> _ogg.OpusInfo | None:
        """The file's Ogg Opus description when it can go as a voice message, else None
        (logged, never raised); a storage error while reading it propagates."""
        memo = self._voice_memo
        if memo is not None and memo[0] is file:
            return memo[1]
        info: _ogg.OpusInfo | None = None
        if _may_be_ogg(file):
            try:
                with file.open() as f:
                    info = _ogg.opus_info(f)
            except _ogg.OggError as exc:
                log.info("discord: %s goes as an audio attachment, not a voice message: %s", file.name, exc.reason)
            except OSError as exc:
                raise Transient(f"discord: I/O error reading {file.name}: {exc.strerror or exc}") from exc
        self._voice_memo = (file, info)
        return info

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        """A voice note that is not Ogg Opus goes as an audio attachment (and is recorded so)."""
        return Kind.AUDIO if kind == Kind.VOICE and self.voice_info(file) is None else kind

    def caption_chars_for(self, kind: Kind, file: FileSource) -> int:
        """A voice message holds no text: 0 (its caption follows as text messages)."""
        return 0 if kind == Kind.VOICE and self.voice_info(file) is not None else self.limits.caption_chars

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        if kind == Kind.VOICE and not caption:
            info = self.voice_info(file)
            if info is not None:
                return self._send_voice(chat, file, info, delivery_id)
        # (a caption that reaches here with a voice note rides on it as an audio
        # attachment: a voice message would lose it; tasks.delivery.delivery moves it out first)
        return self._send_files(chat, [file], caption, delivery_id)[0]

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        if not 0 < len(files) <= self.limits.album_max:
            raise Permanent(f"discord: a message holds 1 to {self.limits.album_max} files, not {len(files)}")
        return self._send_files(chat, [f for _, f in files], caption, delivery_id)

    def _send_files(self, chat: str, files: list[FileSource], caption: str | None, delivery_id: str) -> list[Sent]:
        msg_id = self._run("upload a file", lambda client: self._post_attachments(client, chat, files, caption,
                                                                                   delivery_id))
        return [Sent(message_id=msg_id) for _ in files]

    async def _post_attachments(self, client: discord.Client, chat: str, files: list[FileSource],
                                caption: str | None, delivery_id: str) -> str:
        channel = self._channel(client, chat)
        with ExitStack() as stack:
            attachments = [stack.enter_context(closing(discord.File(self._source_of(f, stack), filename=f.name)))
                           for f in files]
            msg = await channel.send(content=caption or None, files=attachments, nonce=nonce_for(delivery_id),
                                     allowed_mentions=discord.AllowedMentions.none())
        return str(msg.id)

    @staticmethod
    def _source_of(f: FileSource, stack: ExitStack) -> Any:
        """What `discord.File` reads: the local path, else a reader over the stored stream
        (closed with `stack`, after the `discord.File` made of it)."""
        if f.path is not None:
            return str(f.path)
        return stack.enter_context(closing(_StoredReader(f)))

    def _send_voice(self, chat: str, file: FileSource, info: _ogg.OpusInfo, delivery_id: str) -> Sent:
        """One voice message; refused as one (`_VOICE_REFUSED`): the same file as an audio
        attachment, same nonce (Discord created nothing under it)."""
        nonce = nonce_for(delivery_id)

        async def go(client: discord.Client) -> Sent:
            channel = self._channel(client, chat)
            try:
                with ExitStack() as stack:
                    voice = stack.enter_context(closing(_VoiceFile(
                        self._source_of(file, stack), _voice_filename(file.name),
                        duration_secs=round(info.duration_s, 3), waveform=waveform_for(info.duration_s))))
                    # (Messageable.send takes no flags: the same parameters it builds, with the voice flag)
                    with discord.http.handle_message_parameters(
                            files=[voice], flags=discord.MessageFlags(voice=True), nonce=nonce,
                            allowed_mentions=discord.AllowedMentions.none()) as params:
                        data = await client.http.send_message(channel.id, params=params)
                    return Sent(message_id=str(data["id"]))
            except discord.HTTPException as exc:
                if exc.code not in _VOICE_REFUSED:
                    raise
                log.warning("discord: %s refused as a voice message (%s %s, code %s): sent as an audio attachment",
                            file.name, exc.status, exc.text, exc.code)
            return Sent(message_id=await self._post_attachments(client, chat, [file], None, delivery_id),
                        kind=Kind.AUDIO)

        return self._run("send a voice message", go)

    # -- activity --------------------------------------------------------------------------
    def typing(self, chat: str) -> None:
        self._run("show typing", lambda client: client.http.send_typing(self._channel(client, chat).id))

    def start_progress(self, chat: str, text: str) -> str | None:
        msg = self._run("post a progress message", lambda client: self._channel(client, chat).send(
            content=text, allowed_mentions=discord.AllowedMentions.none()))
        return str(msg.id)

    def edit_progress(self, chat: str, message_id: str, text: str) -> None:
        self._run("edit the progress message",
                  lambda client: self._channel(client, chat).get_partial_message(int(message_id)).edit(content=text))

    def end_progress(self, chat: str, message_id: str) -> None:
        with dropping("discord: not found"):  # already gone
            self._run("delete the progress message",
                      lambda client: self._channel(client, chat).get_partial_message(int(message_id)).delete())

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            try:
                _aio.run(client.close(), timeout_s=10)
            except Exception:  # noqa: BLE001 - closing is best effort
                log.debug("discord: closing the client failed", exc_info=True)


# -- the one error map ----------------------------------------------------------------------
def _retry_after(exc: discord.HTTPException) -> float:
    headers = getattr(exc.response, "headers", None) or {}
    for name in ("X-RateLimit-Reset-After", "Retry-After"):
        with contextlib.suppress(TypeError, ValueError):  # (none, or not a number: the next)
            return float(headers.get(name, ""))
    return 1.0


def _http(exc: discord.HTTPException, what: str = "") -> DeliveryError:
    status = exc.status
    detail = " ".join(f"{status} {exc.text or getattr(exc.response, 'reason', '')}".split())
    if exc.code:
        detail += f" (code {exc.code})"
    if status == 429:  # e.g. without a Via header discord.py does not treat it as its own
        ra = _retry_after(exc)
        return RateLimited(ra, f"discord: rate limited, retry after {ra:g}s")
    if status >= 500:
        return Transient(f"discord: server error {detail} ({what})")
    if status == 413 or exc.code == 40005:  # a guild's cap below the setting: the chat gets the notice
        return FileRefused(f"discord: too large: {detail}", too_large=True)
    if status == 401:
        return Permanent(f"discord: the bot token was rejected ({detail})")
    if isinstance(exc, discord.Forbidden):
        return Permanent(f"discord: forbidden: {detail}")
    if isinstance(exc, discord.NotFound):
        return Permanent(f"discord: not found: {detail}")
    return Permanent(f"discord: rejected: {detail}")


def _unexpected(exc: BaseException, what: str = "") -> DeliveryError:
    return Transient(f"discord: unexpected {type(exc).__name__} trying to {what}: {exc}")


#: The one place discord.py / aiohttp / asyncio errors become courier's (`map_error(exc, what)`)
map_error = ErrorMap("discord", [
    # a 429 discord.py would have slept on
    (discord.RateLimited, lambda exc, what="": RateLimited(exc.retry_after, f"discord: rate limited, retry after "
                                                                            f"{exc.retry_after:g}s")),
    (discord.LoginFailure, lambda exc, what="": Permanent("discord: the bot token was rejected (401 Unauthorized)")),
    (discord.HTTPException, _http),
    (TimeoutError, lambda exc, what="": Transient(f"discord: timed out trying to {what}")),
    (aiohttp.ClientError, lambda exc, what="": Transient(f"discord: connection failed trying to {what}: "
                                                         f"{type(exc).__name__}: {exc}")),
    (OSError, lambda exc, what="": Transient(f"discord: I/O error trying to {what}: {exc.strerror or exc}")),
    (discord.ClientException, lambda exc, what="": Permanent(f"discord: cannot {what}: {exc}")),
    # any other of the SDK's (a gateway, voice or app command error: none is raised sending): retried
    (discord.DiscordException, _unexpected),
], unexpected=_unexpected)
