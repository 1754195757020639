"""The suite's own scheduling (tests/fixtures/_schedule.py) stays true to the tests it orders."""

from __future__ import annotations

import re
from pathlib import Path

from tests.fixtures._schedule import COSTS, SPLIT, _test, cost, unit_of

ROOT = Path(__file__).resolve().parents[1]


def test_every_unit_in_the_cost_table_names_a_test_file():
    for unit in COSTS:
        assert (ROOT / unit.split("::", 1)[0]).is_file(), unit


def test_a_file_split_per_test_shares_no_fixture_wider_than_a_test():
    """One unit a test may land on different processes: a module-, class- or
    package-scoped fixture of its own would be set up again on each."""
    wide = r"@pytest\.fixture\(scope=[\"'](?:module|class|package)[\"']\)\s*\ndef (\w+)"
    shared = {name for f in (ROOT / "tests" / "fixtures").glob("*.py") for name in re.findall(wide, f.read_text())}
    assert "docker_api" not in shared and "fake_discord" in shared  # the pattern finds what it should
    for path, key in SPLIT.items():
        if key is not _test:
            continue
        text = (ROOT / path).read_text()
        assert not re.findall(wide, text), path
        params = " ".join(re.findall(r"def \w+\(([^)]*)\)", text))
        assert not shared & set(re.findall(r"\w+", params)), (path, shared & set(re.findall(r"\w+", params)))


def test_the_attack_table_is_one_unit_a_backend():
    ids = ["tests/attacks/test_attacks.py::test_attack[glob_chars-docker-user]",
           "tests/attacks/test_attacks.py::test_attack[link_swap_race-docker-user]",
           "tests/attacks/test_attacks.py::test_attack[glob_chars-ssh-sftp]"]
    assert [unit_of(i) for i in ids] == ["tests/attacks/test_attacks.py::docker-user"] * 2 + [
        "tests/attacks/test_attacks.py::ssh-sftp"]
    assert unit_of("tests/test_docs.py::test_x[a-b]") == "tests/test_docs.py"
    assert unit_of("tests/test_reliability.py::test_y[pool_child]") == "tests/test_reliability.py::test_y[pool_child]"


def test_units_are_handed_out_costliest_first():
    assert cost("tests/test_compose_stack.py", 3) > cost("tests/test_docs.py", 4) > 0
