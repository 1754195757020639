"""The README documents every setting, and CI runs the README's test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme():
    sys.path.insert(0, str(ROOT / "scripts"))
    from settings_table import env_name

    from workers.settings import Settings

    readme = (ROOT / "README.md").read_text()
    missing = [env_name(n, f) for n, f in Settings.model_fields.items() if f"`{env_name(n, f)}`" not in readme]
    assert not missing, f"settings missing from README.md (run scripts/settings_table.py): {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/test" in readme and "./scripts/demo" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci


def test_secrets_do_not_show_in_help_or_repr(monkeypatch):
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123456:SUPERSECRETTOKEN")
    from workers.settings import Settings

    assert "SUPERSECRETTOKEN" not in repr(Settings())
    env = {"TELEGRAM_BOT_TOKEN": "123456:SUPERSECRETTOKEN", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for cmd in ([], ["send", "--help"], ["turn", "--help"], ["demo", "--help"]):
        res = subprocess.run([sys.executable, "-m", "workers.cli", *cmd, "--help"] if not cmd else
                             [sys.executable, "-m", "workers.cli", *cmd], capture_output=True, text=True,
                             env=env, cwd=str(ROOT), timeout=60)
        assert "SUPERSECRETTOKEN" not in res.stdout + res.stderr


def test_an_empty_variable_means_not_set(monkeypatch, tmp_path):
    """`NAME=` (compose, .env) for every setting, lists and maps included,
    loads the defaults instead of failing."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from settings_table import env_name

    from workers.settings import Settings

    monkeypatch.setenv("COURIER_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("COURIER_SIGNING_KEY", raising=False)  # the test session's key (tests/conftest.py)
    defaults = Settings()
    for name, field in Settings.model_fields.items():
        if name != "data_dir":
            monkeypatch.setenv(env_name(name, field), "")
    assert Settings() == defaults
