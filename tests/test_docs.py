"""docs/configuration.md's settings table is the one workers/settings.py
generates (every setting documented), CI runs the README's test command, and
the README stays short, linking every document it points at."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_settings_table_is_the_generated_one():
    """Every setting, its default and its comment as workers/settings.py has them: a setting
    added or changed there fails this until `python scripts/settings_table.py --write`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from settings_table import CONFIG_DOC, env_name, table, written

    from workers.settings import Settings

    doc = CONFIG_DOC.read_text()
    missing = [env_name(n, f) for n, f in Settings.model_fields.items() if f"| `{env_name(n, f)}` |" not in doc]
    assert not missing, f"settings missing from {CONFIG_DOC.name} (run scripts/settings_table.py --write): {missing}"
    assert written(doc) == table(), f"{CONFIG_DOC.name}'s table is stale: run python scripts/settings_table.py --write"


def test_the_readme_is_short_and_its_links_resolve():
    """README.md is the front page (at most 300 lines); the rest lives in docs/ and
    ARCHITECTURE.md, and every relative link it or a doc makes names a file that exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for doc in ("docs/deployment.md", "docs/operations.md", "docs/security.md", "docs/guarantees.md",
                "docs/configuration.md", "docs/benchmarks.md", "ARCHITECTURE.md"):
        assert f"]({doc})" in readme, f"README.md does not link {doc}"
    for page in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for link, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in link:
                continue
            target = page.parent / link if link else page
            assert target.exists(), f"{page.relative_to(ROOT)} links {link}, which is not there"
            if anchor and target.suffix == ".md":
                assert anchor in _anchors(target), f"{page.relative_to(ROOT)} links {link}#{anchor}: no such heading"


def test_the_map_names_one_existing_file_for_each_question():
    """ARCHITECTURE.md answers where a delivery is retried, where per-chat order is kept,
    where a lost message is re-published and where a chat's pace is decided with one file
    each: a file that exists (a move or a rename must update the map)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    where = text[text.index("## Where to look"):]
    rows = re.findall(r"^\| (where [^|]+\?) \| `([^`]+)` \|", where[:where.index("\n## ", 1)], flags=re.M)
    asked = {q for q, _ in rows}
    for question in ("where is a delivery retried?", "where is per-chat order kept?",
                     "where does a lost message get re-published?", "where is a chat's pace decided?"):
        assert question in asked, f"ARCHITECTURE.md's 'Where to look' does not answer {question!r}"
    for question, path in rows:
        assert (ROOT / path).is_file(), f"ARCHITECTURE.md answers {question!r} with {path}, which is not there"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces as -."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


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
