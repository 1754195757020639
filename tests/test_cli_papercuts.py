"""The console's papercuts (issue 24, each measured on e82a350): `status --json` gave numbers as
strings and carried the chat's text; an empty `deliveries --failed` printed a header-only table;
read-only commands said "nothing was enqueued" when Redis was down; a 0-byte file passed `courier
send` and failed in the worker; `courier web` defaulted to 8080 while the Procfile and compose use 8000."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.services import free_port
from tests.fixtures.workers import CourierEnv

TEXT = "a private message 91c2"

pytestmark = pytest.mark.usefixtures("redis_emptied")  # these sends have no worker: nothing left queued after


def test_status_json_numbers_are_numbers_and_no_chat_text(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    job = json.loads(env.cli("send", "outbox:p", "--text", TEXT, "--json").stdout)["job"]
    res = env.cli("status", job, "--json")
    assert TEXT not in res.stdout and '"spec"' not in res.stdout, res.stdout
    got = json.loads(res.stdout)
    row = got["deliveries"][0]
    assert isinstance(row["attempts"], int) and isinstance(row["queued_s"], float)
    assert isinstance(row["size_bytes"], int) and isinstance(got["job"]["created_s"], float)
    one = json.loads(env.cli("status", row["id"], "--json").stdout)
    assert isinstance(one["attempts"], int) and TEXT not in json.dumps(one)
    listed = json.loads(env.cli("deliveries", "--json").stdout)
    assert listed and isinstance(listed[0]["attempts"], int) and TEXT not in json.dumps(listed)


def test_an_empty_failed_list_says_so(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    res = env.cli("deliveries", "--failed", "--chat", "outbox:none")
    assert res.returncode == 0 and res.stdout.strip() == "no failed deliveries to outbox:none", res.stdout


def test_read_only_commands_never_say_nothing_was_enqueued(tmp_path):
    env = CourierEnv(tmp_path / "env", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    for args in (("status", "snd_x"), ("deliveries",), ("queues",)):
        res = env.cli(*args)
        assert res.returncode == 3 and "is not answering" in res.stderr, (args, res.stderr)
        assert "enqueued" not in res.stderr, (args, res.stderr)
    res = env.cli("send", "outbox:x", "--text", "hi")
    assert res.returncode == 3 and "nothing was enqueued" in res.stderr


def test_an_empty_file_is_refused_before_anything_is_registered(tmp_path, redis_server):
    env = CourierEnv(tmp_path / "env", redis_server.url)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    before = set(redis_server.client().scan_iter("courier:job:*"))
    res = env.cli("send", "outbox:e", str(empty))
    assert res.returncode == 2 and "is empty (0 bytes)" in res.stderr, res.stderr
    assert set(redis_server.client().scan_iter("courier:job:*")) == before


def test_the_web_process_defaults_to_the_port_procfile_and_compose_use(monkeypatch):
    from pathlib import Path

    from workers.settings import Settings

    monkeypatch.delenv("COURIER_WEB_PORT", raising=False)
    assert Settings().web_port == 8000
    root = Path(__file__).resolve().parents[1]
    assert "8000" in (root / "Procfile").read_text() and "8000" in (root / "compose" / "docker-compose.yml").read_text()


def test_help_reads_as_a_command_line_not_as_python():
    """typer 0.27+ shows Python types in help (`<bool>`, `<list[str]>`) and `{target}` in usage lines
    (measured with 0.29.2): pyproject keeps typer below 0.27; every command's help is checked."""
    from typer.testing import CliRunner

    from workers.cli import app

    runner = CliRunner()
    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert {"send", "status", "retry", "cancel", "deliveries"} <= set(names)
    for name in [None, *(n for n in names if n != "flower")]:  # (flower's --help is Flower's own: exec'd)
        res = runner.invoke(app, [name, "--help"] if name else ["--help"], prog_name="courier", env={"COLUMNS": "120"})
        assert res.exit_code == 0, (name, res.output)
        assert "<bool>" not in res.output and "<str>" not in res.output and "list[" not in res.output, res.output
        usage = next(ln for ln in res.output.splitlines() if "Usage:" in ln)
        assert "{" not in usage and usage.split()[1] == "courier", usage
    send = runner.invoke(app, ["send", "--help"], env={"COLUMNS": "120"}).output
    assert "TARGET [PATHS]..." in send


def test_flower_without_its_extra_names_the_extra(monkeypatch):
    """`celery flower` without the package says only "No such command 'flower'"; `courier flower`
    names what to install."""
    import importlib.util

    from typer.testing import CliRunner

    from workers.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flower" else real(name, *a))
    res = CliRunner().invoke(app, ["flower", "--port=5555"])
    assert res.exit_code == 3 and "pip install 'courier[flower]'" in res.output, res.output


def test_flower_with_its_extra_runs_celery_flower(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "workers.cli", "flower", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**__import__("os").environ, "COURIER_DATA_DIR": str(tmp_path)})
    assert res.returncode == 0 and "monitoring and administrating Celery" in res.stdout + res.stderr, res.stdout + res.stderr


def test_flower_reads_its_login_from_a_secret_file_and_refuses_a_bad_one(tmp_path, monkeypatch):
    """compose mounts Flower's login as a file (FLOWER_BASIC_AUTH_FILE): an unreadable or empty one, one
    without `user:password`, or one set beside FLOWER_BASIC_AUTH is refused before Flower starts (it
    would start with no login). A good one: tests/test_flower.py starts Flower with it."""
    from typer.testing import CliRunner

    from workers.cli import app

    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    f = tmp_path / "flower_basic_auth"
    for content, why in (("", "must hold user:password"), ("just-a-password\n", "must hold user:password")):
        f.write_text(content)
        res = CliRunner().invoke(app, ["flower"], env={"FLOWER_BASIC_AUTH_FILE": str(f)})
        assert res.exit_code == 2 and why in res.output, res.output
    res = CliRunner().invoke(app, ["flower"], env={"FLOWER_BASIC_AUTH_FILE": str(tmp_path / "missing")})
    assert res.exit_code == 2 and "cannot read" in res.output, res.output
    f.write_text("ops:pw\n")
    res = CliRunner().invoke(app, ["flower"], env={"FLOWER_BASIC_AUTH_FILE": str(f), "FLOWER_BASIC_AUTH": "a:b"})
    assert res.exit_code == 2 and "both set" in res.output, res.output
    assert "ops:pw" not in res.output
