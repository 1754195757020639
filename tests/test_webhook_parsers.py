"""The platforms' webhook parsers as plain functions (adapters/platforms/webhooks):
headers, bytes, a secret and a clock in; the turns to enqueue, an answer or
a refusal out. No server, no Redis: signatures made here as each platform
makes them (HMAC-SHA256 for Slack and WhatsApp, Ed25519 with PyNaCl for
Discord). The web process around them: tests/test_webhook_hardening.py."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys

import pytest

from adapters.platforms.webhooks import Answer, Inbound, Refusal
from adapters.platforms.webhooks import discord as dc
from adapters.platforms.webhooks import slack as sl
from adapters.platforms.webhooks import telegram as tg
from adapters.platforms.webhooks import whatsapp as wa

NOW = 1_700_000_000.0


def j(v) -> bytes:
    return json.dumps(v).encode()


# -- Telegram -------------------------------------------------------------------------------------------
TG_H = {"X-Telegram-Bot-Api-Secret-Token": "s3cret"}


def test_telegram_text_message_is_one_inbound():
    body = j({"update_id": 7, "message": {"chat": {"id": -100}, "text": "hi"}})
    assert tg.parse_webhook(TG_H, body, "s3cret", NOW) == [Inbound("7", "-100", "hi")]
    post = j({"update_id": 8, "channel_post": {"chat": {"id": 5}, "caption": "cap"}})
    assert tg.parse_webhook(TG_H, post, "s3cret", NOW) == [Inbound("8", "5", "cap")]


def test_telegram_refusals_and_acknowledgements():
    body = j({"update_id": 7, "message": {"chat": {"id": 1}, "text": "hi"}})
    assert tg.check_headers({}, "s3cret", NOW) == Refusal(401, "bad secret token")
    assert tg.parse_webhook({"x-telegram-bot-api-secret-token": "nope"}, body, "s3cret", NOW).status == 401
    assert tg.check_headers(TG_H, "s3cret", NOW) is None
    assert tg.parse_webhook(TG_H, b"[1]", "s3cret", NOW).status == 400
    assert tg.parse_webhook(TG_H, j({"update_id": True}), "s3cret", NOW).status == 400
    assert tg.parse_webhook(TG_H, j({"update_id": 1, "message": {"text": "x", "chat": {"id": "a b"}}}),
                            "s3cret", NOW) == Refusal(400, "bad chat id")
    assert tg.parse_webhook(TG_H, j({"update_id": 1, "message": [1]}), "s3cret", NOW) == \
        Answer({"ok": True, "ignored": "no text message"})
    lone = b'{"update_id": 2, "message": {"chat": {"id": 7}, "text": "a \\ud800 b"}}'
    assert tg.parse_webhook(TG_H, lone, "s3cret", NOW)[0].text == "a \ufffd b"
    assert tg.answer([Inbound("1", "2", "x")], [{"ok": True, "job": "turn_1"}], {}) == \
        Answer({"ok": True, "job": "turn_1"})


# -- Slack ----------------------------------------------------------------------------------------------
def slack_h(body: bytes, ts: float = NOW, secret: str = "sig") -> dict:
    sig = "v0=" + hmac.new(secret.encode(), f"v0:{int(ts)}:".encode() + body, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": str(int(ts)), "X-Slack-Signature": sig}


def test_slack_message_is_one_inbound_keyed_by_channel_and_ts():
    body = j({"type": "event_callback", "event_id": "Ev1",
              "event": {"type": "app_mention", "text": "<@U0BOT> hello", "channel": "C1", "ts": "1.5"}})
    assert sl.parse_webhook(slack_h(body), body, "sig", NOW) == [Inbound("C1:1.5", "C1", "hello")]


def test_slack_signature_timestamp_and_answers():
    body = j({"type": "url_verification", "challenge": "abc"})
    assert sl.parse_webhook(slack_h(body), body, "sig", NOW) == Answer({"challenge": "abc"})
    assert sl.parse_webhook(slack_h(body, secret="other"), body, "sig", NOW) == \
        Refusal(401, "signature does not verify")
    assert sl.parse_webhook(slack_h(body, ts=NOW - 301), body, "sig", NOW) == \
        Refusal(401, "stale or future timestamp")
    assert sl.parse_webhook(slack_h(body, ts=NOW - 299), body, "sig", NOW) == Answer({"challenge": "abc"})
    assert sl.check_headers({}, "sig", NOW) == Refusal(401, "missing or bad timestamp")
    assert sl.check_headers({"x-slack-request-timestamp": str(int(NOW)), "x-slack-signature": "v1=x"},
                            "sig", NOW) == Refusal(401, "missing or bad signature")
    bot = j({"type": "event_callback", "event": {"type": "message", "bot_id": "B1", "text": "x", "channel": "C"}})
    assert sl.parse_webhook(slack_h(bot), bot, "sig", NOW) == Answer({"ok": True, "ignored": "not a user message"})
    junk = b'{"not json'
    assert "not JSON" in sl.parse_webhook(slack_h(junk), junk, "sig", NOW).reason
    odd = j({"type": "event_callback", "event": {"type": "message", "text": "x", "channel": {"id": 1}, "ts": "1"}})
    assert sl.parse_webhook(slack_h(odd), odd, "sig", NOW).status == 400


def test_slack_answer_stops_retries_of_duplicates_and_retries():
    one = [Inbound("C:1", "C", "x")]
    assert sl.answer(one, [{"ok": True, "job": "j"}], {}) == Answer({"ok": True, "job": "j"})
    assert sl.answer(one, [{"ok": True, "duplicate": True}], {}).headers == {"X-Slack-No-Retry": "1"}
    assert sl.answer(one, [{"ok": True, "job": "j"}], {"X-Slack-Retry-Num": "1"}).headers == {"X-Slack-No-Retry": "1"}


# -- Discord --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def key():
    from nacl.signing import SigningKey

    return SigningKey.generate()


def discord_h(key, body: bytes, ts: float = NOW) -> dict:
    t = str(int(ts))
    return {"X-Signature-Timestamp": t, "X-Signature-Ed25519": key.sign(t.encode() + body).signature.hex()}


def test_discord_command_is_one_inbound_and_ping_is_pong(key):
    pk = key.verify_key.encode().hex()
    cmd = j({"type": 2, "id": "13", "channel_id": "12", "data": {"name": "ask", "options": [{"value": "hey"}]}})
    assert dc.parse_webhook(discord_h(key, cmd), cmd, pk, NOW) == [Inbound("13", "12", "hey")]
    assert dc.answer([Inbound("13", "12", "hey")], [{"ok": True, "job": "j"}], {}).body["data"]["content"] == "> hey"
    ping = j({"type": 1})
    assert dc.parse_webhook(discord_h(key, ping), ping, pk, NOW) == Answer({"type": 1})
    empty = j({"type": 2, "id": "13", "channel_id": "12", "data": {"name": "ask", "options": []}})
    assert dc.parse_webhook(discord_h(key, empty), empty, pk, NOW).body["data"]["flags"] == 64


def test_discord_refusals(key):
    from nacl.signing import SigningKey

    pk = key.verify_key.encode().hex()
    ping = j({"type": 1})
    assert dc.parse_webhook(discord_h(SigningKey.generate(), ping), ping, pk, NOW) == \
        Refusal(401, "signature does not verify")
    assert dc.parse_webhook(discord_h(key, ping, ts=NOW + 400), ping, pk, NOW) == \
        Refusal(401, "stale or future timestamp")
    assert dc.check_headers({"x-signature-timestamp": str(int(NOW)), "x-signature-ed25519": "zz"}, pk, NOW) == \
        Refusal(401, "missing or bad signature")
    bad = j({"type": 2, "id": {"a": 1}, "channel_id": "1", "data": {"options": [{"value": "x"}]}})
    assert dc.parse_webhook(discord_h(key, bad), bad, pk, NOW) == Refusal(400, "bad interaction id")
    with pytest.raises(ValueError, match="DISCORD_PUBLIC_KEY"):
        dc.verify_key("not hex")


# -- WhatsApp -------------------------------------------------------------------------------------------
def wa_h(body: bytes, secret: str = "app") -> dict:
    return {"X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()}


def _wa(*messages) -> bytes:
    return j({"entry": [{"changes": [{"value": {"messages": list(messages)}}]}]})


def test_whatsapp_every_text_message_is_an_inbound():
    body = _wa({"from": "1555", "id": "w1", "type": "text", "text": {"body": "a"}},
               {"from": "+1666", "id": "w2", "type": "image"},
               {"from": "+1777", "id": "w3", "type": "text", "text": {"body": "b"}})
    assert wa.parse_webhook(wa_h(body), body, "app", NOW) == [Inbound("w1", "+1555", "a"), Inbound("w3", "+1777", "b")]
    outs = [{"ok": True, "job": "j1"}, {"ok": True, "duplicate": True}]
    assert wa.answer([], outs, {}) == Answer({"ok": True, "jobs": ["j1"], "duplicates": 1})


def test_whatsapp_refusals_and_the_subscription_check():
    body = _wa({"from": ["1"], "id": "w1", "type": "text", "text": {"body": "a"}})
    assert wa.parse_webhook(wa_h(body), body, "app", NOW) == Refusal(400, "bad sender")
    assert wa.parse_webhook(wa_h(body, "other"), body, "app", NOW) == Refusal(401, "signature does not verify")
    assert wa.check_headers({"x-hub-signature-256": "md5=1"}, "app", NOW) == Refusal(401, "missing or bad signature")
    assert wa.parse_webhook(wa_h(b"42"), b"42", "app", NOW).status == 400
    q = {"hub.mode": "subscribe", "hub.verify_token": "tok", "hub.challenge": "99"}
    assert wa.verify_subscription(q, "tok") == Answer("99", plain=True)
    assert wa.verify_subscription({**q, "hub.verify_token": "no"}, "tok") == Refusal(403, "verify token does not match")


def test_the_parsers_import_no_platform_sdk():
    code = ("import sys, adapters.platforms.webhooks.telegram, adapters.platforms.webhooks.slack, "
            "adapters.platforms.webhooks.discord, adapters.platforms.webhooks.whatsapp\n"
            "print(sorted(m for m in ('telegram', 'discord', 'slack_sdk', 'nacl', 'aiohttp', 'httpx') "
            "if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.strip() == "[]", out.stdout
