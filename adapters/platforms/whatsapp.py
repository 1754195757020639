"""WhatsApp Cloud API over httpx: upload media, then send a message by media id.

- `POST /{phone_number_id}/media` streams the file; the media id it returns is the reusable file id (ids
  live 30 days: a cached one is looked up first, as a message naming an expired id is accepted and never
  delivered). A send that fails after its upload carries the media id on its error (`file_id`), so the
  retry does not upload again.
- `POST /{phone_number_id}/messages`; a voice note is `audio` with `"voice": true`; audio takes no caption.
- Each file is routed before sending (`route_file`) by the API's own type rules and per-type size limits:
  what it cannot take is refused before anything is uploaded. Every upload carries the file's real type
  (the API refuses application/octet-stream).

The access token only travels in the Authorization header: never in a URL, a repr, or an error message.
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
import threading
from typing import Any

import httpx

from adapters.defaults import WHATSAPP_API_URL
from adapters.errors import ConfigError, DeliveryError, Permanent, RateLimited, Transient
from adapters.platforms.base import MB, ErrorMap, FileRefused, FileSource, Kind, Limits, Platform, Sent

__all__ = ["WhatsAppPlatform", "map_error"]

#: default waits when a rate-limit error carries no Retry-After
_RATE_LIMIT_CODES = {4: 60.0, 80007: 60.0, 130429: 1.0, 131048: 60.0, 131056: 6.0}
#: the API's own "try again later" codes
_TRANSIENT_CODES = {1, 2, 131000, 131016, 133004}
#: "Media upload error": a size or type the API refuses
_MEDIA_ERROR = 131053
#: a cached media id the API no longer knows: upload again
_STALE_MEDIA_CODES = {100, 131052, _MEDIA_ERROR}

#: the media types the Cloud API takes (its supported list), by the message type that shows them
#: inline; any of them may also go as a document. Anything else is refused before uploading.
SUPPORTED_MIME = {
    "image/jpeg": "image", "image/png": "image", "image/webp": "sticker",
    "video/mp4": "video", "video/3gpp": "video",
    "audio/aac": "audio", "audio/amr": "audio", "audio/mpeg": "audio", "audio/mp4": "audio", "audio/ogg": "audio",
    "text/plain": "document", "application/pdf": "document", "application/msword": "document",
    "application/vnd.ms-excel": "document", "application/vnd.ms-powerpoint": "document",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": "document",
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": "document",
    "application/vnd.openxmlformats-officedocument.presentationml.presentation": "document",
}
_EXTRA_MIME = {".opus": "audio/ogg", ".ogg": "audio/ogg", ".oga": "audio/ogg", ".m4a": "audio/mp4",
               ".3gp": "video/3gpp", ".amr": "audio/amr", ".aac": "audio/aac", ".webp": "image/webp",
               ".mp3": "audio/mpeg"}
#: what the API takes of each media class, by the file's own type (whatever message it goes in)
CLASS_UPLOAD_BYTES = {"image": 5 * MB, "video": 16 * MB, "audio": 16 * MB, "sticker": 500 * 1000,
                      "document": 100 * MB}
_CLASS_WORDS = {"image": "images", "video": "videos", "audio": "audio files", "sticker": ".webp images",
                "document": "documents"}
#: the message type that shows each kind inline (any other goes as a document)
_MESSAGE_TYPE = {Kind.PHOTO: "image", Kind.ANIMATION: "image", Kind.VIDEO: "video", Kind.AUDIO: "audio",
                 Kind.VOICE: "audio"}
#: other names of supported types
_ALIASES = {"audio/x-m4a": "audio/mp4", "audio/mp3": "audio/mpeg", "audio/x-aac": "audio/aac",
            "audio/opus": "audio/ogg", "image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}


def mime_of(name: str, given: str | None = None) -> str:
    """The file's media type (its own when given, else by name), in the API's spelling."""
    if given:
        mime = given.split(";")[0].strip().lower()
    else:
        ext = os.path.splitext(name)[1].lower()
        mime = _EXTRA_MIME.get(ext) or mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"
    return _ALIASES.get(mime, mime)


def _answer(err: httpx.Response) -> DeliveryError:
    """An error answer of the Cloud API: its status, code and words."""
    status = err.status_code
    try:
        e = err.json()["error"]
    except (ValueError, TypeError, KeyError):  # not JSON, not an object, no error in it
        e = {}
    e = e if isinstance(e, dict) else {}
    code = e.get("code")
    message = str(e.get("message") or err.reason_phrase or f"HTTP {status}")
    details = (e.get("error_data") or {}).get("details") if isinstance(e.get("error_data"), dict) else None
    text = f"whatsapp: {message}" + (f" — {details}" if details and details not in message else "")
    text += f" (HTTP {status}" + (f", code {code})" if code is not None else ")")
    if status == 429 or code in _RATE_LIMIT_CODES:
        try:
            wait = float(err.headers["Retry-After"])
        except (KeyError, ValueError):
            wait = _RATE_LIMIT_CODES.get(int(code or 0), 5.0)
        return RateLimited(wait, text)
    if status >= 500 or code in _TRANSIENT_CODES or e.get("is_transient") is True:
        return Transient(text)
    if code == _MEDIA_ERROR:  # a size (or type) the API refuses: the chat gets a notice
        said = f"{message} {details or ''}".lower()
        if any(w in said for w in ("size", "too large", "too big", "limit")):
            perm: Permanent = FileRefused(text, too_large=True)
        else:  # the answer lists every supported type (700 characters): keep it short
            perm = FileRefused(f"whatsapp: {message}: the file's type is not accepted (HTTP {status}, code {code})",
                               notice="WhatsApp does not take this type of file")
    else:
        perm = Permanent(text)
    perm.api_code = code  # type: ignore[attr-defined]
    return perm


#: The one place WhatsApp's answers (an `httpx.Response`) and transport failures become courier's errors
map_error = ErrorMap("whatsapp", [
    (httpx.TimeoutException, lambda err: Transient(f"whatsapp: timed out ({type(err).__name__})")),
    ((httpx.TransportError, OSError),
     lambda err: Transient(f"whatsapp: connection failed ({type(err).__name__}: {err})")),
    (httpx.Response, _answer),
    # any other of httpx's (DecodingError, TooManyRedirects, ...): retried
    (httpx.HTTPError, lambda err: Transient(f"whatsapp: unexpected {type(err).__name__}: {err}")),
])


class WhatsAppPlatform(Platform):
    name = "whatsapp"
    #: the Cloud API answers a send with an id, then tells delivered / read / failed by status webhook
    confirms_later = True
    limits = Limits(
        text_chars=4096, caption_chars=1024, upload_bytes=100 * MB, photo_bytes=5 * MB, per_bot_per_s=80,
        kind_upload_bytes={Kind.PHOTO: 5 * MB, Kind.VIDEO: 16 * MB, Kind.AUDIO: 16 * MB, Kind.VOICE: 16 * MB},
        native_kinds=frozenset(Kind) - {Kind.ANIMATION})

    def __init__(self, access_token: str, phone_number_id: str, *, base_url: str = WHATSAPP_API_URL,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0, write_timeout_s: float = 120.0) -> None:
        if not access_token:
            raise ConfigError("whatsapp: WHATSAPP_ACCESS_TOKEN is not set")
        if not phone_number_id:
            raise ConfigError("whatsapp: WHATSAPP_PHONE_NUMBER_ID is not set")
        self._token = access_token
        self._base = base_url.rstrip("/")
        self._root = f"{self._base}/{phone_number_id}"
        #: names this sender in shared Redis keys (media ids, rate limits)
        self.cache_key = hashlib.sha256(b"whatsapp:" + phone_number_id.encode()).hexdigest()[:20]
        self._timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=write_timeout_s, pool=30.0)
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None

    def __repr__(self) -> str:
        return f"WhatsAppPlatform(root={self._root!r})"

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = httpx.Client(timeout=self._timeout,
                                            headers={"Authorization": f"Bearer {self._token}"},
                                            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16))
                self._client_pid = os.getpid()
            return self._client

    def _post(self, path: str, **kw: Any) -> dict:
        try:
            resp = self._http().post(f"{self._root}/{path}", **kw)
        except httpx.HTTPError as exc:
            raise map_error(exc) from None
        if resp.status_code >= 400:
            raise map_error(resp)
        try:
            data = resp.json()
        except ValueError:
            raise Transient(f"whatsapp: unreadable answer to {path} (HTTP {resp.status_code})") from None
        return data if isinstance(data, dict) else {}

    def _message(self, chat: str, type_: str, body: dict) -> Sent:
        data = self._post("messages", json={"messaging_product": "whatsapp", "recipient_type": "individual",
                                            "to": chat, "type": type_, type_: body})
        msgs = data.get("messages") or [{}]
        mid = msgs[0].get("id")
        if not mid:
            raise Transient("whatsapp: the messages answer held no message id")
        return Sent(message_id=str(mid))

    # -- sends ---------------------------------------------------------------------------------
    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        return self._message(chat, "text", {"body": text, "preview_url": False})

    def media_known(self, media_id: str) -> bool:
        """Whether the API still has this media id: a 4xx is no (rate limits and server errors propagate)."""
        try:
            resp = self._http().get(f"{self._base}/{media_id}")
        except httpx.HTTPError as exc:
            raise map_error(exc) from None
        if resp.status_code == 200:
            return True
        err = map_error(resp)
        if isinstance(err, (RateLimited, Transient)):
            raise err
        return False

    def upload(self, file: FileSource, mime: str) -> str:
        with file.open() as f:
            data = self._post("media", data={"messaging_product": "whatsapp", "type": mime},
                              files={"file": (os.path.basename(file.name) or "file", f, mime)})
        media_id = data.get("id")
        if not media_id:
            raise Transient("whatsapp: the media upload answer held no id")
        return str(media_id)

    def route_file(self, kind: Kind, file: FileSource) -> Kind:
        """The kind this file goes as: a type off the supported list is refused; one not shown inline goes
        as a document (webp); a voice note that is not ogg/opus goes as audio. A document over its own type's
        limit (a photo over 5 MB) is refused as too large: the API limits an upload by the file's type."""
        mime = mime_of(file.name, file.mime)
        cls = SUPPORTED_MIME.get(mime)
        if cls is None:
            ext = os.path.splitext(file.name)[1].lower() or f"({mime})"
            raise FileRefused(f"whatsapp does not take {ext} files ({mime})",
                              notice=f"WhatsApp does not take {ext} files")
        if kind == Kind.VOICE:
            out = Kind.VOICE if mime == "audio/ogg" else Kind.AUDIO if cls == "audio" else Kind.DOCUMENT
        else:
            inline = _MESSAGE_TYPE.get(kind)
            out = Kind.DOCUMENT if inline != cls else Kind.PHOTO if kind == Kind.ANIMATION else kind
        cap = CLASS_UPLOAD_BYTES[cls]
        if out == Kind.DOCUMENT and file.size_bytes > cap:  # an inline kind's own limit is the shared flow's check
            shown = f"{cap / MB:g} MB" if cap >= MB else f"{cap // 1000} KB"
            raise FileRefused(f"whatsapp takes {mime} files up to {shown}, as a document too",
                              notice=f"WhatsApp takes {_CLASS_WORDS[cls]} up to {shown}", too_large=True)
        return out

    def caption_chars_for(self, kind: Kind, file: FileSource) -> int:
        """An audio message takes no caption: 0 (its caption follows as text parts)."""
        return 0 if kind in (Kind.AUDIO, Kind.VOICE) else self.limits.caption_chars

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        mime = mime_of(file.name, file.mime)
        kind = self.route_file(kind, file)  # (the shared flow has routed it already: the same answer)
        type_ = _MESSAGE_TYPE.get(kind, "document")

        def body(media_id: str) -> dict:
            b: dict[str, Any] = {"id": media_id}
            if kind == Kind.VOICE:
                b["voice"] = True
            if type_ == "document":
                b["filename"] = os.path.basename(file.name) or "file"
            if caption and type_ != "audio":
                b["caption"] = caption
            return b

        if file_id and self.media_known(file_id):  # (an expired one would be accepted, never delivered)
            try:
                return Sent(self._message(chat, type_, body(file_id)).message_id, file_id=file_id)
            except Permanent as exc:
                if getattr(exc, "api_code", None) not in _STALE_MEDIA_CODES:
                    raise
        media_id = self.upload(file, mime)
        try:
            return Sent(self._message(chat, type_, body(media_id)).message_id, file_id=media_id)
        except DeliveryError as exc:
            exc.file_id = media_id  # type: ignore[attr-defined]  # the shared flow keeps it for the retry
            raise

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None and self._client_pid == os.getpid():
            client.close()
