"""Discord end to end: the real discord.py client in real worker processes,
against a local server speaking Discord's REST API (tests/fixtures/fake_discord.py),
driven by `courier send ... --wait` and `courier turn`."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
from pathlib import Path

import pytest
import redis
import requests

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.base import FileSource, Kind, MiB
from adapters.platforms.discord import DiscordPlatform, nonce_for, waveform_for
from tasks.ledger import keys, receipts
from tests.fixtures._files import sha256_file as sha
from tests.fixtures._platforms import agent_env, assert_status_failed, assert_token_not_logged, chain_with_marker, db
from tests.fixtures._platforms import long_reply_delivered, make, opener, redelivered_file_job, send, send_plain, sent, words
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv
from tests.test_ogg import opus_stream, write_opus

pytestmark = pytest.mark.slow

_chan = itertools.count(int.from_bytes(os.urandom(3), "big") * 1000 + 1)


def channel() -> str:
    """A fresh numeric channel id per test (the fake server and Redis are shared by the module)."""
    return str(700000000000000000 + next(_chan))


MODULE_DB, BOOSTED_DB, CRASH_DB = 1, 2, 3


def nonced(fake, chan: str) -> list[dict]:
    """Messages the deliveries created (progress messages carry no nonce)."""
    return [m for m in fake.channel_messages(chan) if m.get("nonce")]


# -- one worker for the module ------------------------------------------------------------
@pytest.fixture(scope="module")
def denv(tmp_path_factory, redis_server, fake_discord):
    env = agent_env(tmp_path_factory.mktemp("discord"), db(redis_server, MODULE_DB), "long",
                    DISCORD_BOT_TOKEN=fake_discord.token, COURIER_DISCORD_BASE_URL=fake_discord.base_url)
    env.start_worker(concurrency=2)
    yield env
    env.stop()


@pytest.fixture
def rclient(redis_server):
    c = redis.Redis.from_url(db(redis_server, MODULE_DB), decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def fake(fake_discord):
    fake_discord.clear_failures()
    fake_discord.upload_limit_bytes = 10 * MiB
    return fake_discord


# -- every kind ------------------------------------------------------------------------------------
def test_send_every_kind_as_attachments(denv, fake, tmp_path):
    chan = channel()
    files = [make(tmp_path, n, s) for n, s in
             (("a.png", 3000), ("b.pdf", 2000), ("c.ogg", 1500), ("d.mp4", 4000), ("e.gif", 1000))]
    code, data, err = send(denv, f"discord:{chan}", *map(str, files), "--voice", "--caption", "see <@123> & co")
    assert code == 0, (data, err)
    rows = data["deliveries"]
    assert [r["state"] for r in rows] == ["delivered"] * 5
    # no animation kind on Discord: gif as photo; random bytes named .ogg are no Ogg
    # Opus: that voice note goes as an audio attachment, and its receipt says so
    assert [r["kind"] for r in rows] == ["photo", "document", "audio", "video", "photo"]
    msgs = nonced(fake, chan)
    assert len(msgs) == 5
    assert all(m["flags"] == 0 for m in msgs)
    for msg, p, row in zip(msgs, files, rows):
        assert [a["filename"] for a in msg["attachments"]] == [p.name]
        assert msg["attachments"][0]["size"] == p.stat().st_size
        assert msg["courier_test_sha256"] == [sha(p)]
        assert row["message_id"] == msg["id"] and msg["nonce"] == nonce_for(row["id"])
    assert msgs[0]["content"] == "see <@123> & co" and all(m["content"] == "" for m in msgs[1:])
    sends = [c for c in fake.calls("send", chan)]
    assert all(c.fields["enforce_nonce"] is True and c.fields["allowed_mentions"]["parse"] == [] for c in sends)
    assert all(c.files and c.files[0]["field"] == "files[0]" for c in sends)
    # the token never shows in what the workers log
    assert_token_not_logged(denv, fake.token)


def test_text_over_the_limit_is_split(denv, fake, rclient):
    chan = channel()
    text = words(4500, seed=int.from_bytes(os.urandom(4), "big"))
    long_reply_delivered(denv, rclient, f"discord:{chan}", text)
    msgs = nonced(fake, chan)
    assert len(msgs) == 3 and all(0 < len(m["content"]) <= 2000 for m in msgs)
    assert " ".join(m["content"] for m in msgs) == text
    assert len({m["nonce"] for m in msgs}) == 3


def test_caption_over_the_limit_follows_as_text(denv, fake, tmp_path):
    chan = channel()
    caption = words(2600, seed=int.from_bytes(os.urandom(4), "big"))
    p = make(tmp_path, "report.pdf", 5000)
    code, data, err = send(denv, f"discord:{chan}", str(p), "--caption", caption)
    assert code == 0, (data, err)
    msgs = nonced(fake, chan)
    assert len(msgs) == 3
    assert msgs[0]["courier_test_sha256"] == [sha(p)] and msgs[0]["content"] == ""
    assert all(not m["attachments"] and len(m["content"]) <= 2000 for m in msgs[1:])
    assert " ".join(m["content"] for m in msgs[1:]) == caption


def test_over_the_upload_limit_sends_a_notice_and_nothing_else(denv, fake, tmp_path, redis_server):
    chan = channel()
    big = make(tmp_path, "huge.zip", 10 * MiB + 1)
    # plain code, not the CLI: `courier send` refuses it before enqueueing (exit 2); this is the worker's refusal
    code, data, err = send_plain(denv, f"discord:{chan}", str(big))
    assert code == 1, (data, err)
    row = data["deliveries"][0]
    assert row["state"] == "failed" and "too large" in row["reason"] and "huge.zip" in row["reason"]
    msgs = fake.channel_messages(chan)
    assert len(msgs) == 1 and not msgs[0]["attachments"]
    assert "huge.zip" in msgs[0]["content"] and "not sent" in msgs[0]["content"]
    # binary units, the way the limit is set: 10 MiB is "10.0 MiB", not "10.5 MB"
    assert "(10.0 MiB)" in msgs[0]["content"] and "10.0 MiB limit" in msgs[0]["content"], msgs[0]["content"]
    assert "10.0 MiB" in row["reason"] and "MB" not in row["reason"].replace("MiB", "")
    assert not [c for c in fake.calls("send", chan) if c.files]

    # a boosted guild: the limit is a setting; past Discord's own cap the 413 is permanent
    boosted = CourierEnv(tmp_path / "boosted", db(redis_server, BOOSTED_DB), DISCORD_BOT_TOKEN=fake.token,
                         COURIER_DISCORD_BASE_URL=fake.base_url, COURIER_DISCORD_UPLOAD_BYTES=str(25 * MiB))
    try:
        boosted.start_worker(concurrency=1)
        chan2 = channel()
        code, data, err = send(boosted, f"discord:{chan2}", str(big))
        assert code == 1
        row = data["deliveries"][0]
        assert row["state"] == "failed" and "too large" in row["reason"] and "40005" in row["reason"]
        # not retried; the chat gets the same notice as for courier's own limit
        assert [(c.status, bool(c.files)) for c in fake.calls("send", chan2)] == [(413, True), (200, False)]
        (notice,) = fake.channel_messages(chan2)
        assert "huge.zip" in notice["content"] and "too large" in notice["content"]

        fake.upload_limit_bytes = 25 * MiB
        chan3 = channel()
        code, data, err = send(boosted, f"discord:{chan3}", str(big))
        assert code == 0, (data, err)
        (msg,) = nonced(fake, chan3)
        assert msg["courier_test_sha256"] == [sha(big)]
    finally:
        boosted.stop()


# -- voice notes ---------------------------------------------------------------------------------------
VOICE_FLAG = 1 << 13


def test_ogg_voice_note_is_a_native_voice_message(denv, fake, tmp_path):
    chan = channel()
    p = write_opus(tmp_path / "note.ogg", 3.27, frame=b"\xf8" + os.urandom(120))
    code, data, err = send(denv, f"discord:{chan}", str(p), "--voice")
    assert code == 0, (data, err)
    (row,) = data["deliveries"]
    assert row["state"] == "delivered" and row["kind"] == "voice"
    (msg,) = nonced(fake, chan)
    assert msg["flags"] == VOICE_FLAG and msg["content"] == ""
    (att,) = msg["attachments"]
    assert att["filename"] == "note.ogg" and att["content_type"] == "audio/ogg" and att["size"] == p.stat().st_size
    assert att["duration_secs"] == pytest.approx(3.27, abs=0.05)
    wave = base64.b64decode(att["waveform"], validate=True)
    assert 0 < len(wave) <= 256
    assert msg["courier_test_sha256"] == [sha(p)]
    assert row["message_id"] == msg["id"] and msg["nonce"] == nonce_for(row["id"])
    (call,) = fake.calls("send", chan)
    assert call.fields["flags"] == VOICE_FLAG and not call.fields.get("content")
    assert call.fields["enforce_nonce"] is True and call.fields["allowed_mentions"]["parse"] == []
    assert [c["field"] for c in call.files] == ["files[0]"]
    assert [a["id"] for a in call.fields["attachments"]] == [0]


@pytest.mark.parametrize("chars,parts", [(0, 1), (2600, 2)], ids=["short", "long"])
def test_voice_note_caption_follows_as_text(denv, fake, tmp_path, chars, parts):
    """A voice message holds no text: its caption follows as text messages, split
    at Discord's 2000 characters, each a part of its own."""
    chan = channel()
    caption = "listen <@123>" + (" " + words(chars, seed=int.from_bytes(os.urandom(4), "big")) if chars else "")
    p = write_opus(tmp_path / "memo.opus", 1.5)
    code, data, err = send(denv, f"discord:{chan}", str(p), "--voice", "--caption", caption)
    assert code == 0, (data, err)
    (row,) = data["deliveries"]
    msgs = nonced(fake, chan)
    assert len(msgs) == 1 + parts
    voice, texts = msgs[0], msgs[1:]
    assert voice["flags"] == VOICE_FLAG and voice["content"] == "" and voice["id"] == row["message_id"]
    assert [a["filename"] for a in voice["attachments"]] == ["memo.ogg"]  # Discord takes a voice message as .ogg
    assert voice["attachments"][0]["duration_secs"] == pytest.approx(1.5, abs=0.05)
    assert all(m["flags"] == 0 and not m["attachments"] and len(m["content"]) <= 2000 for m in texts)
    assert " ".join(m["content"] for m in texts) == caption
    assert [m["nonce"] for m in texts] == [nonce_for(f"{row['id']}#c{i}") for i in range(parts)]
    assert all(c.fields["allowed_mentions"]["parse"] == [] for c in fake.calls("send", chan))


def test_caption_part_failing_after_the_voice_message_resends_only_the_caption(denv, fake, tmp_path):
    chan = channel()
    fake.fail_next("send_text", 1, 500, channel=chan)
    p = write_opus(tmp_path / "retry.ogg", 2.0)
    code, data, err = send(denv, f"discord:{chan}", str(p), "--voice", "--caption", "said once")
    assert code == 0, (data, err)
    calls = fake.calls("send", chan)
    assert [(bool(c.files), c.status) for c in calls] == [(True, 200), (False, 500), (False, 200)]
    msgs = nonced(fake, chan)
    assert [(m["flags"], m["content"]) for m in msgs] == [(VOICE_FLAG, ""), (0, "said once")]


def test_mp3_voice_note_goes_as_an_audio_attachment(denv, fake, tmp_path):
    chan = channel()
    p = make(tmp_path, "song.mp3", 3000)
    code, data, err = send(denv, f"discord:{chan}", str(p), "--voice", "--caption", "a song")
    assert code == 0, (data, err)
    assert [r["kind"] for r in data["deliveries"]] == ["audio"]  # the receipt says what the chat shows
    (msg,) = nonced(fake, chan)
    assert msg["flags"] == 0 and msg["content"] == "a song"
    (att,) = msg["attachments"]
    assert att["filename"] == "song.mp3" and "duration_secs" not in att and "waveform" not in att
    assert msg["courier_test_sha256"] == [sha(p)]
    assert "flags" not in fake.calls("send", chan)[0].fields


def test_malformed_ogg_voice_notes_fall_back_to_attachments(denv, fake, tmp_path):
    chan = channel()
    cut = tmp_path / "cut.ogg"
    cut.write_bytes(opus_stream(2.0)[:-9])  # truncated inside its last page
    noise = make(tmp_path, "noise.ogg", 2000)  # not Ogg at all
    code, data, err = send(denv, f"discord:{chan}", str(cut), str(noise), "--voice", "--caption", "two notes")
    assert code == 0, (data, err)
    assert [r["state"] for r in data["deliveries"]] == ["delivered"] * 2
    assert [r["kind"] for r in data["deliveries"]] == ["audio"] * 2
    msgs = nonced(fake, chan)
    assert [m["flags"] for m in msgs] == [0, 0]
    assert [[a["filename"] for a in m["attachments"]] for m in msgs] == [["cut.ogg"], ["noise.ogg"]]
    assert [m["courier_test_sha256"] for m in msgs] == [[sha(cut)], [sha(noise)]]
    assert msgs[0]["content"] == "two notes"  # not a voice message: the caption rides on the attachment
    assert all(c.status == 200 for c in fake.calls("send", chan))


def test_redelivered_voice_note_task_sends_nothing_twice(denv, fake, tmp_path, rclient):
    chan = channel()
    target = f"discord:{chan}"
    p = write_opus(tmp_path / "once.ogg", 2.5)
    data, row = sent(denv, target, p, "--voice", "--caption", "only once")
    job = {**redelivered_file_job(data, target, p, sha(p)), "voice": True, "caption": "only once"}
    marker = chain_with_marker(denv, rclient, target, "discord", job)
    wait_until(lambda: any(m["content"] == marker["text"] for m in fake.channel_messages(chan)), timeout_s=60,
               what="the marker message")
    assert len([c for c in fake.calls("send", chan) if c.files]) == 1
    assert [(m["flags"], m["content"]) for m in nonced(fake, chan)] == \
        [(VOICE_FLAG, ""), (0, "only once"), (0, marker["text"])]
    assert len([c for c in fake.calls("send", chan) if c.fields.get("content") == "only once"]) == 1
    assert receipts.get_delivery(rclient, row["id"])["state"] == "delivered"


# -- rate limits and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("via", [True, False], ids=["429-via", "429-cloudflare"])
def test_429_then_success_is_delivered_once_after_retry_after(denv, fake, tmp_path, via):
    chan = channel()
    fake.fail_next("send", 1, 429, channel=chan, retry_after=1.5, via=via)
    p = make(tmp_path, "chart.png", 2500)
    code, data, err = send(denv, f"discord:{chan}", str(p))
    assert code == 0, (data, err)
    calls = fake.calls("send", chan)
    assert [c.status for c in calls] == [429, 200]
    assert calls[1].t - calls[0].t >= 1.5
    (msg,) = nonced(fake, chan)
    assert msg["courier_test_sha256"] == [sha(p)] and data["deliveries"][0]["message_id"] == msg["id"]


def test_repeated_500s_then_success(denv, fake, tmp_path):
    chan = channel()
    fake.fail_next("send", 2, 500, channel=chan)
    p = make(tmp_path, "notes.txt", 800)
    code, data, err = send(denv, f"discord:{chan}", str(p))
    assert code == 0, (data, err)
    assert [c.status for c in fake.calls("send", chan)] == [500, 500, 200]
    assert len(nonced(fake, chan)) == 1
    assert int(data["deliveries"][0]["attempts"]) >= 3  # (plus any turn spent waiting for a rate-limit slot)


def test_permanent_400_and_403_are_not_retried_and_shown_by_status(denv, fake, tmp_path):
    chan = channel()
    fake.fail_next("send", 1, 400, channel=chan)
    fake.fail_next("send", 1, 403, channel=chan)
    a, b = make(tmp_path, "a.png", 1000), make(tmp_path, "b.pdf", 1000)
    code, data, err = send(denv, f"discord:{chan}", str(a), str(b))
    assert code == 1
    rows = data["deliveries"]
    assert [r["state"] for r in rows] == ["failed", "failed"]
    assert "400" in rows[0]["reason"] and "50035" in rows[0]["reason"]
    assert "forbidden" in rows[1]["reason"] and "Missing Permissions" in rows[1]["reason"]
    assert [c.status for c in fake.calls("send", chan)] == [400, 403]
    assert nonced(fake, chan) == []
    assert_status_failed(denv, data["job"], rows)


def test_unknown_channel_is_permanent(denv, fake, tmp_path):
    chan = channel()
    fake.unknown_channels.add(chan)
    code, data, _ = send(denv, f"discord:{chan}", str(make(tmp_path, "x.txt", 10)))
    assert code == 1 and "Unknown Channel" in data["deliveries"][0]["reason"]
    assert len(fake.calls("send", chan)) == 1


# -- idempotency ------------------------------------------------------------------------------------
def test_redelivered_task_after_success_sends_nothing(denv, fake, tmp_path, rclient):
    chan = channel()
    target = f"discord:{chan}"
    p = make(tmp_path, "once.png", 1200)
    data, row = sent(denv, target, p)
    job = redelivered_file_job(data, target, p, sha(p))
    # the same task again, then a marker after it in one chain: when the marker
    # arrives, the redelivered task has run
    marker = chain_with_marker(denv, rclient, target, "discord", job)
    wait_until(lambda: any(m["content"] == marker["text"] for m in fake.channel_messages(chan)), timeout_s=60,
               what="the marker message")
    files_sent = [c for c in fake.calls("send", chan) if c.files]
    assert len(files_sent) == 1
    assert [m["id"] for m in nonced(fake, chan) if m["attachments"]] == [row["message_id"]]
    assert receipts.get_delivery(rclient, row["id"])["state"] == "delivered"


def test_crash_between_send_and_record_still_one_message(fake, tmp_path, redis_server):
    """The worker process dies after Discord created the message and before
    the receipt is written; the task runs again with the same nonce and gets
    the original message back."""
    env = CourierEnv(tmp_path / "crash", db(redis_server, CRASH_DB), DISCORD_BOT_TOKEN=fake.token,
                     COURIER_DISCORD_BASE_URL=fake.base_url)
    rclient = redis.Redis.from_url(db(redis_server, CRASH_DB), decode_responses=True)
    try:
        worker = env.start_worker(concurrency=1)
        chan = channel()
        p = make(tmp_path, "crash.png", 4000)
        release = fake.hold_next("send")
        res = env.cli("send", f"discord:{chan}", str(p), "--json")
        assert res.returncode == 0, res.stderr
        sent = json.loads(res.stdout)
        did = sent["deliveries"][0]
        wait_until(lambda: "send" in fake.held and nonced(fake, chan), timeout_s=60, what="the held send")
        children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
        assert children, "no pool process"
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        release.set()
        # what the dead process held (the delivery's send lock, its chat's lane lease, the
        # chat's rate-limit slot) would expire after its TTL (a dead worker's recovery:
        # test_reliability, tests/chaos); expire it now
        held = [keys.delivery_lock(did), keys.lease("lane", f"discord:{chan}"),
                *rclient.scan_iter(f"{keys.rate_limit_prefix()}*{chan}*")]
        rclient.delete(*held)
        wait_until(lambda: (receipts.get_delivery(rclient, did) or {}).get("state") == "delivered", timeout_s=90,
                   what="the delivery after the crash")
        msgs = nonced(fake, chan)
        assert len(msgs) == 1 and msgs[0]["courier_test_sha256"] == [sha(p)]
        calls = fake.calls("send", chan)
        assert len([c for c in calls if c.status == 200]) >= 2
        assert {c.fields["nonce"] for c in calls} == {nonce_for(did)}
        assert receipts.get_delivery(rclient, did)["message_id"] == msgs[0]["id"]
    finally:
        env.stop()
        rclient.close()


# -- the adapter on its own (same real client and server, no worker) ----------------------------------
def _source(p: Path, *, with_path: bool) -> FileSource:
    return FileSource(name=p.name, size_bytes=p.stat().st_size, sha256="", opener=lambda: opener(p),
                      path=p if with_path else None)


@pytest.fixture
def adapter(fake):
    a = DiscordPlatform(fake.token, base_url=fake.base_url)
    yield a
    a.close()


def test_progress_message_typing_and_album(adapter, fake, tmp_path):
    chan = channel()
    mid = adapter.start_progress(chan, "thinking")
    adapter.typing(chan)
    adapter.edit_progress(chan, mid, "$ pytest -q")
    assert [m["content"] for m in fake.channel_messages(chan)] == ["$ pytest -q"]
    adapter.end_progress(chan, mid)
    adapter.end_progress(chan, mid)  # already gone: fine
    assert fake.channel_messages(chan) == [] and mid in fake.deleted
    assert [c.route for c in fake.calls(channel=chan)] == ["send", "typing", "edit", "delete", "delete"]

    # several files in one message; a stream without a local path is sent as it is read
    files = [make(tmp_path, f"p{i}.png", 2000 + i) for i in range(3)]
    sents = adapter.send_album(chan, [(Kind.PHOTO, _source(f, with_path=i != 1)) for i, f in enumerate(files)],
                               caption="three", delivery_id="album-1")
    (msg,) = fake.channel_messages(chan)
    assert [s.message_id for s in sents] == [msg["id"]] * 3
    assert msg["courier_test_sha256"] == [sha(f) for f in files] and msg["content"] == "three"


@pytest.mark.parametrize("status,opts,error,words_", [
    (429, {"retry_after": 2.25}, RateLimited, "2.25"),
    (429, {"retry_after": 3.5, "via": False}, RateLimited, "3.5"),
    (500, {}, Transient, "500"),
    (502, {"text": "<html>bad gateway</html>"}, Transient, "502"),
    (503, {}, Transient, "503"),
    (400, {}, Permanent, "50035"),
    (403, {}, Permanent, "forbidden"),
    (413, {}, Permanent, "too large"),
])
def test_error_map(adapter, fake, status, opts, error, words_):
    chan = channel()
    fake.fail_next("send", 1, status, channel=chan, **opts)
    with pytest.raises(error) as ei:
        adapter.send_text(chan, "hello", delivery_id=f"err-{status}")
    assert words_ in str(ei.value) and fake.token not in str(ei.value)
    if error is RateLimited:
        assert ei.value.retry_after_s == float(words_)
    assert len(fake.calls("send", chan)) == 1  # the SDK did not retry (or sleep) by itself


def test_bad_token_bad_channel_and_missing_token(fake, denv, tmp_path):
    bad = DiscordPlatform("not-the-token", base_url=fake.base_url)
    with pytest.raises(Permanent, match="token was rejected"):
        bad.send_text("1", "x", delivery_id="bad")
    assert "not-the-token" not in repr(bad)
    bad.close()
    good = DiscordPlatform(fake.token, base_url=fake.base_url)
    with pytest.raises(Permanent, match="must be a number"):
        good.send_text("general", "x", delivery_id="x")
    good.close()
    env = CourierEnv(tmp_path / "notoken", denv.env["COURIER_REDIS_URL"], DISCORD_BOT_TOKEN="")
    res = env.cli("send", "discord:1", str(make(tmp_path, "a.txt", 5)))
    assert res.returncode == 2 and "DISCORD_BOT_TOKEN is not set" in res.stderr


# -- voice messages, the adapter on its own ------------------------------------------------------------
def test_voice_message_from_a_stream_and_the_caption_limit(adapter, fake, tmp_path):
    chan = channel()
    p = write_opus(tmp_path / "stream.opus", 12.34)
    src = _source(p, with_path=False)
    assert adapter.caption_chars_for(Kind.VOICE, src) == 0  # a voice message holds no text
    assert adapter.caption_chars_for(Kind.AUDIO, src) == 2000
    assert adapter.caption_chars_for(Kind.VOICE, _source(make(tmp_path, "x.mp3", 100), with_path=True)) == 2000
    assert adapter.caption_chars_for(Kind.VOICE, _source(make(tmp_path, "y.ogg", 100), with_path=True)) == 2000
    sent = adapter.send_file(chan, Kind.VOICE, src, caption=None, delivery_id="voice-stream")
    (msg,) = fake.channel_messages(chan)
    assert sent.message_id == msg["id"] and msg["flags"] == VOICE_FLAG
    (att,) = msg["attachments"]
    assert att["filename"] == "stream.ogg" and att["duration_secs"] == pytest.approx(12.34, abs=0.05)
    assert base64.b64decode(att["waveform"]) == waveform_for(12.34)
    assert msg["courier_test_sha256"] == [sha(p)]
    # a voice message cannot be edited
    with pytest.raises(Permanent, match="50162"):
        adapter.edit_progress(chan, sent.message_id, "x")


def test_waveform_is_flat_and_at_most_256_samples():
    assert waveform_for(0.01) == bytes([128])
    assert len(waveform_for(3.27)) == 33 and set(waveform_for(3.27)) == {128}
    assert len(waveform_for(3600)) == 256


def test_voice_note_with_a_caption_given_directly_keeps_it_on_an_attachment(adapter, fake, tmp_path):
    chan = channel()
    p = write_opus(tmp_path / "direct.ogg", 1.0)
    adapter.send_file(chan, Kind.VOICE, _source(p, with_path=True), caption="kept", delivery_id="voice-cap")
    (msg,) = fake.channel_messages(chan)
    assert msg["flags"] == 0 and msg["content"] == "kept" and msg["attachments"][0]["filename"] == "direct.ogg"


def test_channel_without_voice_messages_gets_an_audio_attachment(adapter, fake, tmp_path):
    chan = channel()
    fake.no_voice_channels.add(chan)
    p = write_opus(tmp_path / "refused.ogg", 2.0)
    sent = adapter.send_file(chan, Kind.VOICE, _source(p, with_path=False), caption=None, delivery_id="voice-no")
    (msg,) = fake.channel_messages(chan)
    assert sent.message_id == msg["id"] and msg["flags"] == 0
    assert sent.kind == Kind.AUDIO  # what the receipt records: what the chat shows
    assert msg["courier_test_sha256"] == [sha(p)] and msg["nonce"] == nonce_for("voice-no")
    calls = fake.calls("send", chan)
    assert [(c.status, c.fields.get("flags")) for c in calls] == [(403, VOICE_FLAG), (200, None)]


def _post_voice(fake, chan: str, payload: dict, files: list[tuple[str, bytes]]) -> requests.Response:
    form = {"payload_json": (None, json.dumps(payload), "application/json")}
    for i, (name, data) in enumerate(files):
        form[f"files[{i}]"] = (name, data, "application/octet-stream")
    return requests.post(f"{fake.base_url}/channels/{chan}/messages", files=form, timeout=10,
                         headers={"Authorization": f"Bot {fake.token}"})


@pytest.mark.parametrize("change,code", [
    ({"content": "hello"}, 50159),
    ({"files": 2}, 50160),
    ({"name": "note.txt"}, 50160),
    ({"meta": {"waveform": "gA=="}}, 50161),
    ({"meta": {"duration_secs": 1.5}}, 50161),
    ({"meta": {"duration_secs": "1.5", "waveform": "gA=="}}, 50161),
    ({"meta": {"duration_secs": 1.5, "waveform": "not base64!"}}, 50161),
    ({"meta": {"duration_secs": 1.5, "waveform": base64.b64encode(bytes(257)).decode()}}, 50161),
    ({}, None),
], ids=["content", "two-files", "not-audio", "no-duration", "no-waveform", "duration-string", "bad-base64",
        "waveform-257", "sound"])
def test_fake_rejects_what_discord_rejects_in_a_voice_message(fake, change, code):
    chan = channel()
    meta = change.get("meta", {"duration_secs": 1.5, "waveform": base64.b64encode(bytes([128]) * 15).decode()})
    names = [change.get("name", "v.ogg")] * change.get("files", 1)
    payload = {"flags": VOICE_FLAG, "attachments": [{"id": i, "filename": n, **meta} for i, n in enumerate(names)]}
    if "content" in change:
        payload["content"] = change["content"]
    resp = _post_voice(fake, chan, payload, [(n, opus_stream(1.5)) for n in names])
    if code is None:
        assert resp.status_code == 200, resp.text
        assert resp.json()["flags"] == VOICE_FLAG and resp.json()["attachments"][0]["duration_secs"] == 1.5
    else:
        assert resp.status_code == 400 and resp.json()["code"] == code, resp.text
        assert fake.channel_messages(chan) == []


def test_no_voice_library_warning_in_the_worker_log(denv, fake, tmp_path):
    # courier never joins voice channels: discord.py's "davey / PyNaCl is not installed" warning
    # at every client start is noise in every worker log
    chan = channel()
    code, data, err = send(denv, f"discord:{chan}", str(make(tmp_path, "w.pdf", 1200)))
    assert code == 0, (data, err)
    for w in denv.workers:
        log = w.courier_log.read_text(errors="replace")
        assert "davey is not installed" not in log and "PyNaCl is not installed" not in log
