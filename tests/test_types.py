"""mypy over the four packages (configured in pyproject.toml): the typed seams
(task messages, states, the context, the platform and sandbox bases) hold.
The tasks layer and the base modules every adapter and store builds on are
checked as `mypy --strict` checks them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.fixtures.services import need, user_cache

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        import mypy  # noqa: F401
    except ImportError:
        need(False, "mypy is not installed (pip install -e .[test])")
    # mypy's incremental cache outside the checkout (one a flag set: a cache made with other flags is
    # thrown away): a fresh clone's run re-checks only what differs (by content), 10 s -> 0.4 s of CPU
    cache = user_cache("mypy-strict" if "--strict" in args else "mypy")
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=580)


def _strict_modules() -> list[str]:
    """The modules pyproject.toml's strict override names (`tasks.*`: the package)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        overrides = tomllib.load(f)["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if o.get("disallow_untyped_defs") and o.get("disallow_any_generics")]
    assert len(strict) == 1, "one override holds the strict flags"
    return list(strict[0]["module"])


@pytest.mark.timeout(600)
def test_mypy_is_clean():
    res = _mypy("adapters", "tasks", "workers", "storage")
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


@pytest.mark.timeout(600)
def test_strict_modules_pass_mypy_strict():
    """`mypy --strict` finds nothing in the modules the strict override names
    (what it says of third-party code they import is not theirs), and the
    override names the seams: the tasks layer, the platform and store bases,
    the error tree."""
    modules = _strict_modules()
    assert {"tasks.*", "adapters.platforms.base", "adapters.sandboxes.base", "storage.base", "adapters.errors"} <= set(modules)
    paths = [m[:-2].replace(".", "/") if m.endswith(".*") else m.replace(".", "/") + ".py" for m in modules]
    res = _mypy("--strict", *paths)
    mine = [line for line in res.stdout.splitlines()
            if any(line.startswith(p if p.endswith(".py") else p + "/") for p in paths) and ": error:" in line]
    assert not mine, "\n".join(mine[:50])
    assert res.returncode == 0 or "error:" in res.stdout, res.stderr[-2000:]  # mypy itself ran


def test_type_ignores_in_tasks_are_few_and_each_says_why():
    """Issue 23: `type: ignore` had risen to 44; in `tasks/` (mypy strict) there are fewer than 15 and each
    names its error code and says why after it."""
    import re

    found = []
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" in line:
                found.append((f"{path.relative_to(ROOT)}:{n}", line))
    assert len(found) < 15, [w for w, _ in found]
    for where, line in found:
        assert re.search(r"type: ignore\[[a-z-]+(,[a-z-]+)*\]\s+#\s*\S", line), f"{where}: no reason given: {line.strip()}"


# -- the delivery spec: typed in Python, the same JSON on the wire ---------------------------------
#: delivery specs as courier wrote them into receipts before `DeliverySpec` (19db91c): a deployment
#: upgrading mid-flight has these queued, signed, and must still send them
LEGACY_SPECS = [
    {"id": "turn_a.0", "job": "turn_a", "target": "telegram:42", "type": "text", "text": "héllo"},
    {"id": "snd_b.1", "job": "snd_b", "target": "outbox:c", "type": "file", "voice": False, "as_document": True,
     "key": "files/snd_b/1-x.pdf", "name": "x.pdf", "size": 3, "sha256": "00", "caption": "cap"},
    {"id": "turn_c.1", "job": "turn_c", "target": "slack:C1", "type": "file", "voice": True, "as_document": False,
     "key": "files/turn_c/1-a.ogg", "name": "a.ogg",
     "extract": {"sandbox": {"kind": "docker", "target": "box", "roots": ["/w"], "options": {"host": "h1"}},
                 "path": "/w/a.ogg", "key": "files/turn_c/1-a.ogg", "max_bytes": 1000},
     "told_by": "turn_c.2"},
    {"id": "turn_c.2", "job": "turn_c", "target": "slack:C1", "type": "file", "voice": False, "as_document": False,
     "key": "files/turn_c/2-b.png", "name": "b.png",
     "extract": {"sandbox": {"kind": "local", "target": "", "roots": [], "options": {}},
                 "path": "/tmp/b.png", "key": "files/turn_c/2-b.png"},
     "tell": ["turn_c.1", "turn_c.2"]},
]


@pytest.mark.parametrize("wire", LEGACY_SPECS, ids=[w["id"] for w in LEGACY_SPECS])
def test_a_spec_written_before_the_typed_spec_reads_and_writes_back_the_same(wire):
    """Sealed by the code before `DeliverySpec`, read by this one: the same delivery (the wire's
    `id` is `delivery_id`, `job` is `job_id`), and written back as the very same JSON."""
    import json

    from tasks.delivery import specs
    from tasks.ledger import signing
    from tasks.messages import DeliverySpec

    spec = specs.open_delivery(wire["id"], signing.seal_json("delivery", wire["id"], wire))
    assert (spec.delivery_id, spec.job_id, spec.target, spec.type) == (wire["id"], wire["job"], wire["target"],
                                                                       wire["type"])
    assert spec.extract is None if "extract" not in wire else spec.extract.path == wire["extract"]["path"]
    assert json.dumps(spec.to_json()) == json.dumps(wire)  # key for key, in the same order
    assert DeliverySpec.from_json({**wire, "added_later": 1}) == spec  # a newer writer's extra key is ignored


def test_what_chains_writes_is_what_it_wrote_before():
    """Every kind of delivery a plan makes (text, stored file with a caption, sandbox files with a size
    cap, an album, a reply's notice of unsent files) round-trips, and keeps the legacy keys."""
    from adapters.sandboxes.base import SandboxRef
    from tasks.dispatch import chains
    from tasks.messages import DeliverySpec

    ref = SandboxRef("local")
    plan = chains.Plan(job_id="turn_x", target="telegram:1", text="hi", caption="cap", max_bytes=500,
                       album_max=10, tell_unsent=True,
                       files=[chains.StoredFile(key="files/turn_x/1-a.pdf", name="a.pdf", size=3, sha256="00"),
                              chains.SandboxFile(ref, "/tmp/p1.jpg"), chains.SandboxFile(ref, "/tmp/p2.jpg")])
    items = chains.entries(plan)
    for e in items:
        wire = e.spec.to_json()
        assert DeliverySpec.from_json(wire) == e.spec and wire["id"] == e.did and wire["job"] == "turn_x"
    wires = [e.spec.to_json() for e in items]
    assert wires[0] == {"id": "turn_x.0", "job": "turn_x", "target": "telegram:1", "type": "text", "text": "hi"}
    assert wires[1]["caption"] == "cap" and wires[2]["extract"]["max_bytes"] == 500
    assert wires[3]["tell"] == ["turn_x.1", "turn_x.2", "turn_x.3"] and wires[1]["told_by"] == "turn_x.3"


@pytest.mark.parametrize("bad", [{"id": "x.0", "job": "x", "type": "file"}, {"plain": True}, [1, 2],
                                 {"id": "x.0", "job": "x", "target": "t:1", "type": "video"}])
def test_a_json_that_is_no_delivery_spec_is_refused(bad):
    from tasks.messages import DeliverySpec

    with pytest.raises(ValueError):
        DeliverySpec.from_json(bad)


# -- states as enums --------------------------------------------------------------------------------
#: string literals in tasks/ equal to a state's value that are not a state (another vocabulary that
#: shares the word), with why; every other state in tasks/ is a `DeliveryState`/`JobState` member
BARE_STATE_WORDS_ALLOWED = {
    ("confirm.py", "delivered"): (1, "a platform's status word (RANK), not a receipt's state"),
    ("confirm.py", "failed"): (4, "a platform's status word and the confirm script's answer"),
    ("events.py", "error"): (2, "an agent's tool_result status and its `error` field"),
    ("extract.py", "error"): (1, "the extraction metric's outcome label (ok | failed | error)"),
    ("extract.py", "failed"): (4, "the extraction metric's outcome label (ok | failed | error)"),
    ("lanes.py", "rate_limited"): (1, "the receipt's counter field of 429s, not its state"),
    ("listing.py", "rate_limited"): (1, "the receipt's counter field of 429s, not its state"),
    ("operations.py", "cancelled"): (2, "the cancel script's answer"),
    ("turn.py", "error"): (3, "an agent bridge's result status (BridgeResult: completed | error | no_reply)"),
    ("turn.py", "no_reply"): (1, "an agent bridge's result status (BridgeResult: completed | error | no_reply)"),
}


def _bare_state_words() -> dict[tuple[str, str], list[int]]:
    """String constants in tasks/*.py (not states.py) equal to a DeliveryState or JobState value,
    docstrings and f-string parts left out: (file, word) -> lines."""
    import ast

    from tasks.states import DeliveryState, JobState

    words = {s.value for s in DeliveryState} | {s.value for s in JobState}
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted((ROOT / "tasks").rglob("*.py")):
        if path.name == "states.py":
            continue
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                skip.update(id(n) for n in ast.walk(node))
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    skip.add(id(first.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words \
                    and id(node) not in skip:
                found.setdefault((path.name, node.value), []).append(node.lineno)
    return found


def test_states_in_tasks_are_enum_members_not_bare_strings():
    """Issue 23: `DeliveryState`/`JobState` existed and no code used a member (117 bare state strings).
    In tasks/ a state is a member; the words left are another vocabulary's, each listed with why."""
    found = _bare_state_words()
    extra = {k: lines for k, lines in found.items()
             if len(lines) > BARE_STATE_WORDS_ALLOWED.get(k, (0, ""))[0]}
    assert not extra, f"bare state strings (use DeliveryState/JobState, or list why): {extra}"
    assert sum(len(v) for v in found.values()) <= 20


def test_a_state_member_is_its_string_where_it_is_stored_and_sent():
    """StrEnum members are written to Redis, JSON and metrics labels as their plain value."""
    import json

    from tasks.states import DeliveryState, JobState

    assert json.dumps({"state": DeliveryState.FAILED}) == '{"state": "failed"}'
    assert f"{JobState.NO_REPLY}" == str(JobState.NO_REPLY) == "no_reply" and DeliveryState.QUEUED == "queued"


def test_a_state_member_goes_to_redis_as_its_value(redis_client):
    from tasks.ledger import keys, receipts
    from tasks.states import DeliveryState

    receipts.update_delivery(redis_client, "types_x.0", state=DeliveryState.RATE_LIMITED)
    assert redis_client.hget(keys.delivery("types_x.0"), "state") == "rate_limited"
    redis_client.delete(keys.delivery("types_x.0"))


def test_the_cli_and_the_send_task_build_a_send_plan_one_way():
    """Issue 23: `courier send` and the operator's send task (Flower) built their plans two ways; both
    go through `tasks.ops.send.check_send` now, and nothing else in workers/ makes a `chains.Plan`."""
    cli = (ROOT / "workers" / "cli.py").read_text()
    assert "check_send(" in cli and "chains.Plan(" not in cli
    assert [p.name for p in sorted((ROOT / "workers").rglob("*.py")) if "chains.Plan(" in p.read_text()] == []
    send = (ROOT / "tasks" / "ops" / "send.py").read_text()
    assert send.count("chains.Plan(") == 1  # CheckedSend.plan


def test_a_send_is_checked_the_same_with_and_without_files_of_the_host(tmp_path):
    """`check_send`: a file given without `://` is the sender's host file when it takes them
    (`courier send`), else an absolute path in the local sandbox (the send task); the rest alike."""
    from adapters.errors import ConfigError
    from tasks.dispatch import chains
    from tasks.ops.send import HostFile, NothingToSend, check_send

    def checked(**kw):
        return check_send("outbox:x", platform=lambda: None, album_max=lambda: 10, open_sandbox=lambda ref: None,
                          max_files=2, max_file_bytes=1000, **kw)

    with pytest.raises(NothingToSend):
        checked(text="  ")
    with pytest.raises(ConfigError, match="at most 2 go with one send"):
        checked(files=["a", "b", "c"], host_files=lambda raw: HostFile(raw, raw))
    with pytest.raises(ConfigError, match="not a sandbox URI or an absolute path"):
        checked(files=["report.pdf"])
    ok = checked(text="hi", files=["report.pdf"], host_files=lambda raw: HostFile(f"/home/u/{raw}", raw))
    assert ok.files == [HostFile("/home/u/report.pdf", "report.pdf")] and ok.album_max == 10
    plan = ok.plan("snd_t", upload=lambda job, seq, f: chains.StoredFile(f"files/{job}/{seq}-{f.name}", f.name, 3, ""))
    assert plan.files == [chains.StoredFile("files/snd_t/0-report.pdf", "report.pdf", 3, "")] and plan.text == "hi"
