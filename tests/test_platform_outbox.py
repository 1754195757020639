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


# an installed package found by a meta-path finder, as `pip install -e` installs courier (setuptools'
# editable finder): nothing on sys.path names the package root, so a folder in the working directory
# with a package's name would be found first, as a namespace package
EDITABLE_FINDER = '''
import importlib.machinery, importlib.util, sys
ROOT = {root!r}
NAMES = ("adapters", "storage", "tasks", "workers")

class Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname in NAMES:
            return importlib.util.spec_from_file_location(
                fullname, f"{{ROOT}}/{{fullname}}/__init__.py", submodule_search_locations=[f"{{ROOT}}/{{fullname}}"])
        return None

# ahead of any other editable finder of courier, behind the path finder (as setuptools appends its own)
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, Finder)
'''


def test_a_worker_started_in_a_directory_holding_storage_and_tasks_folders(tmp_path):
    import subprocess
    import sys
    import uuid

    from workers.celery_app import make_app

    from tests.fixtures.redis_server import RedisServer
    from tests.fixtures.services import stop_process
    from tests.fixtures.workers import ROOT, CourierEnv
    from workers.demo import wait_worker

    # a Redis of its own: the module's other worker (`oenv`, another data dir) must not take this job
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis").start()
    r = redis_server.client()

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(EDITABLE_FINDER.format(root=str(ROOT)))
    env = CourierEnv(tmp_path / "env", redis_server.url)
    data = env.data_dir
    for d in ("storage", "tasks", "outbox"):  # the data dir: courier's own storage/ folder, and a tasks/ folder
        (data / d).mkdir(parents=True, exist_ok=True)
    env.env["PYTHONPATH"] = str(site)  # the package root itself is not on sys.path
    name = f"cwd{uuid.uuid4().hex[:8]}@localhost"
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "delivery",
                                 "--pool=solo", "-n", name, "--loglevel=WARNING", "--without-mingle",
                                 "--without-gossip"], env=env.env, cwd=str(data), stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_worker(make_app(env.settings()), name, proc, timeout_s=60), log.read_text()[-3000:]
        p = tmp_path / "note.txt"
        sha = write_unique(p, 700)
        env.env["PYTHONPATH"] = str(ROOT)  # (enqueue runs here, in the test process)
        (d,) = wait_job(r, enqueue(env, "outbox:from-data-dir", files=[p]))
        assert d["state"] == "delivered", d
        assert [e["sha256"] for e in read_log(env.outbox, "from-data-dir")] == [sha]
    finally:
        proc.terminate()
        stop_process(proc, timeout_s=20)
        r.close()
        redis_server.stop()


def test_an_empty_file_is_written_as_it_is(oenv, r, tmp_path):
    # chat platforms refuse a 0-byte file before any upload; the outbox is a directory and keeps it
    p = tmp_path / "empty.bin"
    p.write_bytes(b"")
    (d,) = wait_job(r, enqueue(oenv, "outbox:empties", files=[p]))
    assert d["state"] == "delivered", d
    (e,) = read_log(oenv.outbox, "empties")
    assert e["size_bytes"] == 0 and (oenv.outbox / "empties" / e["file"]).stat().st_size == 0
