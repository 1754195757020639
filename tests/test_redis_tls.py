"""COURIER_REDIS_URL with `rediss://` works for every client: against a real
TLS redis-server (tests/fixtures/tls.py: TLS port only, a password, client
certificates required), a real worker (Celery's broker and result backend,
courier's own client) delivers a `courier send` end to end, the web process
answers /healthz from Redis and sees the worker's heartbeat, beat takes its
lock and publishes, Flower lists the worker and reads queue lengths (its own
broker client). The URL (password, CA, client certificate) comes from
COURIER_REDIS_URL_FILE: it is in no process's environment."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from urllib.parse import quote

import httpx
import pytest
import redis

from tasks.ledger import keys
from tests.fixtures.services import free_port, stop_process, wait_until
from tests.fixtures.workers import ROOT, CourierEnv

pytestmark = pytest.mark.slow


def test_the_server_refuses_plaintext_no_certificate_and_no_password(tls_redis):
    """What the other test passes through is really required."""
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=tls_redis.port, socket_timeout=3).ping()  # plaintext to the TLS port
    no_cert = f"rediss://:{tls_redis.PASSWORD}@127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={tls_redis.pki.ca}"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(no_cert, socket_timeout=3).ping()
    anonymous = tls_redis.url.replace(f":{quote(tls_redis.PASSWORD, safe='')}@", "")
    assert "@" not in anonymous
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(anonymous, socket_timeout=3).ping()


def test_worker_cli_web_beat_and_flower_over_tls(tls_redis, tmp_path):
    url_file = tmp_path / "redis-url"
    url_file.write_text(tls_redis.url + "\n")
    env = CourierEnv(tmp_path / "env", "unused")
    del env.env["COURIER_REDIS_URL"]
    env.env["COURIER_REDIS_URL_FILE"] = str(url_file)
    r = tls_redis.client()
    r.flushall()
    procs: list[subprocess.Popen] = []
    try:
        # web and beat start while the worker does
        web_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(web_port)],
            env=env.env, cwd=str(ROOT), stdout=open(tmp_path / "web.log", "wb"), stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.fixtures._beat_app", "beat",
             f"--schedule={tmp_path / 'beat-schedule'}", "--max-interval=1", "--loglevel=INFO"],
            env=env.env, cwd=str(ROOT), stdout=open(tmp_path / "beat.log", "wb"), stderr=subprocess.STDOUT))
        worker = env.start_worker(concurrency=1)  # waits for its ping over TLS

        blob = hashlib.sha256(b"tls").digest() * 4096
        f = tmp_path / "tls.bin"
        f.write_bytes(blob)
        res = env.cli("send", "outbox:tls", str(f), "--wait", "--json", "--timeout", "90")
        assert res.returncode == 0, res.stdout + res.stderr
        out = json.loads(res.stdout)
        assert out["done"] and [d["state"] for d in out["deliveries"]] == ["delivered"], out
        got = [p for p in (env.outbox / "tls").iterdir() if p.name.endswith("tls.bin")]
        assert len(got) == 1 and got[0].read_bytes() == blob

        def web_sees_the_worker():
            try:
                resp = httpx.get(f"http://127.0.0.1:{web_port}/healthz?consumers=turns", timeout=5)
            except httpx.HTTPError:
                return None
            return resp.status_code == 200 and resp.json()["turns_consumers"] >= 1

        wait_until(web_sees_the_worker, timeout_s=60,
                   what=lambda: f"web /healthz over TLS: {(tmp_path / 'web.log').read_text()[-2000:]}")

        def beat_published():  # the lock through courier's client, the probes through kombu
            return r.get(keys.beat_lock()) and r.llen("beatprobe") >= 2

        wait_until(beat_published, timeout_s=60,
                   what=lambda: f"beat over TLS: {(tmp_path / 'beat.log').read_text()[-2000:]}")

        with env.flower(env={"FLOWER_BASIC_AUTH": "ops:pw"}) as base:
            def flower_lists_the_worker():
                resp = httpx.get(f"{base}/api/workers?refresh=1", auth=("ops", "pw"), timeout=20)
                return resp.status_code == 200 and worker.courier_name in resp.json()

            wait_until(flower_lists_the_worker, timeout_s=60, what="Flower to list the worker over TLS")
            resp = httpx.get(f"{base}/api/queues/length", auth=("ops", "pw"), timeout=20)
            assert resp.status_code == 200, resp.text  # Flower's own broker client (broker_use_ssl)
            assert {q["name"] for q in resp.json()["active_queues"]} >= {"delivery", "turns"}
    finally:
        for p in procs:
            stop_process(p)
        env.stop()
        r.close()


def test_the_cli_says_redis_wants_a_password_not_that_it_is_away(tls_redis, tmp_path):
    """A Redis that requires a password was reported "not answering"."""
    userinfo = f":{quote(tls_redis.PASSWORD, safe='')}@"
    anonymous, wrong = tls_redis.url.replace(userinfo, ""), tls_redis.url.replace(userinfo, ":wrong-p%40ss@")
    for url, says in ((anonymous, "requires a password"), (wrong, "refused the password")):
        env = CourierEnv(tmp_path / says.split()[0], url)
        res = env.cli("queues", timeout_s=60)
        assert res.returncode == 3 and says in res.stderr, res.stderr
        assert "p@ss" not in res.stderr and "p%40ss" not in res.stderr  # no password printed
