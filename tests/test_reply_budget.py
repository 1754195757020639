"""A long reply does not flood the chat (issue 24: a 1 MB reply was 101
Discord / 50 Telegram / 50 WhatsApp messages): a text over the reply budget
(`delivery.REPLY_MAX_PARTS` messages) goes as its first part, ending in a line
that says it was cut and where the rest is, then the whole text as the
document `reply.txt`; a text within the budget is split as before.

Plain code as a worker runs it (`chains.register`, then the chat's lane:
`lanes.drive`) against real Redis, each platform's real SDK client against
the local fake server (tests/fixtures/fake_*.py); assertions are on what
that server got.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from adapters.platforms.discord import DiscordPlatform
from adapters.platforms.telegram import TelegramPlatform
from adapters.platforms.whatsapp import WhatsAppPlatform
from storage.volume import VolumeStore
from tasks.delivery import delivery, lanes
from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.runtime import Context
from tests.fixtures._platforms import words
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.timeout(120)

MB = 1024 * 1024


def _reply(redis_client, tmp_path, platform, target: str, text: str) -> str:
    """A reply of `text` registered for `target` and its lane driven until empty; the delivery id."""
    ctx = Context(redis=redis_client, store=VolumeStore(tmp_path / "store"), platform=lambda name: platform,
                  sandbox=lambda ref: None, agent=lambda name: None)  # type: ignore[arg-type,return-value]
    job = chains.new_job_id("turn")
    (entry,) = chains.register(redis_client, chains.Plan(job_id=job, target=target, text=text), job_kind="turn")

    def drained() -> bool:
        lanes.drive(ctx, target, lambda t, countdown=None: None)
        return not redis_client.exists(keys.lane(target))

    wait_until(drained, timeout_s=90, interval_s=0.2, what=f"the lane of {target} drained")
    rec = receipts.get_delivery(redis_client, entry.did) or {}
    assert rec.get("state") == "delivered", rec
    return entry.did


def _megabyte() -> str:
    return words(MB, seed=int.from_bytes(os.urandom(4), "big"))[:MB].strip()


def _cut_line(head: str, total: int) -> None:
    shown, _, note = head.rpartition("\n\n")
    assert note == f"… (truncated, {total - len(shown):,} more characters in reply.txt)", note
    return None


def test_a_megabyte_reply_is_two_telegram_messages(redis_client, tmp_path, fake_telegram):
    text = _megabyte()
    platform = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    try:
        _reply(redis_client, tmp_path, platform, "telegram:901", text)
    finally:
        platform.close()
    calls = fake_telegram.calls_for(chat="901", ok=True)
    assert [c.method for c in calls] == ["sendMessage", "sendDocument"]
    head = calls[0].text or ""
    assert len(head) <= 4096 and text.startswith(head.rpartition("\n\n")[0])
    _cut_line(head, len(text.strip()))
    (doc,) = calls[1].files.values()
    assert doc.filename == "reply.txt" and doc.sha256 == hashlib.sha256(text.strip().encode()).hexdigest()


def test_a_megabyte_reply_is_two_discord_messages(redis_client, tmp_path, fake_discord):
    text = _megabyte()
    platform = DiscordPlatform(fake_discord.token, base_url=fake_discord.base_url)
    try:
        _reply(redis_client, tmp_path, platform, "discord:902", text)
    finally:
        platform.close()
    msgs = fake_discord.channel_messages("902")
    assert len(msgs) == 2, [m["content"][:40] for m in msgs]
    head = msgs[0]["content"]
    assert len(head) <= 2000 and not msgs[0]["attachments"]
    _cut_line(head, len(text.strip()))
    assert [a["filename"] for a in msgs[1]["attachments"]] == ["reply.txt"]
    assert msgs[1]["courier_test_sha256"] == [hashlib.sha256(text.strip().encode()).hexdigest()]


def test_a_megabyte_reply_is_two_whatsapp_messages(redis_client, tmp_path, fake_whatsapp):
    text = _megabyte()
    platform = WhatsAppPlatform(fake_whatsapp.token, fake_whatsapp.phone_number_id, base_url=fake_whatsapp.url)
    try:
        _reply(redis_client, tmp_path, platform, "whatsapp:+15550903", text)
    finally:
        platform.close()
    sends = [c for c in fake_whatsapp.calls_for(ok=True) if c.method == "messages"]
    assert [c.fields.get("type") for c in sends] == ["text", "document"], [c.fields for c in sends]


@pytest.mark.parametrize("parts", [1, delivery.REPLY_MAX_PARTS])
def test_a_reply_within_the_budget_is_split_as_before(redis_client, tmp_path, fake_discord, parts):
    text = words(1900 * parts, seed=parts)
    platform = DiscordPlatform(fake_discord.token, base_url=fake_discord.base_url)
    chan = f"91{parts}"
    try:
        _reply(redis_client, tmp_path, platform, f"discord:{chan}", text)
    finally:
        platform.close()
    msgs = fake_discord.channel_messages(chan)
    assert len(msgs) == parts and not any(m["attachments"] for m in msgs)
    assert " ".join(m["content"] for m in msgs) == text
