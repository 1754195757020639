"""A stalled sandbox costs one slot, once (issue 22, item 6): the per-sandbox
circuit breaker of tasks/turn/breaker.py, against a real podman container whose
shell stalls (tests/fixtures/podman.py `StallingContainer`: every exec the
sandbox code makes runs its `sh`, which waits while the container is stalled,
and each run is counted in the container) and a real Redis.

- the breaker's life, as plain code (`extract.run`, no broker): the first
  timeout opens it; while it is open the sandbox's other files are postponed
  untried (no exec reaches it, no attempt counted, due at its end); at its end
  one file probes, a timeout opens it again for longer, an answer closes it and
  hands every postponed file on; past the outage deadline a postponed file
  fails with the reason;
- the stalled-sandbox row, through real worker processes: 50 files on a
  stalled container and another chat's file on a healthy one at the same
  time. The other file is delivered while the stalled sandbox is still not
  answering, the stalled one cost one shell run per breaker period, and once
  it answers again all 50 are delivered, none lost.

No assertion reads a clock: what is counted is the shell runs that reached
the container, the attempts in the receipts and the breaker's periods.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import pytest

from adapters.sandboxes.base import SandboxRef
from tasks.dispatch import chains
from tasks.ledger import keys, receipts
from tasks.turn import breaker, extract
from tasks.runtime import Context
from tests.fixtures.podman import StallingContainer
from tests.fixtures.services import wait_until

pytestmark = pytest.mark.timeout(600)

#: the read deadline the tests run with (the breaker's first period too) and its longest period
IO_TIMEOUT_S = 2.0
BREAKER_MAX_S = 4.0


@pytest.fixture
def stalling(docker_api):
    made: list[StallingContainer] = []

    def make(files: int = 0) -> StallingContainer:
        c = StallingContainer(docker_api, files=files)
        made.append(c)
        return c

    yield make
    for c in made:
        c.remove()


@pytest.fixture
def plain(docker_api, redis_client, tmp_path):
    """`extract.run` as a sandbox worker runs it, without a broker: real docker sandboxes
    (read deadline IO_TIMEOUT_S), a volume store, the breaker's settings of the tests."""
    from adapters.sandboxes.docker import DockerSandbox
    from storage.volume import VolumeStore

    client = docker_api.client()
    ctx = Context(redis=redis_client, store=VolumeStore(tmp_path / "store"), platform=None,  # type: ignore[arg-type]
                  sandbox=lambda ref: DockerSandbox(ref, None, client=client, io_timeout_s=IO_TIMEOUT_S),
                  agent=lambda name: None, sandbox_io_timeout_s=IO_TIMEOUT_S, sandbox_breaker_max_s=BREAKER_MAX_S)
    yield ctx
    client.close()


def register(r, ctr: StallingContainer, indexes: list[int], target: str = "outbox:breaker") -> list[str]:
    files = [chains.SandboxFile(ref=SandboxRef("docker", ctr.name), path=ctr.path(i)) for i in indexes]
    job = chains.new_job_id("brk")
    return [e.did for e in chains.register(r, chains.Plan(job_id=job, target=target, files=files), job_kind="send")]


def ident(ctr: StallingContainer) -> str:
    return breaker.ident_of({"kind": "docker", "target": ctr.name, "options": {}})


def field(r, did: str, name: str) -> str:
    return (receipts.get_delivery(r, did) or {}).get(name, "")


def gauge(r) -> dict[str, int]:
    """`courier_sandbox_breakers` as /metrics reads it (workers/metrics.py's collector)."""
    from workers.metrics import LedgerCollector

    (family,) = [m for m in LedgerCollector(r).collect() if m.name == "courier_sandbox_breakers"]
    return {s.labels["state"]: int(s.value) for s in family.samples}


def counted(event: str) -> float:
    """`courier_sandbox_breaker_events_total` of docker sandboxes in this process."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("courier_sandbox_breaker_events_total", {"sandbox": "docker", "event": event}) or 0


def _patient(sandbox):
    """A sandbox of the fixture's whose reads wait a minute: the machine's load is no stall."""
    sandbox.io_timeout_s = 60.0
    return sandbox


def test_the_breaker_opens_postpones_untried_probes_and_closes(plain, stalling):
    r, ctx = plain.redis, plain
    ctr = stalling(files=4)
    a, b, c, d = register(r, ctr, [0, 1, 2, 3])
    sid = ident(ctr)
    opened, postponed = counted("opened"), counted("postponed")
    ctr.stall()

    # the first timeout opens the breaker: one shell run, one attempt
    assert extract.run(ctx, a)["state"] == "retrying"
    st = breaker.state(r, sid)
    assert st["state"] == "open" and st["opens"] == "1" and "nothing received" in st["reason"], st
    assert ctr.calls() == 1 and field(r, a, "transient_errors") == "1"
    assert gauge(r) == {"open": 1, "half_open": 0}

    # while it is open, the others (and a re-drive of the first) are postponed untried, due at its end
    for did in (b, c, a):
        out = extract.run(ctx, did)
        assert out["state"] == "retrying", out
    assert ctr.calls() == 1
    assert field(r, b, "transient_errors") == field(r, c, "transient_errors") == "0"
    assert field(r, a, "transient_errors") == "1"
    assert "not answering" in field(r, b, "reason") and field(r, b, "state") == "retrying"
    until = float(breaker.state(r, sid)["until_s"])
    assert until - 0.001 <= r.zscore(keys.due("extract"), b) < until + IO_TIMEOUT_S  # due at the breaker's end
    assert r.smembers(keys.breaker_waiting(sid)) == {a, b, c}
    assert not r.exists(keys.lease("extract", b))  # no slot held: the stage's lease is back

    # at its end ONE file probes; a second timeout opens it again, for longer
    wait_until(lambda: breaker.state(r, sid)["state"] == "half_open", timeout_s=30, what="the breaker's end")
    assert extract.run(ctx, b)["state"] == "retrying"
    st = breaker.state(r, sid)
    assert st["state"] == "open" and st["opens"] == "2" and ctr.calls() == 2, st
    assert float(st["until_s"]) - until >= min(BREAKER_MAX_S, 2 * IO_TIMEOUT_S)  # twice as long, from its end on
    assert field(r, b, "transient_errors") == "1"  # the probe reached the sandbox: an attempt

    # the sandbox answers again: the next probe closes the breaker and hands every postponed file on
    ctr.resume()
    # (from here on the sandbox answers: a loaded machine's slow exec is not a stall to this test)
    # (the sandboxes' own read deadline too: seen under load, a probe's exec slower than 2 s was a stall)
    answering = dataclasses.replace(ctx, sandbox_io_timeout_s=60.0, sandbox=lambda ref: _patient(ctx.sandbox(ref)))
    wait_until(lambda: breaker.state(r, sid)["state"] == "half_open", timeout_s=30, what="the breaker's end")
    out = extract.run(answering, d)
    assert out["state"] == "extracted", out
    assert set(out["wake"]["ids"]) == {a, b, c} and out["wake"]["queue"] == "sandbox"
    assert breaker.state(r, sid) == {"state": "closed", "waiting": "0"} and gauge(r) == {"open": 0, "half_open": 0}
    now = time.time()
    assert all(r.zscore(keys.due("extract"), did) <= now + breaker.HANDOFF_GRACE_S for did in (a, b, c))

    # a sandbox that answered lately runs its files at once (no scout between them)
    for did in (a, b, c):
        assert extract.run(answering, did)["state"] == "extracted"
    assert [field(r, did, "transient_errors") for did in (a, b, c, d)] == ["1", "1", "0", ""]
    assert [field(r, did, "size_bytes") for did in (a, b, c, d)] == ["8"] * 4
    assert (counted("opened") - opened, counted("postponed") - postponed) == (2, 3)


def test_a_file_whose_sandbox_stays_stalled_fails_at_the_outage_deadline(plain, stalling):
    r = plain.redis
    # a breaker period far longer than the deadline (the sandbox's own read deadline stays IO_TIMEOUT_S):
    # the file is postponed again, never the probe, whatever the machine's load
    ctx = dataclasses.replace(plain, outage_deadline_s=0.5, sandbox_io_timeout_s=60.0)
    ctr = stalling(files=2)
    a, b = register(r, ctr, [0, 1])
    ctr.stall()
    assert extract.run(ctx, a)["state"] == "retrying"  # opens the breaker (the deadline counts from here for b)
    assert extract.run(ctx, b)["state"] == "retrying"
    first_s = float(field(r, b, "first_error_s"))
    wait_until(lambda: time.time() > first_s + 0.5, timeout_s=10, what="the outage deadline")
    out = extract.run(ctx, b)
    assert out["state"] == "failed"
    rec = receipts.get_delivery(r, b) or {}
    assert rec["extraction"] == "failed" and rec["notify"] == "the agent's sandbox stopped answering; the operator was told"
    assert rec["reason"].startswith("sandbox unavailable: docker sandbox ") and "not answering" in rec["reason"]
    assert ctr.calls() == 1 and rec["transient_errors"] == "0"  # never tried: the deadline, not the attempts


@pytest.mark.parametrize("mode", ["sftp", "openssh"])
def test_an_ssh_host_that_stops_answering_is_the_timeout_that_opens_its_breaker(sshd_server, tmp_path, store, mode):
    """The breaker's trigger on ssh: its session processes stopped (SIGSTOP), the
    next extraction on the pooled connection ends with ReadTimeout within the
    read deadline (old code, paramiko SFTP: blocked opening its channel, up to
    paramiko's hour), and once they go on the sandbox answers again."""
    import os
    import shutil
    import signal
    import subprocess
    import tempfile

    from adapters.sandboxes.base import ReadTimeout
    from tests.fixtures.services import bounded
    from tests.test_sandbox_ssh import make

    def tree(pids: list[int]) -> list[int]:
        kids = [int(k) for p in pids for k in subprocess.run(["ps", "-o", "pid=", "--ppid", str(p)],
                                                              capture_output=True, text=True).stdout.split()]
        return pids + (tree(kids) if kids else [])

    root, control = tmp_path / "root", tempfile.mkdtemp(prefix="cm", dir="/tmp")  # a ControlPath stays short
    root.mkdir()
    os.chmod(tmp_path, 0o755)
    (root / "f.txt").write_bytes(b"answer\n")
    s = make(sshd_server, root, mode, control, io_timeout_s=5.0)  # a loaded machine answers well within it
    try:
        assert s.extract(str(root / "f.txt"), store, "files/a").size_bytes == 7  # its connection pooled
        stopped = tree(sshd_server.session_pids())
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            _res, exc, _took = bounded(lambda: s.extract(str(root / "f.txt"), store, "files/b"), 60)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert isinstance(exc, ReadTimeout) and breaker.is_timeout(exc), repr(exc)
        assert s.extract(str(root / "f.txt"), store, "files/c").size_bytes == 7
    finally:
        s.close()
        shutil.rmtree(control, ignore_errors=True)


def test_a_stalled_container_costs_one_slot_per_period_and_other_chats_never_wait(courier_env, docker_api, stalling,
                                                                                   redis_client):
    """The stalled-sandbox row: 50 files on a container whose shell stalls, and
    another chat's file on a healthy container right after them on the same
    queue, through a real worker (2 processes)."""
    from adapters.platforms.outbox import read_log

    r = redis_client
    stalled, healthy = stalling(files=50), stalling(files=1)
    stalled.stall()
    env = courier_env(COURIER_DOCKER_HOST=docker_api.base_url, COURIER_SANDBOX_IO_TIMEOUT_S=str(IO_TIMEOUT_S),
                      COURIER_SANDBOX_BREAKER_MAX_S=str(BREAKER_MAX_S))
    env.start_worker(concurrency=2)

    def send(chat: str, uris: list[str]) -> list[str]:
        res = env.cli("send", f"outbox:{chat}", *uris, "--json")
        assert res.returncode == 0, res.stderr + res.stdout
        return json.loads(res.stdout)["deliveries"]

    fifty = send("stalled", [f"docker://{stalled.name}{stalled.path(i)}" for i in range(50)])
    (other,) = send("other", [f"docker://{healthy.name}{healthy.path(0)}"])
    sid = ident(stalled)

    def states(ids: list[str]) -> list[str]:
        return [field(r, did, "state") for did in ids]

    wait_until(lambda: field(r, other, "state") == "delivered", timeout_s=240,
               what=lambda: f"the other chat's file: {receipts.get_delivery(r, other)}")
    # the moment it is delivered: what the stalled sandbox cost so far, and that it was not let in again
    calls = stalled.calls()
    st = breaker.state(r, sid)
    scouting = r.exists(keys.breaker_scout(sid))
    assert calls <= int(st.get("opens") or 0) + 1, (calls, st)  # the scout, then one probe a breaker period
    assert st["state"] != "closed" or scouting, st
    assert "delivered" not in states(fifty)

    # two breaker periods: the probe that ended the first one found it stalled still
    wait_until(lambda: int(breaker.state(r, sid).get("opens") or 0) >= 2, timeout_s=120,
               what=lambda: f"a second period: {breaker.state(r, sid)}")
    calls = stalled.calls()
    st = breaker.state(r, sid)
    assert calls <= int(st["opens"]) + 1, (calls, st)
    attempts = sum(int(field(r, did, "transient_errors") or 0) for did in fifty)
    assert attempts <= int(st["opens"]) + 1, (attempts, st)  # the others were postponed untried

    stalled.resume()
    wait_until(lambda: all(s in ("delivered", "failed") for s in states(fifty)), timeout_s=240,
               what=lambda: f"the 50 files: {sorted(set(states(fifty)))} {breaker.state(r, sid)}")
    assert states(fifty) == ["delivered"] * 50  # 0 lost, 0 failed
    log = read_log(env.outbox, "stalled")
    assert [row["sha256"] for row in log] == [hashlib.sha256(f"file {i:02d}\n".encode()).hexdigest()
                                              for i in range(50)]
    assert breaker.state(r, sid)["state"] == "closed"
