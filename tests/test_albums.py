"""Albums end to end: real worker processes and real Redis drive the real
python-telegram-bot against the local Bot API server
(`tests/fixtures/fake_telegram.py`). Consecutive photos of one send or one
reply go as one `sendMediaGroup` (up to 10), each file keeping its own
delivery id, receipt and message id."""

from __future__ import annotations

import json

import pytest
import redis

from tasks.dispatch import chains
from tasks.ledger import events, keys, receipts
from tests.fixtures._files import write_random
from tests.fixtures._platforms import agent_env, db, running
from tests.fixtures.fake_telegram import FakeTelegram, wait_job
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow

#: this module's Redis database (other worker modules use 0-5)
MODULE_DB = 9


@pytest.fixture(scope="module")
def deployment(redis_server, tmp_path_factory):
    """One worker (two processes) whose Telegram is the local fake, and a
    bridge agent that replies with the text of `env.reply_file`."""
    tmp = tmp_path_factory.mktemp("albums")
    fake = FakeTelegram().start()
    env = agent_env(tmp, db(redis_server, MODULE_DB), "reply", TELEGRAM_BOT_TOKEN=fake.token,
                    COURIER_TELEGRAM_BASE_URL=fake.url)
    with running(env, fake) as dep:
        yield dep


@pytest.fixture
def env(deployment):
    return deployment[0]


@pytest.fixture
def fake(deployment):
    deployment[1].reset()
    return deployment[1]


@pytest.fixture
def r(env):
    c = redis.Redis.from_url(env.env["COURIER_REDIS_URL"], decode_responses=True)
    yield c
    c.close()


def send(env, chat: str, *paths, caption: str | None = None) -> tuple[int, dict]:
    args = ["send", f"telegram:{chat}", *map(str, paths), "--wait", "--json", "--timeout", "60"]
    if caption:
        args += ["--caption", caption]
    res = env.cli(*args)
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        raise AssertionError(f"no JSON from courier send (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")


def album_parts(call) -> list[tuple[str, str, str | None]]:
    """(type, sha256 of the uploaded part, caption) per item of a sendMediaGroup call."""
    media = json.loads(call.fields["media"])
    return [(m["type"], call.files[m["media"].removeprefix("attach://")].sha256, m.get("caption")) for m in media]


def delivered_events(r, job: str) -> dict[str, int]:
    """How many `delivered` events each delivery id got."""
    out: dict[str, int] = {}
    for _, ev in events.read(r, job, count=1000):
        if ev.get("kind") == "delivery" and ev.get("state") == "delivered":
            out[ev["delivery_id"]] = out.get(ev["delivery_id"], 0) + 1
    return out


def test_three_photos_and_a_pdf_go_as_one_album_then_a_document(env, fake, r, tmp_path):
    chat = "910001"
    files = [tmp_path / n for n in ("a.jpg", "b.png", "c.webp", "d.pdf")]
    shas = [write_random(p, 2000 + 100 * i) for i, p in enumerate(files)]
    code, data = send(env, chat, *files, caption="three and a pdf")
    assert code == 0, data
    rows = data["deliveries"]
    assert [(d["state"], d["kind"]) for d in rows] == [("delivered", "photo")] * 3 + [("delivered", "document")]

    album, doc = fake.calls_for(chat=chat)
    assert (album.method, doc.method) == ("sendMediaGroup", "sendDocument")
    assert album_parts(album) == [("photo", shas[0], "three and a pdf"), ("photo", shas[1], None),
                                  ("photo", shas[2], None)]
    assert [album.files[f"{m['media'].removeprefix('attach://')}"].filename
            for m in json.loads(album.fields["media"])] == ["a.jpg", "b.png", "c.webp"]
    assert doc.files["document"].sha256 == shas[3] and doc.caption is None
    # each file: its own receipt with its own message id, and one delivered event
    assert [d["message_id"] for d in rows] == [str(m["message_id"]) for m in album.result] + [
        str(doc.result["message_id"])]
    assert len({d["message_id"] for d in rows}) == 4
    assert delivered_events(r, data["job"]) == {d["id"]: 1 for d in rows}
    assert doc.t - album.t >= 0.95  # one chat: the shared per-chat limit holds between album and document


def test_twelve_photos_go_as_albums_of_ten_and_two(env, fake, r, tmp_path):
    chat = "910002"
    files = [tmp_path / f"p{i:02d}.jpg" for i in range(12)]
    shas = [write_random(p, 1000 + i) for i, p in enumerate(files)]
    code, data = send(env, chat, *files)
    assert code == 0, data
    rows = data["deliveries"]
    assert [(d["state"], d["kind"]) for d in rows] == [("delivered", "photo")] * 12
    first, second = fake.calls_for(chat=chat)
    assert first.method == second.method == "sendMediaGroup"
    parts = album_parts(first) + album_parts(second)
    assert [len(album_parts(c)) for c in (first, second)] == [10, 2]
    assert [sha for _, sha, _ in parts] == shas and all(cap is None for _, _, cap in parts)
    assert [d["message_id"] for d in rows] == [str(m["message_id"]) for m in first.result + second.result]


def test_a_photo_over_the_photo_limit_goes_alone_as_a_document_after_the_album(env, fake, r, tmp_path):
    chat = "910005"
    files = [tmp_path / n for n in ("s1.jpg", "huge.png", "s2.jpg")]
    shas = [write_random(files[0], 2000), write_random(files[1], 10 * 1000 * 1000 + 1), write_random(files[2], 2100)]
    code, data = send(env, chat, *files, caption="two and a big one")
    assert code == 0, data
    assert [(d["state"], d["kind"]) for d in data["deliveries"]] == [
        ("delivered", "photo"), ("delivered", "document"), ("delivered", "photo")]
    album, doc = fake.calls_for(chat=chat)
    assert album.method == "sendMediaGroup" and doc.method == "sendDocument"
    assert album_parts(album) == [("photo", shas[0], "two and a big one"), ("photo", shas[2], None)]
    assert doc.files["document"].sha256 == shas[1] and doc.caption is None


def test_redelivered_album_task_sends_nothing_again(env, fake, r, tmp_path):
    chat = "910003"
    files = [tmp_path / n for n in ("x.jpg", "y.jpg")]
    for i, p in enumerate(files):
        write_random(p, 1500 + i)
    code, data = send(env, chat, *files)
    assert code == 0, data
    job, rows = data["job"], data["deliveries"]
    (album,) = fake.calls_for("sendMediaGroup", chat=chat)

    target = f"telegram:{chat}"

    def redeliver(probe_text: str) -> None:
        # the album's step once more in the chat's lane, then a probe behind it
        r.rpush(keys.lane(target), rows[0]["id"])
        with env.publishing():
            chains.enqueue(r, chains.Plan(job_id=chains.new_job_id("probe"), target=target, text=probe_text))
        wait_until(lambda: [c for c in fake.calls_for("sendMessage", chat=chat) if c.text == probe_text],
                   timeout_s=30, what=f"the probe {probe_text}")

    # 1. all delivered: the task skips
    redeliver("probe-1")
    # 2. a crash after the album went out but before the receipts were written: the album's
    #    recorded part keeps it from going out twice; the receipts get its message ids
    for d in rows:
        receipts.update_delivery(r, d["id"], state="sending")
    redeliver("probe-2")
    wait_job(r, job)
    assert [c.method for c in fake.calls_for(chat=chat)] == ["sendMediaGroup", "sendMessage", "sendMessage"]
    again = [receipts.get_delivery(r, d["id"]) for d in rows]
    assert [a["state"] for a in again] == ["delivered"] * 2
    assert [a["message_id"] for a in again] == [str(m["message_id"]) for m in album.result]


def test_reply_with_a_missing_photo_records_it_failed_and_sends_the_others_as_an_album(env, fake, r):
    chat = "910004"
    sandbox = env.sandbox / "t4"
    sandbox.mkdir(exist_ok=True)
    a, c = sandbox / "a.jpg", sandbox / "c.png"
    shas = [write_random(a, 3000), write_random(c, 3100)]
    env.reply_file.write_text(f"Your pictures: MEDIA:{a} MEDIA:{sandbox / 'gone.jpg'} MEDIA:{c}")
    res = env.cli("turn", f"telegram:{chat}", "pictures please", "--agent", "reply", "--wait", "--json",
                  "--timeout", "60")
    assert res.returncode == 1, res.stdout + res.stderr  # one delivery failed
    data = json.loads(res.stdout)
    text, first, gone, third = data["deliveries"]
    assert (text["state"], first["state"], third["state"]) == ("delivered",) * 3
    assert gone["state"] == "failed" and gone["name"] == "gone.jpg" and "gone.jpg" in gone["reason"], gone
    assert gone["extraction"] == "failed"  # the extraction wrote its failure in the receipt

    # (the chat also saw the turn's typing and progress message)
    (msg,) = [c for c in fake.calls_for("sendMessage", chat=chat) if c.text == "Your pictures:"]
    (album,) = fake.calls_for("sendMediaGroup", chat=chat)
    assert album_parts(album) == [("photo", shas[0], None), ("photo", shas[1], None)]
    assert text["message_id"] == str(msg.result["message_id"]) and msg.t < album.t
    assert [c.method for c in fake.calls_for(chat=chat) if c.files] == ["sendMediaGroup"]
    assert [first["message_id"], third["message_id"]] == [str(m["message_id"]) for m in album.result]
    failed = [ev for _, ev in events.read(r, data["job"], count=1000)
              if ev.get("kind") == "delivery" and ev.get("state") == "failed"]
    assert [ev["delivery_id"] for ev in failed] == [gone["id"]]
