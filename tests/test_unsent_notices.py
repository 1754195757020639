"""Every MEDIA file of a reply that cannot be sent is named, with why, in one
notice in the chat (issue 24, the chat side): a file that is missing, one the
agent may not share, a name holding a NUL or a newline, one over the size cap.
The notice shows names, never a path of the worker's host; the reply's text
shows no path of a refused tag either; `./x` and `x` go once.

Plain code as a worker runs it, against real Redis: a real bridge agent's
turn in a local sandbox (`turn.run_turn` / `turn.finish` into the ledger),
each extraction (`extract.run`), then the chat's lane (`lanes.drive`) to
python-telegram-bot against the local Bot API server
(tests/fixtures/fake_telegram.py); assertions are on what that server got.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from adapters.platforms.telegram import TelegramPlatform
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tasks.delivery import lanes
from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.turn import extract, turn
from tasks.runtime import Context
from tests.fixtures.services import wait_until
from tests.fixtures.webstack import AGENT_PRELUDE
from workers.settings import AgentSpec

pytestmark = pytest.mark.timeout(90)

AGENTS = {
    # one good file named three ways, and five that cannot go
    "mixed": """
        ws = os.getcwd()
        open("chart.png", "wb").write(b"\\x89PNG not really")
        open("big.bin", "wb").write(b"x" * 5000)
        print("Here you go: MEDIA:" + ws + "/chart.png")
        print("again MEDIA:" + ws + "/./chart.png and MEDIA:~/chart.png")
        print("missing MEDIA:" + ws + "/nope.png")
        print("secret MEDIA:/etc/passwd")
        print("nul MEDIA:" + ws + "/id_rsa" + chr(0) + ".png")
        print('newline MEDIA:"' + ws + '/a' + chr(10) + 'b.png" done')
        print("big MEDIA:" + ws + "/big.bin")
        """,
    # the one that cannot go first, the reply's last file in an album
    "album_last": """
        ws = os.getcwd()
        open("a.png", "wb").write(b"\\x89PNG a")
        open("b.png", "wb").write(b"\\x89PNG b")
        print("MEDIA:" + ws + "/missing.pdf MEDIA:" + ws + "/a.png MEDIA:~/b.png")
        """,
    # one file that cannot go, nothing else wrong
    "missing": """
        print("see MEDIA:" + os.getcwd() + "/gone.pdf")
        """,
}


@pytest.fixture
def flow(redis_client, tmp_path, fake_telegram):
    scripts = tmp_path / "agents"
    scripts.mkdir()
    specs = {}
    for name, body in AGENTS.items():
        p = scripts / f"{name}.py"
        p.write_text(AGENT_PRELUDE + textwrap.dedent(body))
        specs[name] = AgentSpec(command=[sys.executable, str(p)], timeout_s=30, isolation="host")
    platform = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    ctx = Context(redis=redis_client, store=VolumeStore(tmp_path / "store"), platform=lambda name: platform,
                  sandbox=lambda ref: LocalSandbox.with_roots(tuple(ref.roots)), agent=specs.get,
                  default_sandbox_dir=str(tmp_path / "sandbox"), max_file_bytes=4096)
    yield ctx
    platform.close()


def _reply(ctx: Context, agent: str, chat: str) -> str:
    """A turn of `agent` to telegram:`chat`, run and enqueued, each extraction
    run, then the chat's lane driven until it is empty (Telegram's per-chat
    pace: a drive stops at the gate; the next one goes once it opens)."""
    target = f"telegram:{chat}"
    job = chains.new_job_id("turn")
    receipts.create_job(ctx.redis, job, kind="turn", target=target, agent=agent)
    spec = chains.turn_spec(job, target, "hi", agent=agent)
    out = turn.run_turn(ctx, spec)
    assert out.state == "replied", out
    turn.finish(ctx, out, lambda r, plan: [e.did for e in chains.register(r, plan)])
    for rec in receipts.job_deliveries(ctx.redis, job):
        if rec.get("type") == "file":
            extract.run(ctx, rec["id"])

    def drained() -> bool:
        lanes.drive(ctx, target, lambda t, countdown=None: None)
        return not ctx.redis.exists(keys.lane(target))

    wait_until(drained, timeout_s=60, interval_s=0.2, what=f"the lane of {target} drained")
    return job


def test_every_file_that_cannot_go_is_named_in_one_notice_and_the_good_one_goes_once(flow, fake_telegram, tmp_path):
    job = _reply(flow, "mixed", "801")
    calls = fake_telegram.calls_for(chat="801", ok=True)
    # the good file once (named three ways), the text, and one notice
    assert [c.method for c in calls] == ["sendMessage", "sendPhoto", "sendMessage"], [c.method for c in calls]
    text, notice = calls[0].text or "", calls[2].text or ""
    assert text.splitlines() == ["Here you go:", "again and", "missing", "secret", "nul", "newline done", "big"]
    assert notice.startswith("⚠️ 5 files could not be sent:\n"), notice
    assert notice.splitlines()[1:] == [
        "• nope.png: it is not in the agent's workspace",
        "• passwd: the agent named a file it may not share",
        "• id_rsa\\u0000.png: its name holds a control character (a newline or a NUL)",
        "• a\\u000ab.png: its name holds a control character (a newline or a NUL)",
        "• big.bin (4.9 KiB): over the 4.0 KiB limit here",
    ], notice
    # no path of the worker's host (the sandbox dir, the workspace) in anything the chat got
    for c in calls:
        assert str(tmp_path) not in (c.text or "") and "/etc" not in (c.text or ""), c.text
    recs = [r for r in receipts.job_deliveries(flow.redis, job) if r.get("type") == "file"]
    assert [(r["name"], r["state"]) for r in recs] == [
        ("chart.png", "delivered"), ("nope.png", "failed"), ("passwd", "failed"), ("id_rsa\x00.png", "failed"),
        ("a\nb.png", "failed"), ("big.bin", "failed")]
    # the receipt keeps the detail; the control-character names were never read
    assert "ControlInName" in recs[3]["reason"] and "ControlInName" in recs[4]["reason"], recs


def test_a_lone_missing_file_is_told_in_one_sentence(flow, fake_telegram):
    _reply(flow, "missing", "802")
    texts = [c.text for c in fake_telegram.calls_for("sendMessage", "802", ok=True)]
    assert texts == ["see", "⚠️ gone.pdf could not be sent: it is not in the agent's workspace."]


def test_the_notice_follows_an_album_that_holds_the_replys_last_file(flow, fake_telegram):
    _reply(flow, "album_last", "803")
    calls = fake_telegram.calls_for(chat="803", ok=True)
    assert [c.method for c in calls] == ["sendMediaGroup", "sendMessage"], [c.method for c in calls]
    assert calls[1].text == "⚠️ missing.pdf could not be sent: it is not in the agent's workspace."
