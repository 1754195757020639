"""Slack end to end: slack_sdk's WebClient (and the streamed upload) in real
worker processes, against a local server speaking Slack's Web API
(tests/fixtures/fake_slack.py), driven by `courier send ... --wait` and `courier turn`."""

from __future__ import annotations

import itertools
import os

import pytest
import redis

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.base import FileSource, Kind
from adapters.platforms.slack import DEFAULT_UPLOAD_BYTES, SlackPlatform
from tests.fixtures._files import sha256_file as sha
from tests.fixtures._platforms import agent_env, assert_status_failed, assert_token_not_logged, chain_with_marker, db
from tests.fixtures._platforms import long_reply_delivered, make, opener, redelivered_file_job, send, send_plain, sent, words
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

MODULE_DB, LIMITED_DB = 4, 5
_chan = itertools.count(int.from_bytes(os.urandom(2), "big") * 1000 + 1)


def channel() -> str:
    """A fresh channel id per test (the fake server and Redis are shared by the module)."""
    return f"C{next(_chan):08d}"


def slack_escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def file_messages(fake, chan: str) -> list[dict]:
    return [m for m in fake.channel_messages(chan) if m["files"]]


@pytest.fixture(scope="module")
def senv(tmp_path_factory, redis_server, fake_slack):
    env = agent_env(tmp_path_factory.mktemp("slack"), db(redis_server, MODULE_DB), "long",
                    SLACK_BOT_TOKEN=fake_slack.token, COURIER_SLACK_BASE_URL=fake_slack.base_url)
    env.start_worker(concurrency=2)
    yield env
    env.stop()


@pytest.fixture
def rclient(redis_server):
    c = redis.Redis.from_url(db(redis_server, MODULE_DB), decode_responses=True)
    yield c
    c.close()


@pytest.fixture
def fake(fake_slack):
    fake_slack.clear_failures()
    fake_slack.upload_limit_bytes = DEFAULT_UPLOAD_BYTES
    return fake_slack


# -- every kind ------------------------------------------------------------------------------
def test_send_every_kind_as_files(senv, fake, tmp_path):
    chan = channel()
    files = [make(tmp_path, n, s) for n, s in
             (("a.png", 3000), ("b.pdf", 2000), ("c.ogg", 1500), ("d.mp4", 4000), ("e.gif", 1000))]
    uploads_before = len(fake.calls("upload"))
    caption = "see <this> & that"
    code, data, err = send(senv, f"slack:{chan}", *map(str, files), "--voice", "--caption", caption)
    assert code == 0, (data, err)
    rows = data["deliveries"]
    assert [r["state"] for r in rows] == ["delivered"] * 5
    # Slack shows files as files: images stay photos (previewed), the rest are documents
    assert [r["kind"] for r in rows] == ["photo", "document", "document", "document", "photo"]
    msgs = file_messages(fake, chan)
    assert len(msgs) == 5
    for msg, p, row in zip(msgs, files, rows):
        (f,) = msg["files"]
        assert (f["name"], f["title"], f["size"], f["sha256"]) == (p.name, p.name, p.stat().st_size, sha(p))
        assert row["message_id"] == f["id"]
    assert msgs[0]["text"] == slack_escaped(caption) and all(m["text"] == "" for m in msgs[1:])
    asked = [c for c in fake.calls("files.getUploadURLExternal")][-5:]
    assert [(c.fields["filename"], int(c.fields["length"])) for c in asked] == [(p.name, p.stat().st_size)
                                                                                 for p in files]
    ups = fake.calls("upload")[uploads_before:]
    assert len(ups) == 5 and not any(u.fields["chunked"] for u in ups)  # streamed with a Content-Length
    assert_token_not_logged(senv, fake.token)


def test_text_over_the_limit_is_split(senv, fake, rclient):
    chan = channel()
    text = words(90000)
    long_reply_delivered(senv, rclient, f"slack:{chan}", text)
    msgs = [m for m in fake.channel_messages(chan) if not m["files"]]
    assert len(msgs) == 3 and all(0 < len(m["text"]) <= 40000 for m in msgs)
    assert " ".join(m["text"] for m in msgs) == text


def test_caption_over_the_limit_follows_as_text(senv, fake, tmp_path):
    chan = channel()
    caption = words(41000)
    p = make(tmp_path, "report.pdf", 5000)
    code, data, err = send(senv, f"slack:{chan}", str(p), "--caption", caption)
    assert code == 0, (data, err)
    msgs = fake.channel_messages(chan)
    assert len(msgs) == 3
    assert msgs[0]["files"][0]["sha256"] == sha(p) and msgs[0]["text"] == ""
    assert all(not m["files"] and len(m["text"]) <= 40000 for m in msgs[1:])
    assert " ".join(m["text"] for m in msgs[1:]) == caption


def test_over_the_upload_limit_sends_a_notice_and_nothing_else(fake, tmp_path, redis_server):
    assert SlackPlatform("xoxb-x").limits.upload_bytes == 1024**3  # Slack's 1 GB by default
    env = CourierEnv(tmp_path / "limited", db(redis_server, LIMITED_DB), SLACK_BOT_TOKEN=fake.token,
                     COURIER_SLACK_BASE_URL=fake.base_url, COURIER_SLACK_UPLOAD_BYTES=str(64 * 1024))
    try:
        env.start_worker(concurrency=1)
        chan = channel()
        big = make(tmp_path, "huge.zip", 64 * 1024 + 1)
        asked, uploaded = len(fake.calls("files.getUploadURLExternal")), len(fake.calls("upload"))
        # plain code, not the CLI: `courier send` refuses it before enqueueing; this is the worker's refusal
        code, data, err = send_plain(env, f"slack:{chan}", str(big))
        assert code == 1, (data, err)
        row = data["deliveries"][0]
        assert row["state"] == "failed" and "too large" in row["reason"] and "huge.zip" in row["reason"]
        (msg,) = fake.channel_messages(chan)
        assert not msg["files"] and "huge.zip" in msg["text"] and "not sent" in msg["text"]
        assert (len(fake.calls("files.getUploadURLExternal")), len(fake.calls("upload"))) == (asked, uploaded)

        # under courier's limit but over the workspace's: Slack's refusal is permanent
        fake.upload_limit_bytes = 32 * 1024
        chan2 = channel()
        code, data, err = send(env, f"slack:{chan2}", str(make(tmp_path, "mid.zip", 40 * 1024)))
        assert code == 1
        assert "too large" in data["deliveries"][0]["reason"] and "file_too_large" in data["deliveries"][0]["reason"]
        (notice,) = fake.channel_messages(chan2)  # the chat is told, as for courier's own limit
        assert not notice["files"] and "mid.zip" in notice["text"] and "too large" in notice["text"]
    finally:
        env.stop()


# -- rate limits and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["files.getUploadURLExternal", "files.completeUploadExternal"])
def test_429_then_success_is_delivered_once_after_retry_after(senv, fake, tmp_path, route):
    chan = channel()
    fake.fail_next(route, 1, 429, retry_after=2)
    p = make(tmp_path, "chart.png", 2500)
    code, data, err = send(senv, f"slack:{chan}", str(p))
    assert code == 0, (data, err)
    calls = fake.calls(route)[-2:]
    assert [c.status for c in calls] == [429, 200]
    assert calls[1].t - calls[0].t >= 2
    (msg,) = fake.channel_messages(chan)
    assert msg["files"][0]["sha256"] == sha(p) and data["deliveries"][0]["message_id"] == msg["files"][0]["id"]


def test_a_completion_whose_answer_was_lost_is_checked_not_shared_again(senv, fake, tmp_path):
    # Slack shared the file, then its answer was lost (a 500): the retry's completion of the same
    # upload answers `file_not_found` (a completed upload is no more); files.info says the file is
    # in the channel already, so nothing is uploaded or shared again
    chan = channel()
    fake.fail_next("files.completeUploadExternal", 1, 500, channel=chan, after=True)
    p = make(tmp_path, "once.pdf", 1800)
    code, data, err = send(senv, f"slack:{chan}", str(p))
    assert code == 0, (data, err)
    (msg,) = fake.channel_messages(chan)  # one share
    assert msg["files"][0]["sha256"] == sha(p)
    row = data["deliveries"][0]
    assert row["state"] == "delivered" and row["message_id"] == msg["files"][0]["id"]
    assert [c.status for c in fake.calls("files.completeUploadExternal", chan)] == [500, 200]
    assert [c.fields.get("file") for c in fake.calls("files.info")][-1] == msg["files"][0]["id"]
    assert len([c for c in fake.calls("upload") if c.fields.get("file_id") == msg["files"][0]["id"]]) == 1


def test_repeated_500s_then_success(senv, fake, tmp_path):
    chan = channel()
    before = len(fake.calls("upload"))
    fake.fail_next("upload", 2, 500)
    p = make(tmp_path, "notes.txt", 800)
    code, data, err = send(senv, f"slack:{chan}", str(p))
    assert code == 0, (data, err)
    assert [c.status for c in fake.calls("upload")[before:]] == [500, 500, 200]
    assert len(fake.channel_messages(chan)) == 1
    assert int(data["deliveries"][0]["attempts"]) >= 3


def test_permanent_errors_are_not_retried_and_shown_by_status(senv, fake, tmp_path):
    chan = channel()
    fake.fail_next("files.getUploadURLExternal", 1, 400)  # HTTP 400, invalid_arguments
    fake.fail_next("upload", 1, 403)
    fake.fail_next("files.completeUploadExternal", 1, 200, error="not_in_channel", channel=chan)
    files = [make(tmp_path, n, 1000) for n in ("a.png", "b.pdf", "c.txt")]
    counts = {r: len(fake.calls(r)) for r in ("files.getUploadURLExternal", "upload", "files.completeUploadExternal")}
    code, data, err = send(senv, f"slack:{chan}", *map(str, files))
    assert code == 1
    rows = data["deliveries"]
    assert [r["state"] for r in rows] == ["failed"] * 3
    assert "invalid_arguments" in rows[0]["reason"]
    assert "403" in rows[1]["reason"]
    assert "not_in_channel" in rows[2]["reason"]
    # each tried once: getUploadURL x3, upload x2, complete x1
    assert {r: len(fake.calls(r)) - n for r, n in counts.items()} == {
        "files.getUploadURLExternal": 3, "upload": 2, "files.completeUploadExternal": 1}
    assert fake.channel_messages(chan) == []
    assert_status_failed(senv, data["job"], rows)


def test_unknown_channel_is_permanent(senv, fake, tmp_path):
    chan = channel()
    fake.unknown_channels.add(chan)
    code, data, _ = send(senv, f"slack:{chan}", str(make(tmp_path, "x.txt", 10)))
    assert code == 1 and "channel_not_found" in data["deliveries"][0]["reason"]
    assert len(fake.calls("files.completeUploadExternal", chan)) == 1


# -- idempotency ------------------------------------------------------------------------------------
def test_redelivered_task_after_success_sends_nothing(senv, fake, tmp_path, rclient):
    chan = channel()
    target = f"slack:{chan}"
    p = make(tmp_path, "once.png", 1200)
    data, row = sent(senv, target, p)
    uploads = len(fake.calls("upload"))
    job = redelivered_file_job(data, target, p, sha(p))
    marker = chain_with_marker(senv, rclient, target, "slack", job)
    wait_until(lambda: any(m["text"] == marker["text"] for m in fake.channel_messages(chan)), timeout_s=60,
               what="the marker message")
    assert len(fake.calls("upload")) == uploads
    assert len(fake.calls("files.completeUploadExternal", chan)) == 1
    assert [m["files"][0]["id"] for m in file_messages(fake, chan)] == [row["message_id"]]


# -- the adapter on its own (same real client and server, no worker) ----------------------------------
@pytest.fixture
def adapter(fake):
    a = SlackPlatform(fake.token, base_url=fake.base_url)
    yield a
    a.close()


def test_progress_message_album_and_no_typing(adapter, fake, tmp_path):
    chan = channel()
    ts = adapter.start_progress(chan, "thinking")
    n = len(fake.requests)
    adapter.typing(chan)  # no typing indicator for bots on the Web API: nothing is sent
    assert len(fake.requests) == n
    adapter.edit_progress(chan, ts, "$ pytest -q")
    assert [m["text"] for m in fake.channel_messages(chan)] == ["$ pytest -q"]
    adapter.end_progress(chan, ts)
    adapter.end_progress(chan, ts)  # already gone: fine
    assert fake.channel_messages(chan) == [] and ts in fake.deleted
    assert [c.route for c in fake.calls(channel=chan)] == ["chat.postMessage", "chat.update", "chat.delete",
                                                             "chat.delete"]
    files = [make(tmp_path, f"p{i}.png", 2000 + i) for i in range(3)]
    srcs = [(Kind.PHOTO, FileSource(name=f.name, size_bytes=f.stat().st_size, sha256="",
                                    opener=lambda f=f: opener(f))) for f in files]
    sents = adapter.send_album(chan, srcs, caption="three", delivery_id="album-1")
    (msg,) = fake.channel_messages(chan)
    assert [f["sha256"] for f in msg["files"]] == [sha(f) for f in files] and msg["text"] == "three"
    assert [s.message_id for s in sents] == [f["id"] for f in msg["files"]]


def test_text_that_escaping_pushes_over_the_limit_is_cut_again(adapter, fake):
    chan = channel()
    text = " ".join(["x&y"] * 9750)  # fits 40 000 as written, not once `&` is `&amp;`
    sent = adapter.send_text(chan, text, delivery_id="amp")
    msgs = fake.channel_messages(chan)
    assert len(msgs) == 2 and all(len(m["text"]) <= 40000 for m in msgs)
    assert " ".join(m["text"] for m in msgs) == slack_escaped(text)
    assert sent.message_id == ",".join(m["ts"] for m in msgs)


@pytest.mark.parametrize("route,status,opts,error,word", [
    ("chat.postMessage", 429, {"retry_after": 3}, RateLimited, "3"),
    ("chat.postMessage", 500, {}, Transient, "internal_error"),
    ("chat.postMessage", 502, {"text": "<html>bad gateway</html>"}, Transient, "server error"),
    ("chat.postMessage", 200, {"error": "invalid_auth"}, Permanent, "invalid_auth"),
    ("chat.postMessage", 200, {"error": "msg_too_long"}, Permanent, "too large"),
    ("upload", 429, {"retry_after": 4}, RateLimited, "4"),
    ("upload", 503, {}, Transient, "503"),
    ("upload", 413, {}, Permanent, "too large"),
])
def test_error_map(adapter, fake, tmp_path, route, status, opts, error, word):
    chan = channel()
    fake.fail_next(route, 1, status, **opts)
    before = len(fake.calls(route))
    with pytest.raises(error) as ei:
        if route == "upload":
            p = make(tmp_path, "f.bin", 100)
            adapter.send_file(chan, Kind.DOCUMENT, FileSource(name=p.name, size_bytes=100, sha256="",
                                                              opener=lambda: opener(p), path=p),
                              caption=None, delivery_id="e")
        else:
            adapter.send_text(chan, "hello", delivery_id="e")
    assert word in str(ei.value) and fake.token not in str(ei.value)
    if error is RateLimited:
        assert ei.value.retry_after_s == float(word)
    assert len(fake.calls(route)) - before == 1  # the SDK did not retry (or sleep) by itself


def test_bad_token_and_missing_token(fake, senv, tmp_path):
    bad = SlackPlatform("xoxb-not-the-token", base_url=fake.base_url)
    with pytest.raises(Permanent, match="invalid_auth"):
        bad.send_text("C0123", "x", delivery_id="bad")
    assert "not-the-token" not in repr(bad)
    env = CourierEnv(tmp_path / "notoken", senv.env["COURIER_REDIS_URL"], SLACK_BOT_TOKEN="")
    res = env.cli("send", "slack:C0123", str(make(tmp_path, "a.txt", 5)))
    assert res.returncode == 2 and "SLACK_BOT_TOKEN is not set" in res.stderr


def test_a_channel_name_is_resolved_to_its_id_for_files_and_text(senv, fake, tmp_path):
    # files.completeUploadExternal takes only a channel id: `slack:#general` / `slack:general` are
    # resolved through conversations.list; a name the bot cannot see is a clear failure
    cid = channel()
    fake.channel_names.update({f"team-{i:03d}": f"C9{i:07d}" for i in range(250)})  # a few pages
    fake.channel_names["general"] = cid
    p, q = make(tmp_path, "a.pdf", 2000), make(tmp_path, "b.png", 1500)
    for target, f in (("slack:#general", p), ("slack:general", q)):
        code, data, err = send(senv, target, str(f), "--caption", "named")
        assert code == 0, (target, data, err)
    assert [m["files"][0]["sha256"] for m in file_messages(fake, cid)] == [sha(p), sha(q)]
    code, data, err = send(senv, "slack:#nowhere", str(p))
    assert code == 1
    reason = data["deliveries"][0]["reason"]
    assert "#nowhere" in reason and "channel" in reason and len(reason) < 200, reason
