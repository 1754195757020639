"""workers/kombu_internals.py against the lowest and the highest kombu pyproject allows
(`kombu>=5.4,<6`): the lowest (5.4.0) installed by pip into a directory of its own and put
first on a subprocess's sys.path, the highest the one installed here. Each run shows that
kombu still raises the AttributeError without the guard (so the guard is still needed) and
that with it a channel closing after its connection let go is quiet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import need

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import sys
from kombu import Connection, __version__
from kombu.common import ignore_errors

if sys.argv[2] == "guarded":
    from workers import kombu_internals
    kombu_internals.install()
conn = Connection(sys.argv[1])
q = conn.SimpleQueue("courier-test-kombu-internals")
q.put({"n": 1})
q.get(timeout=10)  # received, not acked: the channel restores it as it closes
chan = q.channel
chan._pool = None  # as after a connection error
conn.transport.client = None  # kombu lets go of the connection's parameters as it releases it
try:
    ignore_errors(conn, chan.close)
except Exception as exc:
    print(__version__, "raised", type(exc).__name__)
else:
    print(__version__, "quiet")
"""


@pytest.fixture(scope="module")
def kombu_lowest(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("kombu-5.4.0")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(where),
                          "kombu==5.4.0"], capture_output=True, text=True, timeout=300, check=False)
    need(res.returncode == 0, f"no kombu 5.4.0 to install here: {res.stderr.strip()[-300:]}")  # (CI: a failure)
    return where


def _run(redis_url: str, mode: str, first: Path | None = None) -> str:
    path = [str(first)] if first else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)])}
    res = subprocess.run([sys.executable, "-c", _PROBE, redis_url, mode], env=env, cwd=str(ROOT),
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_the_guard_is_needed_and_works_on_the_highest_kombu(redis_server):
    import kombu

    assert _run(redis_server.url, "bare") == f"{kombu.__version__} raised AttributeError"
    assert _run(redis_server.url, "guarded") == f"{kombu.__version__} quiet"


def test_the_guard_is_needed_and_works_on_the_lowest_kombu(redis_server, kombu_lowest):
    assert _run(redis_server.url, "bare", kombu_lowest) == "5.4.0 raised AttributeError"
    assert _run(redis_server.url, "guarded", kombu_lowest) == "5.4.0 quiet"
