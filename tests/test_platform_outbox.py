"""The outbox platform end to end: a real worker writes deliveries to the outbox
directory; assertions are on the files and `deliveries.jsonl` it leaves."""

from __future__ import annotations

import hashlib

import pytest

from adapters.platforms.outbox import read_log
from tests.fixtures._platforms import write_unique
from tests.fixtures.fake_telegram import enqueue, wait_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def oenv(tmp_path_factory, redis_server):
    from tests.fixtures.workers import CourierEnv

    env = CourierEnv(tmp_path_factory.mktemp("outbox"), redis_server.url)
    env.start_worker(concurrency=1)
    yield env
    env.stop()


@pytest.fixture
def r(redis_server):
    c = redis_server.client()
    yield c
    c.close()


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_named_files_of_one_job_are_all_kept(oenv, r, tmp_path):
    # two files named alike in one job: each delivery's file stays on disk (the name keeps the whole delivery id)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = [tmp_path / "a" / "report.csv", tmp_path / "b" / "report.csv"]
    shas = [write_unique(p, 1000 + i) for i, p in enumerate(files)]
    rows = wait_job(r, enqueue(oenv, "outbox:same-names", files=files))
    assert [d["state"] for d in rows] == ["delivered", "delivered"]
    log = read_log(oenv.outbox, "same-names")
    assert [e["sha256"] for e in log] == shas
    on_disk = [oenv.outbox / "same-names" / e["file"] for e in log]
    assert len(set(on_disk)) == 2 and [_sha(p) for p in on_disk] == shas
    assert all(e["file"].startswith(d["id"]) for e, d in zip(log, rows))
