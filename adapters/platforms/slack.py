"""Slack over slack_sdk's WebClient.

- Text: `chat.postMessage`, with `&`, `<`, `>` escaped so agent text shows as written.
- Files: Slack's external upload flow, streamed (slack_sdk's `files_upload_v2` reads every file whole):
  `files.getUploadURLExternal` -> POST of the bytes (httpx; the bot token is not sent there) ->
  `files.completeUploadExternal` (the caption as `initial_comment`). When the completion fails, the
  upload's id rides on the error (`file_id`) and the retry only completes it; a completion that answers
  `file_not_found` asks `files.info` whether an earlier one shared it already (its answer lost).
- A chat is a channel id or a name, resolved through `conversations.list` (cached): sharing takes only ids.
- No typing indicator for bots; progress is a message posted, updated, deleted.
- No sleeping in a worker: the client has no retry handlers (they sleep); a 429 is `RateLimited`.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import threading
import time
import urllib.error
from typing import Any

import httpx
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError, SlackRequestError

from adapters.defaults import SLACK_API_URL
from adapters.errors import ConfigError, DeliveryError, Permanent, RateLimited, Transient
from adapters.platforms.base import ErrorMap, FileRefused, FileSource, Kind, Limits, Platform, Sent
from adapters.platforms.base import dropping, iter_file

__all__ = ["SlackPlatform", "DEFAULT_UPLOAD_BYTES", "map_error"]

log = logging.getLogger(__name__)

#: Slack's per-file cap (slack_sdk: MAX_V2_FILE_SIZE)
DEFAULT_UPLOAD_BYTES = 1024 * 1024 * 1024
UPLOAD_CHUNK_BYTES = 256 * 1024
#: a channel, group or DM id; anything else is a channel name (resolved by `conversations.list`)
_CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{2,}")
#: how long a resolved channel name is trusted
NAMES_TTL_S = 600.0

#: `error` codes worth another try later
_TRANSIENT_ERRORS = frozenset({"internal_error", "fatal_error", "service_unavailable", "request_timeout",
                               "team_added_to_org"})
_TOO_LARGE_ERRORS = frozenset({"msg_too_long", "too_large"})
#: a file's size refused by Slack or by the workspace's own restriction
_FILE_TOO_LARGE_ERRORS = frozenset({"file_too_large", "file_upload_size_restricted"})


def escape(text: str) -> str:
    """Slack's three control characters, escaped (Slack shows them as written)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def fit_escaped(text: str, limit_chars: int) -> list[str]:
    """Escaping can push a text past the limit (`&` is 5 characters): cut it again at a space, not in an entity."""
    parts: list[str] = []
    while len(text) > limit_chars:
        cut = text.rfind(" ", limit_chars // 2, limit_chars)
        if cut <= 0:
            cut = limit_chars
            amp = text.rfind("&", cut - 4, cut)
            if amp != -1 and ";" not in text[amp:cut]:
                cut = amp
        parts.append(text[:cut])
        text = text[cut:].lstrip(" ")
    parts.append(text)
    return parts


class _UploadRejected(Exception):
    """The upload URL answered with something other than 200."""

    def __init__(self, status: int, body: str, retry_after: str | None) -> None:
        super().__init__(f"upload answered {status}: {body[:200]}")
        self.status = status
        self.body = body
        self.retry_after = retry_after


class SlackPlatform(Platform):
    name = "slack"

    def __init__(self, token: str, *, base_url: str = SLACK_API_URL, upload_bytes: int = DEFAULT_UPLOAD_BYTES,
                 timeout_s: float = 60.0, upload_timeout_s: float = 600.0) -> None:
        if not token:
            raise ConfigError("slack: SLACK_BOT_TOKEN is not set")
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.timeout_s = timeout_s
        self.upload_timeout_s = upload_timeout_s
        # no retry handlers: every built-in one sleeps in the calling thread
        self._api = WebClient(token=token, base_url=self.base_url, timeout=int(timeout_s), retry_handlers=[])
        self._http: httpx.Client | None = None
        self._http_pid: int | None = None
        #: channel name -> id, and when it was listed (see `channel_id`)
        self._names: dict[str, str] = {}
        self._names_at = 0.0
        self._names_lock = threading.Lock()
        self.limits = self.limits_for(upload_bytes=upload_bytes)

    @classmethod
    def limits_for(cls, *, upload_bytes: int = DEFAULT_UPLOAD_BYTES, **options: Any) -> Limits:
        return Limits(
            text_chars=40000,
            caption_chars=40000,  # initial_comment is a message text
            upload_bytes=upload_bytes,
            per_chat_per_s=1.0,  # chat.postMessage: about one message a second per channel
            native_kinds=frozenset({Kind.TEXT, Kind.PHOTO, Kind.DOCUMENT}),
            album_max=10,
        )

    def __repr__(self) -> str:
        return f"SlackPlatform(base_url={self.base_url!r})"

    def _uploader(self) -> httpx.Client:
        if self._http is None or self._http_pid != os.getpid():
            self._http = httpx.Client(timeout=httpx.Timeout(self.upload_timeout_s, connect=min(30.0, self.timeout_s)),
                                      follow_redirects=False)
            self._http_pid = os.getpid()
        return self._http

    # -- channels ------------------------------------------------------------------
    def channel_id(self, chat: str) -> str:
        """`chat` as a channel id: a name (`#general`) is looked up in `conversations.list`; unknown: Permanent."""
        if _CHANNEL_ID.fullmatch(chat):
            return chat
        name = chat.lstrip("#").lower()
        with self._names_lock:
            if name not in self._names or time.monotonic() - self._names_at > NAMES_TTL_S:
                self._names, self._names_at = self._list_channels(), time.monotonic()
            cid = self._names.get(name)
        if cid is None:
            raise Permanent(f"slack: no channel #{name} that the bot can see (invite the bot to it, "
                            "or give the channel id, e.g. slack:C0123ABCD)")
        return cid

    def _list_channels(self) -> dict[str, str]:
        names: dict[str, str] = {}
        cursor = None
        for _ in range(100):  # at most 100 pages of 1000
            resp = map_error.call(lambda: self._api.conversations_list(
                types="public_channel,private_channel", exclude_archived=True, limit=1000, cursor=cursor),
                "conversations.list")
            for ch in resp.get("channels") or []:
                if ch.get("name") and ch.get("id"):
                    names[str(ch["name"]).lower()] = str(ch["id"])
            cursor = (resp.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                break
        return names

    # -- sending -----------------------------------------------------------------
    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        chat = self.channel_id(chat)
        ts = []
        for piece in fit_escaped(escape(text), self.limits.text_chars):
            resp = map_error.call(lambda: self._api.chat_postMessage(channel=chat, text=piece), "chat.postMessage")
            ts.append(str(resp["ts"]))
        return Sent(message_id=",".join(ts))

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        """One file; `file_id`: this delivery's own upload from an earlier run whose
        completion failed (uploaded, never shared): completed without uploading again."""
        chat = self.channel_id(chat)
        if file_id:
            with dropping("file_not_found", "invalid"):
                return self._complete(chat, [file_id], [file], caption)[0]
            # no such pending upload: Slack lost it, or an earlier completion shared it
            if self._shared_in(chat, file_id):
                return Sent(message_id=file_id)
        return self._share(chat, [file], caption)[0]

    def _shared_in(self, chat: str, file_id: str) -> bool:
        """Whether `files.info` says the file is shared in `chat` already. A file Slack
        does not know, or no answer (a bot without `files:read`): False, and it is shared again."""
        try:
            info = map_error.call(lambda: self._api.files_info(file=file_id), "files.info")
        except Permanent as exc:
            if "file_not_found" not in exc.reason:
                log.warning("slack: cannot check whether file %s is shared already (%s): sharing it again",
                            file_id, exc.reason)
            return False
        f = info.get("file") or {}
        where = {*(f.get("channels") or []), *(f.get("groups") or []), *(f.get("ims") or [])}
        for scope in (f.get("shares") or {}).values():
            if isinstance(scope, dict):
                where.update(scope)
        return chat in where

    def send_album(self, chat: str, files: list[tuple[Kind, FileSource]], *, caption: str | None,
                   delivery_id: str) -> list[Sent]:
        if not 0 < len(files) <= self.limits.album_max:
            raise Permanent(f"slack: one message shares 1 to {self.limits.album_max} files, not {len(files)}")
        return self._share(self.channel_id(chat), [f for _, f in files], caption)

    def _share(self, chat: str, files: list[FileSource], caption: str | None) -> list[Sent]:
        ids: list[str] = []
        for f in files:
            got = map_error.call(lambda: self._api.files_getUploadURLExternal(filename=f.name, length=f.size_bytes),
                                 "files.getUploadURLExternal")
            map_error.call(lambda: self._post(got["upload_url"], f), "the file upload")
            ids.append(str(got["file_id"]))
        try:
            return self._complete(chat, ids, files, caption)
        except DeliveryError as exc:
            if len(ids) == 1:  # the shared flow keeps it: the retry completes this upload, no second one
                exc.file_id = ids[0]  # type: ignore[attr-defined]
            raise

    def _complete(self, chat: str, ids: list[str], files: list[FileSource], caption: str | None) -> list[Sent]:
        done = map_error.call(lambda: self._api.files_completeUploadExternal(
            files=[{"id": fid, "title": f.name} for fid, f in zip(ids, files)], channel_id=chat,
            initial_comment=escape(caption) if caption else None), "files.completeUploadExternal")
        shared = [str(x.get("id")) for x in (done.get("files") or [])] or ids
        return [Sent(message_id=fid) for fid in shared]

    def _post(self, url: str, file: FileSource) -> None:
        resp = self._uploader().post(
            url, content=iter_file(file, UPLOAD_CHUNK_BYTES),
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(file.size_bytes)})
        if resp.status_code != 200:
            raise _UploadRejected(resp.status_code, resp.text, resp.headers.get("Retry-After"))

    # -- activity ---------------------------------------------------------------------
    def start_progress(self, chat: str, text: str) -> str | None:
        chat = self.channel_id(chat)
        resp = map_error.call(lambda: self._api.chat_postMessage(channel=chat, text=escape(text)), "chat.postMessage")
        return str(resp["ts"])

    def edit_progress(self, chat: str, message_id: str, text: str) -> None:
        chat = self.channel_id(chat)
        map_error.call(lambda: self._api.chat_update(channel=chat, ts=message_id, text=escape(text)), "chat.update")

    def end_progress(self, chat: str, message_id: str) -> None:
        chat = self.channel_id(chat)
        with dropping("message_not_found"):
            map_error.call(lambda: self._api.chat_delete(channel=chat, ts=message_id), "chat.delete")

    def close(self) -> None:
        http, self._http = self._http, None
        if http is not None and self._http_pid == os.getpid():
            http.close()


# -- the one error map -----------------------------------------------------------------------
def _seconds(value: Any, default: float = 1.0) -> float:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return default


def _api_error(exc: SlackApiError, what: str = "") -> DeliveryError:
    resp = exc.response
    status = int(getattr(resp, "status_code", 0) or 0)
    headers = {k.lower(): v for k, v in (getattr(resp, "headers", None) or {}).items()}
    data = getattr(resp, "data", None)
    error = str(data.get("error") or "") if isinstance(data, dict) else ""
    if status == 429 or error == "ratelimited":
        ra = _seconds(headers.get("retry-after"))
        return RateLimited(ra, f"slack: {what}: rate limited, retry after {ra:g}s")
    label = error if len(error) <= 80 else f"HTTP {status}"
    if status >= 500 or error in _TRANSIENT_ERRORS:
        return Transient(f"slack: {what}: server error {label or status}")
    if error in _FILE_TOO_LARGE_ERRORS:
        return FileRefused(f"slack: too large: {what}: {error}", too_large=True)
    if error in _TOO_LARGE_ERRORS:
        return Permanent(f"slack: too large: {what}: {error}")
    if status != 200 and not error:
        return Transient(f"slack: {what}: unexpected HTTP {status}")
    return Permanent(f"slack: {what}: {label or f'HTTP {status}'}")


def _upload_rejected(exc: _UploadRejected, what: str = "") -> DeliveryError:
    if exc.status == 429:
        ra = _seconds(exc.retry_after)
        return RateLimited(ra, f"slack: upload rate limited, retry after {ra:g}s")
    if exc.status == 413:
        return FileRefused(f"slack: too large: the upload answered 413 {exc.body[:100]}".rstrip(), too_large=True)
    if exc.status >= 500 or exc.status == 408:
        return Transient(f"slack: the upload answered {exc.status}")
    return Permanent(f"slack: the upload answered {exc.status}: {exc.body[:100]}".rstrip())


#: The one place slack_sdk / urllib / httpx errors become courier's (`map_error(exc, what)`)
map_error = ErrorMap("slack", [
    (SlackApiError, _api_error),
    (_UploadRejected, _upload_rejected),
    (SlackRequestError, lambda exc, what="": Permanent(f"slack: {what}: bad request: {exc}")),
    ((httpx.TimeoutException, TimeoutError), lambda exc, what="": Transient(f"slack: timed out on {what}")),
    ((httpx.TransportError, urllib.error.URLError, http.client.HTTPException, ConnectionError, OSError),
     lambda exc, what="": Transient(f"slack: connection failed on {what}: {type(exc).__name__}")),
    (SlackClientError, lambda exc, what="": Transient(f"slack: {what}: {type(exc).__name__}")),
], unexpected=lambda exc, what="": Transient(f"slack: unexpected {type(exc).__name__} on {what}: {exc}"))
