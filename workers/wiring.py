"""Builds adapters and stores from settings: the only place that turns the
environment into constructor arguments. Cached per process (connections reused)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from functools import lru_cache
from typing import Any

from pydantic import SecretStr

from adapters.agents.hooks import HookRunner, ShellHook, load_plugins
from adapters.agents.jail import JailConfig, unavailable
from adapters.errors import ConfigError, SandboxGone
from adapters.extras import needs
from adapters.platforms.base import Limits, Platform
from adapters.sandboxes.base import PathPolicy, Sandbox, SandboxRef, parse_uri
from adapters.sandboxes.local import LocalSandbox
from storage import BlobStore, open_store
from storage.links import LinkSigner
from storage.spill import SpillConfig
from tasks.ledger import keys, signing
from tasks.runtime import Context, Retention, TurnTools
from workers.eventauth import server_key
from workers.settings import Settings, get_settings

_lock = threading.Lock()


@lru_cache(maxsize=4)
def _store_for(url: str, public_url: str | None = None, redis_url: str | None = None,
               s3_credentials: tuple | None = None) -> BlobStore:
    st = open_store(url, **dict(zip(("access_key", "secret_key", "session_token"), s3_credentials or ())))
    if public_url and not st.can_sign and hasattr(st, "links"):
        # a volume: its links are served (and checked) by the web process at public_url
        st.links = _link_signer(public_url, redis_url)
        st.can_sign = True
    return st


def store(settings: Settings | None = None) -> BlobStore:
    """The settings' store, with their S3 credentials when they hold a pair (from the variables or
    their files; else boto3 finds its own: profile, instance role)."""
    s = settings or get_settings()
    creds = (s.aws_access_key_id, s.aws_secret_access_key, s.aws_session_token)
    pair = None if None in creds[:2] else tuple(None if c is None else c.get_secret_value() for c in creds)
    return _store_for(s.storage, s.public_url, s.redis_url, pair)


def file_links(settings: Settings | None = None):
    """The signer that checks a volume's download links (the web process's /files/ route)."""
    s = settings or get_settings()
    return _link_signer(s.public_url or "", s.redis_url)


def _link_signer(public_url: str, redis_url: str | None) -> LinkSigner:
    return LinkSigner(public_url, lambda: server_key(redis_client(redis_url), keys.files_key()))


# -- platforms ----------------------------------------------------------------
PLATFORMS = ("outbox", "telegram", "discord", "slack", "whatsapp")

#: (name, id(settings)) -> (the settings, their adapter): the entry keeps its settings alive, so
#: their id is never reused by another Settings object (that would hand it this adapter)
_platforms: dict[tuple[str, int], tuple[Settings, Platform]] = {}


def platform(name: str, settings: Settings | None = None) -> Platform:
    s = settings or get_settings()
    key = (name, id(s))
    with _lock:
        got = _platforms.get(key)
        if got is None or got[0] is not s:
            cls, credentials, options = _adapter(name, s)
            got = _platforms[key] = (s, cls(*credentials, **options))
        return got[1]


def _secret(value: SecretStr | None, missing: str) -> str:
    if value is None or not value.get_secret_value():
        raise ConfigError(missing)
    return value.get_secret_value()


def _adapter(name: str, s: Settings) -> tuple[type[Platform], tuple[Any, ...], dict[str, Any]]:
    """A platform's adapter class, its constructor's positional arguments (a token, a
    directory) and options. Builds nothing; ConfigError when the platform is unknown,
    its SDK is not installed or a credential is not set."""
    if name == "outbox":
        from adapters.platforms.outbox import OutboxPlatform

        return OutboxPlatform, (s.outbox,), {}
    if name == "telegram":
        with needs("telegram", "the telegram platform"):
            from adapters.platforms.telegram import TelegramPlatform

        return TelegramPlatform, (_secret(s.telegram_bot_token, "telegram: TELEGRAM_BOT_TOKEN is not set"),), \
            {"base_url": s.telegram_base_url, "local_api": s.telegram_local_api, "bot_per_s": s.telegram_bot_per_s}
    if name == "whatsapp":
        from adapters.platforms.whatsapp import WhatsAppPlatform

        token = _secret(s.whatsapp_access_token, "whatsapp: WHATSAPP_ACCESS_TOKEN is not set")
        if not s.whatsapp_phone_number_id:
            raise ConfigError("whatsapp: WHATSAPP_PHONE_NUMBER_ID is not set")
        return WhatsAppPlatform, (token, s.whatsapp_phone_number_id), {"base_url": s.whatsapp_base_url}
    if name == "discord":
        with needs("discord", "the discord platform"):
            from adapters.platforms.discord import DiscordPlatform

        return DiscordPlatform, (_secret(s.discord_bot_token, "discord: DISCORD_BOT_TOKEN is not set"),), \
            {"base_url": s.discord_base_url, "upload_bytes": s.discord_upload_bytes}
    if name == "slack":
        with needs("slack", "the slack platform"):
            from adapters.platforms.slack import SlackPlatform

        return SlackPlatform, (_secret(s.slack_bot_token, "slack: SLACK_BOT_TOKEN is not set"),), \
            {"base_url": s.slack_base_url, "upload_bytes": s.slack_upload_bytes}
    raise ConfigError(f"unknown platform {name!r}: use one of {', '.join(PLATFORMS)}")


def check_platform(name: str, settings: Settings | None = None) -> None:
    """ConfigError when a target's platform is unknown or lacks its token or SDK."""
    _adapter(name, settings or get_settings())


def platform_limits(name: str, settings: Settings | None = None) -> Limits:
    """A configured platform's limits, read from its adapter class (nothing is built)."""
    cls, _credentials, options = _adapter(name, settings or get_settings())
    return cls.limits_for(**options)


# -- sandboxes ----------------------------------------------------------------

@lru_cache(maxsize=64)
def _local_sandbox(roots: tuple[str, ...], home: str):
    """Cached: resolving the roots costs syscalls, and a sandbox holds nothing else."""
    return LocalSandbox.with_roots(roots, home=home)


@lru_cache(maxsize=4)
def _docker_client(base_url: str | None):
    import docker

    try:
        return docker.DockerClient(base_url=base_url, timeout=120) if base_url else docker.from_env(timeout=120)
    except docker.errors.DockerException as exc:
        raise SandboxGone(f"cannot reach the docker engine {base_url or '(DOCKER_HOST)'}: {exc}") from exc


def open_sandbox(ref: SandboxRef, settings: Settings | None = None) -> Sandbox:
    s = settings or get_settings()
    if ref.kind == "local":
        return _local_sandbox(tuple(ref.roots or s.local_sandbox_roots), os.path.expanduser("~"))
    if ref.kind == "docker":
        with needs("docker", "docker:// sandboxes"):
            from adapters.sandboxes.docker import DockerSandbox

            return DockerSandbox(ref, None, client=_docker_client(s.docker_host), io_timeout_s=s.sandbox_io_timeout_s)
    if ref.kind == "ssh":
        from adapters.sandboxes.ssh import SshSandbox

        # roots: the ref's, else /workspace, /tmp and the remote home (resolved on first use)
        return SshSandbox(ref, PathPolicy(roots=tuple(ref.roots)), key_path=s.ssh_key_path,
                          known_hosts=s.ssh_known_hosts, user=s.ssh_user, port=s.ssh_port,
                          use_openssh=s.ssh_use_openssh, control_dir=s.ssh_control_dir,
                          connect_timeout_s=s.ssh_connect_timeout_s, io_timeout_s=s.sandbox_io_timeout_s)
    if ref.kind == "modal":
        with needs("modal", "modal:// sandboxes"):
            from adapters.sandboxes.modal import ModalSandbox

            return ModalSandbox(ref, None, io_timeout_s=s.sandbox_io_timeout_s)
    if ref.kind == "singularity":
        from adapters.sandboxes.singularity import SingularitySandbox

        return SingularitySandbox(ref, None, instances_dir=s.singularity_instances_dir)
    raise ConfigError(f"sandbox kind {ref.kind!r} is not available in this build")


# -- the task context ------------------------------------------------------------
_redis_clients: dict[str, object] = {}
_redis_lock = threading.Lock()


def redis_client(url: str | None = None):
    """One client per URL and process (plain or Sentinel-managed: workers.redis_url)."""
    from workers import redis_url

    u = url or get_settings().redis_url
    k = f"{os.getpid()}:{u}"  # a forked pool process makes its own (and its own Sentinel watcher)
    with _redis_lock:  # a threads pool's tasks share it (redis-py clients are thread-safe)
        if k not in _redis_clients:
            _redis_clients[k] = redis_url.client(u)
        return _redis_clients[k]


def durability(settings: Settings | None = None):
    """How a send or turn is confirmed on Redis replicas before it is answered "queued" (tasks/ledger/durable.py)."""
    from tasks.ledger.durable import Durability
    from workers.redis_url import parse_sentinel

    s = settings or get_settings()
    replicas = s.redis_confirm_replicas
    if replicas is None:
        replicas = 1 if parse_sentinel(s.redis_url) is not None else 0
    return Durability(replicas=replicas, within_s=s.redis_confirm_s)


def build_context(settings: Settings | None = None) -> Context:
    s = settings or get_settings()
    built: list = []
    lock = threading.Lock()

    def turn_tools():
        """Built on a turn's first call, once per context (a delivery worker never builds hooks)."""
        with lock:
            if not built:
                built.append(agent_tools(s, store(s)))
            return built[0]

    return Context(
        redis=redis_client(s.redis_url), store=store(s), platform=lambda name: platform(name, s),
        sandbox=lambda ref: open_sandbox(ref, s), agent=s.agent, default_sandbox_dir=str(s.sandbox_dir),
        max_file_bytes=s.max_file_bytes, events_maxlen=s.events_maxlen, max_files_per_job=s.max_files_per_job,
        max_transient_attempts=s.delivery_max_attempts, outage_deadline_s=s.storage_outage_deadline_s,
        sandbox_io_timeout_s=s.sandbox_io_timeout_s, sandbox_breaker_max_s=s.sandbox_breaker_max_s,
        retention=Retention(
            screenshot_ttl_s=s.screenshot_ttl_s, file_ttl_s=s.file_ttl_s, spill_ttl_s=s.spill_ttl_s,
            workspace_ttl_s=s.workspace_ttl_s, spill_prefix=s.hooks_output_spill.directory,
            agent_sandbox_dirs=s.agent_sandbox_dirs, s3_lifecycle=s.s3_lifecycle),
        turn_tools=turn_tools, allowed_roots=lambda ref: allowed_roots(ref, s),
    )


#: roots every remote sandbox kind allows without configuration (the backends' defaults; the home is
#: resolved by the backend, and only a ref that names no roots gets it)
REMOTE_DEFAULT_ROOTS = ("/workspace", "/tmp")


def allowed_roots(ref: SandboxRef, settings: Settings | None = None) -> tuple[str, ...]:
    """The roots this worker's configuration allows for `ref`'s kind (a spec's roots must lie
    inside them): the kind's defaults (local: COURIER_LOCAL_ROOTS and the sandbox dir) and the
    directories and roots of the agents configured on that kind."""
    s = settings or get_settings()
    out: list[str] = list(s.local_sandbox_roots) + [str(s.sandbox_dir)] if ref.kind == "local" else list(
        REMOTE_DEFAULT_ROOTS)
    for a in s.agents.values():
        kind, path = "local", None
        if a.sandbox:
            try:
                r, path = parse_uri(a.sandbox)
            except ConfigError:
                continue
            kind = r.kind
        if kind == ref.kind:
            out += ([path] if path else []) + list(a.roots)
    return tuple(dict.fromkeys(os.path.realpath(p) if ref.kind == "local" else p for p in out))


# -- signing (tasks/ledger/signing.py) ------------------------------------------------------------
SIGNING_KEY_FILE = "signing.key"


def _data_dir_key(data_dir) -> bytes:
    """The data dir's key (0600), generated on first start: linked from a complete temporary
    file, so no process reads a half-written key."""
    path = os.path.join(str(data_dir), SIGNING_KEY_FILE)
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
        if key:
            return key
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot read the signing key {path} ({exc.strerror}): run as the deployment's user, or "
                          f"set COURIER_SIGNING_KEY (or COURIER_SIGNING_KEY_FILE)") from None
    os.makedirs(str(data_dir), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(secrets.token_hex(32).encode() + b"\n")
    try:
        with contextlib.suppress(FileExistsError):  # another process made it first: that one is the key
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read().strip()


def make_signer(settings: Settings | None = None):
    """The process's signer: COURIER_SIGNING_KEY, else the data dir's key; COURIER_SIGNING_KEY_PREVIOUS
    accepted too."""
    s = settings or get_settings()
    current = s.signing_key.get_secret_value().encode() if s.signing_key else _data_dir_key(s.data_dir)
    accepted = [current] + ([s.signing_key_previous.get_secret_value().encode()] if s.signing_key_previous else [])
    try:
        return signing.Signer(accepted, max_age_s=s.signature_max_age_s)
    except ValueError as exc:
        raise ConfigError(f"COURIER_SIGNING_KEY: {exc}") from None


def agent_tools(s: Settings, blob_store: BlobStore):
    """What agent turns need beyond the rest of the context (`tasks.runtime.TurnTools`)."""
    spill = SpillConfig(**s.hooks_output_spill.model_dump())
    hooks: list = [ShellHook(tuple(h.command), h.name or "", h.timeout_s or s.hook_timeout_s) for h in s.hooks]
    if s.hook_plugins:
        hooks += load_plugins(timeout_s=s.hook_timeout_s)
    return TurnTools(
        openai={"base_url": s.openai_base_url, "model": s.openai_model, "api_key": s.openai_api_key,
                "max_steps": s.openai_max_steps, "call_timeout_s": s.openai_call_timeout_s,
                "max_attempts": s.openai_max_attempts, "retry_base_s": s.openai_retry_base_s,
                "retry_max_s": s.openai_retry_max_s},
        hooks=HookRunner(hooks, store=blob_store, spill=spill), spill=spill, chromium_path=s.chromium_path,
        browser_allowed_hosts=tuple(s.browser_allowed_hosts or ()), jail=jail_config(s),
        tool_network=s.sandbox_tool_network,
    )


def jail_config(s: Settings):
    """The agents' namespace sandbox settings (adapters.agents.jail.JailConfig)."""
    return JailConfig(bwrap=s.sandbox_bwrap, uid_base=s.sandbox_uid_base, ro_paths=tuple(s.sandbox_ro_paths),
                      allowed_hosts=tuple(s.browser_allowed_hosts or ()))


def agent_sandbox_report(settings: Settings | None = None) -> list[tuple[int, str]]:
    """(log level, line) for a worker's start: each local agent that runs unconfined (a warning), and,
    where bwrap cannot make namespaces here, that the others' turns will be refused (an error)."""
    s = settings or get_settings()
    local = {n: a for n, a in s.agents.items() if not a.sandbox or a.sandbox.startswith("local:")}
    out = [(logging.WARNING, f"agent {n!r} runs UNCONFINED on this host, as the worker's own user "
                             f"(\"isolation\": \"host\"): it can read what the worker can")
           for n, a in sorted(local.items()) if a.isolation == "host"]
    confined = sorted(n for n, a in local.items() if a.isolation != "host") or ["demo"]
    why = unavailable(jail_config(s))
    if why:
        out.append((logging.ERROR, f"the local sandbox cannot isolate agents here: {why}; turns of "
                                   f"{', '.join(repr(n) for n in confined)} will be refused (set \"isolation\": "
                                   f"\"host\" on an agent to run it unconfined)"))
    return out


signing.set_loader(make_signer)
