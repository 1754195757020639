"""Telegram's webhook: the X-Telegram-Bot-Api-Secret-Token header, one update (`update_id`) with a text
message or a channel post."""

from __future__ import annotations

from collections.abc import Mapping

from adapters.platforms.webhooks.base import Answer, Inbound, Parsed, Refusal
from adapters.platforms.webhooks.base import guarded, ident, lower, obj, payload, same_secret, text

PLATFORM = "telegram"
SETTING = "TELEGRAM_WEBHOOK_SECRET"


def check_headers(headers: Mapping[str, str], secret, now: float) -> Refusal | None:
    """Before the body is read: the secret token header."""
    if not same_secret(lower(headers).get("x-telegram-bot-api-secret-token", ""), secret):
        return Refusal(401, "bad secret token")
    return None


def parse_webhook(headers: Mapping[str, str], body: bytes, secret, now: float) -> Parsed:
    """The update's text message as one `Inbound`, or an acknowledgement when it has none."""
    return check_headers(headers, secret, now) or guarded(PLATFORM, _parse, body)


def _parse(body: bytes) -> Parsed:
    update = payload(body, "a Telegram update")
    if isinstance(update.get("update_id"), bool) or not isinstance(update.get("update_id"), int):
        raise Refusal(400, "not a Telegram update: no update_id")
    msg = obj(update.get("message") or update.get("channel_post"))
    said = text(msg.get("text")) or text(msg.get("caption"))
    chat = obj(msg.get("chat")).get("id")
    if said is None or chat is None:
        return Answer({"ok": True, "ignored": "no text message"})
    return [Inbound(ident(update["update_id"], "update_id"), ident(chat, "chat id"), said)]


def answer(inbound: list[Inbound], outs: list[dict], headers: Mapping[str, str]) -> Answer:
    """The enqueued turn: {"ok", "job"} or {"ok", "duplicate"}."""
    return Answer(outs[0])
