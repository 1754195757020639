"""WhatsApp confirms later (issue 24): the Cloud API answers a send with a message id and reports
`failed` afterwards through its status webhook (an expired media id, a user outside the 24 h
window). e82a350 recorded "delivered" and never learnt otherwise. A real worker sends through the
real adapter to the local Cloud API server; the web process gets the signed status webhooks as Meta
posts them: a receipt moves to delivered / read (never back), a `failed` after acceptance makes it
failed with the platform's reason (in `courier deliveries --failed`), an unsigned one changes nothing."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys

import httpx
import pytest

from tasks.ledger import receipts
from tests.fixtures.services import free_port, stop_process, wait_until
from tests.fixtures.workers import ROOT, CourierEnv

SECRET = "wa-app-secret-for-statuses"
TO = "+15550001111"


def _statuses(*items: dict) -> bytes:
    return json.dumps({"object": "whatsapp_business_account", "entry": [{"id": "1", "changes": [
        {"field": "messages", "value": {"messaging_product": "whatsapp", "statuses": list(items)}}]}]}).encode()


def _post(base: str, body: bytes, *, secret: str = SECRET) -> httpx.Response:
    sig = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return httpx.post(f"{base}/webhooks/whatsapp", content=body, timeout=30,
                      headers={"Content-Type": "application/json", "X-Hub-Signature-256": sig})


@pytest.fixture
def deployment(tmp_path, redis_server, redis_client, fake_whatsapp):
    env = CourierEnv(tmp_path / "env", redis_server.url, WHATSAPP_APP_SECRET=SECRET,
                     WHATSAPP_VERIFY_TOKEN="wa-verify", **fake_whatsapp.courier_settings())
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(port)],
                           env=env.env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code in (200, 503), 60, what="web")
        env.start_worker(queues="delivery", concurrency=1)
        yield env, base, redis_client
    finally:
        stop_process(web)
        env.stop()


def _sent(env: CourierEnv, r, text: str) -> dict:
    res = env.cli("send", f"whatsapp:{TO}", "--text", text, "--wait", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    (rec,) = receipts.job_deliveries(r, json.loads(res.stdout)["job"])
    assert rec["state"] == "delivered" and rec["confirmed"] == "accepted", rec
    return rec


def test_statuses_move_receipts_on_and_a_late_failure_is_told(deployment):
    env, base, r = deployment
    read, lost = _sent(env, r, "one"), _sent(env, r, "two")
    got = _post(base, _statuses({"id": read["message_id"], "status": "delivered", "recipient_id": TO[1:]},
                                {"id": read["message_id"], "status": "read", "recipient_id": TO[1:]},
                                {"id": lost["message_id"], "status": "failed", "recipient_id": TO[1:], "errors": [
                                    {"code": 131047, "title": "Re-engagement message",
                                     "error_data": {"details": "More than 24 hours have passed"}}]}))
    assert got.status_code == 200 and got.json()["statuses"] == 3, got.text
    one, two = receipts.get_delivery(r, read["id"]), receipts.get_delivery(r, lost["id"])
    assert one["state"] == "delivered" and one["confirmed"] == "read"
    assert two["state"] == "failed" and two["failed_after_acceptance"] == "1"
    assert two["reason"] == ("accepted, then failed: Re-engagement message, code 131047, "
                             "More than 24 hours have passed")
    # never backwards: a late `sent` for the read one; and the operator's list shows the failure
    assert _post(base, _statuses({"id": read["message_id"], "status": "sent"})).json().get("statuses", 0) == 0
    assert receipts.get_delivery(r, read["id"])["confirmed"] == "read"
    failed = json.loads(env.cli("deliveries", "--failed", "--json").stdout)
    assert [row["id"] for row in failed] == [lost["id"]]


def test_an_unsigned_or_unknown_status_changes_nothing(deployment):
    env, base, r = deployment
    rec = _sent(env, r, "three")
    forged = _statuses({"id": rec["message_id"], "status": "failed", "errors": [{"code": 1, "title": "x"}]})
    assert _post(base, forged, secret="not-the-app-secret").status_code == 401
    assert _post(base, _statuses({"id": "wamid.not-ours", "status": "failed"})).status_code == 200
    assert receipts.get_delivery(r, rec["id"])["state"] == "delivered"


def test_telegram_like_receipts_are_final_at_acceptance(tmp_path, redis_server, redis_client):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    env.start_worker(queues="delivery", concurrency=1)
    try:
        res = env.cli("send", "outbox:final", "--text", "x", "--wait", "--json")
        (rec,) = receipts.job_deliveries(redis_client, json.loads(res.stdout)["job"])
        assert rec["confirmed"] == "final at acceptance"
    finally:
        env.stop()
