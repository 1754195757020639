"""WhatsApp Cloud API's webhook: the hub.challenge subscription check (the verify token),
X-Hub-Signature-256 (HMAC-SHA256 of the body with the app secret); every text message is a turn."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from adapters.platforms.webhooks.base import Answer, Inbound, Parsed, Refusal
from adapters.platforms.webhooks.base import arr, guarded, hmac_verifies, ident, lower, obj, payload, same_secret
from adapters.platforms.webhooks.base import signature_shape, text

PLATFORM = "whatsapp"
SETTING = "WHATSAPP_APP_SECRET"
VERIFY_SETTING = "WHATSAPP_VERIFY_TOKEN"


def verify_subscription(query: Mapping[str, str], token) -> Answer | Refusal:
    """GET's subscription check: the challenge back when the verify token matches."""
    if query.get("hub.mode") == "subscribe" and same_secret(query.get("hub.verify_token", ""), token):
        return Answer(query.get("hub.challenge", "")[:256], plain=True)
    return Refusal(403, "verify token does not match")


def check_headers(headers: Mapping[str, str], secret, now: float) -> Refusal | None:
    """Before the body is read: a signature of the right shape."""
    return guarded(PLATFORM, signature_shape, lower(headers).get("x-hub-signature-256", ""), "sha256=", 64)


def parse_webhook(headers: Mapping[str, str], body: bytes, secret, now: float) -> Parsed:
    """The signature, then every text message of the notification, all checked before any is enqueued
    (one bad id refuses the whole notification)."""
    h = lower(headers)
    if refused := check_headers(h, secret, now):
        return refused
    if not hmac_verifies(h["x-hub-signature-256"], "sha256=", secret, body):
        return Refusal(401, "signature does not verify")
    return guarded(PLATFORM, _parse, body)


def _parse(body: bytes) -> Parsed:
    found: list[Inbound] = []
    for m in _values(body, "messages"):
        if not isinstance(m, dict) or m.get("type") != "text" or not m.get("id") or not m.get("from"):
            continue
        said = text(obj(m.get("text")).get("body"))
        if said is None:
            continue
        chat = ident(m["from"], "sender")
        found.append(Inbound(ident(m["id"], "message id"), chat if chat.startswith("+") else f"+{chat}", said))
    return found


def _values(body: bytes, name: str) -> Iterator:
    """Every item of `name` (messages, statuses) in a notification's entries' changes."""
    for entry in arr(payload(body, "a WhatsApp notification").get("entry")):
        for change in arr(obj(entry).get("changes")):
            yield from arr(obj(obj(change).get("value")).get(name))


@dataclass(frozen=True)
class StatusUpdate:
    """A sent message's fate as the Cloud API reports it (`statuses` of a notification)."""

    message_id: str
    status: str  # sent | delivered | read | failed
    reason: str = ""


def statuses(body: bytes) -> list[StatusUpdate]:
    """The status updates of a notification whose signature `parse_webhook` verified (the same body):
    each message id with its status and, for `failed`, the error's title, code and details in one line."""
    out: list[StatusUpdate] = []
    for st in _values(body, "statuses"):
        if not isinstance(st, dict) or not st.get("id") or not isinstance(st.get("status"), str):
            continue
        why = []
        for err in arr(st.get("errors")):
            e = obj(err)
            details = obj(e.get("error_data")).get("details")
            bits = [text(e.get("title")) or text(e.get("message")) or "error",
                    f"code {e['code']}" if isinstance(e.get("code"), int) else None,
                    text(details) if isinstance(details, str) else None]
            why.append(", ".join(b for b in bits if b))
        out.append(StatusUpdate(ident(st["id"], "message id"), st["status"].strip().lower()[:20],
                                "; ".join(why)[:400]))
    return out


def answer(inbound: list[Inbound], outs: list[dict], headers: Mapping[str, str]) -> Answer:
    """The turns enqueued and the retried messages dropped."""
    return Answer({"ok": True, "jobs": [o["job"] for o in outs if not o.get("duplicate")],
                   "duplicates": sum(1 for o in outs if o.get("duplicate"))})
