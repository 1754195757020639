"""The platform contract: one table of scenarios run against every adapter and
its local API server (tests/fixtures/fake_*.py), through one real worker and
real Redis. Each scenario asserts what the platform saw (requests, bytes) and
what the chat shows.

Adding a platform = adding its server to `_deployment` and a `Row` subclass
(how to name a fresh chat, what its chat shows, how many uploads it saw).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from adapters.platforms.outbox import read_log
from tests.fixtures._platforms import agent_env, words, write_unique
from tests.fixtures.fake_discord import FakeDiscord
from tests.fixtures.fake_slack import FakeSlack
from tests.fixtures.fake_telegram import FakeTelegram, enqueue, wait_job
from tests.fixtures.fake_whatsapp import FakeWhatsApp
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

_n = itertools.count(int.from_bytes(os.urandom(2), "big") * 1000 + 1)


class Row:
    """One platform's capabilities and views of its fake server."""

    name = ""

    def __init__(self, fake, env: CourierEnv) -> None:
        self.fake, self.env = fake, env

    def chat(self) -> str:
        raise NotImplementedError

    def texts(self, chat: str) -> list[str]:
        """The text messages the chat shows, in order."""
        raise NotImplementedError

    def files(self, chat: str) -> list[str]:
        """The sha256 of each file the chat shows, in order."""
        raise NotImplementedError

    def uploads(self) -> int:
        """Requests that carried file bytes so far (all chats)."""
        raise NotImplementedError

    #: the platform may refuse a file's size itself (below courier's own limit)
    refuses_size = True
    #: a file is uploaded by one request and sent by another (a retry of the send needs no upload)
    uploads_then_sends = False

    def fail_send_after_upload(self, n: int) -> None:
        """The next `n` sends of an uploaded file answer 429 (retry after 1 s)."""
        raise NotImplementedError

    #: an API that can fail: the outbox cannot
    fails = True
    #: a chat platform refuses a 0-byte file (the outbox, a directory, writes it)
    refuses_empty = True
    #: the caption limit of a document (a longer caption follows as text parts)
    caption_chars = 1024

    def fail_next_text(self, status: int) -> None:
        """The next text message answers `status` (429: retry after 1 s)."""
        raise NotImplementedError

    def fail_next_file(self, status: int) -> None:
        """The next request carrying a file's bytes answers `status`."""
        raise NotImplementedError

    def refuse_size_over(self, n: int | None) -> None:
        """Make the server refuse files over `n` bytes the way the platform does (None: as before)."""
        raise NotImplementedError


class TelegramRow(Row):
    name = "telegram"

    def chat(self) -> str:
        return str(100_000_000 + next(_n))

    def texts(self, chat):
        return [c.text for c in self.fake.calls_for("sendMessage", chat, ok=True)]

    def files(self, chat):
        out = []
        for c in self.fake.calls_for(chat=chat, ok=True):
            if c.method.startswith("send") and c.method not in ("sendMessage", "sendChatAction"):
                kind = c.method[4:].lower()
                media = c.result.get(kind) or c.result.get("document")
                fid = (media[-1] if isinstance(media, list) else media)["file_id"]
                out.append(self.fake.files[fid].sha256)
        return out

    def uploads(self):
        return len(self.fake.uploads())

    def refuse_size_over(self, n):  # the Bot API server's 413
        self.fake.max_upload_bytes = n if n is not None else self.fake._max_upload_default

    def fail_next_text(self, status):
        self.fake.fail_next(1, status, retry_after=1, method="sendMessage")

    def fail_next_file(self, status):
        self.fake.fail_next(1, status, method="sendDocument")


class DiscordRow(Row):
    name = "discord"

    def chat(self) -> str:
        return str(900_000_000_000 + next(_n))

    def texts(self, chat):
        return [m["content"] for m in self.fake.channel_messages(chat) if not m["attachments"]]

    def files(self, chat):
        return [sha for m in self.fake.channel_messages(chat) for sha in m["courier_test_sha256"]]

    def uploads(self):
        return sum(1 for r in self.fake.calls("send") for _ in r.files)

    def refuse_size_over(self, n):  # a guild cap below the setting: 413, code 40005
        from tests.fixtures.fake_discord import DEFAULT_UPLOAD_LIMIT

        self.fake.upload_limit_bytes = n if n is not None else DEFAULT_UPLOAD_LIMIT

    caption_chars = 2000

    def fail_next_text(self, status):
        self.fake.fail_next("send_text", 1, status, retry_after=1)

    def fail_next_file(self, status):
        self.fake.fail_next("send", 1, status)


class SlackRow(Row):
    name = "slack"

    def chat(self) -> str:
        return f"C{next(_n):08d}"

    def texts(self, chat):
        return [m["text"] for m in self.fake.channel_messages(chat) if not m["files"]]

    def files(self, chat):
        return [f["sha256"] for m in self.fake.channel_messages(chat) for f in m["files"]]

    def uploads(self):
        return len(self.fake.calls("upload"))

    def refuse_size_over(self, n):  # the workspace's own restriction: file_upload_size_restricted
        self.fake.restricted_bytes = n

    uploads_then_sends = True

    def fail_send_after_upload(self, n):
        self.fake.fail_next("files.completeUploadExternal", n, 429, retry_after=1)

    caption_chars = 40000

    def fail_next_text(self, status):
        self.fake.fail_next("chat.postMessage", 1, status, retry_after=1)

    def fail_next_file(self, status):
        self.fake.fail_next("upload", 1, status)


class WhatsAppRow(Row):
    name = "whatsapp"

    def chat(self) -> str:
        return f"+1555{next(_n):07d}"

    def _msgs(self, chat):
        return [(c.fields["type"], json.loads(c.fields[c.fields["type"]]))
                for c in self.fake.calls_for("messages", chat=chat, ok=True)]

    def texts(self, chat):
        return [body["body"] for t, body in self._msgs(chat) if t == "text"]

    def files(self, chat):
        return [self.fake.media[body["id"]].sha256 for t, body in self._msgs(chat) if t != "text"]

    def uploads(self):
        return len(self.fake.calls_for("media"))

    def refuse_size_over(self, n):  # the media endpoint's 131053
        self.fake.upload_limit_bytes = n if n is not None else 100 * 1000 * 1000

    uploads_then_sends = True

    def fail_send_after_upload(self, n):
        self.fake.fail_next(n, 429, code=130429, retry_after=1, method="messages")

    def fail_next_text(self, status):
        self.fake.fail_next(1, status, retry_after=1, method="messages", msg_type="text")

    def fail_next_file(self, status):
        self.fake.fail_next(1, status, method="media")


class OutboxRow(Row):
    name = "outbox"
    refuses_size = False
    fails = False
    refuses_empty = False

    def chat(self) -> str:
        return f"contract-{next(_n)}"

    def texts(self, chat):
        return [e["text"] for e in read_log(self.env.outbox, chat) if e["kind"] == "text"]

    def files(self, chat):
        return [e["sha256"] for e in read_log(self.env.outbox, chat) if e["kind"] != "text"]

    def uploads(self):
        return sum(1 for d in Path(self.env.outbox).glob("*/*") if d.name != "deliveries.jsonl")


ROWS = [TelegramRow, DiscordRow, SlackRow, WhatsAppRow, OutboxRow]


@pytest.fixture(scope="module")
def _deployment(tmp_path_factory, redis_server):
    fakes = {"telegram": FakeTelegram().start(), "discord": FakeDiscord().start(), "slack": FakeSlack().start(),
             "whatsapp": FakeWhatsApp().start()}
    tg, dc, sl, wa = fakes["telegram"], fakes["discord"], fakes["slack"], fakes["whatsapp"]
    # (an agent "long" replying what `env.reply_file` holds: the rows of a turn's reply)
    env = agent_env(tmp_path_factory.mktemp("contract"), redis_server.url, "long",
                     TELEGRAM_BOT_TOKEN=tg.token, COURIER_TELEGRAM_BASE_URL=tg.url,
                     DISCORD_BOT_TOKEN=dc.token, COURIER_DISCORD_BASE_URL=dc.base_url,
                     SLACK_BOT_TOKEN=sl.token, COURIER_SLACK_BASE_URL=sl.base_url,
                     WHATSAPP_ACCESS_TOKEN=wa.token, WHATSAPP_PHONE_NUMBER_ID=wa.phone_number_id,
                     COURIER_WHATSAPP_BASE_URL=wa.url)
    try:
        env.start_worker(concurrency=2)
        yield env, fakes
    finally:
        env.stop()
        for f in fakes.values():
            f.stop()


def rows(capability: str | None = None):
    """`row` parametrized over every platform (with `capability` set, if given)."""
    chosen = [c for c in ROWS if capability is None or getattr(c, capability)]
    return pytest.mark.parametrize("row", chosen, ids=[c.name for c in chosen], indirect=True)


@pytest.fixture
def row(request, _deployment) -> Row:
    env, fakes = _deployment
    cls = request.param
    return cls(fakes.get(cls.name), env)


@rows("refuses_empty")
def test_empty_file_is_refused_before_any_upload_with_a_notice(row, r, tmp_path):
    chat = row.chat()
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    before = row.uploads()
    (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", files=[p], caption="see this"))
    assert d["state"] == "failed" and d["reason"] == "empty file: empty.txt is 0 bytes", d
    assert d.get("kind") == "document", d
    assert row.uploads() == before and row.files(chat) == []
    (notice,) = row.texts(chat)
    assert "empty.txt" in notice and "empty" in notice.replace("empty.txt", "")


@rows("refuses_size")
def test_a_size_the_platform_itself_refuses_is_too_large_with_a_notice(row, r, tmp_path):
    # below courier's own limit, over the platform's (a guild cap, a workspace restriction, ...)
    chat = row.chat()
    p = tmp_path / "big.pdf"
    write_unique(p, 60_000)
    row.refuse_size_over(20_000)
    try:
        before = row.uploads()
        (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", files=[p], caption="the big one"))
    finally:
        row.refuse_size_over(None)
    assert d["state"] == "failed" and d["reason"].startswith("too large: big.pdf is "), d
    assert d.get("kind") == "document", d  # a failed receipt keeps the kind it went as
    assert row.files(chat) == [] and row.uploads() - before <= 1  # tried once, not retried
    (notice,) = row.texts(chat)
    assert "big.pdf" in notice and "too large" in notice, notice


@rows("uploads_then_sends")
def test_a_send_retried_after_its_upload_does_not_upload_again(row, r, tmp_path):
    # three 429s on the step after the upload: the retries resume at the send, with the same upload
    chat = row.chat()
    p = tmp_path / "report.pdf"
    sha = write_unique(p, 300_000)
    row.fail_send_after_upload(3)
    before = row.uploads()
    (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", files=[p]), timeout_s=60)
    assert d["state"] == "delivered" and d["rate_limited"] == "3", d
    assert row.uploads() - before == 1
    assert row.files(chat) == [sha]


@pytest.mark.parametrize("target, says", [
    ("discord:not-a-number", "numeric channel id"), ("whatsapp:hello", "phone number"),
    ("telegram:chat one", "numeric chat id"), ("slack:Not A Channel!", "channel id"),
])
def test_a_malformed_chat_id_is_refused_at_parse_exit_2_nothing_enqueued(_deployment, r, tmp_path, target, says):
    env, _ = _deployment
    f = tmp_path / "a.txt"
    f.write_text("x")
    jobs_before = set(r.scan_iter("courier:job:*"))
    res = env.cli("send", target, str(f), "--wait", "--timeout", "20")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "malformed target" in res.stderr and says in res.stderr, res.stderr
    assert set(r.scan_iter("courier:job:*")) == jobs_before


@rows("fails")
def test_a_429_on_the_caption_part_resumes_there_and_the_file_goes_once(row, r, tmp_path):
    # a caption over the caption limit follows the file as text parts; a 429 on the first of them
    # re-schedules the delivery, which resumes at that part: one upload, the whole caption once
    chat = row.chat()
    p = tmp_path / "notes.pdf"
    sha = write_unique(p, 5000)
    caption = words(row.caption_chars + 100, seed=7)
    row.fail_next_text(429)
    before = row.uploads()
    (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", files=[p], caption=caption), timeout_s=60)
    # (rate_limited also counts courier's own per-chat interval before the caption's retry)
    assert d["state"] == "delivered" and int(d["rate_limited"]) >= 1, d
    assert row.files(chat) == [sha] and row.uploads() - before == 1
    assert " ".join(row.texts(chat)) == caption


@rows("fails")
def test_a_500_on_the_file_is_retried_and_the_file_and_caption_go_once(row, r, tmp_path):
    chat = row.chat()
    p = tmp_path / "plot.pdf"
    sha = write_unique(p, 7000)
    row.fail_next_file(500)
    (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", files=[p], caption="the plot"), timeout_s=60)
    assert d["state"] == "delivered" and d["transient_errors"] == "1", d
    assert row.files(chat) == [sha] and row.texts(chat) == []


@rows()
def test_a_long_reply_is_its_first_part_then_the_whole_text_as_reply_txt(row, r):
    # issue 24: a 1 MB reply was 101 Discord / 50 Telegram / 50 WhatsApp / 6 Slack messages
    import hashlib

    chat = row.chat()
    text = words(1024 * 1024, seed=11)[:1024 * 1024].strip()
    (d,) = wait_job(r, enqueue(row.env, f"{row.name}:{chat}", text=text), timeout_s=60)
    assert d["state"] == "delivered", d
    (head,) = row.texts(chat)
    shown, _, note = head.rpartition("\n\n")
    assert text.startswith(shown) and note == f"… (truncated, {len(text) - len(shown):,} more characters in reply.txt)"
    assert row.files(chat) == [hashlib.sha256(text.encode()).hexdigest()]


@rows()
def test_every_media_tag_that_cannot_go_is_named_in_one_notice_after_the_file_that_went(row, r):
    # issue 24: a missing or unsafe file got no notice; a newline garbled the text and failed a file
    # named `a`; a NUL showed the sandbox path; `./x` and `x` went twice
    chat = row.chat()
    d = row.env.sandbox / f"reply-{chat.lstrip('+#')}"
    d.mkdir()
    good = d / "good.pdf"
    sha = write_unique(good, 3000)
    row.env.reply_file.write_text(
        f"Here MEDIA:{good} and MEDIA:{d}/./good.pdf\n"
        f"gone MEDIA:{d}/nope.pdf, secret MEDIA:/etc/passwd\n"
        f"nul MEDIA:{d}/a\x00b.pdf; split MEDIA:\"{d}/a\nb.pdf\" done\n", encoding="utf-8")
    res = row.env.cli("turn", f"{row.name}:{chat}", "go", "--agent", "long", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    job = json.loads(res.stdout)["job"]
    from tasks.ledger import receipts
    from tests.fixtures.services import wait_until

    def over() -> list[dict] | None:
        recs = receipts.job_deliveries(r, job)
        return recs if len(recs) == 6 and all(x["state"] in ("delivered", "failed") for x in recs) else None

    recs = wait_until(over, timeout_s=60, what="the reply's deliveries over")
    assert [(x.get("name"), x["state"]) for x in recs] == [
        (None, "delivered"), ("good.pdf", "delivered"), ("nope.pdf", "failed"), ("passwd", "failed"),
        ("a\x00b.pdf", "failed"), ("a\nb.pdf", "failed")], recs
    assert row.files(chat) == [sha]  # once, named twice
    texts = row.texts(chat)
    assert texts[0] == "Here and\ngone, secret\nnul; split done", texts
    assert texts[1:] == ["⚠️ 4 files could not be sent:\n"
                         "• nope.pdf: it is not in the agent's workspace\n"
                         "• passwd: the agent named a file it may not share\n"
                         "• a\\u0000b.pdf: its name holds a control character (a newline or a NUL)\n"
                         "• a\\u000ab.pdf: its name holds a control character (a newline or a NUL)"], texts
    assert not any(str(row.env.sandbox) in t for t in texts)
