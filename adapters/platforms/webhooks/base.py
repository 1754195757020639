"""What every platform webhook parser shares: its results (`Inbound`, `Answer`, `Refusal`) and the
checks on a payload's values."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: how far a signed timestamp (Slack, Discord) may be from now, either way
MAX_CLOCK_SKEW_S = 300
#: ids that go into Redis keys (update, event, chat ids): a bounded, plain alphabet
_ID = re.compile(r"[A-Za-z0-9_.:=+-]{1,256}")
HEX = re.compile(r"[0-9a-fA-F]+")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: what a payload's shape can make a parser trip over: a 400, never a 500
MALFORMED = (TypeError, AttributeError, KeyError, ValueError, IndexError, RecursionError)


class Refusal(Exception):
    """A request that is refused: its status and a one-line reason for the caller."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refusal) and (self.status, self.reason) == (other.status, other.reason)

    def __hash__(self) -> int:
        return hash((self.status, self.reason))

    def __repr__(self) -> str:
        return f"Refusal({self.status}, {self.reason!r})"


@dataclass(frozen=True)
class Inbound:
    """One user message that becomes a turn: the platform's update (or event, message) id for de-dup,
    the chat the reply goes to, the text."""

    update_id: str
    chat: str
    text: str


@dataclass(frozen=True)
class Answer:
    """A webhook's reply: a JSON body (or plain text), its headers."""

    body: Any
    headers: dict[str, str] | None = None
    plain: bool = False


#: what `parse_webhook` gives: the turns to enqueue, or an answer that needs none, or a refusal
Parsed = list[Inbound] | Answer | Refusal


def lower(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers with lower-case names (Starlette's Headers or a plain dict)."""
    return {k.lower(): v for k, v in headers.items()}


def secret_bytes(v) -> bytes:
    """A secret (SecretStr, str or bytes) as bytes."""
    if v is None:
        return b""
    if hasattr(v, "get_secret_value"):
        v = v.get_secret_value()
    return v if isinstance(v, bytes) else str(v).encode()


def same_secret(got: str, secret) -> bool:
    """`got` (a header or query value) equals the secret, compared in constant time."""
    return hmac.compare_digest(got.encode(), secret_bytes(secret))


def signature_shape(sig: str, prefix: str, digits: int) -> None:
    """A signature header is `prefix` and `digits` hex digits; Refusal 401 otherwise."""
    if not (sig.startswith(prefix) and len(sig) == len(prefix) + digits and HEX.fullmatch(sig[len(prefix):])):
        raise Refusal(401, "missing or bad signature")


def hmac_verifies(sig: str, prefix: str, secret, message: bytes) -> bool:
    """`sig` is `prefix` and the hex HMAC-SHA256 of `message` with the secret (any case), in constant time."""
    want = prefix + hmac.new(secret_bytes(secret), message, hashlib.sha256).hexdigest()
    return hmac.compare_digest(sig.lower().encode(), want.encode())


def payload(body: bytes, what: str) -> dict:
    """The JSON object of a (verified) body; Refusal 400 when it is not one."""
    try:
        out = json.loads(body)
    except (ValueError, RecursionError):
        raise Refusal(400, f"not {what}: the body is not JSON") from None
    if not isinstance(out, dict):
        raise Refusal(400, f"not {what}: the body is not a JSON object")
    return out


def obj(v) -> dict:
    return v if isinstance(v, dict) else {}


def arr(v) -> list:
    return v if isinstance(v, list) else []


def ident(v, what: str) -> str:
    """An id from a payload (int or plain string) as a string; Refusal 400 otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not _ID.fullmatch(str(v)):
        raise Refusal(400, f"bad {what}")
    return str(v)


def text(v) -> str | None:
    """A message text, or None; lone surrogates (invalid JSON escapes) become U+FFFD."""
    if not isinstance(v, str) or not v.strip():
        return None
    return _SURROGATE.sub("\ufffd", v)


def signed_headers(h: dict, now: float, ts_name: str, sig_name: str, prefix: str, digits: int) -> None:
    """A signed timestamp (epoch seconds) within MAX_CLOCK_SKEW_S of `now` and a signature of the right
    shape; Refusal 401 otherwise."""
    raw = h.get(ts_name, "")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise Refusal(401, "missing or bad timestamp")
    if abs(now - int(raw)) > MAX_CLOCK_SKEW_S:
        raise Refusal(401, "stale or future timestamp")
    signature_shape(h.get(sig_name, ""), prefix, digits)


def guarded(platform: str, fn, *args) -> Any:
    """`fn(*args)`, with a Refusal raised in it, or a malformed payload it trips over (a 400), returned."""
    try:
        return fn(*args)
    except Refusal as exc:
        return exc
    except MALFORMED as exc:
        return Refusal(400, f"malformed {platform} payload ({type(exc).__name__})")
