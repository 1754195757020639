"""A file that fails for good tells its chat what failed in the chat's words;
the detail (bucket, key, S3 endpoint, the agent's host paths) stays in the receipt.

Plain code, no worker: the delivery and extraction stages as a worker runs
them (`lanes.drive`, `extract.run`) against real Redis, a real S3 server
(SeaweedFS) reached through a proxy that goes down (an outage), a real local
sandbox and the outbox platform (the chat: a directory; no pacing, so a
notice goes right after its failure). The outage deadline is behind every
failure: the first storage error gives up.
"""

from __future__ import annotations

import pytest

from adapters.platforms.outbox import OutboxPlatform, read_log
from adapters.sandboxes.base import SandboxRef
from adapters.sandboxes.local import LocalSandbox
from storage.s3 import S3Store
from tasks.delivery import lanes
from tasks.dispatch import chains
from tasks.ledger import receipts
from tasks.turn import extract
from tasks.runtime import Context
from tests.fixtures.faults import TcpProxy

pytestmark = pytest.mark.timeout(120)

TOLD = "storage unavailable; the operator was told"


@pytest.fixture
def outage(redis_client, s3_server, tmp_path):
    bucket = s3_server.make_bucket()
    proxy = TcpProxy("127.0.0.1", s3_server.port).start()
    store = S3Store(bucket, "courier", endpoint_url=proxy.url, region=s3_server.region,
                    access_key=s3_server.access_key, secret_key=s3_server.secret_key, max_attempts=1)
    platform = OutboxPlatform(tmp_path / "outbox")
    ctx = Context(redis=redis_client, store=store, platform=lambda name: platform,
                  sandbox=lambda ref: LocalSandbox.with_roots(tuple(ref.roots)),
                  agent=lambda name: None,  # type: ignore[arg-type,return-value]
                  outage_deadline_s=-1.0)  # no outage is waited out: the first storage error gives up
    try:
        yield ctx, proxy, bucket
    finally:
        platform.close()
        proxy.stop()
        s3_server.drop_bucket(bucket)


def _texts(outbox, chat: str) -> list[str]:
    return [row["text"] for row in read_log(outbox, chat) if row["kind"] == "text"]


def _drive(ctx: Context, target: str) -> None:
    lanes.drive(ctx, target, lambda t, countdown=None: None)


def test_a_storage_outage_is_told_in_the_chats_words_and_its_detail_kept_in_the_receipt(
        outage, redis_client, tmp_path):
    ctx, proxy, bucket = outage
    # a stored file (`courier send`), stored while S3 answers
    job = chains.new_job_id("snd")
    key = chains.storage_key(job, 0, "report.pdf")
    info = ctx.store.put_bytes(key, b"%PDF-1.4 a report")
    (sent,) = [e.did for e in chains.register(redis_client, chains.Plan(
        job_id=job, target="outbox:501", files=[chains.StoredFile(key=key, name="report.pdf", size=info.size_bytes,
                                                                     sha256=info.sha256 or "")]), job_kind="send")]
    # an agent's file in its workspace, to be extracted into S3
    ws = tmp_path / "agents" / "turns" / "turn_x"
    ws.mkdir(parents=True)
    (ws / "chart.png").write_bytes(b"\x89PNG not really")
    turn = chains.new_job_id("turn")
    (made,) = [e.did for e in chains.register(redis_client, chains.Plan(
        job_id=turn, target="outbox:502",
        files=[chains.SandboxFile(SandboxRef("local", roots=(str(ws),)), str(ws / "chart.png"))]), job_kind="turn")]

    proxy.down()
    _drive(ctx, "outbox:501")  # reads S3: away, past the deadline at once
    assert extract.run(ctx, made)["state"] == "failed"
    _drive(ctx, "outbox:502")

    for did, chat, name in ((sent, "501", "report.pdf"), (made, "502", "chart.png")):
        rec = receipts.get_delivery(redis_client, did) or {}
        # the receipt keeps the detail: the failure, the bucket and the endpoint it could not reach
        assert rec.get("state") == "failed" and rec["reason"].startswith("storage unavailable: "), rec
        assert bucket in rec["reason"], rec
        (notice,) = _texts(tmp_path / "outbox", chat)
        assert notice == f"⚠️ {name} could not be sent: {TOLD}.", notice
        for detail in (bucket, "courier/files", "127.0.0.1", str(proxy.port), "s3://", str(tmp_path)):
            assert detail not in notice
