"""End to end: real Redis, real worker processes, the real CLI; files land
byte-identical in the outbox, in order."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from adapters.platforms.outbox import read_log
from tests.fixtures._files import sha256_file, write_random

pytestmark = pytest.mark.slow


@pytest.fixture(params=["volume", "s3"])
def storage_env(request) -> dict:
    """The deployment's storage: the shared volume, or a real S3 server (SeaweedFS)."""
    if request.param == "volume":
        return {}
    srv = request.getfixturevalue("s3_server")
    bucket = srv.make_bucket()
    return {"COURIER_STORAGE_URL": f"s3://{bucket}/courier", "AWS_ENDPOINT_URL": srv.endpoint_url,
            "AWS_ACCESS_KEY_ID": srv.access_key, "AWS_SECRET_ACCESS_KEY": srv.secret_key,
            "AWS_DEFAULT_REGION": srv.region}


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    out = []
    for name, size in (("empty.bin", 0), ("small.txt", 1000), ("big.mp4", 50 * 1000 * 1000)):
        p = d / name
        out.append((p, write_random(p, size), size))
    return out


def test_send_wait_delivers_byte_identical_in_order(courier_env, files, storage_env):
    env = courier_env(**storage_env)
    env.start_worker()
    # no platform takes an empty file: refused before anything is registered, naming it
    res = env.cli("send", "outbox:ops", *[str(p) for p, _, _ in files], "--caption", "nightly", "--json")
    assert res.returncode == 2 and "empty.bin is empty (0 bytes)" in res.stderr, res.stderr
    assert not (env.outbox / "ops").exists()
    files = [(p, sha, size) for p, sha, size in files if size] + [(files[0][0].with_name("one.bin"), None, 1)]
    files[-1] = (files[-1][0], write_random(files[-1][0], 1), 1)
    res = env.cli("send", "outbox:ops", *[str(p) for p, _, _ in files], "--caption", "nightly", "--wait", "--json", "--timeout", "120")
    assert res.returncode == 0, res.stderr + res.stdout
    data = json.loads(res.stdout)
    assert [d["state"] for d in data["deliveries"]] == ["delivered"] * 3
    log = read_log(env.outbox, "ops")
    assert [r["name"] for r in log] == [p.name for p, _, _ in files]
    for rec, (p, sha, size) in zip(log, files):
        assert rec["sha256"] == sha and rec["size_bytes"] == size
        assert sha256_file(env.outbox / "ops" / rec["file"]) == sha
    assert log[0]["caption"] == "nightly" and log[1]["caption"] is None
    assert [r["kind"] for r in log] == ["document", "video", "document"]


def test_sandbox_uri_extracted_then_delivered(courier_env):
    env = courier_env()
    src = env.sandbox / "chart.png"
    sha = write_random(src, 5000)
    env.start_worker()
    res = env.cli("send", "outbox:sb", f"local://{src}", "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    log = read_log(env.outbox, "sb")
    assert len(log) == 1 and log[0]["kind"] == "photo" and log[0]["sha256"] == sha


def test_turn_with_bridge_agent_delivers_files_in_reply_order(courier_env, files, tmp_path, storage_env):
    agent = tmp_path / "agent.py"
    sb = tmp_path / "env-agent-sandbox"
    sb.mkdir()
    paths = []
    for p, sha, size in files:
        dst = sb / p.name
        shutil.copyfile(p, dst)  # a copy: a file with several hard links is never delivered
        paths.append((dst, sha, size))
    agent.write_text(
        "import sys, json\n"
        "msg = sys.stdin.read()\n"
        "print('AX_GATEWAY_EVENT ' + json.dumps({'kind': 'tool_start', 'tool_name': 'terminal', 'activity': '$ ls'}))\n"
        "print('chatter goes here? no: this is the reply')\n"
        + "".join(f"print('MEDIA:{p}')\n" for p, _, _ in reversed(paths))
    )
    # files outside the turn's workspace: reachable because the agent's config names their root
    agents = json.dumps({"files": {"command": [os.sys.executable, str(agent)], "timeout_s": 60, "roots": [str(sb)]}})
    env = courier_env(COURIER_AGENTS=agents,
                      COURIER_MAX_FILE_BYTES=str(60 * 1000 * 1000), **storage_env)
    env.start_worker()
    res = env.cli("turn", "outbox:t1", "send me the files", "--agent", "files", "--wait", "--json", "--timeout", "120")
    assert res.returncode == 0, res.stderr + res.stdout
    log = read_log(env.outbox, "t1")
    assert log[0]["kind"] == "text" and "this is the reply" in log[0]["text"] and "MEDIA:" not in log[0]["text"]
    got = [(r["name"], r["sha256"]) for r in log[1:]]
    assert got == [(p.name, sha) for p, sha, _ in reversed(paths)]
    if storage_env:  # the bytes really went through S3
        import boto3

        s3 = boto3.client("s3", endpoint_url=storage_env["AWS_ENDPOINT_URL"],
                          aws_access_key_id=storage_env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=storage_env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        bucket = storage_env["COURIER_STORAGE_URL"].split("/")[2]
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="courier/files/")
        sizes = sorted(o["Size"] for o in listed.get("Contents", []))
        assert sizes == sorted(size for _, _, size in paths)


def test_bad_input_is_a_clear_one_line_error_and_nothing_enqueued(courier_env, redis_client, tmp_path):
    env = courier_env()
    f = tmp_path / "a.txt"
    f.write_text("x")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    cases = [
        (["send", "nowhere:1", str(f)], "unknown platform"),
        (["send", "outbox", str(f)], "malformed target"),
        (["send", "outbox:x", str(tmp_path / "missing.txt")], "no such file"),
        (["send", "outbox:x", f"local://{outside}"], "outside the allowed roots"),
        (["send", "outbox:x", "local:///etc/passwd"], "never readable"),
        (["send", "outbox:x", "ftp://host/x"], "unknown sandbox"),
    ]
    for args, expect in cases:
        res = env.cli(*args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert expect in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) <= 2, res.stderr
    bad_storage = courier_env(COURIER_STORAGE_URL="gopher://x/y")
    res = bad_storage.cli("send", "outbox:x", str(f))
    assert res.returncode == 2 and "storage" in res.stderr.lower()
    down = courier_env(COURIER_REDIS_URL="redis://127.0.0.1:1/0")
    res = down.cli("send", "outbox:x", str(f), timeout_s=30)
    assert res.returncode == 3 and "not answering" in res.stderr
    # nothing reached the broker queues
    assert redis_client.llen("delivery") == 0 and redis_client.llen("sandbox") == 0
    assert not list(redis_client.scan_iter("courier:job:*"))


def test_routing_flags_reach_the_platform(courier_env, tmp_path):
    """--voice and --as-document change the kinds the platform is asked for."""
    env = courier_env()
    names = ["a.png", "b.ogg", "c.mp3", "d.gif", "e.mp4", "f.pdf"]
    paths = []
    for n in names:
        p = tmp_path / n
        p.write_bytes(os.urandom(100))
        paths.append(str(p))
    env.start_worker()
    res = env.cli("send", "outbox:plain", *paths, "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    res = env.cli("send", "outbox:flags", *paths, "--voice", "--as-document", "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    plain = [r["kind"] for r in read_log(env.outbox, "plain")]
    flags = [r["kind"] for r in read_log(env.outbox, "flags")]
    assert plain == ["photo", "audio", "audio", "animation", "video", "document"]
    assert flags == ["document", "voice", "voice", "document", "document", "document"]
    status = env.cli("status", json.loads(res.stdout)["job"], "--json")
    assert status.returncode == 0
    rows = json.loads(status.stdout)["deliveries"]
    assert [r["kind"] for r in rows] == flags and all(r["attempts"] == 1 for r in rows)


def test_turn_attachments_reach_the_agent_in_its_sandbox(courier_env, tmp_path):
    """Inbound: storage -> the turn's sandbox, then the agent works on the file."""
    agent = tmp_path / "hasher.py"
    agent.write_text(
        "import hashlib, json, os, sys\n"
        "sys.stdin.read()\n"
        "for p in json.loads(os.environ['COURIER_ATTACHMENTS']):\n"
        "    print(os.path.basename(p), hashlib.sha256(open(p, 'rb').read()).hexdigest(), p.startswith(os.getcwd()))\n"
    )
    sb = tmp_path / "work"
    agents = json.dumps({"hasher": {"command": [os.sys.executable, str(agent)], "sandbox": f"local://{sb}"}})
    env = courier_env(COURIER_AGENTS=agents, COURIER_LOCAL_ROOTS=json.dumps([str(sb)]))
    src = tmp_path / "user photo.jpg"
    sha = write_random(src, 300_000)
    (tmp_path / "b").mkdir()
    src2 = tmp_path / "b" / "user photo.jpg"  # the same name: both reach the agent, neither overwrites
    sha2 = write_random(src2, 1000)
    env.start_worker()
    res = env.cli("turn", "outbox:in", "what is this?", "--agent", "hasher", "--attach", str(src),
                  "--attach", str(src2), "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    text = read_log(env.outbox, "in")[0]["text"]
    assert text == f"user photo.jpg {sha} True\nuser photo-2.jpg {sha2} True"
    job = json.loads(res.stdout)["job"]
    assert (sb / "turns" / job / "inbox" / "user photo.jpg").stat().st_size == 300_000
    res = env.cli("turn", "outbox:in", "x", "--agent", "hasher", "--attach", str(tmp_path / "nope.bin"))
    assert res.returncode == 2 and "no such file to attach" in res.stderr
