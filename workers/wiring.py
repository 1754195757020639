"""Builds adapters and stores from settings: the only place that turns the
environment into constructor arguments. Everything is cached per process
(connections are reused within a worker)."""

from __future__ import annotations

import os
import threading
from functools import lru_cache
from typing import Any

from pydantic import SecretStr

from adapters.errors import ConfigError
from adapters.extras import needs
from adapters.platforms.base import Limits, Platform
from adapters.sandboxes.base import PathPolicy, Sandbox, SandboxRef
from storage import BlobStore, open_store
from workers.settings import Settings, get_settings

_lock = threading.Lock()


@lru_cache(maxsize=4)
def _store_for(url: str, public_url: str | None = None, redis_url: str | None = None) -> BlobStore:
    st = open_store(url)
    if public_url and not st.can_sign and hasattr(st, "links"):
        # a volume: its links are served (and checked) by the web process at public_url
        from storage.links import LinkSigner
        from tasks import keys
        from workers.eventauth import server_key

        st.links = LinkSigner(public_url, lambda: server_key(redis_client(redis_url), keys.files_key()))
        st.can_sign = True
    return st


def store(settings: Settings | None = None) -> BlobStore:
    s = settings or get_settings()
    return _store_for(s.storage, s.public_url, s.redis_url)


def file_links(settings: Settings | None = None):
    """The signer that checks a volume's download links (the web process's /files/ route)."""
    from storage.links import LinkSigner
    from tasks import keys
    from workers.eventauth import server_key

    s = settings or get_settings()
    return LinkSigner(s.public_url or "", lambda: server_key(redis_client(s.redis_url), keys.files_key()))


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
            got = _platforms[key] = (s, _build_platform(name, s))
        return got[1]


def _build_platform(name: str, s: Settings) -> Platform:
    cls, credentials, options = _adapter(name, s)
    return cls(*credentials, **options)


def _secret(value: SecretStr | None, missing: str) -> str:
    if value is None or not value.get_secret_value():
        raise ConfigError(missing)
    return value.get_secret_value()


def _adapter(name: str, s: Settings) -> tuple[type[Platform], tuple[Any, ...], dict[str, Any]]:
    """A platform's adapter class, its constructor's positional arguments (what
    it sends as: a token, a directory) and its options, from the settings.
    Builds nothing; ConfigError when the platform is unknown, its SDK is not
    installed or a credential is not set."""
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
    """Raise ConfigError when a target's platform is unknown or lacks its token
    (or its SDK); builds no adapter."""
    _adapter(name, settings or get_settings())


def platform_limits(name: str, settings: Settings | None = None) -> Limits:
    """A configured platform's limits (upload sizes, album size, rate limits),
    read from its adapter class: no adapter and no SDK client is built.
    ConfigError as `check_platform`."""
    cls, _credentials, options = _adapter(name, settings or get_settings())
    return cls.limits_for(**options)


# -- sandboxes ----------------------------------------------------------------

@lru_cache(maxsize=64)
def _local_sandbox(roots: tuple[str, ...], home: str):
    """A local sandbox per set of roots, per process: resolving the roots'
    links costs a syscall per path component, and a sandbox holds nothing
    else (every file is resolved and checked when it is opened)."""
    from adapters.sandboxes.local import LocalSandbox

    return LocalSandbox.with_roots(roots, home=home)


@lru_cache(maxsize=4)
def _docker_client(base_url: str | None):
    """One Docker API client per engine and process (connections reused)."""
    import docker

    try:
        return docker.DockerClient(base_url=base_url, timeout=120) if base_url else docker.from_env(timeout=120)
    except docker.errors.DockerException as exc:
        from adapters.errors import SandboxGone

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
        return SshSandbox(
            ref, PathPolicy(roots=tuple(ref.roots)), key_path=s.ssh_key_path, known_hosts=s.ssh_known_hosts,
            user=s.ssh_user, port=s.ssh_port, use_openssh=s.ssh_use_openssh, control_dir=s.ssh_control_dir,
            connect_timeout_s=s.ssh_connect_timeout_s, io_timeout_s=s.sandbox_io_timeout_s,
        )
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
    c = _redis_clients.get(k)
    if c is None:
        with _redis_lock:  # a threads pool's tasks share it (redis-py clients are thread-safe: a connection pool)
            c = _redis_clients.get(k)
            if c is None:
                c = _redis_clients[k] = redis_url.client(u)
    return c


def build_context(settings: Settings | None = None):
    from tasks.runtime import Context, Retention

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
        redis=redis_client(s.redis_url),
        store=store(s),
        platform=lambda name: platform(name, s),
        sandbox=lambda ref: open_sandbox(ref, s),
        agent=s.agent,
        default_sandbox_dir=str(s.sandbox_dir),
        max_file_bytes=s.max_file_bytes,
        events_maxlen=s.events_maxlen,
        max_transient_attempts=s.delivery_max_attempts,
        outage_deadline_s=s.storage_outage_deadline_s,
        sandbox_io_timeout_s=s.sandbox_io_timeout_s,
        sandbox_breaker_max_s=s.sandbox_breaker_max_s,
        max_files_per_job=s.max_files_per_job,
        retention=Retention(
            screenshot_ttl_s=s.screenshot_ttl_s, file_ttl_s=s.file_ttl_s, spill_ttl_s=s.spill_ttl_s,
            workspace_ttl_s=s.workspace_ttl_s, spill_prefix=s.hooks_output_spill.directory,
            agent_sandbox_dirs=tuple(s.agent_sandbox_dirs or ()), s3_lifecycle=s.s3_lifecycle),
        turn_tools=turn_tools,
    )


def agent_tools(s: Settings, blob_store: BlobStore):
    """What agent turns need beyond the rest of the context (`tasks.runtime.TurnTools`):
    the OpenAI-compatible endpoint, the hooks (a HookRunner: shell hooks, then
    entry-point plugins), the output spill config, the browser."""
    from adapters.agents.hooks import HookRunner, ShellHook, load_plugins
    from storage.spill import SpillConfig
    from tasks.runtime import TurnTools

    spill = SpillConfig(**s.hooks_output_spill.model_dump())
    hooks: list = [ShellHook(tuple(h.command), h.name or "", h.timeout_s or s.hook_timeout_s) for h in s.hooks]
    if s.hook_plugins:
        hooks += load_plugins(timeout_s=s.hook_timeout_s)
    return TurnTools(
        openai={"base_url": s.openai_base_url, "model": s.openai_model, "api_key": s.openai_api_key,
                "max_steps": s.openai_max_steps, "call_timeout_s": s.openai_call_timeout_s,
                "max_attempts": s.openai_max_attempts, "retry_base_s": s.openai_retry_base_s,
                "retry_max_s": s.openai_retry_max_s},
        hooks=HookRunner(hooks, store=blob_store, spill=spill),
        spill=spill,
        chromium_path=s.chromium_path,
        browser_allowed_hosts=tuple(s.browser_allowed_hosts or ()),
    )
