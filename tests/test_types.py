"""mypy over the four packages (configured in pyproject.toml): the typed seams
(task messages, states, the context, the platform and sandbox bases) hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.services import need

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_mypy_is_clean():
    try:
        import mypy  # noqa: F401
    except ImportError:
        need(False, "mypy is not installed (pip install -e .[test])")
    res = subprocess.run([sys.executable, "-m", "mypy", "adapters", "tasks", "workers", "storage"], cwd=ROOT,
                         capture_output=True, text=True, timeout=580)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
