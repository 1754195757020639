"""`courier demo` end to end, with Redis running and without (embedded)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from adapters.platforms.outbox import read_log
from tests.fixtures.workers import ROOT

pytestmark = pytest.mark.slow


def _run_demo(env_extra: dict, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    data = tmp_path / "data"
    env = {**os.environ, "COURIER_DATA_DIR": str(data), "PYTHONPATH": str(ROOT), "COLUMNS": "200", **env_extra}
    res = subprocess.run([sys.executable, "-m", "workers.cli", "demo", "--timeout", "90"], env=env,
                         capture_output=True, text=True, timeout=180, cwd=str(ROOT))
    return res, str(data / "outbox")


def _check_outbox(outbox: str) -> None:
    log = read_log(outbox, "demo")
    kinds = [r["kind"] for r in log]
    assert kinds == ["text", "photo", "document"], log
    png = os.path.join(outbox, "demo", log[1]["file"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) == log[1]["size_bytes"] > 1000
    csv_path = os.path.join(outbox, "demo", log[2]["file"])
    with open(csv_path) as f:
        rows = f.read().splitlines()
    assert rows[0] == "x,x^2" and rows[-1] == "10,100"


def test_demo_with_running_redis(redis_server, tmp_path):
    res, outbox = _run_demo({"COURIER_REDIS_URL": redis_server.url}, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "using Redis" in res.stdout and "chart.png" in res.stdout and "report.csv" in res.stdout
    assert "● completed" in res.stdout
    _check_outbox(outbox)


def test_demo_starts_embedded_redis_when_none_answers(tmp_path):
    from tests.fixtures.services import free_port

    res, outbox = _run_demo({"COURIER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "started an embedded one" in res.stdout
    _check_outbox(outbox)
    # nothing left running: the embedded redis and the worker were stopped
    import re

    from tests.fixtures.services import port_open

    # its URL is shown without its password
    port = int(re.search(r"embedded one at redis://:\*\*\*@127.0.0.1:(\d+)/0", res.stdout).group(1))
    assert not port_open(port)
    marker = f"COURIER_DATA_DIR={tmp_path / 'data'}".encode()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    left.append(pid)
        except OSError:
            continue
    assert not left, f"processes left running: {left}"


def test_the_embedded_redis_has_a_random_password_off_its_command_line():
    """The demo's Redis answered anyone on the host (no password): it has a
    random one now, given on its stdin (not in its argv, which every user can
    read in /proc), and the URL courier's clients use carries it."""
    from pathlib import Path
    from urllib.parse import unquote, urlsplit

    import redis

    from tests.fixtures.services import free_port
    from workers.embedded import ensure_redis

    first = ensure_redis(f"redis://127.0.0.1:{free_port()}/0")
    second = ensure_redis(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert first.embedded and second.embedded
        u = urlsplit(first.url)
        password = unquote(u.password or "")
        assert len(password) >= 32 and password != unquote(urlsplit(second.url).password or "")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=u.port, socket_timeout=5).ping()
        assert redis.Redis.from_url(first.url, socket_timeout=5).ping()
        assert password.encode() not in Path(f"/proc/{first.proc.pid}/cmdline").read_bytes()
    finally:
        first.stop()
        second.stop()
