"""compose/docker-compose.yml, compose/Dockerfile and the Procfile are valid
and say what the design says. Nothing here builds images or runs the
containers: podman-compose renders and validates the file (with the
variables of an `.env` file), the tests check its content; the S3
service's start script runs here with a stand-in `weed`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures.services import need
from workers.celery_app import QUEUES
from workers.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
#: each courier service's secret files, no more (measured on e82a350: every container got every secret)
TOKENS = {"telegram_bot_token", "discord_bot_token", "slack_bot_token", "whatsapp_access_token"}
WEBHOOKS = {"telegram_webhook_secret", "slack_signing_secret", "whatsapp_app_secret", "whatsapp_verify_token"}
EVERY = {"redis_password", "signing_key"}
SECRETS_OF = {
    "web": EVERY | WEBHOOKS | {"metrics_token"},
    "worker-turns": EVERY | TOKENS | {"s3_secret_key", "metrics_token", "openai_api_key"},
    "worker-sandbox": EVERY | {"s3_secret_key", "metrics_token"},
    "worker-delivery": EVERY | TOKENS | {"s3_secret_key", "metrics_token"},
    "beat": EVERY,
    "flower": EVERY | {"flower_basic_auth"},
    "redis": {"redis_password"},
    "s3": {"s3_secret_key"},
}
COURIER_SERVICES = ("web", "worker-turns", "worker-sandbox", "worker-delivery", "beat", "flower")
WORKERS = ("worker-turns", "worker-sandbox", "worker-delivery")


def _render(tmp_path: Path | None = None, env_file: dict | None = None, **env: str) -> subprocess.CompletedProcess:
    exe = shutil.which("podman-compose")
    need(exe is not None, "podman-compose is not installed (pip install podman-compose)")
    args = [exe]
    if env_file is not None:
        p = tmp_path / "courier.env"
        p.write_text("".join(f"{k}={v}\n" for k, v in env_file.items()))
        args += ["--env-file", str(p)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COURIER_", "S3_"))}
    return subprocess.run([*args, "-f", str(COMPOSE), "config"], capture_output=True, text=True, timeout=60,
                          env={**clean, **env}, cwd=str(ROOT))


@pytest.fixture(scope="module")
def rendered() -> dict:
    res = _render()
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


def test_secrets_are_files_and_scripts_compose_secrets_makes_them(tmp_path):
    """Every secret is a compose secret from one directory (COURIER_SECRETS, default compose/secrets):
    scripts/compose-secrets makes each file the compose file names, random ones for what courier can
    make itself and empty ones for the operator to fill in; it never replaces one."""
    res = _render(tmp_path, env_file={"COURIER_SECRETS": "/etc/courier/secrets"})
    assert res.returncode == 0, res.stderr
    declared = yaml.safe_load(res.stdout)["secrets"]
    assert set(declared) == set().union(*SECRETS_OF.values(), {"metrics_token"})
    assert all(v["file"] == f"/etc/courier/secrets/{k}" for k, v in declared.items())
    out = tmp_path / "secrets"
    res = subprocess.run([str(ROOT / "scripts" / "compose-secrets"), str(out)], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert {p.name for p in out.iterdir()} == set(declared)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700  # the operator's only
    made = {p.name: p.read_text() for p in out.iterdir()}
    for name in ("redis_password", "signing_key", "s3_secret_key", "metrics_token"):
        assert re.fullmatch(r"[0-9a-f]{64}\n", made[name]), name
    assert re.fullmatch(r"admin:[0-9a-f]{64}\n", made["flower_basic_auth"])
    assert all(made[n] == "" for n in TOKENS | WEBHOOKS | {"openai_api_key"})
    assert len({made[n] for n in ("redis_password", "signing_key", "s3_secret_key", "metrics_token")}) == 4
    (out / "telegram_bot_token").write_text("123:tok")
    again = subprocess.run([str(ROOT / "scripts" / "compose-secrets"), str(out)], capture_output=True, text=True,
                           timeout=30)
    assert again.returncode == 0 and not again.stdout  # nothing written: kept
    assert {p.name: p.read_text() for p in out.iterdir()} == {**made, "telegram_bot_token": "123:tok"}


def test_settings_come_from_an_env_file(tmp_path):
    """Plain settings go from one .env file to the courier processes that use them (the web process
    gets the agents and Discord's public key; the workers the agents); secrets never do."""
    agents = '{"helper": {"runtime": "openai", "model": "m", "sandbox": "local:///data/sandbox/helper"}}'
    res = _render(tmp_path, env_file={"DISCORD_PUBLIC_KEY": "ab" * 32, "COURIER_AGENTS": f"'{agents}'",
                                      "S3_ACCESS_KEY": "key-id-1"})
    assert res.returncode == 0, res.stderr
    svcs = yaml.safe_load(res.stdout)["services"]
    assert svcs["web"]["environment"]["DISCORD_PUBLIC_KEY"] == "ab" * 32
    for name in ("web", "worker-turns", "worker-sandbox"):
        assert json.loads(svcs[name]["environment"]["COURIER_AGENTS"]) == json.loads(agents), name
    assert svcs["s3"]["environment"]["S3_ACCESS_KEY"] == svcs["worker-turns"]["environment"]["AWS_ACCESS_KEY_ID"] \
        == "key-id-1"


def test_env_example_documents_every_variable_and_env_files_stay_out():
    compose_vars = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE.read_text()))
    example = {ln.split("=", 1)[0] for ln in ENV_EXAMPLE.read_text().splitlines()
               if re.match(r"[A-Z0-9_]+=", ln)}
    assert compose_vars <= example, compose_vars - example
    for line in ENV_EXAMPLE.read_text().splitlines():  # no secret in the example
        if re.match(r"(S3_SECRET_KEY|FLOWER_BASIC_AUTH|.*TOKEN|.*SECRET|.*API_KEY|.*PASSWORD)=", line):
            assert line.endswith("="), line
    assert "compose/.env" in (ROOT / ".gitignore").read_text().split()
    assert {".env", "compose/.env", ".git", "tests"} <= set((ROOT / ".dockerignore").read_text().split())


def test_no_s3_secret_in_any_file_and_the_identity_is_made_from_the_secret_file(rendered, tmp_path):
    """compose/s3.json hard-coded the secret (S3_SECRET_KEY as documented gave
    SignatureDoesNotMatch on every send). The S3 service now writes its
    identity at start from S3_ACCESS_KEY and its secret file: its start script
    runs here (a stand-in `weed` records how it is started)."""
    assert not (ROOT / "compose" / "s3.json").exists()
    for p in (ROOT / "compose").rglob("*"):
        if p.is_file():
            assert "change-me" not in p.read_text(errors="replace"), p
    script = rendered["services"]["s3"]["command"][0]
    assert rendered["services"]["s3"]["entrypoint"] == ["/bin/sh", "-c"]
    cfg = tmp_path / "s3.json"
    secret = tmp_path / "s3_secret_key"
    secret.write_text("Zx9/+=._-secret\n")
    script = script.replace("/tmp/s3.json", str(cfg)).replace("/run/secrets/s3_secret_key", str(secret))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    weed = bindir / "weed"
    weed.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'weed-args'}\n")
    weed.chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "S3_ACCESS_KEY": "courier"}
    res = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    ident = json.loads(cfg.read_text())["identities"][0]
    assert ident["credentials"] == [{"accessKey": "courier", "secretKey": "Zx9/+=._-secret"}]
    assert {"Read", "Write", "List"} <= set(ident["actions"])
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert f"-s3.config={cfg}" in (tmp_path / "weed-args").read_text().split()
    cfg.unlink()
    for bad, why in (('bad"key', "may hold only"), ("", "is empty")):
        secret.write_text(bad)
        res = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 2 and why in res.stderr and not cfg.exists(), res.stderr


def _redis_script(rendered: dict) -> str:
    cmd = rendered["services"]["redis"]["command"]
    assert cmd[:2] == ["/bin/sh", "-c"], cmd
    return cmd[2]


def test_redis_keeps_tasks(rendered):
    script = _redis_script(rendered)
    exec_line = next(ln for ln in script.splitlines() if ln.startswith("exec "))
    cmd = shlex.split(exec_line.split("<<")[0])
    assert cmd[1:3] == ["docker-entrypoint.sh", "redis-server"], cmd  # the image's own entrypoint: drops root
    assert "--appendonly" in cmd and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "always"
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"


def test_redis_and_every_courier_service_share_a_password_from_a_secret_file(rendered, tmp_path):
    """Redis ran without a password: anything on the compose network, or
    anything that read a worker's environment, could use it. Now a random
    password per deployment sits in a secret file (scripts/compose-secrets makes
    it) that Redis and every courier process read; it is in no environment
    and no file of the repo."""
    svcs = rendered["services"]
    secret = rendered["secrets"]["redis_password"]["file"]
    assert secret.endswith("secrets/redis_password")
    assert "redis_password" in svcs["redis"]["secrets"]
    for name in COURIER_SERVICES:
        env = svcs[name]["environment"]
        assert "redis_password" in svcs[name]["secrets"], name
        assert env["COURIER_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password", name
        assert "@" not in env["COURIER_REDIS_URL"] and "COURIER_REDIS_PASSWORD" not in env, name
    assert "REDISCLI_AUTH" in " ".join(svcs["redis"]["healthcheck"]["test"])  # the healthcheck authenticates
    assert "secrets" in (ROOT / ".dockerignore").read_text() and "compose/secrets/" in (ROOT / ".gitignore").read_text()


def _start_redis_script(rendered: dict, tmp_path: Path, secret: Path) -> tuple[subprocess.Popen, int]:
    """The compose Redis service's start script, run here: the real redis-server behind a
    stand-in `docker-entrypoint.sh` that adds a free port and a private dir."""
    from tests.fixtures.services import free_port

    port = free_port()
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    entry = bindir / "docker-entrypoint.sh"
    exe = shutil.which("redis-server", path="/usr/bin:/bin") or shutil.which("redis-server")
    need(exe is not None, "no redis-server")
    entry.write_text(f'#!/bin/sh\nshift\nexec {exe} --port {port} --bind 127.0.0.1 --dir {tmp_path} '
                     f'--logfile {tmp_path / "redis.log"} "$@"\n')
    entry.chmod(0o755)
    script = _redis_script(rendered).replace("/run/secrets/redis_password", str(secret))
    proc = subprocess.Popen(["/bin/sh", "-c", script], env={"PATH": f"{bindir}:/usr/bin:/bin"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, port


def test_the_redis_service_requires_its_password(rendered, tmp_path):
    """The start script runs for real (redis-server, the secret made by
    scripts/compose-secrets): an unauthenticated PING is refused, the password
    opens it, and it is not on the server's command line; AOF is on."""
    import redis

    from tests.fixtures.services import stop_process, wait_until

    secret = tmp_path / "secrets" / "redis_password"
    res = subprocess.run([str(ROOT / "scripts" / "compose-secrets"), str(secret.parent)], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    password = secret.read_text().strip()
    proc, port = _start_redis_script(rendered, tmp_path, secret)
    try:
        good = redis.Redis(port=port, password=password, socket_timeout=5)
        wait_until(lambda: proc.poll() is None and good.ping(), timeout_s=15,
                   what=lambda: f"redis from the compose script: {proc.poll()} {proc.stderr}")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert good.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        stop_process(proc)
    for bad in ("", "has space", "quote\"d"):
        secret.write_text(bad + "\n")
        proc, _ = _start_redis_script(rendered, tmp_path, secret)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and b"redis_password" in err, (bad, err)
    secret.unlink()
    proc, _ = _start_redis_script(rendered, tmp_path, secret)
    proc.communicate(timeout=30)
    assert proc.returncode != 0


def test_every_service_that_touches_files_shares_one_volume(rendered):
    """The turns and sandbox workers shared no volume: every file of a
    `local://` turn failed FileMissing."""
    svcs = rendered["services"]
    for name in COURIER_SERVICES:
        env = svcs[name]["environment"]
        assert f"courier-data:{env['COURIER_DATA_DIR']}" in svcs[name]["volumes"], name
    assert "courier-data" in rendered["volumes"]


def test_every_service_has_a_healthcheck_and_a_grace_period(rendered):
    svcs = rendered["services"]
    assert set(svcs) == {"redis", "s3", "proxy", *COURIER_SERVICES}
    for name, svc in svcs.items():
        hc = svc.get("healthcheck") or {}
        assert hc.get("test") and hc["test"][0] in ("CMD", "CMD-SHELL"), name
        assert re.fullmatch(r"\d+[sm]", str(svc.get("stop_grace_period", ""))), name
    for name in WORKERS:
        test = " ".join(svcs[name]["healthcheck"]["test"][1:])
        node = svcs[name]["command"][svcs[name]["command"].index("-n") + 1].split("@")[0]
        # $HOSTNAME is not in the environment of a podman exec (the healthcheck never passed there)
        assert f"inspect ping -d {node}@$(hostname)" in test, name
    assert "/healthz?consumers=turns" in " ".join(svcs["web"]["healthcheck"]["test"])
    assert "/healthcheck" in " ".join(svcs["flower"]["healthcheck"]["test"])
    assert "/status" in " ".join(svcs["s3"]["healthcheck"]["test"])
    assert "/proxy-health" in " ".join(svcs["proxy"]["healthcheck"]["test"])
    # a deploy gives running turns time to finish (Celery's warm shutdown on SIGTERM)
    assert svcs["worker-turns"]["stop_grace_period"].endswith("m")
    assert svcs["s3"]["healthcheck"] and svcs["web"]["depends_on"]["s3"]["condition"] == "service_healthy"


def test_images_are_pinned(rendered):
    for name, svc in rendered["services"].items():
        repo, _, tag = svc["image"].rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), (name, svc["image"])
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    if base.startswith("${"):  # FROM ${BASE_IMAGE}: the ARG's default is what an operator gets
        arg = base.strip("${}")
        base = re.search(rf"^ARG {arg}=(\S+)", text, re.M).group(1)
    assert re.search(r":\d+\.\d+\.\d+", base), base


def test_ports_are_on_loopback_by_default(rendered, tmp_path):
    published = {n: s["ports"] for n, s in rendered["services"].items() if s.get("ports")}
    assert set(published) == {"proxy", "flower"}  # web is behind the proxy: `--scale web=N` clashes on nothing
    for ports in published.values():
        assert all(str(p).startswith("127.0.0.1:") for p in ports), ports
    res = _render(COURIER_BIND="0.0.0.0")
    assert "0.0.0.0:8000:8000" in yaml.safe_load(res.stdout)["services"]["proxy"]["ports"]


def test_the_proxy_finds_every_web_replica_by_name():
    """HAProxy's backend is a server template on the service name, re-resolved: replicas come and go."""
    cfg = (ROOT / "compose" / "proxy" / "haproxy.cfg").read_text()
    assert re.search(r"^\s*server-template web \d+ web:8000\b", cfg, re.M), cfg
    assert re.search(r"check resolvers compose", cfg) and "parse-resolv-conf" in cfg
    assert "option httpchk GET /healthz" in cfg and "monitor-uri /proxy-health" in cfg
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    need(os.path.exists(haproxy), "haproxy is not installed (apt-get install haproxy)")
    res = subprocess.run([haproxy, "-c", "-f", str(ROOT / "compose" / "proxy" / "haproxy.cfg")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr  # valid to HAProxy itself


def test_flower_has_auth_but_not_on_its_command_line(rendered):
    """`--basic_auth=user:password` was visible in `ps`; `courier flower` reads the login from its secret
    file (tests/test_flower.py starts Flower that way) and hands it to Flower in its own environment."""
    flower = rendered["services"]["flower"]
    assert not any("basic_auth" in a for a in flower["command"]) and flower["command"][:2] == ["courier", "flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH_FILE"] == "/run/secrets/flower_basic_auth"
    assert "FLOWER_BASIC_AUTH" not in flower["environment"]


def test_workers_export_metrics_from_a_private_multiprocess_dir(rendered):
    """Each worker's processes count together in the directory `courier worker` makes for its container
    (<data dir>/metrics/<hostname>): a tmpfs given in compose was root's, mode 755, under podman (the
    compose proof's Prometheus found no worker series), so none is set here."""
    for name in WORKERS:
        svc = rendered["services"][name]
        assert "PROMETHEUS_MULTIPROC_DIR" not in svc["environment"] and not svc.get("tmpfs"), name
        assert int(svc["environment"]["COURIER_METRICS_PORT"]) > 0
        assert svc["command"][:3] == ["python", "-m", "workers.worker"], name  # the supervisor makes the dir
    assert "PROMETHEUS_MULTIPROC_DIR" not in rendered["services"]["flower"]["environment"]  # Flower's own metrics


def test_dockerfile_layers_user_and_healthcheck():
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    first_code = next(i for i, ln in enumerate(lines) if ln.startswith("COPY workers"))
    deps = next(i for i, ln in enumerate(lines) if ln.startswith("RUN") and "pip install -r" in " ".join(lines[i:i + 3]))
    assert deps < first_code, "dependencies must be installed before the code is copied (a cached layer)"
    assert any(ln.startswith("COPY pyproject.toml") for ln in lines[:deps])
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(ln.startswith("HEALTHCHECK") for ln in lines)
    assert "WITH_BROWSER" in DOCKERFILE.read_text() and "chromium" in DOCKERFILE.read_text()


def test_workers_cover_every_queue_and_can_scale(rendered):
    served = set()
    workers = {n: s for n, s in rendered["services"].items() if n.startswith("worker-")}
    assert workers
    for name, svc in workers.items():
        cmd = svc["command"]
        # every worker starts through workers.worker (`courier worker`): the pool of its queue
        # (COURIER_DELIVERY_POOL), and a supervisor that restarts a Celery worker that exits (issue 24)
        assert cmd[:3] == ["python", "-m", "workers.worker"], cmd
        served |= set(cmd[cmd.index("-Q") + 1].split(","))
        # --scale needs no fixed names or host ports
        assert "container_name" not in svc and "ports" not in svc, name
    assert served == set(QUEUES)
    assert "--prefetch-multiplier=1" in workers["worker-turns"]["command"]


def test_every_process_exists(rendered):
    svcs = rendered["services"]
    assert {"web", "beat", "flower", "redis", "s3"} <= set(svcs)
    assert svcs["web"]["command"][1] == "workers.web:app"


def test_environment_names_are_settings_courier_reads(rendered):
    from workers.settings import file_variables

    known = _known_env() | set(file_variables()) | {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                            "PROMETHEUS_MULTIPROC_DIR", "FLOWER_BASIC_AUTH_FILE"}
    for name, svc in rendered["services"].items():
        if not svc.get("image", "").startswith("courier:"):
            continue
        unknown = set(svc["environment"]) - known
        assert not unknown, (name, unknown)


def test_procfile_names_the_five_processes():
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, cmd = line.partition(":")
            entries[name.strip()] = shlex.split(cmd.replace("${", "{"))
    assert set(entries) == {"web", "worker", "delivery", "beat", "flower"}
    assert entries["web"][1] == "workers.web:app"
    q = entries["worker"][entries["worker"].index("-Q") + 1] + "," + entries["delivery"][
        entries["delivery"].index("-Q") + 1]
    assert sorted(q.split(",")) == sorted(QUEUES)
    # the workers run under `courier worker`'s supervisor (a Procfile runner stops all when one exits)
    for name in ("worker", "delivery"):
        assert entries[name][:3] == ["python", "-m", "workers.worker"], name
    for name in ("beat",):
        assert entries[name][:3] == ["celery", "-A", "workers.celery_app"]
    assert entries["flower"][:2] == ["courier", "flower"]  # (names the extra when Flower is missing)
    assert not any("basic_auth" in a for a in entries["flower"])  # the password is not on the command line


def test_each_service_holds_only_the_secrets_its_process_uses(rendered):
    """Measured on e82a350: every container got every secret (Flower and web held the bot tokens, the
    OpenAI key and the AWS secret), in its environment. Now each service mounts only the secret files its
    process uses, names each through `<NAME>_FILE`, and holds no secret in its environment."""
    from workers.settings import file_variables

    svcs = rendered["services"]
    readers = set(file_variables()) | {"FLOWER_BASIC_AUTH_FILE"}
    for name, want in SECRETS_OF.items():
        assert set(svcs[name]["secrets"]) == want, name
        env = svcs[name].get("environment") or {}
        named = {v.removeprefix("/run/secrets/") for k, v in env.items() if k.endswith("_FILE")}
        if name in COURIER_SERVICES:
            assert named == want, name  # each file mounted is read, and only those
            assert {k for k in env if k.endswith("_FILE")} <= readers, name
        # no secret in the environment: only their files' paths
        assert not {k for k in env if k.endswith(("_TOKEN", "_SECRET", "_API_KEY", "_PASSWORD", "_AUTH",
                                                  "SECRET_ACCESS_KEY", "SIGNING_KEY"))}, (name, env)
    prom = _render_monitoring()["services"]["prometheus"]
    assert prom["secrets"] == ["metrics_token"] and not prom.get("environment")


def _render_monitoring() -> dict:
    exe = shutil.which("podman-compose")
    need(exe is not None, "podman-compose is not installed (pip install podman-compose)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COURIER_", "S3_"))}
    res = subprocess.run([exe, "--profile", "monitoring", "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, timeout=60, env=clean, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def test_any_other_setting_goes_to_every_service_from_settings_env(rendered):
    """Settings outside the compose file's blocks (e.g. COURIER_LOG_FORMAT) could not be set from compose/.env:
    compose/settings.env reaches every courier service, and holds no secret."""
    for name in COURIER_SERVICES:
        files = rendered["services"][name].get("env_file") or []
        assert any(str(f).endswith("settings.env") for f in files), (name, files)
    text = (ROOT / "compose" / "settings.env").read_text()
    assert all(ln.startswith("#") or not ln.strip() for ln in text.splitlines())  # comments only, as shipped


def test_monitoring_profile_scrapes_every_replica_and_loads_the_alerts(tmp_path):
    """compose had no Prometheus: `--profile monitoring` adds one that finds every web replica and worker
    by name (scaled services included), authenticates with the metrics token from a file, and evaluates
    compose/monitoring/alerts.yml; promtool accepts the config and the rules."""
    prom = _render_monitoring()["services"]["prometheus"]
    assert str(prom["ports"][0]).startswith("127.0.0.1:")
    cfg = yaml.safe_load((ROOT / "compose" / "monitoring" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["courier-web"]["dns_sd_configs"][0]["names"] == ["web"]
    assert jobs["courier-web"]["dns_sd_configs"][0]["port"] == 8000
    assert sorted(jobs["courier-workers"]["dns_sd_configs"][0]["names"]) == sorted(WORKERS)
    assert jobs["courier-workers"]["dns_sd_configs"][0]["port"] == 9100
    mounted = {v.split(":")[1] for v in prom["volumes"] if isinstance(v, str)} | {
        v["target"] for v in prom["volumes"] if isinstance(v, dict)}
    assert set(cfg["rule_files"]) <= mounted and "/etc/prometheus/prometheus.yml" in mounted
    for j in jobs.values():
        assert j["authorization"]["credentials_file"] == "/run/secrets/metrics_token"  # its only secret
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool is not installed (apt-get install prometheus)")
    (tmp_path / "alerts.yml").write_text((ROOT / "compose" / "monitoring" / "alerts.yml").read_text())
    (tmp_path / "token").write_text("t")
    text = (ROOT / "compose" / "monitoring" / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/alerts.yml", "alerts.yml").replace("/run/secrets/metrics_token", "token")
    (tmp_path / "prometheus.yml").write_text(text)
    res = subprocess.run([promtool, "check", "config", "prometheus.yml"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 0 and re.search(r"SUCCESS: [1-9]\d* rules found", res.stdout), res.stdout + res.stderr
