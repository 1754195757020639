r"""A file name's invisible and reordering characters are escaped wherever the name is shown.

`invoice\u202efdp.exe` (a right-to-left override) shows as `invoiceexe.pdf`
in a chat: a program dressed as a document. `adapters.display.visible`
escapes it, and every place that shows a name uses it: the file name the
platform shows (python-telegram-bot against the local Bot API server,
tests/fixtures/fake_telegram.py, through the delivery flow as a worker runs
it, on real Redis), the chat's notices, the turn's events (the turn page,
`courier watch`), the CLI's tables.
"""

from __future__ import annotations

import hashlib

import pytest
from rich.console import Console

from adapters.platforms.telegram import TelegramPlatform
from storage.volume import VolumeStore
from tasks.delivery import lanes
from tasks.dispatch import chains
from tasks.ledger import events, receipts
from tasks.runtime import Context

pytestmark = pytest.mark.timeout(60)

RLO = "\u202e"


@pytest.mark.parametrize("name, shown", [
    ("invoice\u202efdp.exe", "invoice\\u202efdp.exe"),  # right-to-left override
    ("a\u2066b\u2069.txt", "a\\u2066b\\u2069.txt"),  # an isolate
    ("re\u200bport.pdf", "re\\u200bport.pdf"),  # zero-width space
    ("x\ny.txt", "x\\u000ay.txt"),  # a line of its own in a notice
    ("\ufeffbom.txt", "\\ufeffbom.txt"),
    ("\u3164.png", "\\u3164.png"),  # a Hangul filler: a name that looks empty
    ("tag\U000e0041.txt", "tag\\U000e0041.txt"),  # a tag character
    ("\udcff.txt", "\\udcff.txt"),  # a byte of a name that was not UTF-8
    # what is seen as written stays so
    ("café menu.pdf", "café menu.pdf"), ("日本語.txt", "日本語.txt"), ("👩\u200d💻.png", "👩\u200d💻.png"),
    ("plain-name_1.tar.gz", "plain-name_1.tar.gz"),
])
def test_visible_escapes_what_cannot_be_seen_and_keeps_what_can(name, shown):
    from adapters.display import visible

    assert visible(name) == shown
    assert visible(shown) == shown  # escaping twice changes nothing


@pytest.fixture
def flow(redis_client, tmp_path, fake_telegram):
    store = VolumeStore(tmp_path / "store")
    platform = TelegramPlatform(fake_telegram.token, base_url=fake_telegram.url)
    ctx = Context(redis=redis_client, store=store, platform=lambda name: platform,
                  sandbox=lambda ref: None, agent=lambda name: None)  # type: ignore[arg-type,return-value]
    yield ctx
    platform.close()


def _send(ctx: Context, chat: str, name: str, body: bytes) -> tuple[str, str]:
    """A `courier send` of one file named `name` to telegram:`chat`, driven to its end: (job, delivery)."""
    job = chains.new_job_id("snd")
    key = chains.storage_key(job, 0, name)
    ctx.store.put_bytes(key, body)
    (entry,) = chains.register(ctx.redis, chains.Plan(job_id=job, target=f"telegram:{chat}", files=[
        chains.StoredFile(key=key, name=name, size=len(body), sha256=hashlib.sha256(body).hexdigest())]),
        job_kind="send")
    lanes.drive(ctx, f"telegram:{chat}", lambda t, countdown=None: None)
    return job, entry.did


def test_a_right_to_left_override_in_a_file_name_is_escaped_everywhere_it_is_shown(flow, fake_telegram):
    job, did = _send(flow, "601", f"invoice{RLO}fdp.exe", b"MZ not really a program")
    assert (receipts.get_delivery(flow.redis, did) or {}).get("state") == "delivered"
    (call,) = fake_telegram.calls_for("sendDocument", "601", ok=True)
    (part,) = call.files.values()
    assert part.filename == "invoice\\u202efdp.exe"  # the name the chat shows
    # the turn page and `courier watch` show the job's events
    evs = [ev for _, ev in events.read_range(flow.redis, job)]
    assert [ev.get("name") for ev in evs if ev.get("state") == "delivered"] == ["invoice\\u202efdp.exe"]
    assert all(RLO not in events.describe(ev) for ev in evs)
    # a notice built from a name
    _send(flow, "602", f"empty{RLO}txt.exe", b"")
    (notice,) = [c.text for c in fake_telegram.calls_for("sendMessage", "602", ok=True)]
    assert notice.startswith("⚠️ empty\\u202etxt.exe was not sent") and RLO not in notice
    # the CLI's table of a job's deliveries
    from workers.console import deliveries_table

    out = Console(record=True, width=300)
    out.print(deliveries_table(job, receipts.job_deliveries(flow.redis, job)))
    table = out.export_text()
    assert "invoice\\u202efdp.exe" in table and RLO not in table
