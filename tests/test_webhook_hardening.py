"""Webhooks against bad requests, into the real web process (`courier web
--log-level trace`, uvicorn on loopback, its own redis-server, no worker):
stale or future signed timestamps are refused; signature headers are
checked before the body is read and the signature before the body is
parsed; a body over the platform's cap is a 413 as soon as the cap is
passed; every bad or malformed request is a 4xx with a one-line reason,
never a 500; no secret appears in the log at any level; a turn's events
stream needs the turn's token."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse

import httpx
import pytest

from tasks.ledger import events, receipts
from tests.fixtures.webstack import (
    SLACK_SECRET,
    TELEGRAM_SECRET,
    WA_SECRET,
    WA_VERIFY,
    slack_headers,
    web_only,
    whatsapp_headers,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with web_only(tmp_path_factory.mktemp("hard"), log_level="trace") as w:
        yield w
        log = w.log()
        assert "Traceback" not in log, log[-3000:]


def discord(web, payload: dict | bytes, ts: int | None = None, key=None) -> tuple[bytes, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    t = str(int(time.time()) if ts is None else ts)
    sig = (key or web.discord_key).sign(t.encode() + body).signature.hex()
    return body, {"X-Signature-Ed25519": sig, "X-Signature-Timestamp": t, "Content-Type": "application/json"}


def one_line_4xx(r: httpx.Response, status: int | None = None) -> str:
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), (r.status_code, r.text)
    reason = r.json()["error"]
    assert isinstance(reason, str) and reason and "\n" not in reason and len(reason) < 200, reason
    return reason


# -- Discord: timestamps within 5 minutes ---------------------------------------------------------------
def test_discord_timestamps_must_be_within_five_minutes(web):
    url = web.base + "/webhooks/discord"
    now = int(time.time())
    # 301 s would race the clock: the server reads it up to a second (or, on a busy machine, more) later
    for ts in (now - 2 * 86400, now + 10 * 86400, now - 310, now + 310, 0):
        body, h = discord(web, {"type": 1, "id": "1"}, ts=ts)
        assert "timestamp" in one_line_4xx(httpx.post(url, content=body, headers=h), 401)
    for ts in (now - 240, now, now + 240):
        body, h = discord(web, {"type": 1, "id": "1"}, ts=ts)
        assert httpx.post(url, content=body, headers=h).json() == {"type": 1}


# -- order: headers, capped body, signature, then parsing ----------------------------------------------
def test_the_signature_is_checked_before_the_body_is_parsed(web):
    junk = b'{"not json'
    assert one_line_4xx(httpx.post(web.base + "/webhooks/telegram", content=junk,
                                   headers={"X-Telegram-Bot-Api-Secret-Token": "nope"}), 401)
    assert one_line_4xx(httpx.post(web.base + "/webhooks/slack", content=junk,
                                   headers=slack_headers(junk, secret="other")), 401)
    assert one_line_4xx(httpx.post(web.base + "/webhooks/whatsapp", content=junk,
                                   headers=whatsapp_headers(junk, secret="other")), 401)
    from nacl.signing import SigningKey

    body, h = discord(web, junk, key=SigningKey.generate())
    assert one_line_4xx(httpx.post(web.base + "/webhooks/discord", content=body, headers=h), 401)
    # signed right: now it is parsed, and refused as what it is
    assert "not JSON" in one_line_4xx(httpx.post(web.base + "/webhooks/slack", content=junk,
                                                 headers=slack_headers(junk)), 400)


@pytest.mark.parametrize("path,cap", [("/webhooks/telegram", 128), ("/webhooks/slack", 256),
                                      ("/webhooks/discord", 128), ("/webhooks/whatsapp", 512)])
def test_a_body_over_the_platform_cap_is_refused_as_soon_as_it_passes_the_cap(web, path, cap):
    cap *= 1024
    now = str(int(time.time()))
    headers = {"/webhooks/telegram": TG,
               "/webhooks/slack": {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": "v0=" + "0" * 64},
               "/webhooks/discord": {"X-Signature-Timestamp": now, "X-Signature-Ed25519": "0" * 128},
               "/webhooks/whatsapp": {"X-Hub-Signature-256": "sha256=" + "0" * 64}}[path]
    # declared: refused from the headers
    big = b"x" * (cap + 1)
    assert "body over" in one_line_4xx(httpx.post(web.base + path, content=big, headers=headers), 413)
    # streamed (chunked, no length): the answer comes while the body is still unfinished
    u = urllib.parse.urlsplit(web.base)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + \
            "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode())
        chunk = b"y" * 16384
        for _ in range(cap // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        # no last chunk: a server that waited for the whole body would never answer
        s.settimeout(10)
        got = s.recv(4096)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]


def test_missing_or_bad_signature_headers_are_401_without_reading_the_body(web):
    now = str(int(time.time()))
    cases = [
        ("/webhooks/slack", {}),  # unsigned, no timestamp (was a 500 and a traceback)
        ("/webhooks/slack", {"X-Slack-Request-Timestamp": "soon", "X-Slack-Signature": "v0=" + "0" * 64}),
        ("/webhooks/slack", {"X-Slack-Request-Timestamp": str(int(now) - 3600), "X-Slack-Signature": "v0=" + "0" * 64}),
        ("/webhooks/slack", {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": "v1=abc"}),
        ("/webhooks/discord", {}),
        ("/webhooks/discord", {"X-Signature-Timestamp": now, "X-Signature-Ed25519": "zz"}),
        ("/webhooks/discord", {"X-Signature-Timestamp": "-1", "X-Signature-Ed25519": "0" * 128}),
        ("/webhooks/whatsapp", {}),
        ("/webhooks/whatsapp", {"X-Hub-Signature-256": "md5=abc"}),
        ("/webhooks/telegram", {}),
    ]
    for path, h in cases:
        # a declared body that never comes: refused from the headers alone (a server that
        # read the body first would never answer)
        u = urllib.parse.urlsplit(web.base)
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n"
                       + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode())
            got = s.recv(4096)
        assert got.startswith(b"HTTP/1.1 401") or got.startswith(b"HTTP/1.1 413"), (path, h, got[:300])


# -- malformed but signed: 4xx (or acknowledged and ignored), never a 500 --------------------------------
def _tg(update) -> tuple[str, bytes, dict]:
    return "/webhooks/telegram", update if isinstance(update, bytes) else json.dumps(update).encode(), TG


def _slack(payload) -> tuple[str, bytes, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return "/webhooks/slack", body, slack_headers(body)


def _signed_now(path: str, body: bytes, h: dict) -> dict:
    """The headers of a request built at import, signed again now: Slack's
    signed timestamp must be within 5 minutes when it is sent."""
    return slack_headers(body) if path.endswith("/slack") else h


def _wa(payload) -> tuple[str, bytes, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return "/webhooks/whatsapp", body, whatsapp_headers(body)


def _ev(**event) -> dict:
    return {"type": "event_callback", "event_id": "Ev1",
            "event": {"type": "message", "text": "hi", "channel": "C1", "ts": "1.2", **event}}


def _wam(**m) -> dict:
    return {"entry": [{"changes": [{"value": {"messages": [
        {"from": "15550001", "id": "wamid.X", "type": "text", "text": {"body": "hi"}, **m}]}}]}]}


MALFORMED = {
    "tg-not-json": _tg(b"\xff\xfe not json"),
    "tg-array": _tg([1, 2]),
    "tg-deep": _tg(b"[" * 20_000 + b"]" * 20_000),
    "tg-update-id-str": _tg({"update_id": "x", "message": {"text": "hi", "chat": {"id": 1}}}),
    "tg-update-id-bool": _tg({"update_id": True, "message": {"text": "hi", "chat": {"id": 1}}}),
    "tg-chat-id-dict": _tg({"update_id": 5, "message": {"text": "hi", "chat": {"id": {"a": 1}}}}),
    "tg-chat-id-odd": _tg({"update_id": 6, "message": {"text": "hi", "chat": {"id": "a b\n"}}}),
    "slack-array": _slack([]),
    "slack-channel-dict": _slack(_ev(channel={"id": "C1"})),
    "slack-ts-list": _slack(_ev(ts=[1])),
    "slack-ts-float": _slack(_ev(ts=1.5)),
    "wa-from-list": _wa(_wam(**{"from": ["1"]})),
    "wa-id-dict": _wa(_wam(id={"x": 1})),
    "wa-not-object": _wa(b"42"),
}
IGNORED = {  # well signed, the wrong shape where it does not matter: acknowledged, nothing enqueued
    "tg-message-list": _tg({"update_id": 1, "message": [1]}),
    "tg-chat-list": _tg({"update_id": 2, "message": {"text": "hi", "chat": [1]}}),
    "tg-text-list": _tg({"update_id": 3, "message": {"text": ["hi"], "chat": {"id": 1}}}),
    "slack-event-list": _slack({"type": "event_callback", "event": []}),
    "slack-text-dict": _slack(_ev(text={"a": 1})),
    "slack-type-dict": _slack({"type": {"a": 1}}),
    "wa-entry-dict": _wa({"entry": {"changes": 1}}),
    "wa-changes-str": _wa({"entry": [{"changes": "abc"}]}),
    "wa-messages-dict": _wa({"entry": [{"changes": [{"value": {"messages": {"a": 1}}}]}]}),
    "wa-text-str": _wa(_wam(text="hi")),
}


def test_malformed_signed_payloads_are_4xx_with_a_one_line_reason(web):
    before = web.queued()
    for name, (path, body, h) in MALFORMED.items():
        r = httpx.post(web.base + path, content=body, headers=_signed_now(path, body, h))
        reason = one_line_4xx(r, 400)
        assert reason, name
    for name, (path, body, h) in IGNORED.items():
        r = httpx.post(web.base + path, content=body, headers=_signed_now(path, body, h))
        assert r.status_code == 200 and r.json().get("ok") is True and not r.json().get("job") \
            and not r.json().get("jobs"), (name, r.text)
    assert web.queued() == before


def test_malformed_discord_interactions_are_4xx_or_an_ephemeral_answer(web):
    url = web.base + "/webhooks/discord"
    base = {"type": 2, "id": "1300000000000000001", "channel_id": "1200", "data": {
        "name": "ask", "options": [{"name": "prompt", "type": 3, "value": "hi"}]}}
    for payload in ({**base, "data": [1]}, {**base, "data": {"options": {"a": 1}}}, {**base, "channel_id": None,
                    "channel": [1]}, {**base, "data": {"name": ["x"], "options": []}}):
        body, h = discord(web, payload)
        r = httpx.post(url, content=body, headers=h)
        assert r.status_code == 200 and r.json()["data"]["flags"] == 64, r.text
    for payload in ({**base, "id": {"a": 1}}, {**base, "channel_id": ["x"]}, [1], 7):
        body, h = discord(web, payload)
        one_line_4xx(httpx.post(url, content=body, headers=h), 400)


def test_a_lone_surrogate_in_a_message_is_enqueued_not_a_503(web):
    body = b'{"update_id": 424242, "message": {"chat": {"id": 7}, "text": "hi \\ud800 there"}}'
    r = httpx.post(web.base + "/webhooks/telegram", content=body, headers=TG)
    assert r.status_code == 200, r.text
    (m,) = [m for m in web.queued() if m["id"] == r.json()["job"]]
    assert m["spec"]["message"] == "hi \ufffd there"


# -- no secret in the log, at trace level ------------------------------------------------------------------
def test_no_secret_in_the_log_at_any_level(web):
    q = {"hub.mode": "subscribe", "hub.verify_token": WA_VERIFY, "hub.challenge": "1158201444"}
    r = httpx.get(web.base + "/webhooks/whatsapp?" + urllib.parse.urlencode(q))
    assert r.status_code == 200 and r.text == "1158201444"
    body = json.dumps({"update_id": 99, "message": {"chat": {"id": 1}, "text": "x"}}).encode()
    assert httpx.post(web.base + "/webhooks/telegram", content=body, headers=TG).status_code == 200
    job = "turn_logcheck"
    receipts.create_job(web.r, job, kind="turn", target="outbox:x")
    events.publish(web.r, job, {"kind": "status", "status": "completed", "deliveries": 0})
    from workers.eventauth import events_token

    token = events_token(web.r, job)
    assert httpx.get(web.base + f"/turns/{job}/events?token={token}").status_code == 200
    log = web.log()
    assert "/webhooks/whatsapp?" in log and "ASGI" in log  # the request lines and the trace are there
    leaked = [s for s in (WA_VERIFY, TELEGRAM_SECRET, SLACK_SECRET, WA_SECRET, token) if s in log]
    assert not leaked, f"secrets in the web log: {len(leaked)}"


# -- the events stream: the turn's token, or nothing ---------------------------------------------------
def test_the_events_stream_needs_the_turns_token(web):
    from workers.eventauth import events_token

    job = "turn_authcheck"
    receipts.create_job(web.r, job, kind="turn", target="outbox:x")
    events.publish(web.r, job, {"kind": "status", "status": "started"})
    events.publish(web.r, job, {"kind": "status", "status": "no_reply", "deliveries": 0})
    url = web.base + f"/turns/{job}/events"
    assert "token" in one_line_4xx(httpx.get(url), 401)
    assert one_line_4xx(httpx.get(url + "?token=" + "0" * 32), 403)
    assert one_line_4xx(httpx.get(url + "?token=" + events_token(web.r, "turn_other")), 403)
    assert one_line_4xx(httpx.get(url, headers={"Authorization": "Bearer nope"}), 403)
    token = events_token(web.r, job)
    for r in (httpx.get(url + "?token=" + token), httpx.get(url, headers={"Authorization": f"Bearer {token}"})):
        assert r.status_code == 200 and r.text.count("event: status") == 2, r.text
    # deleting the key revokes every token given so far
    from tasks.ledger import keys

    web.r.delete(keys.events_key())
    assert one_line_4xx(httpx.get(url + "?token=" + token), 403)
    assert httpx.get(url + "?token=" + events_token(web.r, job)).status_code == 200
    # an unknown turn: its (valid) token gets a 404, no token a 401, a wrong one a 403
    assert one_line_4xx(httpx.get(web.base + "/turns/turn_nope/events?token=" + events_token(web.r, "turn_nope")), 404)
    assert one_line_4xx(httpx.get(web.base + "/turns/turn_nope/events"), 401)
    # the CLI gives the token with the turn, and shows it
    res = web.env.cli("turn", "outbox:tok", "hi", "--agent", "demo", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["events_token"] == events_token(web.r, out["job"])
    res = web.env.cli("status", out["job"])
    assert f"/turns/{out['job']}/events?token={out['events_token']}" in res.stdout, res.stdout
    assert json.loads(web.env.cli("status", out["job"], "--json").stdout)["events_token"] == out["events_token"]
