"""The Lua scripts (tasks/ledger/lua/*.lua) and their registry (tasks/ledger/scripts.py): each file has a
header naming every KEYS[i] and ARGV[i] and binds them to named locals; every key a script
touches comes in KEYS; no state name of tasks/states.py is written in a script; every script is
run by the code, only through the registry, and every name the code runs exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks import states
from tasks.ledger import keys, scripts

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted(scripts.DIR.glob("*.lua"))
NAMES = [p.stem for p in FILES]

_DECL = re.compile(r"^--\s+(KEYS|ARGV)\[(\d+)(\.\.\.|\?)?\]\s+(\w+):")
#: `local name = KEYS[i]`, `local name = tonumber(ARGV[i])`, `local name = {unpack(KEYS, i)}`
_BIND = re.compile(r"^local (\w+) = (?:tonumber\()?(KEYS|ARGV)\[(\d+)\]\)?$")
_BIND_REST = re.compile(r"^local (\w+) = \{unpack\((KEYS|ARGV), (\d+)\)\}$")
_CALL = re.compile(r"redis\.call\(\s*'(\w+)'\s*,\s*([^,)]+)")


def _split(path: Path) -> tuple[list[str], list[str]]:
    """(the header's lines, the code's lines without comments)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    n = 0
    while n < len(lines) and lines[n].startswith("--"):
        n += 1
    code = [re.sub(r"--.*$", "", line).rstrip() for line in lines[n:]]
    return lines[:n], code


def test_the_scripts_are_there():
    assert len(FILES) >= 18 and scripts.names() == frozenset(NAMES)


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_a_script_declares_its_keys_and_args_and_binds_them_to_names(path):
    header, code = _split(path)
    assert header and header[0].startswith(f"-- {path.stem}: "), "the header starts with the name and what it does"
    declared: dict[str, dict[int, str]] = {"KEYS": {}, "ARGV": {}}
    for line in header:
        m = _DECL.match(line)
        if m:
            declared[m[1]][int(m[2])] = m[3] or ""
    assert declared["KEYS"], "a script touches at least one key"
    bound: dict[str, dict[int, str]] = {"KEYS": {}, "ARGV": {}}
    for line in code:
        if "KEYS" not in line and "ARGV" not in line:
            continue
        rest = _BIND_REST.match(line)
        m = rest or _BIND.match(line)
        assert m, f"KEYS and ARGV are only read into named locals: {line!r}"
        bound[m[2]][int(m[3])] = "..." if rest else ""
    for kind in ("KEYS", "ARGV"):
        d = declared[kind]
        assert sorted(d) == list(range(1, len(d) + 1)), f"{kind} declared as 1..n: {sorted(d)}"
        assert set(bound[kind]) == set(d), f"{kind} declared {sorted(d)}, bound {sorted(bound[kind])}"
        for i, mark in d.items():
            assert (mark == "...") == (bound[kind][i] == "..."), f"{kind}[{i}{mark}] bound as {bound[kind][i] or 'one'}"
        rest = [i for i, mark in d.items() if mark == "..."]
        assert not rest or rest == [max(d)], f"only the last {kind} is the rest"
    # the registry checks callers against the same header
    lua = scripts.load(path.stem)
    fixed = {kind: [i for i, mark in declared[kind].items() if not mark] for kind in declared}
    assert (lua.keys, lua.args) == (len(fixed["KEYS"]), len(fixed["ARGV"]))


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_no_key_is_built_inside_a_script(path):
    """Conservative: a script concatenates nothing (no `..` outside comments), and the key of
    every redis.call is a local bound from KEYS (directly, from the KEYS rest, or a loop over it)
    and never assigned anything else."""
    _, code = _split(path)
    text = "\n".join(code)
    assert ".." not in text.replace("...", ""), "no string is built inside a script"
    key_tables = {m[1] for line in code if (m := _BIND_REST.match(line)) and m[2] == "KEYS"}
    key_names = {m[1] for line in code if (m := _BIND.match(line)) and m[2] == "KEYS"}
    for t in key_tables:
        key_names |= set(re.findall(rf"local (\w+) = {t}\[[^\]]+\]$", text, re.M))
        key_names |= set(re.findall(rf"for _, (\w+) in ipairs\({t}\)", text))
    calls = _CALL.findall(text)
    assert calls
    for cmd, first in calls:
        assert first.strip() in key_names, f"redis.call('{cmd}', {first.strip()}): not a key from KEYS"
    for name in key_names:
        assigned = re.findall(rf"^\s*(?:local )?{name}\s*=(?!=)", text, re.M)
        assert len(assigned) <= 1, f"{name} is assigned once, from KEYS"


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_no_state_name_is_written_in_a_script(path):
    """State names are states.py's: a script gets the ones it needs in ARGV."""
    owned = {str(s) for s in (*states.DeliveryState, *states.JobState)}
    owned |= {states.EXTRACTION_OK, states.EXTRACTION_FAILED}
    _, code = _split(path)
    # a hash field named like a state (a receipt's `rate_limited` counts the 429s) is no state
    text = re.sub(r"redis\.call\('(?:hdel|hget|hmget|hincrby|hexists)'[^)]*\)", "", "\n".join(code))
    literals = re.findall(r"'([^']*)'|\"([^\"]*)\"", text)
    found = {a or b for a, b in literals} & owned
    assert not found, f"state names written in the script: {sorted(found)}"


def _sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for d in ("tasks", "workers", "adapters", "storage")
            for p in sorted((ROOT / d).rglob("*.py"))}


def test_every_script_is_run_by_the_code_and_every_name_run_exists():
    run = set()
    for path, text in _sources().items():
        for m in re.finditer(r"scripts\.run(?:_async)?\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*(\S+?)\s*,", text):
            assert re.fullmatch(r'"\w+"', m[1]), f"{path.name}: a script is named by a literal, not {m[1]}"
            run.add(m[1].strip('"'))
    assert run - set(NAMES) == set(), "names run without a file"
    assert set(NAMES) - run == set(), "files no code runs"


def test_scripts_run_only_through_the_registry():
    for path, text in _sources().items():
        if path == ROOT / "tasks" / "ledger" / "scripts.py":
            continue
        for pattern in (r"redis\.call\(", r"\.eval(?:sha)?\(", r"register_script\(", r"\bScript\("):
            assert not re.search(pattern, text), f"{path.relative_to(ROOT)}: {pattern}"


def test_the_registry_checks_counts_and_runs_on_a_client_a_pipeline_and_after_redis_lost_its_scripts(redis_client):
    r = redis_client
    lease = keys.lease("lane", "test:lua")
    with pytest.raises(ValueError, match="lease_renew.lua takes 2 ARGV, given 1"):
        scripts.run(r, "lease_renew", keys=[lease], args=["token"])
    with pytest.raises(ValueError, match="KEYS"):
        scripts.run(r, "lease_renew", keys=[], args=["token", 10])
    r.set(lease, "token", ex=5)
    assert scripts.run(r, "lease_renew", keys=[lease], args=["token", 60]) == 1 and r.ttl(lease) > 5
    assert scripts.run(r, "lease_renew", keys=[lease], args=["another", 90]) == 0 and r.ttl(lease) <= 60
    r.script_flush()  # a Redis restarted: its script cache is empty
    p = r.pipeline(transaction=False)
    p.get(lease)
    scripts.run(p, "lease_release", keys=[lease], args=["another"])
    scripts.run(p, "lease_release", keys=[lease], args=["token"])
    assert p.execute() == ["token", 0, 1] and not r.exists(lease)
    r.script_flush()
    r.set(lease, "token")
    assert scripts.run(r, "lease_release", keys=[lease], args=["token"]) == 1 and not r.exists(lease)


def test_the_scripts_ship_with_the_package():
    """pyproject's package data names the folder the registry reads (beside tasks/ledger/scripts.py)."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = scripts.__name__.rpartition(".")[0]
    folder = scripts.DIR.relative_to(Path(scripts.__file__).resolve().parent)
    assert f"{folder}/*.lua" in data[package]


def test_a_lane_found_empty_is_kept_when_a_step_came_before_it_was_forgotten(redis_client):
    """lane_forget.lua checks the lane is still empty in the step that forgets it and releases its
    lease: a step appended after the look read no head (its wake-up found the lease held) keeps
    the lane's due time and the lease, and the look goes on with it."""
    r, target = redis_client, "memory:lua-forget"
    lane, lease, due, ready = keys.lane(target), keys.lease("lane", target), keys.due("lane"), keys.lanes_ready()
    r.set(lease, "tok")
    r.zadd(due, {target: 1})
    r.rpush(lane, "d1")  # appended after the look read an empty lane
    assert scripts.run(r, "lane_forget", keys=[lane, due, lease, ready], args=[target, "tok", "1"]) == ["again"]
    assert r.get(lease) == "tok" and r.zscore(due, target) == 1
    r.delete(lane)
    r.zadd(ready, {"memory:next": 1})
    got = scripts.run(r, "lane_forget", keys=[lane, due, lease, ready], args=[target, "tok", "1"])
    assert got == ["empty", "memory:next"]
    assert not r.exists(lease) and r.zscore(due, target) is None and not r.exists(ready)


def test_a_head_being_extracted_parks_the_lane_and_releases_its_lease_in_one_step(redis_client):
    """lane_head.lua: a file still in its sandbox sets the lane's due time and releases the lease
    together; a ready one is locked and counted; a head that moved is looked at again."""
    from tasks.delivery import lanes

    r, target = redis_client, "memory:lua-head"
    lane, lease, due = keys.lane(target), keys.lease("lane", target), keys.due("lane")
    r.set(lease, "tok")
    r.rpush(lane, "d1")
    r.hset(keys.delivery("d1"), mapping={"state": "queued", "queue": "sandbox", "attempts": "0"})
    ks = [lane, due, lease, keys.delivery("d1"), keys.delivery_lock("d1")]
    consts = [lanes.DEAD_SEND, states.DeliveryState.SENDING, states.EXTRACTION_OK, states.EXTRACTION_FAILED,
              *sorted(states.DELIVERY_OVER)]
    assert scripts.run(r, "lane_head", keys=ks, args=[target, "tok", "d0", 99, "", 20, *consts]) == ["moved"]
    assert scripts.run(r, "lane_head", keys=ks, args=[target, "tok", "d1", 99, "own", 20, *consts]) == ["extracting"]
    assert not r.exists(lease) and r.zscore(due, target) == 99 and not r.exists(keys.delivery_lock("d1"))
    r.hset(keys.delivery("d1"), "extraction", states.EXTRACTION_OK)
    got = scripts.run(r, "lane_head", keys=ks, args=[target, "tok", "d1", 99, "own", 20, *consts])
    assert got[0] == "head" and got[2:] == [1, 1] and r.get(keys.delivery_lock("d1")) == "own"
    assert r.hget(keys.delivery("d1"), "state") == states.DeliveryState.SENDING
