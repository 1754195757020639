"""The signatures on what crosses Redis (tasks/ledger/signing.py): what verifies and
what does not, the key generated into the data dir, and a key rotation with
real worker processes (the previous key accepted, never used to sign)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tasks.ledger import signing
from tasks.ledger.signing import Forged, Signer

OLD = b"the-old-key-0123456789abcdef"
NEW = b"the-new-key-0123456789abcdef"


def test_a_sealed_spec_opens_only_as_what_it_was_sealed_for():
    s = Signer([NEW])
    sealed = s.seal("delivery", "snd_a.0", '{"target":"outbox:a"}')
    assert s.open("delivery", "snd_a.0", sealed) == '{"target":"outbox:a"}'
    for purpose, ident, text, why in [
        ("delivery", "snd_b.0", sealed, "does not verify"),                          # another id
        ("turn", "snd_a.0", sealed, "does not verify"),                              # another purpose
        ("delivery", "snd_a.0", sealed.replace("outbox:a", "outbox:b"), "does not verify"),  # tampered
        ("delivery", "snd_a.0", '{"target":"outbox:a"}', "unsigned"),                 # plain JSON
        ("delivery", "snd_a.0", Signer([OLD]).seal("delivery", "snd_a.0", "{}"), "unknown key"),
    ]:
        with pytest.raises(Forged, match=why):
            s.open(purpose, ident, text)
    old = s.seal("delivery", "snd_a.0", "{}", now=1_000_000)
    with pytest.raises(Forged, match="too old"):
        s.open("delivery", "snd_a.0", old)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Signer([b"short"])


def test_while_rotating_the_previous_key_opens_and_the_new_one_signs():
    old, rotating, new_only = Signer([OLD]), Signer([NEW, OLD]), Signer([NEW])
    by_old = old.seal("turn", "turn_x", "{}")
    assert rotating.open("turn", "turn_x", by_old) == "{}"
    by_rotating = rotating.seal("turn", "turn_x", "{}")
    assert new_only.open("turn", "turn_x", by_rotating) == "{}"  # it signs with the new key
    with pytest.raises(Forged, match="unknown key"):
        old.open("turn", "turn_x", by_rotating)
    with pytest.raises(Forged, match="unknown key"):
        new_only.open("turn", "turn_x", by_old)  # rotation over: the old key's are refused


def test_the_key_is_generated_once_into_the_data_dir(tmp_path):
    """Eight processes starting at once on a fresh data dir end up with one key, private to its owner."""
    code = ("import sys; from workers.settings import Settings; from workers.wiring import make_signer; "
            "from tasks.ledger.signing import key_id; s = make_signer(Settings()); "
            "print(key_id(s._keys[s._current]))")
    env = {k: v for k, v in os.environ.items() if k != "COURIER_SIGNING_KEY"}
    env.update(COURIER_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(__import__("pathlib").Path(__file__).parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(8)]
    ids = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(ids) == 1 and all(ids), ids
    key = tmp_path / "data" / "signing.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600" and len(key.read_text().strip()) == 64
    assert not [p for p in key.parent.iterdir() if p.name.startswith("signing.key.")]  # no temp file left


def test_a_forgery_is_counted():
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("courier_forged_total", {"what": "delivery"}) or 0
    with pytest.raises(Forged):
        signing.open_json("delivery", "snd_z.0", '{"plain": true}')
    assert REGISTRY.get_sample_value("courier_forged_total", {"what": "delivery"}) == before + 1


def test_a_rotation_with_real_workers(tmp_path, redis_server):
    """What was signed with the old key is delivered by a worker that has it as its previous key; a worker
    that has only the new key refuses it (and says why in the receipt)."""
    from adapters.platforms.outbox import read_log
    from tasks.dispatch import chains
    from tasks.ledger import receipts
    from tests.fixtures.services import wait_until
    from tests.fixtures.workers import CourierEnv

    old_key = os.environ["COURIER_SIGNING_KEY"].encode()  # the test session's key (tests/conftest.py)
    r = redis_server.client()
    try:
        for chat, previous in (("rotating", old_key), ("rotated", None)):
            extra = {"COURIER_SIGNING_KEY": NEW.decode()}
            if previous:
                extra["COURIER_SIGNING_KEY_PREVIOUS"] = previous.decode()
            env = CourierEnv(tmp_path / chat, redis_server.url, **extra)
            try:
                signing.install(Signer([NEW]))  # this process talks to the new deployment's worker
                env.start_worker(queues="delivery", concurrency=1)
                signing.install(Signer([old_key]))  # a spec the old deployment wrote
                chains.register(r, chains.Plan(job_id=f"snd_{chat}", target=f"outbox:{chat}",
                                               text="signed by the old key"), job_kind="send")
                signing.install(Signer([NEW]))  # the new deployment's processes publish the lane's drive
                from workers.celery_app import make_app

                make_app(env.settings()).send_task("courier.delivery.drive_lane", args=[f"outbox:{chat}"],
                                                   queue="delivery")
                rec = wait_until(lambda: (lambda x: x if x and x.get("state") in receipts.TERMINAL else None)(
                    receipts.get_delivery(r, f"snd_{chat}.0")), 60, what=f"the {chat} delivery to be final")
                if previous:
                    assert rec["state"] == "delivered", rec
                    assert read_log(env.outbox, chat)[0]["text"] == "signed by the old key"
                else:
                    assert rec["state"] == "failed" and "unknown key" in rec["reason"], rec
                    assert not read_log(env.outbox, chat)
            finally:
                env.stop()
    finally:
        signing.install(Signer([old_key]))
