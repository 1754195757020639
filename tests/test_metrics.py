"""Prometheus metrics: a prefork worker's children counted together
(PROMETHEUS_MULTIPROC_DIR) on its exporter, the web process's `/metrics`
behind the operator token with queue, consumer and ledger gauges read from
a real Redis (a `sandbox.<host>` queue nobody consumes included)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.fixtures.services import free_port, stop_process, wait_until
from tests.fixtures.workers import ROOT

pytestmark = pytest.mark.slow

TOKEN = "op-metrics-token"



def _value(text: str, name: str, **labels: str) -> float | None:
    """The sample `name{labels...}` of an exposition (labels matched as a subset)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return None


def test_queue_stats_see_depth_age_and_consumers(redis_client):
    """Plain code against a real Redis: the oldest message's age from its
    `sent_s` stamp, consumers from heartbeats (a stale one does not count),
    a registered queue with no consumer is listed."""
    import json

    from tasks.ops import queues

    now = time.time()
    for age in (30.0, 5.0):  # LPUSH: the oldest ends up on the right, as Celery's transport keeps it
        redis_client.lpush("sandbox.gpu1", json.dumps({"headers": {"sent_s": now - age}, "body": ""}))
    queues.register(redis_client, "sandbox.gpu1", now=now)
    queues.heartbeat(redis_client, "w1@a", ["delivery", "sandbox"], now=now)
    queues.heartbeat(redis_client, "w2@b", ["delivery"], now=now - 120)  # died two minutes ago
    rows = {row["queue"]: row for row in queues.stats(redis_client, now=now)}
    assert rows["sandbox.gpu1"]["depth"] == 2 and rows["sandbox.gpu1"]["consumers"] == 0
    assert rows["sandbox.gpu1"]["oldest_age_s"] == pytest.approx(30.0, abs=0.01)
    assert rows["delivery"]["consumers"] == 1 and rows["sandbox"]["consumers"] == 1
    assert rows["turns"] == {"queue": "turns", "depth": 0, "oldest_age_s": None, "consumers": 0}
    queues.leave(redis_client, "w1@a", ["delivery"])
    assert {r["queue"]: r for r in queues.stats(redis_client, now=now)}["delivery"]["consumers"] == 0
    # an old, empty, unconsumed registry entry is forgotten; the base queues stay
    redis_client.delete("sandbox.gpu1")
    queues.register(redis_client, "sandbox.gone", now=now - queues.FORGET_S - 60)
    names = {r["queue"] for r in queues.stats(redis_client, now=now)}
    assert "sandbox.gone" not in names and {"turns", "sandbox", "delivery", "janitor"} <= names


def test_the_delivery_queue_counts_the_lanes_waiting_in_the_ready_set(redis_client):
    """Lanes whose wake-up joined the ready set (tasks/dispatch/chains.py) are delivery work waiting
    like messages: the delivery queue's depth and age show them."""
    import json

    from tasks.ledger import keys
    from tasks.ops import queues

    now = time.time()
    redis_client.lpush("delivery", json.dumps({"headers": {"sent_s": now - 3.0}, "body": ""}))
    redis_client.zadd(keys.lanes_ready(), {"telegram:1": now - 12.0, "telegram:2": now - 1.0})
    row = {r["queue"]: r for r in queues.stats(redis_client, now=now)}["delivery"]
    assert row["depth"] == 3 and row["oldest_age_s"] == pytest.approx(12.0, abs=0.01)
    redis_client.delete("delivery")
    row = {r["queue"]: r for r in queues.stats(redis_client, now=now)}["delivery"]
    assert row["depth"] == 2 and row["oldest_age_s"] == pytest.approx(12.0, abs=0.01)


def test_a_queue_entry_that_is_not_utf8_is_counted_without_an_age(redis_client):
    """A foreign client's entry that is not UTF-8 text (the oldest one, which `courier
    queues` reads) is counted; its age is unknown: the command shows '-', never a
    UnicodeDecodeError."""
    import json

    from tasks.ops import queues

    now = time.time()
    redis_client.rpush("delivery", b"\xff\xfe\x00 not utf-8")  # the right end: the oldest
    redis_client.lpush("delivery", json.dumps({"headers": {"sent_s": now - 3.0}, "body": ""}))
    try:
        row = {r["queue"]: r for r in queues.stats(redis_client, now=now)}["delivery"]
        assert row["depth"] == 2 and row["oldest_age_s"] is None
    finally:
        redis_client.delete("delivery")


def test_worker_exporter_counts_every_pool_process(courier_env, tmp_path):
    """Deliveries (delivered and failed), extractions (bytes, outcome) run in
    two prefork children; the worker's one exporter shows them all."""
    mpdir = tmp_path / "prom"
    mpdir.mkdir()
    port = free_port()
    env = courier_env(PROMETHEUS_MULTIPROC_DIR=str(mpdir), COURIER_METRICS_PORT=str(port),
                      COURIER_METRICS_TOKEN=TOKEN)
    plain = tmp_path / "report.txt"
    plain.write_bytes(b"r" * 1000)
    small, gone = env.sandbox / "small.csv", env.sandbox / "gone.bin"
    small.write_bytes(b"s" * 3000)
    gone.write_bytes(b"g" * 9000)
    for args in ([str(plain)], [f"local://{small}"], [f"local://{gone}"], [str(plain), f"local://{small}"]):
        res = env.cli("send", "outbox:m", *args, "--json")
        assert res.returncode == 0, res.stderr
    gone.unlink()  # before any worker looks: its extraction fails for good
    env.start_worker(concurrency=2)
    url = f"http://127.0.0.1:{port}/metrics"
    assert httpx.get(url, timeout=5).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def counted():
        text = httpx.get(url, headers=auth, timeout=5).text
        delivered = _value(text, "courier_deliveries_total", platform="outbox", kind="document", state="delivered")
        failed = _value(text, "courier_deliveries_total", platform="outbox", kind="file", state="failed")
        return text if (delivered, failed) == (4.0, 1.0) else None

    text = wait_until(counted, timeout_s=60, what="5 final deliveries in the worker's metrics")
    assert _value(text, "courier_extracted_bytes_total", sandbox="local") == 6000
    assert _value(text, "courier_extract_seconds_count", sandbox="local", outcome="ok") == 2
    assert _value(text, "courier_extract_seconds_count", sandbox="local", outcome="failed") == 1
    # the counts were made in the pool's children (their files), not in the exporter's own process
    pids = {int(f.split("_")[1].split(".")[0]) for f in os.listdir(mpdir) if f.startswith("counter_")}
    assert pids and env.workers[0].pid not in pids
    assert "courier_queue_depth" not in text  # the deployment-wide gauges come from the web process only


def test_web_metrics_count_every_process_of_courier_worker_without_a_multiproc_dir(courier_env, tmp_path):
    """Issue 24: `courier worker -Q delivery` runs 2 processes; without PROMETHEUS_MULTIPROC_DIR
    `/metrics` counted one (2 texts shown of 3 delivered, 0 failed of 1). `courier worker` now
    gives its processes a private directory (<data dir>/metrics/<host>) and the web process on the
    host adds what is counted there: 3 texts delivered and 1 failed file show as 3 and 1.
    Their log lines name the two delivery processes apart (`<node>-1`, `<node>-2`)."""
    import uuid

    from workers.demo import wait_worker

    env = courier_env(COURIER_METRICS_TOKEN=TOKEN, COURIER_DELIVERY_POOL="threads",
                      COURIER_DELIVERY_PROCESSES="2", COURIER_DELIVERY_CONCURRENCY="2")
    env.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    gone = env.sandbox / "gone.bin"
    gone.write_bytes(b"g" * 100)
    for i in range(3):
        res = env.cli("send", f"outbox:mp{i}", "--text", f"text {i}", "--json")
        assert res.returncode == 0, res.stderr
    res = env.cli("send", "outbox:mp3", f"local://{gone}", "--json")
    assert res.returncode == 0, res.stderr
    gone.unlink()  # before any worker looks: its extraction fails for good
    started = []
    for queues, extra in (("delivery", []), ("sandbox,janitor", ["-c", "1"])):
        node = f"mp{uuid.uuid4().hex[:6]}@localhost"
        log_path = tmp_path / f"{node.split('@')[0]}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "workers.worker", "-Q", queues, *extra, "-n", node,
                                     "--loglevel=INFO", "--without-mingle", "--without-gossip"],
                                    env=env.env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT)
        env.workers.append(proc)
        started.append((node, proc, log_path))
    for node, proc, log_path in started:
        assert wait_worker(env.celery_app(), node, proc, timeout_s=120), log_path.read_text()[-3000:]
    port = free_port()
    log = open(tmp_path / "web.log", "wb")  # noqa: SIM115
    web = subprocess.Popen([sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(port)],
                           env=env.env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200,
                   timeout_s=30, what="web")

        def counted():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth, timeout=5).text
            got = (_value(text, "courier_deliveries_total", platform="outbox", kind="text", state="delivered"),
                   _value(text, "courier_deliveries_total", platform="outbox", kind="file", state="failed"))
            return text if got == (3.0, 1.0) else None

        wait_until(counted, timeout_s=90, what="3 texts delivered and 1 failed on the web process's /metrics")
    finally:
        stop_process(web)
        log.close()
    # the two delivery processes log under their own names
    node, _, log_path = started[0]
    local = node.split("@")[0]
    text = log_path.read_text()
    assert f" {local}-1[" in text and f" {local}-2[" in text, text[-3000:]
    assert " MainProcess[" not in text, text[-3000:]


def test_web_metrics_need_the_token_and_show_queues_ledger_and_webhooks(courier_env, tmp_path, redis_client):
    env_redis = redis_client
    from tests.fixtures.webstack import TELEGRAM_SECRET

    env = courier_env(COURIER_METRICS_TOKEN=TOKEN, TELEGRAM_WEBHOOK_SECRET=TELEGRAM_SECRET)
    # a docker file pinned to a host whose worker does not exist: it waits in `sandbox.gpu7`
    res = env.cli("send", "outbox:m", "docker://ctr1/workspace/a.png?host=gpu7", "--json")
    assert res.returncode == 0, res.stderr
    port = free_port()
    log = open(tmp_path / "web.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "web", "--host", "127.0.0.1", "--port", str(port)],
                            env=env.env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/healthz", timeout=1).status_code == 200, timeout_s=30, what="web")
        r = httpx.get(base + "/metrics", timeout=5)
        assert r.status_code == 401 and "secret" not in r.text
        assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
        bad = httpx.post(base + "/webhooks/telegram", json={"update_id": 1},
                         headers={"X-Telegram-Bot-Api-Secret-Token": "wrong"}, timeout=5)
        assert bad.status_code == 401
        r = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert _value(text, "courier_redis_up") == 1
        assert _value(text, "courier_queue_depth", queue="sandbox.gpu7") == 1
        assert _value(text, "courier_queue_consumers", queue="sandbox.gpu7") == 0
        age = _value(text, "courier_queue_oldest_age_seconds", queue="sandbox.gpu7")
        assert age is not None and 0 <= age < 120
        assert _value(text, "courier_queue_depth", queue="turns") == 0
        assert _value(text, "courier_ledger_pending", stage="extract") == 1
        assert _value(text, "courier_ledger_pending", stage="lane") == 1
        assert _value(text, "courier_sandbox_breakers", state="open") == 0  # tests/test_sandbox_breaker.py opens one
        assert _value(text, "courier_webhook_requests_total", platform="telegram", outcome="rejected") == 1
        # no worker consumes `turns`: /healthz stays 200 (Redis answers) and says so; asked, it is a 503
        h = httpx.get(base + "/healthz", timeout=5)
        assert h.status_code == 200 and h.json()["turns_consumers"] == 0
        h = httpx.get(base + "/healthz?consumers=turns", timeout=5)
        assert h.status_code == 503 and h.json()["no_consumer"] == ["turns"]
        from tasks.ops import queues

        queues.heartbeat(env_redis, "w@h", ["turns"])
        h = httpx.get(base + "/healthz?consumers=turns", timeout=5)
        assert h.status_code == 200 and h.json()["turns_consumers"] == 1
    finally:
        stop_process(proc)
        log.close()


def test_alert_rules_and_dashboard_use_series_courier_exports(redis_client):
    """compose/monitoring: the alert rules parse, have the three the operator
    needs (failed deliveries, queue age, no consumer), and every courier_*
    series they and the dashboard name is one courier exports."""
    import json

    import yaml

    from tasks import metrics
    from workers import metrics as exposition

    metrics.record_delivery("snd_x.0", "outbox:x", "delivered", "text")
    metrics.record_extraction("local", 0.1, 10, "ok")
    metrics.record_turn("demo", "replied", 1.0)
    metrics.record_webhook("slack", 200)
    metrics.record_webhook_turn("slack", False)
    metrics.record_rate_limited("telegram:1")
    text = exposition.render(exposition.registry(redis_client)).decode()
    exported = {m.group(1) for m in re.finditer(r"^(courier_[a-z_]+)[{ ]", text, re.M)}
    mon = ROOT / "compose" / "monitoring"
    rules = yaml.safe_load((mon / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"CourierDeliveriesFailed", "CourierQueueOldMessage", "CourierQueueNoConsumer"} <= names
    dash = json.loads((mon / "grafana-dashboard.json").read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"courier_[a-z_]+", e)}
    assert used and used <= exported, used - exported


def test_platform_429s_are_counted_and_courier_pacing_is_not(courier_env, fake_telegram, tmp_path):
    """A real worker against the local Telegram server: one 429 (retry after
    1 s) is counted once; the second message to the chat waits for courier's
    own per-chat pacing, which is no 429."""
    from tests.fixtures.fake_telegram import enqueue

    port = free_port()
    env = courier_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path), COURIER_METRICS_PORT=str(port),
                      TELEGRAM_BOT_TOKEN=fake_telegram.token, COURIER_TELEGRAM_BASE_URL=fake_telegram.url)
    env.start_worker(queues="delivery,sandbox")
    fake_telegram.fail_next(1, 429, retry_after=1, method="sendMessage")
    enqueue(env, "telegram:-100555", text="first")
    enqueue(env, "telegram:-100555", text="second")

    def counted():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        done = _value(text, "courier_deliveries_total", platform="telegram", kind="text", state="delivered")
        return text if done == 2 else None

    text = wait_until(counted, timeout_s=60, what="two telegram deliveries")
    assert _value(text, "courier_rate_limited_total", platform="telegram") == 1
    assert [c.status for c in fake_telegram.calls_for("sendMessage")] == [429, 200, 200]
