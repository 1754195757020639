"""courier's own Redis clients decode replies (issue 14): what they read is
`str`, never `bytes`, for every way courier makes one (plain URL, Sentinel,
the web process's asyncio twin), so no module decodes a reply by hand.
Real redis-server (and a real sentinel: redis-server --sentinel)."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from tasks.dispatch import chains
from tasks.ledger import events, keys, receipts, signing
from tests.fixtures.redis_server import RedisServer, _redis_binary
from tests.fixtures.services import free_port, stop_process, wait_until
from workers import redis_url, wiring

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tasks", "workers", "adapters", "storage")


def _register(r, job: str) -> str:
    (entry,) = chains.register(r, chains.Plan(job_id=job, target="outbox:dec", text="héllo 🎉"), job_kind="send")
    return entry.did


def test_courier_client_reads_a_receipts_state_as_str(redis_client, redis_server):
    r = wiring.redis_client(redis_server.url)
    did = _register(r, "snd_dec1")
    state = r.hget(keys.delivery(did), "state")
    assert state == "queued" and type(state) is str
    rec = receipts.get_delivery(r, did)
    assert rec is not None and all(type(k) is str and type(v) is str for k, v in rec.items())
    assert signing.open_json("delivery", rec["id"], rec["spec"])["text"] == "héllo 🎉"  # non-ASCII text round-trips
    assert r.lrange(keys.job_deliveries("snd_dec1"), 0, -1) == [did]
    eid = events.publish(r, "snd_dec1", {"kind": "status", "status": "queued"})
    assert type(eid) is str and events.read(r, "snd_dec1")[0][0] == eid


def test_async_client_reads_str(redis_client, redis_server):
    did = _register(redis_client, "snd_dec2")

    async def read():
        a = redis_url.async_client(redis_server.url)
        try:
            return await a.hget(keys.delivery(did), "state"), await a.hgetall(keys.job("snd_dec2"))
        finally:
            await a.aclose()

    state, job = asyncio.run(read())
    assert state == "queued" and type(state) is str
    assert job["kind"] == "send" and all(type(k) is str for k in job)


@pytest.fixture
def sentinel_url(tmp_path):
    (tmp_path / "m").mkdir()
    master = RedisServer(tmp_path / "m").start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\nlogfile {tmp_path / 'sentinel.log'}\n"
                    f"sentinel monitor dec 127.0.0.1 {master.port} 1\n")
    proc = subprocess.Popen([_redis_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        import redis

        probe = redis.Redis(port=port, socket_timeout=5)
        wait_until(lambda: probe.execute_command("SENTINEL", "get-master-addr-by-name", "dec"), timeout_s=15,
                   what="the sentinel to name the master")
        probe.close()
        yield f"sentinel://127.0.0.1:{port}/dec/0"
    finally:
        stop_process(proc)
        master.stop()


def test_sentinel_clients_read_str(sentinel_url):
    r = redis_url.client(sentinel_url)
    try:
        did = _register(r, "snd_dec3")
        assert r.hget(keys.delivery(did), "state") == "queued"
        assert type(r.hget(keys.delivery(did), "state")) is str
    finally:
        r.close()

    async def read():
        a = redis_url.async_client(sentinel_url)
        try:
            return await a.hget(keys.delivery(did), "state")
        finally:
            await a.aclose()

    state = asyncio.run(read())
    assert state == "queued" and type(state) is str


#: what a module that reads Redis uses: a client's reply-returning commands, or the client itself
_REDIS_ATTRS = frozenset({"redis", "aredis", "aredis_turns", "redis_client", "pipeline", "get", "hget", "hgetall",
                          "hmget", "lrange", "lindex", "zrange", "zrangebyscore", "xread", "xrange", "eval",
                          "evalsha", "scan_iter"})


def _talks_to_redis(tree: ast.AST) -> bool:
    """The module imports redis (or courier's keys / client makers) and uses a client."""
    imports = False
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            imports |= any(a.name.split(".")[0] == "redis" for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module:
            names = {a.name for a in n.names}
            imports |= (n.module.split(".")[0] == "redis" or n.module in ("tasks.ledger.keys", "workers.redis_url")
                        or (n.module.split(".")[0] == "tasks" and "keys" in names) or "redis_client" in names)
    return imports and any(isinstance(n, ast.Attribute) and n.attr in _REDIS_ATTRS for n in ast.walk(tree))


def _hand_decoding(tree: ast.AST) -> list[int]:
    """Lines of `x.decode()` (no codec named: a reply decoded by hand) and of
    `isinstance(x, bytes)` (a reply told from text)."""
    lines = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr == "decode" and not n.args and not n.keywords:
            lines.append(n.lineno)
        elif isinstance(f, ast.Name) and f.id == "isinstance" and len(n.args) == 2:
            kinds = n.args[1].elts if isinstance(n.args[1], ast.Tuple) else [n.args[1]]
            if any(isinstance(k, ast.Name) and k.id == "bytes" for k in kinds):
                lines.append(n.lineno)
    return lines


def test_no_module_that_talks_to_redis_decodes_replies_by_hand():
    found: list[str] = []
    talking: set[str] = set()
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(p.read_text())
            if _talks_to_redis(tree):
                talking.add(str(p.relative_to(ROOT)))
                found += [f"{p.relative_to(ROOT)}:{line}" for line in _hand_decoding(tree)]
    assert not found, found
    # the modules that read replies are among those looked at
    assert {"tasks/ledger/receipts.py", "tasks/delivery/lanes.py", "tasks/ledger/events.py", "workers/web.py", "workers/turnpage.py",
            "workers/redis_url.py", "workers/celery_app.py"} <= talking
    assert not hasattr(receipts, "as_str") and not hasattr(receipts, "_s")


def test_the_hand_decoding_check_finds_what_it_looks_for():
    tree = ast.parse("def f(r):\n    v = r.get('k')\n    return v.decode() if isinstance(v, bytes) else v\n"
                     "b = base64.b64encode(x).decode('ascii')\n")
    assert _hand_decoding(tree) == [3, 3]
