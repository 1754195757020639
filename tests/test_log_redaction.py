"""No secret, and no chat text, in any log line of a worker at `--loglevel=DEBUG`.

One real worker (prefork, every queue) at DEBUG against a password-protected
Redis, S3 storage (SeaweedFS) and the four platforms' local API servers
(tests/fixtures/fake_*.py), with every secret setting set to a value of its
own. A turn (a bridge agent that replies with a text and a file) goes to each
platform; the SDKs log what they log at DEBUG (python-telegram-bot's request
parameters, httpx's request URL with the Bot API token, discord.py's
payloads, slack_sdk's bodies, botocore's requests), Celery its task
messages; the captured log is grepped for every secret and every chat text:
none may appear.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from tests.fixtures.fake_discord import FakeDiscord
from tests.fixtures.fake_slack import FakeSlack
from tests.fixtures.fake_telegram import FakeTelegram, wait_job
from tests.fixtures.fake_whatsapp import FakeWhatsApp
from tests.fixtures.redis_server import RedisServer
from tests.fixtures.s3_server import SeaweedS3
from tests.fixtures.workers import ROOT, CourierEnv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: replies with the text in its first argument's file and a MEDIA tag for a file it writes
AGENT = """import os, sys
said = sys.stdin.read()
text = open(sys.argv[1], encoding="utf-8").read()
with open("notes.txt", "w") as f:
    f.write(text)
print(text + "\\nMEDIA:" + os.path.join(os.getcwd(), "notes.txt"))
"""


def _secret(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(10)}"


class _PasswordRedis(RedisServer):
    def __init__(self, tmp: Path, password: str) -> None:
        super().__init__(tmp, extra_args=("--requirepass", password))
        self.password = password

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"


def test_a_debug_worker_logs_no_secret_and_no_chat_text(tmp_path):
    tokens = {"telegram": f"{secrets.randbelow(10**9)}:{_secret('tg')}", "discord": _secret("dc"),
              "slack": "xoxb-" + _secret("sl"), "whatsapp": "EAA" + _secret("wa")}
    fakes = {"telegram": FakeTelegram(tokens["telegram"]).start(), "discord": FakeDiscord(tokens["discord"]).start(),
             "slack": FakeSlack(tokens["slack"]).start(), "whatsapp": FakeWhatsApp(tokens["whatsapp"]).start()}
    (tmp_path / "redis").mkdir()
    rsrv = _PasswordRedis(tmp_path / "redis", _secret("redispw")).start()
    (tmp_path / "s3").mkdir()
    s3 = SeaweedS3(tmp_path / "s3")
    s3.access_key, s3.secret_key = _secret("AKID"), _secret("s3secret")
    s3.start()
    bucket = s3.make_bucket()
    others = {name: _secret(name.lower().replace("_", "")) for name in (
        "COURIER_OPENAI_API_KEY", "TELEGRAM_WEBHOOK_SECRET", "SLACK_SIGNING_SECRET", "WHATSAPP_APP_SECRET",
        "WHATSAPP_VERIFY_TOKEN", "COURIER_METRICS_TOKEN")}
    script, reply = tmp_path / "agent.py", tmp_path / "reply.txt"
    script.write_text(AGENT)
    env = CourierEnv(
        tmp_path / "env", rsrv.url,
        TELEGRAM_BOT_TOKEN=tokens["telegram"], COURIER_TELEGRAM_BASE_URL=fakes["telegram"].url,
        DISCORD_BOT_TOKEN=tokens["discord"], COURIER_DISCORD_BASE_URL=fakes["discord"].base_url,
        SLACK_BOT_TOKEN=tokens["slack"], COURIER_SLACK_BASE_URL=fakes["slack"].base_url,
        WHATSAPP_ACCESS_TOKEN=tokens["whatsapp"], WHATSAPP_PHONE_NUMBER_ID=fakes["whatsapp"].phone_number_id,
        COURIER_WHATSAPP_BASE_URL=fakes["whatsapp"].url,
        COURIER_STORAGE_URL=f"s3://{bucket}/courier", AWS_ENDPOINT_URL=s3.endpoint_url,
        AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_DEFAULT_REGION=s3.region,
        COURIER_AGENTS=json.dumps({"echo": {"command": [sys.executable, str(script), str(reply)],
                                            "timeout_s": 60}}),
        **others)
    log = tmp_path / "worker.log"
    name = f"t{uuid.uuid4().hex[:8]}@localhost"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q",
             "turns,sandbox,delivery,janitor", "--concurrency=2", "-n", name, "--loglevel=DEBUG",
             "--without-mingle", "--without-gossip"],
            env=env.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    env.workers.append(proc)
    r = redis.Redis.from_url(rsrv.url, decode_responses=True)
    chats = {"telegram": "100200300", "discord": "900000000000123", "slack": "C0123ABCD", "whatsapp": "+15550001234"}
    said = {}
    try:
        from workers.demo import wait_worker

        assert wait_worker(env.celery_app(), name, proc, timeout_s=60), log.read_text()[-3000:]
        for platform, chat in chats.items():
            said[platform] = (_secret("asked"), _secret("replied"))
            reply.write_text(said[platform][1])
            res = env.cli("turn", f"{platform}:{chat}", said[platform][0], "--agent", "echo", "--json")
            assert res.returncode == 0, res.stdout + res.stderr
            rows = wait_job(r, json.loads(res.stdout)["job"], timeout_s=90)
            assert [d["state"] for d in rows] == ["delivered", "delivered"], rows
    finally:
        env.stop()
        r.close()
        for f in fakes.values():
            f.stop()
        s3.drop_bucket(bucket)
        s3.stop()
        rsrv.stop()
    text = log.read_text(errors="replace")
    assert "DEBUG" in text and len(text) > 10_000, text[-2000:]  # it did log at DEBUG
    shown = {f"{p} token": t for p, t in tokens.items()}
    shown.update({"Redis password": rsrv.password, "S3 secret key": s3.secret_key, **others})
    for platform, (asked, replied) in said.items():
        shown[f"{platform} chat's message"] = asked
        shown[f"{platform} reply text"] = replied
    leaks = {what: [line for line in text.splitlines() if value in line][:3]
             for what, value in shown.items() if value in text}
    assert not leaks, json.dumps(leaks, indent=1)[:6000]


# -- the rules, on records (no process: workers/logsafe.py's Redactor and clean) ------------------
def _emit(redactor, name: str, level: int, msg, *args, exc_info=None) -> tuple[logging.LogRecord, str]:
    """A record of logger `name` through a handler with `redactor`, and what the handler wrote."""
    import io

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(redactor)
    record = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    handler.handle(record)
    return record, out.getvalue()


def test_secrets_are_redacted_in_the_message_its_arguments_and_its_traceback():
    from workers.logsafe import REDACTED, Redactor

    red = Redactor(["tok:en-1234", "p@ss/word"])
    # a secret in a string argument is replaced there: the arguments stay (uvicorn's access formatter reads them)
    rec, shown = _emit(red, "uvicorn.access", logging.INFO, '%s - "%s %s"', "1.2.3.4", "GET", "/bot tok:en-1234/x")
    assert rec.args == ("1.2.3.4", "GET", f"/bot {REDACTED}/x") and "tok:en" not in shown
    # the URL-encoded form of a password, in the format string itself
    _, shown = _emit(red, "kombu", logging.WARNING, "lost redis://:p%40ss%2Fword@h:6379/0")
    assert "p%40ss" not in shown and REDACTED in shown
    # in an argument that is not a string: the message is formatted here
    _, shown = _emit(red, "x", logging.ERROR, "failed: %r", ValueError("url /bottok:en-1234/send"))
    assert "tok:en" not in shown and REDACTED in shown
    try:
        raise RuntimeError("connect to redis://:p@ss/word@host failed")
    except RuntimeError:
        import sys

        _, shown = _emit(red, "celery", logging.ERROR, "task failed", exc_info=sys.exc_info())
    assert "Traceback" in shown and "p@ss" not in shown and REDACTED in shown
    # nothing to hide: the record is left as it was
    rec, shown = _emit(red, "courier", logging.INFO, "sent %d files to %s", 3, "telegram:1")
    assert rec.args == (3, "telegram:1") and shown == "sent 3 files to telegram:1\n"


def test_payload_loggers_keep_their_format_string_at_debug_and_nothing_else():
    from workers.logsafe import Redactor

    red = Redactor()
    _, shown = _emit(red, "telegram.Bot", logging.DEBUG, "Calling Bot API endpoint `%s` with parameters `%s`",
                     "sendMessage", {"text": "hello chat"})
    assert shown == "Calling Bot API endpoint `…` with parameters `…`\n"
    _, shown = _emit(red, "slack_sdk.web.base_client", logging.DEBUG, "Sending a request - json_body: {'text': 'hi'}")
    assert "hi" not in shown and "withheld" in shown
    # at INFO and above, and on other loggers, the line is whole
    _, shown = _emit(red, "telegram.Bot", logging.WARNING, "endpoint %s slow", "sendMessage")
    assert shown == "endpoint sendMessage slow\n"
    _, shown = _emit(red, "telegramx", logging.DEBUG, "a %s", "b")
    assert shown == "a b\n"


def test_the_secrets_a_process_knows():
    from workers.logsafe import secrets_of
    from workers.settings import Settings

    s = Settings(redis_url="redis://:redis-pw-1@127.0.0.1:6379/0", telegram_bot_token="1:tg-token",
                 metrics_token="metrics-tok",
                 agents={"a": {"command": ["x"], "env": {"OPENAI_API_KEY": "sk-agent", "LANG": "C.UTF-8"}}})
    found = secrets_of(s, environ={"AWS_SECRET_ACCESS_KEY": "aws-secret", "MY_SERVICE_TOKEN": "svc-token",
                                   "AWS_ACCESS_KEY_ID": "AKIDPUBLIC", "COURIER_SSH_KEY_PATH": "/k",
                                   "HTTPS_PROXY": "http://u:proxy-pw@proxy:3128", "HOME": "/root"})
    assert {"redis-pw-1", "1:tg-token", "metrics-tok", "sk-agent", "aws-secret", "svc-token",
            "proxy-pw"} <= found
    assert not found & {"C.UTF-8", "AKIDPUBLIC", "/k", "/root"}
