"""Discord end to end: the real discord.py client in real worker processes,
against a local server speaking Discord's REST API (tests/fixtures/fake_discord.py),
driven by `courier send ... --wait` and `courier turn`."""

from __future__ import annotations

import itertools
import json
import os
import signal
from pathlib import Path

import pytest
import redis

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.base import FileSource, Kind, MiB
from adapters.platforms.discord import DiscordPlatform, nonce_for
from tasks import keys, receipts
from tests.fixtures._files import sha256_file as sha
from tests.fixtures._platforms import agent_env, chain_with_marker, db, make, opener, redelivered_file_job, send, words
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

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
    c = redis.Redis.from_url(db(redis_server, MODULE_DB))
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
    # no voice-note or animation kind on Discord: ogg as audio, gif as photo
    assert [r["kind"] for r in rows] == ["photo", "document", "audio", "video", "photo"]
    msgs = nonced(fake, chan)
    assert len(msgs) == 5
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
    for w in denv.workers:
        assert fake.token not in w.courier_log.read_text(errors="replace")


def test_text_over_the_limit_is_split(denv, fake, rclient):
    chan = channel()
    text = words(4500, seed=int.from_bytes(os.urandom(4), "big"))
    denv.reply_file.write_text(text, encoding="utf-8")
    res = denv.cli("turn", f"discord:{chan}", "write a lot", "--agent", "long", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    job = json.loads(res.stdout)["job"]

    def delivered() -> bool:
        rows = receipts.job_deliveries(rclient, job)
        return bool(rows) and all(r.get("state") == "delivered" for r in rows)

    wait_until(delivered, timeout_s=90, what="the reply's delivery")
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
    code, data, err = send(denv, f"discord:{chan}", str(big))
    assert code == 1, (data, err)
    row = data["deliveries"][0]
    assert row["state"] == "failed" and "too large" in row["reason"] and "huge.zip" in row["reason"]
    msgs = fake.channel_messages(chan)
    assert len(msgs) == 1 and not msgs[0]["attachments"]
    assert "huge.zip" in msgs[0]["content"] and "not sent" in msgs[0]["content"]
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
        assert [c.status for c in fake.calls("send", chan2)] == [413]  # not retried

        fake.upload_limit_bytes = 25 * MiB
        chan3 = channel()
        code, data, err = send(boosted, f"discord:{chan3}", str(big))
        assert code == 0, (data, err)
        (msg,) = nonced(fake, chan3)
        assert msg["courier_test_sha256"] == [sha(big)]
    finally:
        boosted.stop()


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
    res = denv.cli("status", data["job"], "--json")
    assert res.returncode == 1
    shown = {r["id"]: r["reason"] for r in json.loads(res.stdout)["deliveries"]}
    assert shown == {r["id"]: r["reason"] for r in rows}
    res = denv.cli("status", data["job"])
    assert res.returncode == 1 and "failed" in res.stdout


def test_unknown_channel_is_permanent(denv, fake, tmp_path):
    chan = channel()
    fake.unknown_channels.add(chan)
    code, data, _ = send(denv, f"discord:{chan}", str(make(tmp_path, "x.txt", 10)))
    assert code == 1 and "Unknown Channel" in data["deliveries"][0]["reason"]
    assert len(fake.calls("send", chan)) == 1


# -- idempotency ------------------------------------------------------------------------------------
def test_redelivered_task_after_success_sends_nothing(denv, fake, tmp_path, rclient):
    chan = channel()
    p = make(tmp_path, "once.png", 1200)
    code, data, err = send(denv, f"discord:{chan}", str(p))
    assert code == 0, (data, err)
    row = data["deliveries"][0]
    target = f"discord:{chan}"
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
    rclient = redis.Redis.from_url(db(redis_server, CRASH_DB))
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
        # what the dead process held (the delivery's send lock, the chat's rate-limit
        # slot) would expire after its TTL; expire it now
        held = [keys.delivery_lock(did), *rclient.scan_iter(f"{keys.rate_limit_prefix()}*{chan}*")]
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
