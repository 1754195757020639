"""Webhook turns end to end, with no reply override: a signed Slack event, a
Discord interaction and a WhatsApp message each go into the real web
process, a real worker runs the bridge agent, and its reply (the text, then
one file from a MEDIA tag) arrives in the chat the update came from, through
the real adapter and a local server speaking that platform's API
(tests/fixtures/fake_slack.py, fake_discord.py, fake_whatsapp.py). The stack
(worker, web processes, agents, fake servers) is tests/fixtures/webstack.py.
Telegram's counterpart is in tests/test_events_sse.py."""

from __future__ import annotations

import hashlib
import json
import os
import time

import httpx
import pytest

from adapters.platforms.outbox import read_log
from tasks.ledger import keys, receipts
from tests.fixtures.services import wait_until
from tests.fixtures.webstack import (
    attachment_bytes,
    discord_signed,
    slack_headers,
    whatsapp_headers,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: the reply's file, and the kind courier sends it as
FILES = [("chart.png", "photo"), ("report.pdf", "document")]
PROGRESS = "reading message.txt"  # the echo agent's tool activity, shown while it runs


def unique(name: str) -> str:
    """`name` made unique to this test run (fake servers and Redis are shared by the module)."""
    stem, ext = os.path.splitext(name)
    return f"{stem}-{os.urandom(4).hex()}{ext}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def settle(stack, job: str, origin: str) -> list[dict]:
    """The turn's receipt names the chat as origin and target; wait until the
    turn and its deliveries are over; its deliveries' receipts."""
    rec = receipts.get_job(stack.r, job)
    assert rec["origin"] == rec["target"] == origin and rec["agent"] == "echo"
    stack.wait_over(job)
    assert receipts.get_job(stack.r, job)["state"] == "replied"
    return receipts.job_deliveries(stack.r, job)


def assert_delivered(rows: list[dict], kind: str, name: str) -> None:
    assert [(d.get("type"), d.get("kind"), d.get("state")) for d in rows] == [
        ("text", "text", "delivered"), ("file", kind, "delivered")], rows
    assert rows[1]["name"] == name


# -- Slack: Events API -> chat.postMessage, then the external upload shared in the channel ------------
@pytest.mark.parametrize("fname,kind", FILES)
def test_slack_event_turn_replies_with_text_and_file_in_the_channel(stack, fname, kind):
    slack = stack.slack
    chan = "C" + os.urandom(5).hex().upper()
    name = unique(fname)
    body = json.dumps({"type": "event_callback", "event_id": "Ev" + os.urandom(6).hex().upper(), "team_id": "T1",
                       "event": {"type": "app_mention", "user": "U1", "text": f"<@U0000BOT1> attach {name}",
                                 "channel": chan, "ts": f"{time.time():.6f}"}}).encode()
    r = httpx.post(stack.direct + "/webhooks/slack", content=body, headers=slack_headers(body))
    assert r.status_code == 200, r.text
    rows = settle(stack, r.json()["job"], f"slack:{chan}")
    assert_delivered(rows, kind, name)

    def reply():  # the progress message is gone; the text, then the file, remain
        msgs = slack.channel_messages(chan)
        return msgs if len(msgs) == 2 and all(m["text"] != PROGRESS for m in msgs) else None

    text_msg, file_msg = wait_until(reply, timeout_s=30, what=f"the reply in Slack channel {chan}")
    assert text_msg["text"] == f"echo: attach {name}" and not text_msg.get("files")
    want = attachment_bytes(name)
    assert [(f["name"], f["size"], f["sha256"]) for f in file_msg["files"]] == [(name, len(want), sha(want))]
    assert not file_msg["text"]  # no caption: the text went first, on its own
    # in that order, and through Slack's upload flow
    posts = [c for c in slack.calls("chat.postMessage", chan) if c.fields.get("text") == f"echo: attach {name}"]
    shares = slack.calls("files.completeUploadExternal", chan)
    assert len(posts) == 1 and len(shares) == 1 and posts[0].t <= shares[0].t
    assert [m["ts"] for m in (text_msg, file_msg)] == sorted((text_msg["ts"], file_msg["ts"]))
    progress = [c for c in slack.calls("chat.postMessage", chan) if c.fields.get("text") == PROGRESS]
    assert len(progress) == 1 and len(slack.calls("chat.delete", chan)) == 1
    assert read_log(stack.env.outbox, f"slack_{chan}") == []  # no override


# -- Discord: an interaction answered at once; the reply as messages in its channel --------------------
@pytest.mark.parametrize("fname,kind", FILES)
def test_discord_interaction_turn_replies_with_text_and_file_in_the_channel(stack, fname, kind):
    discord = stack.discord
    chan = str(1_200_000_000_000_000_000 + int.from_bytes(os.urandom(6), "big"))
    name = unique(fname)
    interaction = {"type": 2, "id": str(1_300_000_000_000_000_000 + int.from_bytes(os.urandom(6), "big")),
                   "application_id": "1100000000000000002", "channel_id": chan, "guild_id": "1400000000000000001",
                   "token": "interaction-token-" + os.urandom(8).hex(), "version": 1,
                   "data": {"id": "1500000000000000001", "name": "ask", "type": 1,
                            "options": [{"name": "prompt", "type": 3, "value": f"attach {name}"}]}}
    body, headers = discord_signed(stack.discord_key, interaction)
    t0 = time.monotonic()
    r = httpx.post(stack.direct + "/webhooks/discord", content=body, headers=headers)
    acked_in = time.monotonic() - t0
    # Discord waits 3 s for the answer: the web process answers at once with
    # CHANNEL_MESSAGE_WITH_SOURCE (type 4) quoting the prompt; the agent's reply
    # then comes as bot messages in the interaction's channel (not as a follow-up
    # through the interaction token: courier has no such path)
    assert r.status_code == 200 and acked_in < 3.0, (r.status_code, acked_in)
    assert r.json() == {"type": 4, "data": {"content": f"> attach {name}", "allowed_mentions": {"parse": []}}}
    seen = keys.webhook_seen("discord", interaction["id"])  # the update id -> its turn
    job = wait_until(lambda: (v := stack.r.get(seen)) and v != "pending" and v, what="the turn's id")
    rows = settle(stack, job, f"discord:{chan}")
    assert_delivered(rows, kind, name)

    def reply():  # the progress message is gone; the text, then the file, remain
        msgs = discord.channel_messages(chan)
        return msgs if len(msgs) == 2 and all(m["content"] != PROGRESS for m in msgs) else None

    text_msg, file_msg = wait_until(reply, timeout_s=30, what=f"the reply in Discord channel {chan}")
    assert text_msg["content"] == f"echo: attach {name}" and text_msg["attachments"] == []
    want = attachment_bytes(name)
    assert [(a["filename"], a["size"]) for a in file_msg["attachments"]] == [(name, len(want))]
    assert file_msg["courier_test_sha256"] == [sha(want)]
    assert file_msg["content"] == ""  # no caption: the text went first, on its own
    assert int(text_msg["id"]) < int(file_msg["id"])  # snowflakes: created in that order
    sends = discord.calls("send", chan)
    assert [c.status for c in sends] == [200, 200, 200]  # progress, text, file
    assert sends[1].fields.get("content") == f"echo: attach {name}" and sends[1].t <= sends[2].t
    assert [f["filename"] for f in sends[2].files] == [name]
    assert sends[0].fields.get("content") == PROGRESS and len(discord.calls("delete", chan)) == 1
    assert discord.calls("typing", chan)
    assert read_log(stack.env.outbox, f"discord_{chan}") == []  # no override


# -- WhatsApp: a Cloud API notification -> /messages text, then /media + /messages by media id --------
@pytest.mark.parametrize("fname,kind", FILES)
def test_whatsapp_message_turn_replies_with_text_and_file_to_the_sender(stack, fname, kind):
    wa = stack.whatsapp
    sender = "1555" + str(int.from_bytes(os.urandom(4), "big") % 10**7).zfill(7)
    to = "+" + sender
    name = unique(fname)
    body = json.dumps({"object": "whatsapp_business_account", "entry": [{"id": "WABA", "changes": [{
        "field": "messages", "value": {
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": "15550001111", "phone_number_id": wa.phone_number_id},
            "contacts": [{"profile": {"name": "Ada"}, "wa_id": sender}],
            "messages": [{"from": sender, "id": "wamid." + os.urandom(12).hex(), "timestamp": str(int(time.time())),
                          "type": "text", "text": {"body": f"attach {name}"}}]}}]}]}).encode()
    r = httpx.post(stack.direct + "/webhooks/whatsapp", content=body, headers=whatsapp_headers(body))
    assert r.status_code == 200, r.text
    (job,) = r.json()["jobs"]
    rows = settle(stack, job, f"whatsapp:{to}")
    assert_delivered(rows, kind, name)

    msgs = wait_until(lambda: (m := wa.calls_for("messages", chat=to)) and len(m) == 2 and m,
                      timeout_s=30, what=f"the reply to WhatsApp {to}")
    text_call, file_call = msgs
    assert [c.status for c in msgs] == [200, 200]
    assert text_call.fields["type"] == "text"
    assert json.loads(text_call.fields["text"])["body"] == f"echo: attach {name}"
    # photo -> an image message; anything else -> a document (with its file name)
    wa_type = {"photo": "image", "document": "document"}[kind]
    assert file_call.fields["type"] == wa_type and text_call.t <= file_call.t
    obj = json.loads(file_call.fields[wa_type])
    assert "caption" not in obj  # the text went first, on its own
    if wa_type == "document":
        assert obj["filename"] == name
    media = wa.media[obj["id"]]  # the uploaded file the message names
    want = attachment_bytes(name)
    assert (media.size, media.sha256) == (len(want), sha(want))
    uploads = [c for c in wa.calls_for("media") if c.result and c.result.get("id") == obj["id"]]
    assert len(uploads) == 1 and uploads[0].files["file"].filename == name
    assert media.mime == {"chart.png": "image/png", "report.pdf": "application/pdf"}[fname]
    assert [d["message_id"] for d in rows] == [c.result["messages"][0]["id"] for c in msgs]
    assert read_log(stack.env.outbox, f"whatsapp_{to}") == []  # no override
