"""Telegram end to end: real worker processes and real Redis drive the real
python-telegram-bot against a local server speaking the Bot API
(`tests/fixtures/fake_telegram.py`); assertions are on what that server received."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import os
from pathlib import Path

import pytest

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.base import FileSource, Kind
from adapters.platforms.telegram import TelegramPlatform
from tasks.ledger import receipts
from tests.fixtures._platforms import deployment_fixtures, write_unique
from tests.fixtures.fake_telegram import FakeTelegram, enqueue, wait_job
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

CHAT = "777001"


#: one courier deployment for the module (`tg`): its Telegram is the local fake (`fake_telegram`), one worker
_deployment, tg, fake_telegram = deployment_fixtures(FakeTelegram, "tg", "fake_telegram")


def _fields(call, name: str) -> str | None:
    return call.fields.get(name)


# -- the operator's command -----------------------------------------------------------------
def test_cli_send_photo_document_voice(tg, fake_telegram, tmp_path):
    files = {n: tmp_path / n for n in ("a.png", "b.pdf", "c.ogg")}
    shas = {n: write_unique(p, 3000 + i * 1000) for i, (n, p) in enumerate(files.items())}
    res = tg.cli("send", f"telegram:{CHAT}", *map(str, files.values()), "--voice", "--caption", "look",
                 "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    rows = json.loads(res.stdout)["deliveries"]
    assert [(d["state"], d["kind"], d["platform"]) for d in rows] == [
        ("delivered", "photo", "telegram"), ("delivered", "document", "telegram"), ("delivered", "voice", "telegram")]
    calls = fake_telegram.calls_for(chat=CHAT)
    assert [c.method for c in calls] == ["sendPhoto", "sendDocument", "sendVoice"]
    assert [c.files[f].sha256 for c, f in zip(calls, ("photo", "document", "voice"))] == list(shas.values())
    assert [c.files[f].filename for c, f in zip(calls, ("photo", "document", "voice"))] == list(files)
    assert calls[0].caption == "look" and calls[1].caption is None and calls[2].caption is None
    assert [d["message_id"] for d in rows] == [str(c.result["message_id"]) for c in calls]
    # one chat: sends at least a second apart (shared per-chat limit), in order
    assert all(b.t - a.t >= 0.95 for a, b in zip(calls, calls[1:])), [c.t for c in calls]


def test_missing_token_is_a_config_error_and_nothing_enqueued(redis_server, r, tmp_path):
    env = CourierEnv(tmp_path, redis_server.url, TELEGRAM_BOT_TOKEN="")
    f = tmp_path / "a.txt"
    f.write_text("x")
    jobs_before = set(r.scan_iter("courier:job:*"))
    res = env.cli("send", "telegram:1", str(f))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "TELEGRAM_BOT_TOKEN is not set" in res.stderr
    assert r.llen("delivery") == 0 and set(r.scan_iter("courier:job:*")) == jobs_before


# -- every kind, text and caption limits ------------------------------------------------------
def test_every_kind_text_split_and_caption_overflow(tg, fake_telegram, r, tmp_path):
    kinds = {"p.jpg": ("sendPhoto", "photo", False), "a.gif": ("sendAnimation", "animation", False),
             "v.mp4": ("sendVideo", "video", False), "s.mp3": ("sendAudio", "audio", False),
             "n.ogg": ("sendVoice", "voice", True),
             "m.ogg": ("sendDocument", "document", False),  # Telegram shows audio only as mp3/m4a
             "r.csv": ("sendDocument", "document", False)}
    jobs = {}
    for i, (name, (_, _, voice)) in enumerate(kinds.items()):
        p = tmp_path / name
        sha = write_unique(p, 2000 + i)
        chat = str(800100 + i)
        jobs[name] = (chat, sha, enqueue(tg, f"telegram:{chat}", files=[p], voice=voice, caption=f"cap {name}"))
    long_text = " ".join(f"word{i}" for i in range(1200))  # ~9 KB: three messages
    long_caption = "c" * 700 + " " + "d" * 700  # over 1024: the file goes bare, the caption follows
    doc = tmp_path / "long.pdf"
    doc_sha = write_unique(doc, 1500)
    text_job = enqueue(tg, "telegram:800200", text=long_text, files=[doc], caption=long_caption)

    for name, (method, field, _) in kinds.items():
        chat, sha, job = jobs[name]
        rows = wait_job(r, job)
        assert rows[0]["state"] == "delivered" and rows[0]["kind"] == field, rows
        (call,) = fake_telegram.calls_for(chat=chat)
        assert call.method == method and call.files[field].sha256 == sha and call.caption == f"cap {name}"

    rows = wait_job(r, text_job, timeout_s=60)
    assert [d["state"] for d in rows] == ["delivered", "delivered"], rows
    calls = fake_telegram.calls_for(chat="800200")
    assert [c.method for c in calls] == ["sendMessage"] * 3 + ["sendDocument", "sendMessage"]
    texts = [c.text for c in calls[:3]]
    assert all(len(t) <= 4096 for t in texts) and " ".join(texts) == long_text
    assert calls[3].files["document"].sha256 == doc_sha and calls[3].caption is None
    assert [c.text for c in calls[4:]] == [long_caption]  # one message: split at the 4096 text limit, not 1024
    assert all(b.t - a.t >= 0.95 for a, b in zip(calls, calls[1:]))  # one chat, 1 msg/s


def test_photo_over_10mb_goes_as_document(tg, fake_telegram, r, tmp_path):
    p = tmp_path / "huge.png"
    sha = write_unique(p, 10 * 1000 * 1000 + 500_000)
    rows = wait_job(r, enqueue(tg, "telegram:800300", files=[p]))
    assert rows[0]["state"] == "delivered" and rows[0]["kind"] == "document"
    (call,) = fake_telegram.calls_for(chat="800300")
    assert call.method == "sendDocument" and call.files["document"].sha256 == sha


def test_over_the_upload_limit_sends_a_notice_and_uploads_nothing(tg, fake_telegram, r, tmp_path):
    p = tmp_path / "backup.tar"
    with open(p, "wb") as f:  # sparse: 51 MB without writing them
        f.truncate(51 * 1000 * 1000)
    # enqueued as plain code: `courier send` refuses it before enqueueing (the next test); the
    # worker's refusal is for files the CLI cannot see (an agent's, a remote sandbox's)
    (row,) = wait_job(r, enqueue(tg, "telegram:800400", files=[p]))
    assert row["state"] == "failed" and "too large" in row["reason"] and "47.7 MiB" in row["reason"]
    (call,) = fake_telegram.calls_for(chat="800400")
    assert call.method == "sendMessage" and "backup.tar" in call.text and "48.6 MiB" in call.text
    assert fake_telegram.uploads() == []


def test_cli_refuses_a_file_over_the_upload_limit_exit_2_nothing_registered(tg, fake_telegram, r, tmp_path):
    """60 MB to Telegram (50 MB for a bot): exit 2 with the sizes, before
    anything is stored, registered or sent; the same file through a
    local:// URI too. Under the limit it goes."""
    p = tg.sandbox / "video.mp4"
    with open(p, "wb") as f:  # sparse: 60 MB without writing them
        f.truncate(60 * 1000 * 1000)
    storage = tg.data_dir / "storage"
    before_jobs = set(r.scan_iter("courier:job:*"))

    def stored() -> list[Path]:  # files only: the store's staging directory may come and go with other tests' puts
        return sorted(q for q in storage.rglob("*") if q.is_file()) if storage.exists() else []

    before_files = stored()
    for arg in (str(p), f"local://{p}"):
        res = tg.cli("send", "telegram:800450", arg, "--voice")
        assert res.returncode == 2, res.stdout + res.stderr
        assert "57.2 MiB is over telegram's upload limit for a video (47.7 MiB)" in res.stderr, res.stderr
        assert "nothing was enqueued" in res.stderr
    assert set(r.scan_iter("courier:job:*")) == before_jobs
    assert stored() == before_files
    assert fake_telegram.calls_for(chat="800450") == []


def test_server_413_is_permanent(tg, fake_telegram, r, tmp_path):
    fake_telegram.max_upload_bytes = 100_000
    p = tmp_path / "big.zip"
    write_unique(p, 200_000)
    rows = wait_job(r, enqueue(tg, "telegram:800500", files=[p]))
    assert rows[0]["state"] == "failed" and "413" in rows[0]["reason"] and "too large" in rows[0]["reason"], rows
    sent, notice = fake_telegram.calls_for(chat="800500")  # not retried; the chat is told
    assert (sent.method, sent.status, notice.method) == ("sendDocument", 413, "sendMessage")
    assert "big.zip" in notice.text and "too large" in notice.text


# -- retries ------------------------------------------------------------------------------------
def test_429_then_success_waits_retry_after_and_sends_once(tg, fake_telegram, r, tmp_path):
    fake_telegram.fail_next(1, 429, retry_after=2, method="sendDocument")
    p = tmp_path / "r.pdf"
    sha = write_unique(p, 4000)
    rows = wait_job(r, enqueue(tg, "telegram:800600", files=[p]), timeout_s=60)
    assert rows[0]["state"] == "delivered", rows
    limited, ok = fake_telegram.calls_for(chat="800600")
    assert (limited.status, ok.status) == (429, 200) and ok.files["document"].sha256 == sha
    assert ok.t - limited.t >= 2.0
    assert len(fake_telegram.calls_for(chat="800600", ok=True)) == 1
    assert receipts.get_delivery(r, rows[0]["id"])["rate_limited"] == "1"


def test_repeated_500s_then_success(tg, fake_telegram, r, tmp_path):
    fake_telegram.fail_next(3, 500, method="sendMessage")
    job = enqueue(tg, "telegram:800700", text="hello after errors")
    rows = wait_job(r, job, timeout_s=90)
    assert rows[0]["state"] == "delivered", rows
    calls = fake_telegram.calls_for(chat="800700")
    assert [c.status for c in calls] == [500, 500, 500, 200]
    assert calls[-1].text == "hello after errors"
    # every try counts as an attempt: the three errors, the success, and any wait for the chat's slot
    assert rows[0]["transient_errors"] == "3"
    assert int(rows[0]["attempts"]) == 4 + int(rows[0].get("rate_limited", 0))


@pytest.mark.parametrize("failure", ["unknown", "blocked"])
def test_permanent_errors_do_not_retry_and_show_in_status(tg, fake_telegram, r, tmp_path, failure):
    chat = "800800"
    (fake_telegram.unknown_chats if failure == "unknown" else fake_telegram.blocked_chats).add(chat)
    p = tmp_path / "x.pdf"
    write_unique(p, 1000)
    job = enqueue(tg, f"telegram:{chat}", files=[p])
    rows = wait_job(r, job)
    expect = "Chat not found" if failure == "unknown" else "Forbidden: bot was blocked by the user"
    assert rows[0]["state"] == "failed" and expect in rows[0]["reason"], rows
    assert len(fake_telegram.calls_for(chat=chat)) == 1  # no retry
    res = tg.cli("status", job, "--json")
    assert res.returncode == 1
    (shown,) = json.loads(res.stdout)["deliveries"]
    assert expect in shown["reason"] and fake_telegram.token not in res.stdout


# -- idempotency and upload once -------------------------------------------------------------
def test_redelivered_task_after_success_sends_nothing(tg, fake_telegram, r, tmp_path):
    from tasks.dispatch import chains
    from tasks.ledger import keys

    p = tmp_path / "once.pdf"
    write_unique(p, 1000)
    job = enqueue(tg, "telegram:800900", files=[p])
    (row,) = wait_job(r, job)
    assert row["state"] == "delivered"
    # the delivered step once more in the lane, two more drives of it, then a probe behind them
    r.rpush(keys.lane("telegram:800900"), row["id"])
    with tg.publishing():
        chains.publish_lane("telegram:800900")
        chains.publish_lane("telegram:800900")
    enqueue(tg, "telegram:800900", text="probe")
    wait_until(lambda: fake_telegram.calls_for("sendMessage", chat="800900"), timeout_s=30, what="the probe")
    assert [c.method for c in fake_telegram.calls_for(chat="800900")] == ["sendDocument", "sendMessage"]


def test_same_file_to_two_chats_is_uploaded_once(tg, fake_telegram, r, tmp_path):
    p = tmp_path / "shared.png"
    sha = write_unique(p, 5000)
    (first,) = wait_job(r, enqueue(tg, "telegram:801000", files=[p]))
    (second,) = wait_job(r, enqueue(tg, "telegram:-1001234", files=[p]))
    assert first["state"] == second["state"] == "delivered"
    a, b = fake_telegram.calls_for("sendPhoto")
    assert a.files["photo"].sha256 == sha and b.files == {}
    assert b.fields["photo"] == a.result["photo"][-1]["file_id"] and b.chat == "-1001234"
    assert [u.sha256 for u in fake_telegram.uploads()] == [sha]


# -- the adapter alone: albums, activity, error map, secrets ----------------------------------
def _src(name: str, data: bytes) -> FileSource:
    return FileSource(name=name, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      opener=lambda: contextlib.closing(io.BytesIO(data)))


def test_album_typing_and_progress_message(tg, fake_telegram):
    tp = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    blobs = [os.urandom(1500 + i) for i in range(3)]
    sent = tp.send_album("-100777", [(Kind.PHOTO, _src(f"{i}.jpg", b)) for i, b in enumerate(blobs)],
                         caption="three", delivery_id="alb")
    (call,) = fake_telegram.calls_for("sendMediaGroup")
    media = json.loads(call.fields["media"])
    assert [m["type"] for m in media] == ["photo"] * 3 and media[0]["caption"] == "three" and "caption" not in media[1]
    shas = [call.files[m["media"].removeprefix("attach://")].sha256 for m in media]
    assert shas == [hashlib.sha256(b).hexdigest() for b in blobs]
    assert len(sent) == 3 and all(s.file_id for s in sent)

    tp.typing("42")
    mid = tp.start_progress("42", "● thinking")
    tp.edit_progress("42", mid, "→ $ ls")
    tp.end_progress("42", mid)
    acts = fake_telegram.calls_for(chat="42")
    assert [c.method for c in acts] == ["sendChatAction", "sendMessage", "editMessageText", "deleteMessage"]
    assert acts[0].fields["action"] == "typing" and acts[2].fields["message_id"] == mid
    tp.close()


def test_error_map_and_no_token_in_errors(tg, fake_telegram, caplog):
    tp = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    with caplog.at_level(logging.INFO, logger="httpx"):  # httpx logs each request URL, token included
        tp.send_text("1", "logged", delivery_id="d")
    # (the adapter's filter says <token>; a process that installed workers/logsafe.py's says <redacted> first)
    assert re.search(r"/bot<(token|redacted)>/sendMessage", caplog.text) and fake_telegram.token not in caplog.text
    fake_telegram.fail_next(1, 429, retry_after=7)
    with pytest.raises(RateLimited) as rl:
        tp.send_text("1", "x", delivery_id="d")
    assert rl.value.retry_after_s == 7
    for status, cls in ((500, Transient), (502, Transient), (400, Permanent), (403, Permanent), (413, Permanent)):
        fake_telegram.fail_next(1, status)
        with pytest.raises(cls):
            tp.send_text("1", "x", delivery_id="d")
    wrong = TelegramPlatform("1:wrong-token", base_url=fake_telegram.url)
    with pytest.raises(Permanent) as bad:
        wrong.send_text("1", "x", delivery_id="d")
    down = TelegramPlatform(fake_telegram.token, base_url="http://127.0.0.1:9")
    with pytest.raises(Transient) as gone:
        down.send_text("1", "x", delivery_id="d")
    for exc in (rl.value, bad.value, gone.value):
        assert fake_telegram.token not in str(exc) and "wrong-token" not in str(exc)
    assert fake_telegram.token not in repr(tp) and tp.cache_key not in fake_telegram.token


def test_audio_telegram_shows_as_a_document_goes_as_one_and_its_file_id_is_reused(tg, fake_telegram, r, tmp_path):
    # Telegram shows audio only as mp3/m4a: a .wav goes as a document on purpose, the receipt says so,
    # and the cached file id (of the kind actually used) works for the next chat
    p = tmp_path / "take.wav"
    sha = write_unique(p, 4000)
    (a,) = wait_job(r, enqueue(tg, "telegram:800601", files=[p]))
    (b,) = wait_job(r, enqueue(tg, "telegram:800602", files=[p]))
    assert [(d["state"], d["kind"]) for d in (a, b)] == [("delivered", "document")] * 2, (a, b)
    calls = fake_telegram.calls_for("sendDocument") + fake_telegram.calls_for("sendAudio")
    assert [(c.method, c.chat, c.status) for c in calls] == [("sendDocument", "800601", 200),
                                                            ("sendDocument", "800602", 200)]
    assert [u.sha256 for u in fake_telegram.uploads()] == [sha]  # the second went by file id
    mp3 = tmp_path / "song.mp3"
    write_unique(mp3, 3000)
    (c,) = wait_job(r, enqueue(tg, "telegram:800603", files=[mp3]))
    assert (c["kind"], fake_telegram.calls_for("sendAudio", "800603")[0].result["audio"]["file_size"]) == ("audio", 3000)


def test_a_small_upload_goes_in_one_write_and_a_large_one_streams(tg, fake_telegram, monkeypatch):
    """A multipart upload of up to ONE_WRITE_BYTES is one body (one socket write, not ~10);
    a larger one streams chunk by chunk as before. Both arrive byte-identical."""
    import httpx

    from adapters.platforms import telegram as tg_mod

    bodies: list[str] = []
    plain = httpx.AsyncHTTPTransport.handle_async_request

    async def seen(self, request):  # what httpx's own transport is handed, after `_OneWrite`
        if request.url.path.endswith("/sendDocument"):
            bodies.append(type(request.stream).__name__)
        return await plain(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", seen)
    tp = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    small, large = os.urandom(1024), os.urandom(tg_mod.ONE_WRITE_BYTES + 1)
    for name, data in (("small.txt", small), ("large.bin", large)):
        tp.send_file("880100", Kind.DOCUMENT, _src(name, data), caption=None, delivery_id=name)
    tp.close()
    assert bodies[0] == "ByteStream" and bodies[1] != "ByteStream", bodies
    assert [c.files["document"].sha256 for c in fake_telegram.calls_for(chat="880100")] \
        == [hashlib.sha256(small).hexdigest(), hashlib.sha256(large).hexdigest()]


def test_bots_share_the_process_tls_context(monkeypatch):
    """A drive's first send on each thread makes a Bot (one per loop): building a TLS
    context for each (the CA bundle parsed again, ~20 ms of CPU, twice per Bot) was the
    largest cost of a worker's first sends. Every Bot uses the process's one context."""
    import ssl

    from adapters.platforms import _aio

    _aio.tls()  # the process's, made once
    made: list[int] = []
    real = ssl.create_default_context

    def counted(*a, **kw):
        made.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ssl, "create_default_context", counted)
    tp = TelegramPlatform("123:abc", base_url="http://127.0.0.1:9")
    bots = [tp._new_bot() for _ in range(3)]
    assert made == [] and len(bots) == 3
    assert _aio.tls() is _aio.tls()
