"""Forged and tampered ledger specs and task messages, written straight into
Redis as anyone who can write there could (issue 22): a wider root and a
bigger cap, an unsigned spec, another chat's spec, a spec signed with the
real key that names roots the worker's own configuration does not allow,
an unsigned and a tampered task message. A real worker (real Redis, real
Celery) refuses each: its receipt says so, the worker logs it, and no byte
of the file it aimed at is read, stored or delivered."""

from __future__ import annotations

import json
import time

import pytest

from adapters.platforms.outbox import read_log
from adapters.sandboxes.base import SandboxRef
from tasks import task_names
from tasks.dispatch import chains
from tasks.ledger import keys, receipts, signing
from tests.fixtures.services import wait_until
from tests.fixtures.workers import CourierEnv

pytestmark = pytest.mark.slow

TOKEN = "HOST-PRIVATE-KEY-6f1e"


def _plan(env: CourierEnv, job: str, chat: str, name: str) -> chains.Plan:
    ref = SandboxRef("local", roots=(str(env.sandbox),))
    return chains.Plan(job_id=job, target=f"outbox:{chat}", files=[chains.SandboxFile(ref, str(env.sandbox / name))])


def _tamper(raw: str, change) -> str:
    """The sealed spec with its payload changed and its old signature kept."""
    head, payload = raw.rsplit(".", 1)[0], None
    parts = raw.split(".", 4)
    payload = json.loads(parts[4])
    change(payload)
    return ".".join(parts[:4]) + "." + json.dumps(payload, separators=(",", ":"))


def _final(r, did: str) -> dict:
    return wait_until(lambda: (lambda rec: rec if rec and rec.get("state") in receipts.TERMINAL else None)(
        receipts.get_delivery(r, did)), 60, what=f"{did} to be final")


@pytest.fixture
def deployment(tmp_path, redis_server):
    secret_dir = tmp_path / "etc-ssh"
    secret_dir.mkdir()
    (secret_dir / "ssh_host_key").write_text(TOKEN * 200 + "\n")  # 4 KB: over the worker's cap below
    env = CourierEnv(tmp_path / "env", redis_server.url, COURIER_MAX_FILE_BYTES="2000")
    (env.sandbox / "ok.txt").write_text("an agent's own file\n")
    (env.sandbox / "big.bin").write_bytes(b"x" * 3000)
    worker = env.start_worker(concurrency=1)
    from workers.celery_app import make_app

    app = make_app(env.settings())
    yield env, redis_server.client(), app, secret_dir, worker
    env.stop()


def _publish_file(app, did: str) -> None:
    app.send_task(task_names.EXTRACT_FILE, args=[did], queue="sandbox")


def _nothing_leaked(env: CourierEnv) -> None:
    for p in [*env.outbox.rglob("*"), *(env.data_dir / "storage").rglob("*")]:
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


def test_tampered_unsigned_and_misplaced_specs_are_refused(deployment):
    env, r, app, secret_dir, worker = deployment
    key = str(secret_dir / "ssh_host_key")
    cases = {}
    # a wider root and a bigger cap, the signature kept
    chains.register(r, _plan(env, "snd_wide", "a", "ok.txt"), job_kind="send")

    def widen(p):
        p["extract"].update(path=key, max_bytes=10 ** 12, sandbox={**p["extract"]["sandbox"], "roots": [str(secret_dir)]})

    raw = receipts.get_delivery(r, "snd_wide.0")["spec"]
    r.hset(keys.delivery("snd_wide.0"), "spec", _tamper(raw, widen))
    cases["snd_wide.0"] = "does not verify"
    # an unsigned spec
    chains.register(r, _plan(env, "snd_plain", "b", "ok.txt"), job_kind="send")
    plain = signing.open_json("delivery", "snd_plain.0", receipts.get_delivery(r, "snd_plain.0")["spec"])
    plain["extract"].update(path=key, sandbox={**plain["extract"]["sandbox"], "roots": [str(secret_dir)]})
    r.hset(keys.delivery("snd_plain.0"), "spec", json.dumps(plain))
    cases["snd_plain.0"] = "unsigned delivery"
    # another chat's spec (signed for its own delivery id) replayed into this one's receipt
    chains.register(r, _plan(env, "snd_other", "c", "ok.txt"), job_kind="send")
    chains.register(r, _plan(env, "snd_mine", "d", "ok.txt"), job_kind="send")
    r.hset(keys.delivery("snd_mine.0"), "spec", receipts.get_delivery(r, "snd_other.0")["spec"])
    cases["snd_mine.0"] = "does not verify"
    for did in cases:
        _publish_file(app, did)
    for did, why in cases.items():
        rec = _final(r, did)
        assert rec["state"] == "failed" and why in rec.get("reason", ""), (did, rec)
        assert rec["reason"].startswith("refused:")
    # the lanes the refused ones were in go on: the honest delivery of chat c arrives
    app.send_task(task_names.DRIVE_LANE, args=["outbox:c"], queue="delivery")
    assert _final(r, "snd_other.0")["state"] == "delivered"
    _nothing_leaked(env)
    log = worker.courier_log.read_text()
    assert log.count("refused a forged delivery") >= len(cases), log[-3000:]


def test_a_delivery_in_another_chats_lane_is_refused(deployment):
    """A signed delivery id pushed into another chat's lane: never sent there (nor anywhere)."""
    env, r, app, secret_dir, worker = deployment
    chains.register(r, chains.Plan(job_id="snd_x", target="outbox:x", text="for x only"), job_kind="send")
    r.lrem(keys.lane("outbox:x"), 0, "snd_x.0")
    r.rpush(keys.lane("outbox:y"), "snd_x.0")
    app.send_task(task_names.DRIVE_LANE, args=["outbox:y"], queue="delivery")
    rec = _final(r, "snd_x.0")
    assert rec["state"] == "failed" and "another chat" in rec["reason"], rec
    assert not read_log(env.outbox, "y") and not read_log(env.outbox, "x")


def test_the_workers_own_roots_and_cap_hold_against_a_validly_signed_spec(deployment):
    """Defence in depth: a spec signed with the real key (a compromised signer) still cannot widen what
    this worker reads: its roots and its size cap are its own configuration's."""
    env, r, app, secret_dir, worker = deployment
    key = str(secret_dir / "ssh_host_key")
    chains.register(r, _plan(env, "snd_signed", "e", "ok.txt"), job_kind="send")
    spec = signing.open_json("delivery", "snd_signed.0", receipts.get_delivery(r, "snd_signed.0")["spec"])
    spec["extract"].update(path=key, sandbox={**spec["extract"]["sandbox"], "roots": [str(secret_dir)]})
    r.hset(keys.delivery("snd_signed.0"), "spec", signing.seal_json("delivery", "snd_signed.0", spec))
    chains.register(r, chains.Plan(job_id="snd_cap", target="outbox:f", files=[chains.SandboxFile(
        SandboxRef("local", roots=(str(env.sandbox),)), str(env.sandbox / "big.bin"))], max_bytes=10 ** 12),
        job_kind="send")
    for did in ("snd_signed.0", "snd_cap.0"):
        _publish_file(app, did)
    rec = _final(r, "snd_signed.0")
    assert rec["state"] == "failed" and "roots this worker does not allow" in rec["reason"], rec
    rec = _final(r, "snd_cap.0")
    assert rec["state"] == "failed" and "too large" in rec["reason"] and rec.get("limit_bytes") == "2000", rec
    _nothing_leaked(env)


def test_unsigned_and_tampered_task_messages_never_run(deployment):
    env, r, app, secret_dir, worker = deployment
    marker = env.data_dir / "sandbox" / "demo" / "turns"
    spec = chains.turn_spec("turn_forged1", "outbox:victim", "forged", agent="demo")
    # unsigned: a plain JSON body, as anyone with Redis could push
    app.send_task(task_names.AGENT_TURN, args=[spec], task_id="turn_forged1", queue="turns", serializer="json")
    # tampered: a signed message whose body is changed, its signature kept
    spec2 = chains.turn_spec("turn_forged2", "outbox:me", "hello", agent="demo")
    app.send_task(task_names.AGENT_TURN, args=[spec2], task_id="turn_forged2", queue="turns-hold")
    (raw,) = r.lrange("turns-hold", 0, -1)
    r.delete("turns-hold")
    msg = json.loads(raw)
    import base64

    body = base64.b64decode(msg["body"]).decode()
    head, payload = body.rsplit(".", 1)[0], body.split(".", 4)[4]
    parts = body.split(".", 4)
    payload = payload.replace("outbox:me", "outbox:victim")
    msg["body"] = base64.b64encode((".".join(parts[:4]) + "." + payload).encode()).decode()
    r.lpush("turns", json.dumps(msg))
    # then an honest send: once it is delivered, the worker has taken both forged ones (one queue, in order)
    res = env.cli("send", "outbox:honest", "--text", "after", "--wait", "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr
    deadline = time.monotonic() + 30
    wait_until(lambda: r.llen("turns") == 0, 30, what="the forged messages to be taken")
    log_text = lambda: worker.courier_log.read_text()  # noqa: E731
    wait_until(lambda: log_text().count("refused a forged message") + log_text().count("untrusted content") >= 2,
               max(1.0, deadline - time.monotonic()), what=lambda: f"both refusals in the log: {log_text()[-3000:]}")
    assert not (env.outbox / "victim").exists()
    assert not marker.exists() or not any(marker.iterdir())  # no turn ran
    assert receipts.get_job(r, "turn_forged1") is None and receipts.get_job(r, "turn_forged2") is None
