"""Discord's interactions webhook: Ed25519 over the timestamp and body (PyNaCl, imported when a request
is verified), the timestamp within 5 minutes; PING -> PONG; a slash command's first text option is the
turn, answered at once with the user's words quoted back."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from adapters.platforms.webhooks.base import Answer, Inbound, Parsed, Refusal
from adapters.platforms.webhooks.base import arr, guarded, ident, lower, obj, payload, signed_headers, text

PLATFORM = "discord"
SETTING = "DISCORD_PUBLIC_KEY"


@functools.lru_cache(maxsize=4)
def verify_key(public_key: str):
    """The application's public key (64 hex digits) as PyNaCl's VerifyKey, made once; ValueError when it is not one."""
    from nacl.signing import VerifyKey

    try:
        return VerifyKey(bytes.fromhex(public_key))
    except (ValueError, TypeError):
        raise ValueError("DISCORD_PUBLIC_KEY is not an Ed25519 public key in hex (64 hex digits)") from None


def check_headers(headers: Mapping[str, str], public_key: str, now: float) -> Refusal | None:
    """Before the body is read: a timestamp within 5 minutes, a signature of the right shape."""
    return guarded(PLATFORM, signed_headers, lower(headers), now, "x-signature-timestamp", "x-signature-ed25519", "",
                   128)


def parse_webhook(headers: Mapping[str, str], body: bytes, public_key: str, now: float) -> Parsed:
    """The signature, then the interaction: a command's text as one `Inbound`, or an answer (PONG, an
    ephemeral note for what is no command with text)."""
    from nacl.exceptions import BadSignatureError

    h = lower(headers)
    if refused := check_headers(h, public_key, now):
        return refused
    try:
        verify_key(public_key).verify(h["x-signature-timestamp"].encode() + body,
                                      bytes.fromhex(h["x-signature-ed25519"]))
    except BadSignatureError:
        return Refusal(401, "signature does not verify")
    return guarded(PLATFORM, _parse, body)


def _parse(body: bytes) -> Parsed:
    p = payload(body, "an interaction")
    if p.get("type") == 1:
        return Answer({"type": 1})
    if p.get("type") != 2:
        return Answer({"type": 4, "data": {"content": "This interaction is not supported.", "flags": 64}})
    data = obj(p.get("data"))
    said = next((text(o.get("value")) for o in arr(data.get("options"))
                 if isinstance(o, dict) and text(o.get("value"))), None)
    channel = p.get("channel_id") or obj(p.get("channel")).get("id")
    if not said or not channel or not p.get("id"):
        raw_name = data.get("name")
        name = raw_name if isinstance(raw_name, str) else "ask"
        return Answer({"type": 4, "data": {"content": f"Ask me something: /{name[:32]} <message>",
                                           "flags": 64, "allowed_mentions": {"parse": []}}})
    return [Inbound(ident(p["id"], "interaction id"), ident(channel, "channel id"), said)]


def answer(inbound: list[Inbound], outs: list[dict], headers: Mapping[str, str]) -> Answer:
    """The user's own words, quoted back: they never ping anyone (as the adapter's agent text)."""
    return Answer({"type": 4, "data": {"content": f"> {inbound[0].text[:1900]}", "allowed_mentions": {"parse": []}}})
