"""The operator's console: `courier --version`, text-only sends, `deliveries`,
`queues`, and the `courier.delivery.send` task applied from real Flower
(async-apply with JSON kwargs), all against a real Redis and worker."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.fixtures.services import wait_until

pytestmark = pytest.mark.slow



def _final(env, job: str, timeout_s: float = 60) -> dict:
    def done():
        res = env.cli("status", job, "--json")
        if not res.stdout.strip():
            return None
        got = json.loads(res.stdout)
        rows = got["deliveries"]
        return got if rows and all(r["state"] in ("delivered", "failed") for r in rows) else None

    return wait_until(done, timeout_s=timeout_s, what=f"{job}'s deliveries to be final")


def test_version_and_bad_input_exit_2(courier_env):
    env = courier_env()
    res = env.cli("--version")
    assert res.returncode == 0 and re.fullmatch(r"courier \S+\n", res.stdout)
    # shell completion (courier --install-completion). The shell is named, not detected:
    # typer detects it from the parent processes, which a test runner's are not
    env.env["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"] = "1"
    res = env.cli("--show-completion", "bash")
    del env.env["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"]
    assert res.returncode == 0 and "complete" in res.stdout
    res = env.cli("send", "outbox:me")
    assert res.returncode == 2 and "nothing to send" in res.stderr
    res = env.cli("deliveries", "--chat", "nochat")
    assert res.returncode == 2 and "--chat" in res.stderr
    res = env.cli("deliveries", "--since", "yesterday")
    assert res.returncode == 2 and "--since" in res.stderr


def test_text_send_deliveries_and_queues(courier_env, tmp_path):
    env = courier_env()
    gone = env.sandbox / "gone.bin"
    gone.write_bytes(b"b" * 5000)
    res = env.cli("send", "outbox:other", f"local://{gone}", "--text", "with a file", "--json")
    assert res.returncode == 0, res.stderr
    failed_job = json.loads(res.stdout)["job"]
    gone.unlink()  # gone before any worker looks at it: its extraction fails for good
    env.start_worker()
    assert [d["state"] for d in _final(env, failed_job)["deliveries"]] == ["delivered", "failed"]
    res = env.cli("send", "outbox:ops", "--text", "hello [bold]operators[/bold]", "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    text_job = json.loads(res.stdout)["job"]
    assert [d["kind"] for d in json.loads(res.stdout)["deliveries"]] == ["text"]
    arrived = [p for p in (env.outbox / "ops").iterdir() if not p.name.startswith(".")]
    assert any("hello [bold]operators[/bold]" in p.read_text(errors="replace") for p in arrived if p.is_file())

    rows = json.loads(env.cli("deliveries", "--json").stdout)
    assert [r["job"] for r in rows[:3]] == [text_job, failed_job, failed_job]  # newest job first, in order
    assert all("spec" not in r for r in rows) and "hello" not in json.dumps(rows)  # no chat text
    failed = json.loads(env.cli("deliveries", "--failed", "--json").stdout)
    assert [r["id"] for r in failed] == [f"{failed_job}.1"] and "gone.bin" in failed[0]["reason"]
    mine = json.loads(env.cli("deliveries", "--chat", "outbox:ops", "--since", "1h", "--json").stdout)
    assert {r["job"] for r in mine} == {text_job}
    # piped: a row is one line, ids and reasons whole, whatever the width
    table = env.cli("deliveries", "--failed")
    assert table.returncode == 0
    line = next(ln for ln in table.stdout.splitlines() if f"{failed_job}.1" in ln)
    assert "outbox:other" in line and "gone.bin" in line

    # a docker file pinned to a host nobody serves waits in sandbox.gpu7: visible, with no consumer
    res = env.cli("send", "outbox:m", "docker://ctr1/workspace/a.png?host=gpu7")
    assert res.returncode == 0, res.stderr

    def listed():
        got = json.loads(env.cli("queues", "--json").stdout)
        q = {row["queue"]: row for row in got["queues"]}
        return got if "sandbox.gpu7" in q and q["delivery"]["consumers"] == 1 else None

    got = wait_until(listed, timeout_s=30, what="queues with the worker's heartbeat")
    q = {row["queue"]: row for row in got["queues"]}
    assert q["sandbox.gpu7"]["depth"] == 1 and q["sandbox.gpu7"]["consumers"] == 0
    assert q["sandbox.gpu7"]["oldest_age_s"] is not None
    assert {q[n]["consumers"] for n in ("turns", "sandbox", "delivery", "janitor")} == {1}
    assert got["ledger_pending"]["extract"] == 1
    table = env.cli("queues").stdout
    assert re.search(r"sandbox\.gpu7\s+1\s+\S+\s+0", table), table
    assert re.search(r"extract\s+1", table), table


def test_send_task_from_flower_goes_through_receipts(courier_env, tmp_path):
    """Flower's async-apply with the documented JSON kwargs: one task for a
    text and files (a sandbox URI and a plain absolute path), a job that
    `courier status` knows, and bad input fails without enqueuing anything."""
    from adapters.errors import ConfigError
    from tasks.ops import send as send_mod
    from workers.wiring import build_context

    env = courier_env()
    env.start_worker()
    a = env.sandbox / "a.csv"
    a.write_text("x,y\n1,2\n")
    b = env.sandbox / "b.txt"
    b.write_text("hello")
    with env.flower("--basic_auth=ops:pw") as base:
        kwargs = {"target": "outbox:fl", "text": "nightly", "files": [f"local://{a}", str(b)], "caption": "the csv"}
        r = httpx.post(f"{base}/api/task/async-apply/courier.delivery.send",
                       json={"kwargs": kwargs}, auth=("ops", "pw"), timeout=30)
        assert r.status_code == 200, r.text
        job = "snd_" + r.json()["task-id"].replace("-", "")
        got = _final(env, job)
        assert got["job"]["kind"] == "send" and got["job"]["target"] == "outbox:fl"
        assert [(d["kind"], d["state"]) for d in got["deliveries"]] == [
            ("text", "delivered"), ("document", "delivered"), ("document", "delivered")]
        names = sorted(p.name for p in (env.outbox / "fl").iterdir() if not p.name.startswith("."))
        assert any(n.endswith("a.csv") for n in names) and any(n.endswith("b.txt") for n in names)
    ctx = build_context(env.settings())
    big = env.sandbox / "big.bin"
    with open(big, "wb") as f:  # sparse: over the 50 MB extraction cap
        f.truncate(60 * 1000 * 1000)
    for bad, why in (({"target": "outbox:x", "files": ["docker://c/etc/shadow"]}, "never readable"),
                     ({"target": "outbox:x", "files": [str(env.sandbox / "nope.txt")]}, "nope.txt"),
                     ({"target": "outbox:x", "files": [str(big)]}, "COURIER_MAX_FILE_BYTES"),
                     ({"target": "nosuch:1", "text": "x"}, "nosuch"),
                     ({"target": "outbox:x"}, "nothing to send"),
                     ({"target": "outbox:x", "files": "local:///tmp/a"}, "files must be a list"),
                     ({"target": "outbox:x", "files": ["relative/p"]}, "absolute path"),
                     ({"target": "outbox:x", "files": ["ftp://h/a"]}, "unknown sandbox")):
        with pytest.raises(ConfigError, match=why):
            send_mod.send(ctx, **bad)
    assert json.loads(env.cli("deliveries", "--chat", "outbox:x", "--json").stdout) == []


def test_precheck_refuses_what_would_fail_later_and_bad_json_settings(courier_env, tmp_path, redis_client):
    """A denylisted docker://…/etc/shadow was accepted with exit 0 and failed
    later; bad JSON in COURIER_AGENTS was a raw traceback. Both exit 2 now,
    nothing enqueued."""
    env = courier_env()
    before = set(redis_client.scan_iter("courier:*"))
    for uri in ("docker://ctr/etc/shadow", "ssh://u@h/proc/self/environ", "docker://ctr/workspace/../etc/passwd"):
        res = env.cli("send", "outbox:x", uri)
        assert res.returncode == 2 and ("never readable" in res.stderr or "'..'" in res.stderr), (uri, res.stderr)
    assert set(redis_client.scan_iter("courier:*")) == before  # nothing registered
    assert redis_client.llen("sandbox") == 0
    small = tmp_path / "ok.png"
    small.write_bytes(b"x" * 100)
    assert env.cli("send", "outbox:x", str(small), "docker://ctr/workspace/a.png").returncode == 0
    bad = courier_env(COURIER_AGENTS="{bad")
    res = bad.cli("send", "outbox:x", str(small))
    assert res.returncode == 2 and "bad setting COURIER_AGENTS: not valid JSON" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_send_jobs_state_follows_its_receipts(courier_env, tmp_path):
    env = courier_env()
    f = tmp_path / "a.txt"
    f.write_text("a")
    job = json.loads(env.cli("send", "outbox:st", str(f), "--json").stdout)["job"]
    assert json.loads(env.cli("status", job, "--json").stdout)["job"]["state"] == "queued"  # no worker yet
    env.start_worker()
    got = _final(env, job)
    assert got["job"]["state"] == "delivered"
    assert f"send {job} → outbox:st: delivered" in env.cli("status", job).stdout


def test_webhook_set_calls_telegram_setwebhook_with_the_secret(courier_env):
    """`courier webhook set telegram URL` calls setWebhook (a local HTTP server
    stands in for the Bot API and records the call) with the secret token;
    the other platforms get the steps their console needs; nothing prints the bot token."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls: list[tuple[str, dict]] = []
    answer = {"ok": True, "result": True, "description": "Webhook was set"}

    class BotApi(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((self.path, body))
            data = json.dumps(answer).encode()
            self.send_response(200 if answer["ok"] else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), BotApi)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = courier_env(TELEGRAM_BOT_TOKEN="999:SECRET-BOT-TOKEN", TELEGRAM_WEBHOOK_SECRET="hook-secret",
                          COURIER_TELEGRAM_BASE_URL=f"http://127.0.0.1:{srv.server_port}")
        res = env.cli("webhook", "set", "telegram", "https://bot.example.com/", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == {"platform": "telegram", "url": "https://bot.example.com/webhooks/telegram",
                                          "done": True}
        (path, body), = calls
        assert path == "/bot999:SECRET-BOT-TOKEN/setWebhook"
        assert body["url"] == "https://bot.example.com/webhooks/telegram" and body["secret_token"] == "hook-secret"
        answer.update(ok=False, description="Bad Request: bad webhook: HTTPS url must be provided for webhook")
        res = env.cli("webhook", "set", "telegram", "https://bot.example.com")
        assert res.returncode == 1 and "HTTPS url must be provided" in res.stderr
        assert "SECRET-BOT-TOKEN" not in res.stdout + res.stderr
        for bad in ("http://bot.example.com", "https://bot.example.com/?x=1", "bot.example.com"):
            res = env.cli("webhook", "set", "telegram", bad)
            assert res.returncode == 2 and "https" in res.stderr, bad
        res = env.cli("webhook", "set", "whatsapp", "https://bot.example.com", "--json")
        got = json.loads(res.stdout)
        assert got["done"] is False and "https://bot.example.com/webhooks/whatsapp" in got["steps"]
        assert "WHATSAPP_VERIFY_TOKEN" in got["steps"]
        nosecret = courier_env(TELEGRAM_BOT_TOKEN="999:SECRET-BOT-TOKEN")
        res = nosecret.cli("webhook", "set", "telegram", "https://bot.example.com")
        assert res.returncode == 2 and "TELEGRAM_WEBHOOK_SECRET" in res.stderr
    finally:
        srv.shutdown()
    srv2 = ThreadingHTTPServer(("127.0.0.1", 0), BotApi)
    port = srv2.server_port
    srv2.server_close()  # nothing listens there now
    down = courier_env(TELEGRAM_BOT_TOKEN="999:SECRET-BOT-TOKEN", TELEGRAM_WEBHOOK_SECRET="s",
                       COURIER_TELEGRAM_BASE_URL=f"http://127.0.0.1:{port}")
    res = down.cli("webhook", "set", "telegram", "https://bot.example.com")
    assert res.returncode == 3 and "SECRET-BOT-TOKEN" not in res.stdout + res.stderr
