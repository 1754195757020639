"""Slack's Events API webhook: the signing secret (v0 HMAC-SHA256 over the timestamp and body, the
timestamp within 5 minutes), url_verification, user messages and app mentions (one turn per message `ts`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from adapters.platforms.webhooks.base import Answer, Inbound, Parsed, Refusal
from adapters.platforms.webhooks.base import guarded, hmac_verifies, ident, lower, payload, signed_headers, text

PLATFORM = "slack"
SETTING = "SLACK_SIGNING_SECRET"
_MENTION = re.compile(r"<@[A-Z0-9]+>\s*")


def check_headers(headers: Mapping[str, str], secret, now: float) -> Refusal | None:
    """Before the body is read: a timestamp within 5 minutes, a signature of the right shape."""
    return guarded(PLATFORM, signed_headers, lower(headers), now, "x-slack-request-timestamp", "x-slack-signature",
                   "v0=", 64)


def parse_webhook(headers: Mapping[str, str], body: bytes, secret, now: float) -> Parsed:
    """The signature, then the event: a user message as one `Inbound`, or an answer (the url_verification
    challenge, an acknowledged event that is no user message)."""
    h = lower(headers)
    if refused := check_headers(h, secret, now):
        return refused
    ts, sig = h["x-slack-request-timestamp"], h["x-slack-signature"]
    if not hmac_verifies(sig, "v0=", secret, f"v0:{ts}:".encode() + body):
        return Refusal(401, "signature does not verify")
    return guarded(PLATFORM, _parse, body)


def _parse(body: bytes) -> Parsed:
    p = payload(body, "a Slack event")
    if p.get("type") == "url_verification":
        challenge = p.get("challenge", "")
        return Answer({"challenge": challenge if isinstance(challenge, str) else ""})
    event = p.get("event")
    if p.get("type") != "event_callback" or not isinstance(event, dict):
        kind = p.get("type")
        return Answer({"ok": True, "ignored": kind if isinstance(kind, str) else "not an event"})
    if event.get("type") not in ("message", "app_mention") or event.get("bot_id") or event.get("subtype"):
        return Answer({"ok": True, "ignored": "not a user message"})
    raw = event.get("text")
    said = text(_MENTION.sub("", raw).strip()) if isinstance(raw, str) else None
    channel = event.get("channel")
    # one user message is one turn: a mention comes as both `app_mention` and `message`
    # (different event ids) when the app subscribes to both; a retry repeats either
    if not said or not channel or not (event.get("ts") or p.get("event_id")):
        return Answer({"ok": True, "ignored": "no text message"})
    channel = ident(channel, "channel")
    event_id = f"{channel}:{ident(event['ts'], 'ts')}" if event.get("ts") else ident(p["event_id"], "event_id")
    return [Inbound(event_id, channel, said)]


def answer(inbound: list[Inbound], outs: list[dict], headers: Mapping[str, str]) -> Answer:
    """The enqueued turn; a duplicate or a retry tells Slack to stop retrying."""
    out = outs[0]
    retry = out.get("duplicate") or lower(headers).get("x-slack-retry-num")
    return Answer(out, headers={"X-Slack-No-Retry": "1"} if retry else None)
