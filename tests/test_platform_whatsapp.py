"""WhatsApp end to end: real worker processes and real Redis drive the adapter
(httpx against the Cloud API) into a local server speaking that API
(`tests/fixtures/fake_whatsapp.py`); assertions are on what the server received."""

from __future__ import annotations

import json

import httpx
import pytest

from adapters.errors import Permanent, RateLimited, Transient
from adapters.platforms.whatsapp import map_error
from tests.fixtures._platforms import deployment_fixtures, write_unique
from tests.fixtures.fake_telegram import enqueue, wait_job
from tests.fixtures.fake_whatsapp import FakeWhatsApp
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

TO = "+15551234567"


#: one courier deployment for the module (`wa`): its WhatsApp is the local fake (`fake_whatsapp`), one worker
_deployment, wa, fake_whatsapp = deployment_fixtures(FakeWhatsApp, "wa", "fake_whatsapp")


def _body(call) -> dict:
    return json.loads(call.fields[call.fields["type"]])


def test_cli_send_photo_document_voice(wa, fake_whatsapp, tmp_path):
    files = [tmp_path / n for n in ("a.png", "b.pdf", "c.ogg")]
    shas = [write_unique(p, 2000 + i * 500) for i, p in enumerate(files)]
    res = wa.cli("send", f"whatsapp:{TO}", *map(str, files), "--voice", "--caption", "see",
                 "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    rows = json.loads(res.stdout)["deliveries"]
    assert [(d["state"], d["kind"]) for d in rows] == [("delivered", "photo"), ("delivered", "document"),
                                                       ("delivered", "voice")]
    uploads = fake_whatsapp.calls_for("media")
    assert [u.files["file"].sha256 for u in uploads] == shas
    assert [u.fields["type"] for u in uploads] == ["image/png", "application/pdf", "audio/ogg"]
    msgs = fake_whatsapp.calls_for("messages", chat=TO)
    assert [m.fields["type"] for m in msgs] == ["image", "document", "audio"]
    bodies = [_body(m) for m in msgs]
    assert [b["id"] for b in bodies] == [u.result["id"] for u in uploads]
    assert bodies[0]["caption"] == "see" and bodies[1]["filename"] == "b.pdf" and bodies[2]["voice"] is True
    assert [d["message_id"] for d in rows] == [m.result["messages"][0]["id"] for m in msgs]


def test_missing_settings_are_config_errors(redis_server, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    env = CourierEnv(tmp_path / "e1", redis_server.url, WHATSAPP_ACCESS_TOKEN="")
    res = env.cli("send", "whatsapp:+15551234567", str(f))
    assert res.returncode == 2 and "WHATSAPP_ACCESS_TOKEN is not set" in res.stderr
    env = CourierEnv(tmp_path / "e2", redis_server.url, WHATSAPP_ACCESS_TOKEN="t", WHATSAPP_PHONE_NUMBER_ID="")
    res = env.cli("send", "whatsapp:+15551234567", str(f))
    assert res.returncode == 2 and "WHATSAPP_PHONE_NUMBER_ID is not set" in res.stderr


def test_every_kind_limits_and_fallbacks(wa, fake_whatsapp, r, tmp_path):
    cases = {  # name -> (receipt kind, message type, uploaded mime)
        "p.jpg": ("photo", "image", "image/jpeg"), "v.mp4": ("video", "video", "video/mp4"),
        "s.mp3": ("audio", "audio", "audio/mpeg"), "r.pdf": ("document", "document", "application/pdf"),
        "w.webp": ("document", "document", "image/webp"),  # not an inline image on WhatsApp: a document
        "m.3gp": ("video", "video", "video/3gpp"),
    }
    jobs = {}
    for i, name in enumerate(cases):
        p = tmp_path / name
        to = f"+1555000{i:04d}"
        jobs[name] = (to, write_unique(p, 3000 + i), enqueue(wa, f"whatsapp:{to}", files=[p], caption=f"about {name}"))
    long_text = "\n\n".join(f"paragraph {i} " + "x" * 900 for i in range(6))  # ~5.5 K chars: two messages
    big_photo = tmp_path / "big.png"  # over the 5 MB image limit: the API takes no png over it, as a document either
    write_unique(big_photo, 5_500_000)
    text_job = enqueue(wa, "whatsapp:+15559990000", text=long_text, files=[big_photo], caption="y" * 1500)

    for name, (kind, mtype, mime) in cases.items():
        to, sha, job = jobs[name]
        (row,) = wait_job(r, job)
        assert row["state"] == "delivered" and row["kind"] == kind, row
        msgs = fake_whatsapp.calls_for("messages", chat=to)
        assert msgs[0].fields["type"] == mtype
        media = fake_whatsapp.media[_body(msgs[0])["id"]]
        assert (media.sha256, media.mime) == (sha, mime)
        if mtype == "audio":  # audio takes no caption: it follows as a text message
            assert "caption" not in _body(msgs[0]) and [_body(m)["body"] for m in msgs[1:]] == [f"about {name}"]
        else:
            assert _body(msgs[0])["caption"] == f"about {name}" and len(msgs) == 1

    rows = wait_job(r, text_job)
    assert [(d["state"], d.get("kind")) for d in rows] == [("delivered", "text"), ("failed", "document")], rows
    assert rows[1]["reason"].startswith("too large: big.png is 5.2 MiB"), rows[1]
    msgs = fake_whatsapp.calls_for("messages", chat="+15559990000")
    assert [m.fields["type"] for m in msgs] == ["text", "text", "text"]
    assert "\n\n".join(_body(m)["body"] for m in msgs[:2]) == long_text
    assert _body(msgs[2])["body"].startswith("⚠️ big.png (5.2 MiB) was not sent: WhatsApp takes images up to 5 MB.")
    assert not [u for u in fake_whatsapp.calls_for("media") if u.files["file"].filename == "big.png"]  # not uploaded


def test_video_over_16mb_gets_a_notice_and_nothing_uploaded(wa, fake_whatsapp, r, tmp_path):
    p = tmp_path / "talk.mp4"
    with open(p, "wb") as f:
        f.truncate(16_500_000)
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{TO}", files=[p]))
    assert row["state"] == "failed" and "15.3 MiB" in row["reason"] and "talk.mp4" in row["reason"]
    (notice,) = fake_whatsapp.calls_for("messages", chat=TO)
    assert notice.fields["type"] == "text" and "talk.mp4" in _body(notice)["body"]
    assert fake_whatsapp.calls_for("media") == []


def test_rate_limit_then_success_is_sent_once_after_retry_after(wa, fake_whatsapp, r, tmp_path):
    fake_whatsapp.fail_next(1, 429, code=130429, retry_after=2, method="messages")
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{TO}", text="hi"), timeout_s=60)
    assert row["state"] == "delivered"
    limited, ok = fake_whatsapp.calls_for("messages", chat=TO)
    assert (limited.status, ok.status) == (429, 200) and ok.t - limited.t >= 2.0
    assert row["rate_limited"] == "1"


def test_500s_then_success_and_permanent_error_recorded(wa, fake_whatsapp, r, tmp_path):
    fake_whatsapp.fail_next(2, 500, method="media")
    p = tmp_path / "d.pdf"
    sha = write_unique(p, 1200)
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{TO}", files=[p]), timeout_s=60)
    assert row["state"] == "delivered" and row["transient_errors"] == "2"
    assert [c.status for c in fake_whatsapp.calls_for("media")] == [500, 500, 200]
    assert fake_whatsapp.calls_for("media")[-1].files["file"].sha256 == sha

    fake_whatsapp.unknown_chats.add("+15550000404")
    job = enqueue(wa, "whatsapp:+15550000404", text="anyone?")
    (row,) = wait_job(r, job)
    assert row["state"] == "failed" and "not in allowed list" in row["reason"] and "131030" in row["reason"]
    assert len(fake_whatsapp.calls_for("messages", chat="+15550000404")) == 1  # not retried
    res = wa.cli("status", job, "--json")
    assert res.returncode == 1 and "not in allowed list" in json.loads(res.stdout)["deliveries"][0]["reason"]
    assert fake_whatsapp.token not in res.stdout


def test_same_file_to_two_chats_is_uploaded_once(wa, fake_whatsapp, r, tmp_path):
    p = tmp_path / "same.jpg"
    sha = write_unique(p, 4000)
    (a,) = wait_job(r, enqueue(wa, "whatsapp:+15551110001", files=[p]))
    (b,) = wait_job(r, enqueue(wa, "whatsapp:+15551110002", files=[p]))
    assert a["state"] == b["state"] == "delivered"
    assert [u.sha256 for u in fake_whatsapp.uploads()] == [sha]
    ids = [_body(m)["id"] for m in fake_whatsapp.calls_for("messages")]
    assert len(ids) == 2 and ids[0] == ids[1]


def test_error_map():
    def resp(status: int, code: int | None = None, headers: dict | None = None, msg: str = "boom"):
        body = {"error": {"message": msg, "type": "OAuthException", "code": code}} if code else {}
        return httpx.Response(status, json=body, headers=headers)

    cases = [
        (resp(429, 130429, {"Retry-After": "3"}), RateLimited, 3.0),
        (resp(400, 131056), RateLimited, 6.0),  # pair rate limit: default wait
        (resp(400, 80007), RateLimited, 60.0),
        (resp(500, 1), Transient, None), (resp(503), Transient, None), (resp(400, 131000), Transient, None),
        (resp(400, 131026), Permanent, None), (resp(401, 190), Permanent, None), (resp(404), Permanent, None),
        (httpx.ReadTimeout("slow"), Transient, None), (httpx.ConnectError("refused"), Transient, None),
    ]
    for err, cls, wait in cases:
        mapped = map_error(err)
        assert type(mapped) is cls, (err, mapped)
        if wait is not None:
            assert mapped.retry_after_s == wait
    assert "boom" in map_error(resp(400, 131026)).reason and "131026" in map_error(resp(400, 131026)).reason


def test_audio_caption_paced_by_whatsapp_is_a_part_of_its_own_audio_sent_once(wa, fake_whatsapp, r, tmp_path):
    # WhatsApp paces messages to one user (131056): the caption right after the audio is refused;
    # the retry sends only the caption (a recorded part), never the audio again
    fake_whatsapp.pacing_s = 5.0  # below the adapter's 6 s default wait for 131056
    to = "+15557770001"
    p = tmp_path / "song.mp3"
    sha = write_unique(p, 5000)
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{to}", files=[p], caption="listen"), timeout_s=30)
    assert row["state"] == "delivered" and row["kind"] == "audio", row
    msgs = fake_whatsapp.calls_for("messages", chat=to)
    assert [(m.status, m.fields["type"]) for m in msgs] == [(200, "audio"), (400, "text"), (200, "text")]
    assert "caption" not in _body(msgs[0]) and _body(msgs[2])["body"] == "listen"
    assert [u.files["file"].sha256 for u in fake_whatsapp.calls_for("media")] == [sha]
    assert msgs[2].t - msgs[0].t >= 5.0


def test_document_fallback_keeps_the_real_type_and_types_whatsapp_refuses_get_a_notice(wa, fake_whatsapp, r,
                                                                                        tmp_path):
    to = "+15557770002"
    big = tmp_path / "big.png"  # over the 5 MB image limit: refused (the API takes no png over it, as a document
    write_unique(big, 5_200_000)  # either), the chat told, nothing uploaded
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{to}", files=[big]))
    assert (row["state"], row.get("kind")) == ("failed", "document"), row
    memo = tmp_path / "memo.mp3"  # --voice mp3: a voice note must be ogg/opus, so an audio message
    memo_sha = write_unique(memo, 3000)
    (row,) = wait_job(r, enqueue(wa, f"whatsapp:{to}", files=[memo], voice=True))
    assert (row["state"], row["kind"]) == ("delivered", "audio"), row
    refused = [tmp_path / n for n in ("report.csv", "bundle.zip", "spin.gif", "clip.mkv")]
    for p in refused:
        write_unique(p, 1500)
    rows = wait_job(r, enqueue(wa, f"whatsapp:{to}", files=refused, caption="the report"))

    uploads = fake_whatsapp.calls_for("media")
    assert [(u.status, u.fields["type"], u.files["file"].sha256) for u in uploads] == [
        (200, "audio/mpeg", memo_sha)]  # nothing refused was uploaded
    msgs = fake_whatsapp.calls_for("messages", chat=to)
    assert [(m.status, m.fields["type"]) for m in msgs[:2]] == [(200, "text"), (200, "audio")]
    assert _body(msgs[0])["body"].startswith("⚠️ big.png (5.0 MiB) was not sent: WhatsApp takes images up to 5 MB.")
    assert "voice" not in _body(msgs[1])
    notices = [_body(m)["body"] for m in msgs[2:]]
    assert len(notices) == len(refused) and all(m.status == 200 for m in msgs[2:])
    for p, d, notice in zip(refused, rows, notices):
        ext = p.suffix
        assert d["state"] == "failed" and ext in d["reason"] and len(d["reason"]) < 120, d
        assert d.get("kind") == ("photo" if ext == ".gif" else "video" if ext == ".mkv" else "document"), d
        assert p.name in notice and f"WhatsApp does not take {ext} files" in notice, notice


def test_an_expired_media_id_is_checked_before_reuse_and_uploaded_again(wa, fake_whatsapp, r, tmp_path):
    # a message naming an expired media id is accepted and never delivered: the cached id is
    # looked up (GET /<media id>) before it is reused, and an unknown one is uploaded again
    p = tmp_path / "again.pdf"
    sha = write_unique(p, 2500)
    (a,) = wait_job(r, enqueue(wa, "whatsapp:+15551120001", files=[p]))
    (first,) = fake_whatsapp.calls_for("media")
    (b,) = wait_job(r, enqueue(wa, "whatsapp:+15551120002", files=[p]))  # fresh: reused after a check
    assert [c.status for c in fake_whatsapp.calls_for("get_media")] == [200]
    assert len(fake_whatsapp.calls_for("media")) == 1
    fake_whatsapp.expired.add(first.result["id"])
    (c,) = wait_job(r, enqueue(wa, "whatsapp:+15551120003", files=[p]))
    assert a["state"] == b["state"] == c["state"] == "delivered"
    assert [x.status for x in fake_whatsapp.calls_for("get_media")] == [200, 400]
    second = fake_whatsapp.calls_for("media")[1]
    (msg,) = fake_whatsapp.calls_for("messages", chat="+15551120003")
    assert _body(msg)["id"] == second.result["id"] != first.result["id"] and second.files["file"].sha256 == sha
    assert fake_whatsapp.undelivered == []
