"""compose/docker-compose.yml and the Procfile are valid and say what the
design says (nothing here can run the containers: podman-compose renders
and validates the file, the test checks its content)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.services import need
from workers.celery_app import QUEUES
from workers.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"


def _render(**env: str) -> subprocess.CompletedProcess:
    exe = shutil.which("podman-compose")
    need(exe is not None, "podman-compose is not installed (pip install podman-compose)")
    return subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd=str(ROOT))


@pytest.fixture(scope="module")
def rendered() -> dict:
    res = _render(S3_SECRET_KEY="s3cret", FLOWER_PASSWORD="pw")
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def _known_env() -> set[str]:
    names = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if alias is not None:
            names.update(getattr(alias, "choices", [alias]))
        else:
            names.add(f"COURIER_{name.upper()}")
    return {str(n) for n in names}


def test_compose_renders_and_requires_its_secrets():
    res = _render()
    assert res.returncode != 0 and "S3_SECRET_KEY" in res.stderr


def test_redis_keeps_tasks(rendered):
    cmd = rendered["services"]["redis"]["command"]
    assert "--appendonly" in cmd and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"


def test_workers_cover_every_queue_and_can_scale(rendered):
    served = set()
    workers = {n: s for n, s in rendered["services"].items() if n.startswith("worker-")}
    assert workers
    for name, svc in workers.items():
        cmd = svc["command"]
        assert cmd[:4] == ["celery", "-A", "workers.celery_app", "worker"]
        served |= set(cmd[cmd.index("-Q") + 1].split(","))
        # --scale needs no fixed names or host ports
        assert "container_name" not in svc and "ports" not in svc, name
    assert served == set(QUEUES)
    assert "--prefetch-multiplier=1" in workers["worker-turns"]["command"]


def test_flower_has_auth_and_every_process_exists(rendered):
    svcs = rendered["services"]
    assert any(a.startswith("--basic_auth=admin:pw") for a in svcs["flower"]["command"])
    assert {"web", "beat", "flower", "redis", "s3"} <= set(svcs)
    assert svcs["web"]["command"][1] == "workers.web:app"


def test_environment_names_are_settings_courier_reads(rendered):
    known = _known_env() | {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
    for name, svc in rendered["services"].items():
        if svc.get("image") != "courier:latest":
            continue
        unknown = set(svc["environment"]) - known
        assert not unknown, (name, unknown)


def test_procfile_names_the_four_processes():
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, cmd = line.partition(":")
            entries[name.strip()] = shlex.split(cmd.replace("${", "{"))
    assert set(entries) == {"web", "worker", "beat", "flower"}
    assert entries["web"][1] == "workers.web:app"
    q = entries["worker"][entries["worker"].index("-Q") + 1]
    assert set(q.split(",")) == set(QUEUES)
    for name in ("worker", "beat", "flower"):
        assert entries[name][:3] == ["celery", "-A", "workers.celery_app"]
