"""Phase events end to end: real Redis, a real worker, the web process served
by uvicorn on loopback, the real CLI. SSE and `courier watch` show exactly
the turn's stream; `Last-Event-ID` resumes skip nothing and repeat nothing;
webhooks verify signatures, drop retried duplicates and lead to delivered
replies; the task shows its activity as a custom Celery state; platforms get
typing and a throttled progress message while a turn runs."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import textwrap
import threading
import time
import urllib.parse

import httpx
import pytest

from adapters.platforms.outbox import read_log
from tasks.dispatch import chains
from tasks.ledger import events, keys, receipts
from tests.fixtures.services import wait_until
from tests.fixtures.webstack import AGENT_PRELUDE, TELEGRAM_SECRET, WA_SECRET, WA_VERIFY
from tests.fixtures.webstack import slack_headers as _slack_headers

# the `stack` fixture (worker, web processes, agents, fake platform servers): tests/fixtures/webstack.py

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


# -- SSE ------------------------------------------------------------------------------------
def sse(client: httpx.Client, url: str, *, last_event_id: str | None = None, limit: int | None = None,
        keepalives: list | None = None, into: list | None = None) -> list[tuple[str, dict]]:
    """Read an SSE stream: (id, data) per event (appended to `into` as they
    come); stops after `limit` events, or when the server ends the stream."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    got: list[tuple[str, dict]] = [] if into is None else into
    with client.stream("GET", url, headers=headers, timeout=httpx.Timeout(30.0)) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in resp.iter_lines():
            if line.startswith(":"):
                if keepalives is not None:
                    keepalives.append(line)
                continue
            if line:
                name, _, value = line.partition(":")
                fields[name] = value[1:] if value.startswith(" ") else value
                continue
            if "data" in fields:
                ev = json.loads(fields["data"])
                assert fields["event"] == ev["kind"]
                got.append((fields["id"], ev))
                if limit is not None and len(got) >= limit:
                    break
            fields = {}
    return got


def test_sse_shows_a_real_turn_and_ends_after_its_deliveries(stack):
    job = stack.turn("outbox:sse", "compute", "slow")
    with httpx.Client(base_url=stack.base) as c:
        got = sse(c, stack.events(job))
    full = stack.stream(job)
    assert got == full  # the same ids, the same events, in order
    kinds = [ev.get("status") or ev["kind"] for _, ev in got]
    assert kinds[:2] == ["started", "thinking"]
    terminal = [ev for _, ev in got if events.is_terminal(ev)]
    assert len(terminal) == 1 and terminal[0]["status"] == "completed" and terminal[0]["deliveries"] == 2
    starts = [ev for _, ev in got if ev["kind"] == "tool_start"]
    results = [ev for _, ev in got if ev["kind"] == "tool_result"]
    assert [e["activity"] for e in starts] == [f"$ step {i}" for i in range(8)]
    assert [e["tool_call_id"] for e in results] == [e["tool_call_id"] for e in starts]
    final = {ev["delivery_id"]: ev["state"] for _, ev in got if ev["kind"] == "delivery" and ev["state"] != "queued"}
    assert sorted(final.values()) == ["delivered", "delivered"]
    assert [r["kind"] for r in read_log(stack.env.outbox, "sse")] == ["text", "document"]


def test_sse_resume_with_last_event_id_skips_nothing_repeats_nothing(stack):
    job = stack.turn("outbox:resume", "resume me", "slow")
    with httpx.Client(base_url=stack.base) as c:
        # live: drop the connection mid-turn, resume from the last id seen, twice
        part1 = sse(c, stack.events(job), limit=4)
        part2 = sse(c, stack.events(job), last_event_id=part1[-1][0], limit=6)
        part3 = sse(c, stack.events(job), last_event_id=part2[-1][0])
        full = stack.stream(job)
        assert part1 + part2 + part3 == full
        assert len({eid for eid, _ in full}) == len(full)
        # after the end: resuming from any id gives exactly the rest
        for k in (0, len(full) // 2, len(full) - 2):
            assert sse(c, stack.events(job), last_event_id=full[k][0]) == full[k + 1:]
        # query parameter form (EventSource polyfills)
        assert sse(c, stack.events(job) + f"&last_event_id={full[3][0]}") == full[4:]
        # resuming a stream that is over: 204, the browser's EventSource stops reconnecting
        assert c.get(stack.events(job), headers={"Last-Event-ID": full[-1][0]}).status_code == 204


def test_sse_keepalive_while_waiting_then_ends(stack):
    """A turn nobody has started yet: keep-alive comments, then its events as they come."""
    job = "turn_handmade" + str(time.monotonic_ns())
    receipts.create_job(stack.r, job, kind="turn", target="outbox:none")
    keepalives: list[str] = []
    result: list = []

    def read():
        with httpx.Client(base_url=stack.base) as c:
            sse(c, stack.events(job), keepalives=keepalives, into=result)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    wait_until(lambda: len(keepalives) >= 2, timeout_s=10, what="two keep-alive comments")
    events.publish(stack.r, job, {"kind": "status", "status": "started"})
    events.publish(stack.r, job, {"kind": "delivery", "delivery_id": f"{job}.0", "state": "queued"})
    events.publish(stack.r, job, {"kind": "status", "status": "completed", "deliveries": 1})
    wait_until(lambda: len(result) == 3, timeout_s=10, what="three events")
    assert t.is_alive()  # a delivery is still open: the stream goes on
    events.publish(stack.r, job, {"kind": "delivery", "delivery_id": f"{job}.0", "state": "delivered"})
    t.join(10)
    assert not t.is_alive() and result == stack.stream(job)
    assert all(k == ": keep-alive" for k in keepalives)


def test_sse_errors_and_healthz(stack):
    with httpx.Client(base_url=stack.base) as c:
        h = c.get("/healthz").json()
        assert h["ok"] is True and h["redis"] == "ok" and h["turns_consumers"] >= 1  # the stack's worker
        assert c.get(stack.events("turn_nope")).status_code == 404
        job = stack.turn("outbox:x", "hi", "echo")
        assert c.get(stack.events(job), headers={"Last-Event-ID": "garbage"}).status_code == 400


@pytest.mark.parametrize("agent,status,reason,deliveries", [
    ("fail", "error", "agent exited with code 2", 1),
    ("quiet", "no_reply", "not for me", 0),
    ("sleepy", "error", "runtime_timeout", 1),
])
def test_exactly_one_terminal_event_and_a_short_error_message(stack, agent, status, reason, deliveries):
    chat = f"term_{agent}"
    job = stack.turn(f"outbox:{chat}", "go", agent)
    with httpx.Client(base_url=stack.base) as c:
        got = sse(c, stack.events(job))
    assert got == stack.stream(job)
    terminal = [ev for _, ev in got if events.is_terminal(ev)]
    assert len(terminal) == 1
    assert terminal[0]["status"] == status and terminal[0]["reason"] == reason
    assert terminal[0]["deliveries"] == deliveries
    log = read_log(stack.env.outbox, chat)
    assert len(log) == deliveries
    if deliveries:
        assert log[0]["text"] == f"Sorry, that did not work ({reason})."
        assert "secret stack trace" not in log[0]["text"]


# -- courier watch ----------------------------------------------------------------------------
def test_watch_renders_live_and_matches_the_stream(stack):
    job = stack.turn("outbox:watch", "watch me", "slow")
    res = stack.env.cli("watch", job, "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [(d.pop("id"), d) for d in lines] == stack.stream(job)
    res = stack.env.cli("watch", job, "--timeout", "60")  # a finished turn replays, then ends
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for expect in ("● started", "● thinking planning", "→ $ step 0", "✓ $ step 7", "⇢ delivered",
                   f"{job}: completed · 8 tool calls · 2 deliveries"):
        assert expect in out, out
    bad = stack.turn("outbox:watchfail", "x", "fail")
    res = stack.env.cli("watch", bad, "--timeout", "60")
    assert res.returncode == 1 and "● error agent exited with code 2" in res.stdout
    res = stack.env.cli("watch", "turn_missing")
    assert res.returncode == 2 and "no turn or send" in res.stderr


def test_turn_wait_shows_live_phases_and_delivers_the_demo_files(stack):
    res = stack.env.cli("turn", "outbox:me", "make a chart of x^2", "--agent", "demo", "--wait", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    for expect in ("● started", "● thinking", "→ writing", "chart.png", "⇢ delivered", "completed"):
        assert expect in res.stdout, res.stdout
    assert sorted(r.get("name", "") for r in read_log(stack.env.outbox, "me")) == ["", "chart.png", "report.csv"]


@pytest.mark.parametrize("agent,status", [("quiet", "no_reply"), ("empty", None)])
def test_turn_wait_ends_when_the_turn_ends_without_a_reply(stack, agent, status):
    """No reply (declined) or an empty one: `--wait` ends as soon as the turn
    is over, exit 0 (it used to wait for deliveries that never come: the
    whole --timeout, then exit 4)."""
    t0 = time.monotonic()
    res = stack.env.cli("turn", f"outbox:noreply_{agent}", "go", "--agent", agent, "--wait", "--timeout", "40",
                        "--json", timeout_s=60)
    took = time.monotonic() - t0
    assert res.returncode == 0 and took < 20, (res.returncode, took, res.stderr)
    out = json.loads(res.stdout)
    job = out["job"]
    assert out["done"] is True and out["deliveries"] == []
    terminal = [ev for _, ev in stack.stream(job) if events.is_terminal(ev)]
    assert terminal[0]["status"] == (status or terminal[0]["status"]) and terminal[0]["deliveries"] == 0
    res = stack.env.cli("turn", f"outbox:noreply_{agent}", "go", "--agent", agent, "--wait", "--timeout", "40",
                        timeout_s=60)
    assert res.returncode == 0, res.stderr
    assert read_log(stack.env.outbox, f"noreply_{agent}") == []


def test_agent_text_is_never_markup_and_never_carries_control_characters(stack):
    """`[/]` in the agent's text, tool arguments, a file name and a failed
    path's reason: `turn --wait` and `status` print them as they are (they
    used to crash with rich's MarkupError); a NUL or an escape sequence never
    reaches the chat."""
    res = stack.env.cli("turn", "outbox:markup", "go", "--agent", "markup", "--wait", "--timeout", "60")
    assert "Traceback" not in res.stderr and "MarkupError" not in res.stderr, res.stderr
    assert res.returncode == 1, res.stdout + res.stderr  # the MEDIA path that does not exist failed
    job = res.stdout.split()[1]
    assert "$ echo [/] [bold]" in res.stdout and "out[bold]x.txt" in res.stdout, res.stdout
    rows = receipts.job_deliveries(stack.r, job)
    assert [(d["type"], d["state"]) for d in rows] == [("text", "delivered"), ("file", "delivered"),
                                                      ("file", "failed")]
    assert "[/i]" in rows[2]["reason"]
    log = read_log(stack.env.outbox, "markup")
    assert log[0]["text"] == "done [/] [red]xy[0m" and log[1]["name"] == "out[bold]x.txt"
    import subprocess

    res = subprocess.run([sys.executable, "-m", "workers.cli", "status", job], capture_output=True, text=True,
                         env={**stack.env.env, "COLUMNS": "600"}, timeout=60)  # wide: no folded cells
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "out[bold]x.txt" in res.stdout and "/nonexistent[/i]/gone.png" in res.stdout, res.stdout


def test_an_error_text_with_brackets_is_printed_as_it_is(stack, tmp_path):
    import subprocess

    f = tmp_path / "n.txt"
    f.write_text("note")
    res = subprocess.run([sys.executable, "-m", "workers.cli", "send", "outbox:x", str(f)], capture_output=True,
                         text=True, env={**stack.env.env, "COURIER_STORAGE_URL": "s3:/bucket"}, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.strip() == "error: COURIER_STORAGE_URL: storage URL must be s3://bucket[/prefix], " \
                                 "got 's3:/bucket'", res.stderr


def test_watch_a_send_job(stack, tmp_path):
    f = tmp_path / "n.txt"
    f.write_text("note")
    res = stack.env.cli("send", "outbox:sendwatch", str(f), "--json")
    job = json.loads(res.stdout)["job"]
    res = stack.env.cli("watch", job, "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    assert [json.loads(x)["state"] for x in res.stdout.splitlines()] == ["delivered"]


# -- Celery custom state (result backend and Flower's event stream) --------------------------------
def test_progress_state_in_result_backend_and_task_events(stack, tmp_path):
    """What Flower reads: the custom PROGRESS state with the activity, from the
    result backend (AsyncResult) and from the workers' task events."""
    from celery import Celery
    from celery.events.state import State

    url = stack.env.env["COURIER_REDIS_URL"]
    app = Celery(broker=url, backend=url)
    state = State()
    seen: list[dict] = []
    receivers: list = []

    def on_event(ev):
        state.event(ev)
        if ev.get("type") == "task-progress":
            seen.append(ev)

    def capture():
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"*": on_event})
            receivers.append(recv)
            recv.capture(limit=None, timeout=None, wakeup=True)

    threading.Thread(target=capture, daemon=True).start()
    # the wake-up makes the workers send a heartbeat: once it arrives, events flow to us
    wait_until(lambda: len(state.workers) > 0, timeout_s=20, what="a worker heartbeat")
    gate = stack.env.tmp / "gates" / "seen-running"
    job = stack.turn("outbox:flower", f"hold {gate}", "slow")
    res = app.AsyncResult(job)
    # the agent holds its turn open until the gate exists: PROGRESS is read while it runs
    info = wait_until(lambda: res.state == "PROGRESS" and res.info, timeout_s=30, what="PROGRESS in the backend")
    gate.touch()
    assert info["job"] == job and info["activity"]
    stack.wait_over(job)
    assert res.get(timeout=30)["state"] == "replied"
    wait_until(lambda: job in state.tasks and state.tasks[job].state == "SUCCESS", timeout_s=30,
               what="the task-succeeded event")
    receivers[0].should_stop = True
    acts = [e["activity"] for e in seen if e["uuid"] == job]
    assert "planning" in acts and "$ step 0" in acts and "$ step 7 (tool_complete)" in acts
    assert all(isinstance(a, str) and len(a) <= 80 for a in acts)


# -- webhooks -----------------------------------------------------------------------------------
def _delivered(stack, chat: str, text: str):
    return wait_until(lambda: any(r.get("text") == text for r in read_log(stack.env.outbox, chat)),
                      timeout_s=30, what=f"{text!r} in outbox:{chat}")


def test_telegram_webhook(stack):
    url = stack.base + "/webhooks/telegram"
    update = {"update_id": 9001, "message": {"message_id": 1, "chat": {"id": -1004242, "type": "group"},
                                              "text": "hello from telegram"}}
    before = stack.jobs()
    for bad in ({}, {"X-Telegram-Bot-Api-Secret-Token": "wrong"},
                {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET[:-1]}):
        assert httpx.post(url, json=update, headers=bad).status_code == 401
    assert stack.jobs() == before
    good = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
    r1 = httpx.post(url, json=update, headers=good)
    assert r1.status_code == 200, r1.text
    job = r1.json()["job"]
    rec = receipts.get_job(stack.r, job)
    assert rec["origin"] == "telegram:-1004242" and rec["target"] == "outbox:telegram_-1004242"
    assert rec["agent"] == "echo" and rec["kind"] == "turn"
    # Telegram retries the same update: dropped
    assert httpx.post(url, json=update, headers=good).json() == {"ok": True, "duplicate": True}
    _delivered(stack, "telegram_-1004242", "echo: hello from telegram")
    assert stack.jobs() == before | {job}
    # a non-text update is acknowledged and ignored
    sticker = {"update_id": 9002, "message": {"message_id": 2, "chat": {"id": 1}, "sticker": {}}}
    assert httpx.post(url, json=sticker, headers=good).json()["ignored"]


def test_telegram_webhook_turn_shows_native_activity_and_replies_in_the_chat(stack):
    """No override: a real worker, the real Telegram adapter against a local Bot API server."""
    tg = stack.telegram
    # the agent stays in its tool until the chat shows that activity (however slow the machine)
    gate = stack.env.tmp / "gates" / "gate-activity-seen"
    text = f"gated {gate}"
    update = {"update_id": 77001, "message": {"message_id": 5, "chat": {"id": 5151, "type": "private"},
                                               "text": text}}
    r1 = httpx.post(stack.direct + "/webhooks/telegram", json=update,
                    headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET})
    job = r1.json()["job"]
    rec = receipts.get_job(stack.r, job)
    assert rec["target"] == rec["origin"] == "telegram:5151"
    wait_until(lambda: any(c.method == "sendMessage" and c.text == "reading message.txt"
                           for c in tg.calls_for(chat="5151", ok=True)), timeout_s=60, what="the activity shown")
    gate.touch()
    stack.wait_over(job)
    calls = tg.calls_for(chat="5151", ok=True)
    assert any(c.method == "sendChatAction" and c.fields.get("action") == "typing" for c in calls)
    progress = [c for c in calls if c.method == "sendMessage" and c.text == "reading message.txt"]
    assert len(progress) == 1
    pid = str(progress[0].result["message_id"])
    wait_until(lambda: [c.fields.get("message_id") for c in tg.calls_for("deleteMessage", chat="5151")] == [pid],
               timeout_s=10, what="the progress message removed")
    replies = [c for c in tg.calls_for("sendMessage", chat="5151") if c.text == f"echo: {text}"]
    assert len(replies) == 1 and replies[0].t > progress[0].t
    # the outbox records nothing for activity (nor for this chat)
    assert read_log(stack.env.outbox, "5151") == []


def test_slack_webhook(stack):
    url = stack.base + "/webhooks/slack"
    challenge = json.dumps({"type": "url_verification", "challenge": "c-123", "token": "x"}).encode()
    assert httpx.post(url, content=challenge, headers=_slack_headers(challenge)).json() == {"challenge": "c-123"}
    assert httpx.post(url, content=challenge, headers=_slack_headers(challenge, secret="nope")).status_code == 401
    ev = json.dumps({"type": "event_callback", "event_id": "Ev0001", "team_id": "T1",
                     "event": {"type": "app_mention", "user": "U1", "text": "<@UBOT> hello slack",
                               "channel": "C0123", "ts": "1700000000.000100"}}).encode()
    before = stack.jobs()
    stale = int(time.time()) - 600
    assert httpx.post(url, content=ev, headers=_slack_headers(ev, ts=stale)).status_code == 401
    tampered = ev.replace(b"hello", b"HELLO")
    assert httpx.post(url, content=tampered, headers=_slack_headers(ev)).status_code == 401
    assert stack.jobs() == before
    r1 = httpx.post(url, content=ev, headers=_slack_headers(ev))
    job = r1.json()["job"]
    assert receipts.get_job(stack.r, job)["origin"] == "slack:C0123"
    retry = httpx.post(url, content=ev, headers={**_slack_headers(ev), "X-Slack-Retry-Num": "1",
                                                  "X-Slack-Retry-Reason": "http_timeout"})
    assert retry.json() == {"ok": True, "duplicate": True} and retry.headers["x-slack-no-retry"] == "1"
    # the same mention as a `message` event (an app subscribed to both) is the same turn
    also = json.dumps({"type": "event_callback", "event_id": "Ev0003", "team_id": "T1",
                       "event": {"type": "message", "user": "U1", "text": "<@UBOT> hello slack",
                                 "channel": "C0123", "ts": "1700000000.000100"}}).encode()
    assert httpx.post(url, content=also, headers=_slack_headers(also)).json() == {"ok": True, "duplicate": True}
    bot = json.dumps({"type": "event_callback", "event_id": "Ev0002",
                      "event": {"type": "message", "bot_id": "B1", "text": "mine", "channel": "C0123"}}).encode()
    assert httpx.post(url, content=bot, headers=_slack_headers(bot)).json()["ignored"]
    _delivered(stack, "slack_C0123", "echo: hello slack")
    assert stack.jobs() == before | {job}


def test_discord_interactions_webhook(stack):
    url = stack.base + "/webhooks/discord"

    def signed(payload: dict, key=stack.discord_key) -> tuple[bytes, dict]:
        body = json.dumps(payload).encode()
        ts = str(int(time.time()))
        sig = key.sign(ts.encode() + body).signature.hex()
        return body, {"X-Signature-Ed25519": sig, "X-Signature-Timestamp": ts, "Content-Type": "application/json"}

    body, h = signed({"type": 1, "id": "1"})
    assert httpx.post(url, content=body, headers=h).json() == {"type": 1}
    from nacl.signing import SigningKey

    body, h = signed({"type": 1, "id": "1"}, key=SigningKey.generate())
    assert httpx.post(url, content=body, headers=h).status_code == 401
    assert httpx.post(url, content=body, headers={**h, "X-Signature-Ed25519": "zz"}).status_code == 401
    before = stack.jobs()
    cmd = {"type": 2, "id": "1122334455", "channel_id": "998877", "token": "itoken",
           "data": {"name": "ask", "options": [{"name": "prompt", "type": 3, "value": "hello discord"}]}}
    body, h = signed(cmd)
    bad_h = {**h, "X-Signature-Timestamp": str(int(h["X-Signature-Timestamp"]) + 1)}
    assert httpx.post(url, content=body, headers=bad_h).status_code == 401
    assert stack.jobs() == before
    r1 = httpx.post(url, content=body, headers=h)
    assert r1.json()["type"] == 4 and "hello discord" in r1.json()["data"]["content"]
    new = stack.jobs() - before
    assert len(new) == 1
    (job,) = new
    assert receipts.get_job(stack.r, job)["origin"] == "discord:998877"
    httpx.post(url, content=body, headers=h)  # a replayed interaction: dropped
    _delivered(stack, "discord_998877", "echo: hello discord")
    assert stack.jobs() == before | {job}


def test_whatsapp_webhook(stack):
    url = stack.base + "/webhooks/whatsapp"
    q = {"hub.mode": "subscribe", "hub.verify_token": WA_VERIFY, "hub.challenge": "1158201444"}
    r = httpx.get(url + "?" + urllib.parse.urlencode(q))
    assert r.status_code == 200 and r.text == "1158201444"
    assert httpx.get(url + "?" + urllib.parse.urlencode({**q, "hub.verify_token": "no"})).status_code == 403

    def payload(mid: str, text: str) -> bytes:
        return json.dumps({"object": "whatsapp_business_account", "entry": [{"id": "WABA", "changes": [{
            "field": "messages", "value": {
                "messaging_product": "whatsapp", "metadata": {"phone_number_id": "PNID"},
                "contacts": [{"wa_id": "15551234567"}],
                "messages": [{"from": "15551234567", "id": mid, "timestamp": "1700000000", "type": "text",
                              "text": {"body": text}}],
                "statuses": []}}]}]}).encode()

    def sig(body: bytes, secret: str = WA_SECRET) -> dict:
        return {"X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
                "Content-Type": "application/json"}

    body = payload("wamid.ABC", "hello whatsapp")
    before = stack.jobs()
    assert httpx.post(url, content=body, headers=sig(body, "wrong")).status_code == 401
    assert httpx.post(url, content=body, headers={"Content-Type": "application/json"}).status_code == 401
    assert stack.jobs() == before
    r1 = httpx.post(url, content=body, headers=sig(body)).json()
    assert len(r1["jobs"]) == 1 and r1["duplicates"] == 0
    assert receipts.get_job(stack.r, r1["jobs"][0])["origin"] == "whatsapp:+15551234567"
    assert httpx.post(url, content=body, headers=sig(body)).json() == {"ok": True, "jobs": [], "duplicates": 1}
    _delivered(stack, "whatsapp_+15551234567", "echo: hello whatsapp")
    assert stack.jobs() == before | set(r1["jobs"])


def test_webhook_without_its_secret_is_refused(stack, tmp_path):
    """A second web app without secrets, in-process: 404 for every platform, nothing enqueued."""
    import asyncio

    from workers.settings import Settings
    from workers.web import create_app

    s = Settings(redis_url=stack.env.env["COURIER_REDIS_URL"], data_dir=tmp_path)
    before = stack.jobs()

    async def post_all() -> list[int]:
        transport = httpx.ASGITransport(app=create_app(s))
        async with httpx.AsyncClient(transport=transport, base_url="http://courier") as c:
            return [(await c.post(f"/webhooks/{p}", content=b"{}")).status_code
                    for p in ("telegram", "slack", "discord", "whatsapp")]

    assert asyncio.run(post_all()) == [404] * 4
    assert stack.jobs() == before


# -- native activity on platforms -------------------------------------------------------------------
class RecordingPlatform:
    """A platform that shows activity and records every call (with its time)."""

    def __new__(cls, fail: set[str] | None = None):
        from adapters.errors import RateLimited, Transient
        from adapters.platforms.base import Platform
        from adapters.platforms.outbox import OutboxPlatform

        class _P(Platform):
            name = "rec"
            limits = OutboxPlatform.limits

            def __init__(self):
                self.calls: list[tuple[float, str, tuple]] = []
                self.fail = fail or set()

            def _rec(self, name, *args):
                self.calls.append((time.monotonic(), name, args))
                if name in self.fail:
                    if name == "edit_progress":
                        raise RateLimited(0.5)
                    raise Transient(f"{name} is down")

            def send_text(self, chat, text, *, delivery_id):
                raise AssertionError("not in these tests")

            def send_file(self, *a, **k):
                raise AssertionError("not in these tests")

            def typing(self, chat):
                self._rec("typing", chat)

            def start_progress(self, chat, text):
                self._rec("start_progress", chat, text)
                return "m1"

            def edit_progress(self, chat, message_id, text):
                self._rec("edit_progress", chat, message_id, text)

            def end_progress(self, chat, message_id):
                self._rec("end_progress", chat, message_id)

        return _P()


def _activity_turn(stack, tmp_path, platform, steps: int = 10):
    """run_turn (plain code, real Redis, a real bridge agent) with the task's activity glue."""
    from tasks.turn.activity import TurnActivity
    from tasks.runtime import Context
    from tasks.turn.turn import finish, run_turn
    from workers.settings import AgentSpec

    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_PRELUDE + textwrap.dedent(f"""
        for i in range({steps}):
            ev(kind="tool_start", tool_name="terminal", args={{"command": f"step {{i}}"}})
            time.sleep(0.1)
            ev(kind="tool_result", tool_name="terminal")
        ev(kind="status", status="no_reply")
        """))
    spec = AgentSpec(command=[sys.executable, str(agent)], timeout_s=30)
    ctx = Context(redis=stack.r, store=None, platform=lambda name: platform, sandbox=None,  # type: ignore[arg-type]
                  agent=lambda name: spec, default_sandbox_dir=str(tmp_path / "sb"),
                  typing_interval_s=0.2, progress_edit_interval_s=0.3)
    job = "turn_act" + str(time.monotonic_ns())
    receipts.create_job(stack.r, job, kind="turn", target="rec:chat1")
    t0 = time.monotonic()
    with TurnActivity(ctx, "rec:chat1", job) as act:
        outcome = run_turn(ctx, {"job": job, "target": "rec:chat1", "message": "x", "agent": "a"},
                           on_activity=act.on_event)
        out = finish(ctx, outcome, chains.enqueue, on_activity=act.on_event)  # as agent_turn does
    return out, t0, time.monotonic(), job


def test_native_typing_and_throttled_progress_message(stack, tmp_path):
    p = RecordingPlatform()
    out, t0, t1, job = _activity_turn(stack, tmp_path, p)
    assert out["state"] == "no_reply"
    calls = p.calls
    typing = [t for t, n, _ in calls if n == "typing"]
    assert len(typing) >= 3 and all(b - a >= 0.15 for a, b in zip(typing, typing[1:]))
    assert [n for _, n, _ in calls if n == "start_progress"] == ["start_progress"]
    shown = [(t, a[-1]) for t, n, a in calls if n in ("start_progress", "edit_progress")]
    assert shown[0][1] == "$ step 0"
    assert all(b[0] - a[0] >= 0.29 for a, b in zip(shown, shown[1:]))  # <= 1 edit per interval
    assert 2 <= len(shown) < 10  # throttled: fewer edits than activities
    assert [x[1] for x in shown] == sorted({x[1] for x in shown}, key=lambda s: int(s.split()[-1]))
    ends = [i for i, (_, n, _) in enumerate(calls) if n == "end_progress"]
    assert len(ends) == 1 and ends[0] == len(calls) - 1 and calls[-1][2] == ("chat1", "m1")
    assert not stack.r.exists(keys.progress_message(job))


def test_activity_errors_never_fail_the_turn(stack, tmp_path, caplog):
    p = RecordingPlatform(fail={"typing", "edit_progress", "end_progress"})
    out, *_ = _activity_turn(stack, tmp_path, p, steps=8)
    assert out["state"] == "no_reply"
    names = [n for _, n, _ in p.calls]
    assert names.count("typing") >= 2 and names.count("end_progress") == 1
    assert names.count("edit_progress") <= 2  # rate limited: paused for its retry_after
    assert any("typing failed" in r.getMessage() for r in caplog.records)
