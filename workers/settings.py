"""courier's settings: the environment, read in one place (only `workers/` reads it).

Tokens are `SecretStr` (never in repr, logs or `--help`). Every secret (each `SecretStr` field, and
COURIER_REDIS_URL) may come from `<NAME>_FILE` instead: then it sits in no process's environment.
"""

from __future__ import annotations

import os
import stat
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationInfo, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from adapters import defaults
from adapters.errors import ConfigError
from adapters.sandboxes.base import parse_uri
from storage import prefixes
from workers.redis_url import SCHEMES, celery_ssl, parse_sentinel, with_password


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "courier"


# -- secrets from files --------------------------------------------------------------------------
#: settings that take `<NAME>_FILE` besides the SecretStr ones (the Redis URL may carry a password)
ALSO_FROM_FILES = frozenset({"redis_url"})
#: a secret file larger than this is refused: a secret is a line, this is something else
SECRET_FILE_MAX_BYTES = 64 * 1024


class SecretFileError(ConfigError):
    """A `<NAME>_FILE` that cannot be used; the message never quotes the content."""


def takes_file(name: str, field: FieldInfo) -> bool:
    """Whether a setting may come from `<NAME>_FILE`: every SecretStr field and ALSO_FROM_FILES."""
    ann = field.annotation
    return name in ALSO_FROM_FILES or ann is SecretStr or SecretStr in typing.get_args(ann)


def env_names(name: str, field: FieldInfo, prefix: str = "COURIER_") -> list[str]:
    """The environment variables a field is read from (its aliases, else <prefix><NAME>)."""
    alias = field.validation_alias
    if alias is None:
        return [f"{prefix}{name}".upper()]
    return [str(a).upper() for a in getattr(alias, "choices", [alias])]


def read_secret_file(var: str, path: str) -> str:
    """The secret file `path` (named by `var`) without its trailing newline: a regular file
    (a FIFO or a device would block or never end) of UTF-8, at most SECRET_FILE_MAX_BYTES."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused just below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SecretFileError(f"{var}: {path} is not a regular file")
            with open(fd, "rb", closefd=False) as f:
                data = f.read(SECRET_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise SecretFileError(f"{var}: cannot read {path}: {exc.strerror}") from None
    if len(data) > SECRET_FILE_MAX_BYTES:
        raise SecretFileError(f"{var}: {path} is larger than {SECRET_FILE_MAX_BYTES} bytes: not a secret file")
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise SecretFileError(f"{var}: {path} is not UTF-8 text") from None


class FileSecretsSource(PydanticBaseSettingsSource):
    """`<NAME>_FILE` for every setting `takes_file` accepts, ranked just above the environment.
    The variable and its `_FILE` both set is an error; an empty one (or an empty file) counts
    as unset. Names match case-insensitively, as pydantic-settings matches the others."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every field at once

    def __call__(self) -> dict[str, Any]:
        environ = {k.lower(): v for k, v in os.environ.items()}
        values = {}
        for name, field in self.settings_cls.model_fields.items():
            for var in env_names(name, field, self.config.get("env_prefix") or "") if takes_file(name, field) else ():
                path = environ.get(f"{var}_FILE".lower(), "")
                if not path.strip():
                    continue
                if environ.get(var.lower(), "").strip():
                    raise SecretFileError(f"{var} and {var}_FILE are both set: set one of them")
                values[name] = read_secret_file(f"{var}_FILE", path)
        return {name: v for name, v in values.items() if v.strip()}


def file_variables() -> list[str]:
    """Every `<NAME>_FILE` variable courier reads (compose's environment is checked against them)."""
    return [f"{var}_FILE" for name, field in Settings.model_fields.items() if takes_file(name, field)
            for var in env_names(name, field, Settings.model_config.get("env_prefix") or "")]


class AgentLimits(BaseModel):
    """A sandboxed agent's limits per turn (0: none); hitting one ends the turn with a message naming it."""

    processes: int = Field(default=256, ge=0)
    open_files: int = Field(default=1024, ge=0)
    #: address space of each process (RLIMIT_AS)
    memory_bytes: int = Field(default=4 * 1024 ** 3, ge=0)
    #: the workspace as a whole and each file in it; also the size of the private /tmp
    workspace_bytes: int = Field(default=2 * 1024 ** 3, ge=0)


class AgentSpec(BaseModel):
    """An agent declared by name: a bridge command (argv list, no shell), or ``"runtime": "openai"``:
    the built-in loop against an OpenAI-compatible endpoint (defaults: COURIER_OPENAI_*)."""

    runtime: Literal["bridge", "openai"] = "bridge"
    command: list[str] = Field(default_factory=list)
    #: variables the agent gets (its environment is an allowlist: PATH, HOME, LANG and the like, these, and
    #: env_passthrough's; never the worker's settings or secrets)
    env: dict[str, str] = Field(default_factory=dict)
    #: names of the worker's own variables this agent may inherit (e.g. ["HTTPS_PROXY"])
    env_passthrough: list[str] = Field(default_factory=list)
    timeout_s: float = defaults.AGENT_TIMEOUT_S
    #: sandbox URI of the agent's working directory, e.g. local:///srv/agents/demo
    sandbox: str | None = None
    cwd: str | None = None
    #: the only absolute paths (in its sandbox) beyond the turn's workspace its MEDIA tags and file tools reach
    roots: list[str] = Field(default_factory=list)
    #: "bwrap": a local agent runs in a namespace sandbox of its own (adapters/agents/jail.py); "host":
    #: unconfined, as the worker's own user (an opt-in, warned about at worker start). Others ignore it.
    isolation: Literal["bwrap", "host"] = "bwrap"
    #: a sandboxed agent's network: "proxy" (only through courier's egress proxy: its allowlist, no private
    #: ranges) or "none"; default: "proxy" for a bridge agent, none for the built-in loop's terminal commands
    network: Literal["none", "proxy"] | None = None
    #: more hosts the egress proxy lets this agent reach (as COURIER_BROWSER_ALLOWED_HOSTS: host[:port], CIDR)
    allowed_hosts: list[str] = Field(default_factory=list)
    #: a sandboxed agent's limits per turn (0: none)
    limits: AgentLimits = Field(default_factory=lambda: AgentLimits())
    # -- runtime "openai" only ---------------------------------------------
    model: str | None = None
    system_prompt: str | None = None
    base_url: str | None = None
    max_steps: int | None = Field(default=None, ge=1)

    @field_validator("roots")
    @classmethod
    def _absolute_roots(cls, v: list[str]) -> list[str]:
        bad = [r for r in v if not r.startswith("/") or ".." in r.split("/") or "\x00" in r]
        if bad:
            raise ValueError(f"roots must be absolute paths without '..': {bad}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _host_sandbox(cls, v: Any) -> Any:
        # "sandbox": "host" is the opt-in written the short way: the default directory, unconfined
        if isinstance(v, dict) and v.get("sandbox") == "host":
            v = {**v, "sandbox": None, "isolation": "host"}
        return v

    @model_validator(mode="after")
    def _needs_command(self) -> "AgentSpec":
        if self.runtime == "bridge" and not self.command:
            raise ValueError("a bridge agent needs a command (argv list)")
        return self


class HookSpec(BaseModel):
    """A shell hook: an argv command (no shell), the turn context as JSON on stdin, JSON out."""

    command: list[str] = Field(min_length=1)
    name: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _argv(cls, v: Any) -> Any:
        return {"command": v} if isinstance(v, list) else v


class OutputSpill(BaseModel):
    """Hook contexts and tool outputs over `max_chars` go to storage; the prompt gets a preview."""

    enabled: bool = True
    max_chars: int = 10000
    preview_head: int = 500
    preview_tail: int = 500
    directory: str = prefixes.SPILL


class Settings(BaseSettings):
    # hide_input_in_errors: a refused value is not quoted in the error (a Redis URL carries its password)
    model_config = SettingsConfigDict(env_prefix="COURIER_", extra="ignore", populate_by_name=True,
                                      env_ignore_empty=True, hide_input_in_errors=True)

    #: where courier keeps its files by default (storage, outbox, local sandboxes)
    data_dir: Path = Field(default_factory=_default_data_dir)
    #: broker, results, ledger, events, rate limits: `redis://host:port/db`, `rediss://` (TLS: the query may
    #: say `ssl_ca_certs=/ca.pem`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs=required` (the default),
    #: `ssl_check_hostname`), or `sentinel://h1:26379,h2:26379/<master name>/<db>`; or COURIER_REDIS_URL_FILE
    redis_url: str = Field("redis://127.0.0.1:6379/0", repr=False)
    #: Redis's password (`requirepass`) when COURIER_REDIS_URL carries none (e.g. from COURIER_REDIS_PASSWORD_FILE)
    redis_password: SecretStr | None = None
    #: replicas that must confirm a send or turn before `courier send`/`courier turn`/a webhook answer "queued"
    #: (Redis `WAIT`: a write taken by a master deposed in a failover is made again on the new one); unset:
    #: 1 with a `sentinel://` URL, else 0 (no confirmation)
    redis_confirm_replicas: int | None = Field(default=None, ge=0)
    #: how long an unconfirmed send or turn is written again (a failover in between) before it is accepted
    #: on the master alone, with a warning
    redis_confirm_s: float = Field(default=10.0, gt=0)
    #: `file:///abs/dir` or `s3://bucket/prefix` (endpoint: AWS_ENDPOINT_URL); default file://<data dir>/storage
    storage_url: str | None = None
    #: S3 credentials (boto3's own variables, read here too so that they may come from files:
    #: AWS_SECRET_ACCESS_KEY_FILE, ...); unset: boto3's usual chain (profile, instance role)
    aws_access_key_id: SecretStr | None = Field(default=None, validation_alias="AWS_ACCESS_KEY_ID")
    aws_secret_access_key: SecretStr | None = Field(default=None, validation_alias="AWS_SECRET_ACCESS_KEY")
    aws_session_token: SecretStr | None = Field(default=None, validation_alias="AWS_SESSION_TOKEN")
    #: the web process's public URL (https://bot.example.com): a volume store's download links (in
    #: too-large notices) point at its signed, expiring /files/ route; S3 signs its own links
    public_url: str | None = None
    #: where the `outbox` platform writes; default <data dir>/outbox
    outbox_dir: Path | None = None

    # -- platforms -----------------------------------------------------
    telegram_bot_token: SecretStr | None = Field(default=None, validation_alias="TELEGRAM_BOT_TOKEN")
    #: Bot API server root (a local Bot API server or a test server may stand in); courier adds /bot<token>/<method>
    telegram_base_url: str = defaults.TELEGRAM_API_URL
    #: a local Bot API server (telegram-bot-api --local): uploads up to 2000 MB
    telegram_local_api: bool = False
    #: shared per-bot send rate (~30/s; paid broadcasts allow up to 1000/s; 0: no per-bot limit)
    telegram_bot_per_s: float = 30.0
    discord_bot_token: SecretStr | None = Field(default=None, validation_alias="DISCORD_BOT_TOKEN")
    #: Discord REST root
    discord_base_url: str = defaults.DISCORD_API_URL
    #: attachment cap: 10 MiB by default; boosted guilds allow more (50 MiB at level 2, 100 MiB at 3)
    discord_upload_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    slack_bot_token: SecretStr | None = Field(default=None, validation_alias="SLACK_BOT_TOKEN")
    #: Slack Web API root
    slack_base_url: str = defaults.SLACK_API_URL
    #: per-file cap (Slack's is 1 GB; a workspace may set less)
    slack_upload_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    whatsapp_access_token: SecretStr | None = Field(default=None, validation_alias="WHATSAPP_ACCESS_TOKEN")
    #: the sending phone number's id (Cloud API)
    whatsapp_phone_number_id: str | None = Field(default=None, validation_alias="WHATSAPP_PHONE_NUMBER_ID")
    #: WhatsApp Cloud API root
    whatsapp_base_url: str = defaults.WHATSAPP_API_URL

    # -- sandboxes -----------------------------------------------------
    #: allowed roots of the local sandbox (JSON list); default: <data dir>/sandbox, /tmp, /workspace
    local_roots: list[str] | None = None
    #: size cap for one extracted file
    max_file_bytes: int = defaults.MAX_FILE_BYTES
    #: Docker API of docker:// sandboxes (unix:///run/podman/podman.sock, tcp://...); default: DOCKER_HOST
    docker_host: str | None = None
    #: where singularity instance roots live (<dir>/<instance>/rootfs); default: ask apptainer
    singularity_instances_dir: str | None = None
    #: private key of ssh:// sandboxes (default: the ssh agent's, or ~/.ssh keys)
    ssh_key_path: str | None = None
    #: known_hosts file for ssh:// sandboxes (default ~/.ssh/known_hosts); an unknown host is refused
    ssh_known_hosts: str | None = None
    #: remote user and port when the URI names none (default: the worker's user, 22)
    ssh_user: str | None = None
    #: remote port when the URI names none
    ssh_port: int = 22
    #: use the OpenSSH client over a ControlMaster socket instead of paramiko SFTP
    ssh_use_openssh: bool = False
    #: directory of the ControlMaster sockets (keep it short); default: a private dir in /tmp
    ssh_control_dir: str | None = None
    #: seconds to connect and authenticate before an ssh sandbox counts as gone
    ssh_connect_timeout_s: float = 10.0
    #: read deadline of docker, ssh and modal sandboxes; a timeout opens the sandbox's circuit breaker (its
    #: other files wait untried, one file probes it at the end, the period doubling while it keeps timing out)
    sandbox_io_timeout_s: float = Field(default=60.0, gt=0)
    #: the longest period a stalled sandbox's breaker stays open between two probes
    sandbox_breaker_max_s: float = Field(default=600.0, gt=0)

    # -- agents ----------------------------------------------------------
    #: JSON object: name -> {"command": [...], "env": {}, "timeout_s": 900, "sandbox": "local:///dir", "roots": [],
    #: "env_passthrough": []}, or {"runtime": "openai", "model", "system_prompt", "base_url", "max_steps", ...}
    agents: dict[str, AgentSpec] = Field(default_factory=dict)
    #: the agent `courier turn` runs without --agent
    default_agent: str = "demo"
    #: OpenAI-compatible chat completions (agents with "runtime": "openai")
    openai_base_url: str = "https://api.openai.com/v1"
    #: model of openai agents that name none
    openai_model: str | None = None
    #: sent only as the Authorization bearer token
    openai_api_key: SecretStr | None = None
    #: model calls per turn before it ends with max_steps_exceeded (an agent's max_steps wins)
    openai_max_steps: int = Field(default=20, ge=1)
    #: one chat-completions request
    openai_call_timeout_s: float = Field(default=120.0, gt=0)
    #: tries of one model call: a 429 (after its retry-after), a 5xx or a failed connection is tried again
    openai_max_attempts: int = Field(default=6, ge=1)
    #: backoff between tries of a model call: base * 2^n seconds with jitter, at most openai_retry_max_s
    openai_retry_base_s: float = Field(default=1.0, ge=0)
    #: longest backoff between tries of a model call (never past the turn's timeout)
    openai_retry_max_s: float = Field(default=30.0, ge=0)
    #: headless Chromium for the browser_screenshot tool
    chromium_path: str = defaults.CHROMIUM_PATH
    #: JSON list of non-public destinations browser_screenshot may reach: host names, addresses or CIDR
    #: networks, each optionally with :port ([v6]:port; none: every port), e.g. ["dash.intranet",
    #: "10.1.0.0/16:8080"]; anything else must be public, on port 80 or 443 (page, redirects, subresources)
    browser_allowed_hosts: list[str] | None = None

    # -- hooks -------------------------------------------------------------
    #: a lane's drive that makes no progress (no step, no chunk of a file sent) for this long stops renewing its
    #: lease: another worker takes the chat over once it lapses (20 s later), and the stuck process is recycled
    lease_stall_s: float = Field(default=40.0, gt=0)
    #: log lines: "plain" (time, level, process, logger, message) or "json" (one object a line: ts, level,
    #: process, logger, message, and the job, delivery or lane a task ran for; never chat text or a secret)
    log_format: Literal["plain", "json"] = "plain"

    # -- what crosses Redis is signed (tasks/ledger/signing.py) ---------------------------------------
    #: the HMAC key every spec and task message is signed with (16+ bytes; `openssl rand -hex 32`); every
    #: process of a deployment needs the same one. Unset: a key generated into <data dir>/signing.key on
    #: first start (one host, or hosts sharing the data volume)
    signing_key: SecretStr | None = None
    #: the key before a rotation, still accepted (never used to sign) until everything it signed is gone
    signing_key_previous: SecretStr | None = None
    #: how old a signed spec or message may be (seconds)
    signature_max_age_s: int = Field(default=30 * 24 * 3600, gt=0)

    # -- the agents' namespace sandbox (local agents; adapters/agents/jail.py) -------------------
    #: the bubblewrap program
    sandbox_bwrap: str = "bwrap"
    #: a root worker runs each turn's agent as uid (and gid) base + a hash of the turn id (span 65536)
    sandbox_uid_base: int = Field(default=720_000, ge=1000)
    #: JSON list of more paths every sandboxed agent sees read-only (tools installed outside /usr)
    sandbox_ro_paths: list[str] = Field(default_factory=list)
    #: network of the built-in loop's terminal commands and of hooks: "none" or "proxy"
    sandbox_tool_network: Literal["none", "proxy"] = "none"

    #: JSON list of shell hooks: [["cmd", "arg"], {"command": [...], "name": "x", "timeout_s": 5}]
    hooks: list[HookSpec] = Field(default_factory=list)
    #: a hook (shell or plugin) running longer is skipped (a shell hook's process group is killed)
    hook_timeout_s: float = Field(default=10.0, gt=0)
    #: load Python hook plugins from the `courier.hooks` entry point group
    hook_plugins: bool = True
    #: JSON object: enabled, max_chars, preview_head, preview_tail, directory
    hooks_output_spill: OutputSpill = Field(default_factory=OutputSpill)

    # -- retention (janitor) -----------------------------------------------
    #: screenshots/ older than this are deleted by the janitor
    screenshot_ttl_s: int = 24 * 3600
    #: files/ (extracted and sent files) older than this are deleted by the janitor
    file_ttl_s: int = 7 * 24 * 3600
    #: hook_outputs/ spills older than this are deleted by the janitor
    spill_ttl_s: int = 7 * 24 * 3600
    #: turn workspaces of local sandboxes (<agent dir>/turns/<job>) untouched this long are deleted by the
    #: janitor; keep it well above the turn timeout plus the time deliveries may wait
    workspace_ttl_s: int = 24 * 3600
    #: S3 storage: the janitor keeps lifecycle rules on the bucket (each prefix expires after its TTL in whole
    #: days; unfinished multipart uploads after a day) instead of listing and deleting (`courier janitor
    #: --install-lifecycle` installs them at once); only for services that enforce them (AWS S3, MinIO, Ceph)
    s3_lifecycle: bool = False

    # -- delivery ----------------------------------------------------------
    #: attempts of a delivery or extraction on transient errors before it is recorded failed
    delivery_max_attempts: int = 8
    #: a task message held by a worker that died is handed out again after this many seconds (recovery does
    #: not wait for it: the reconciler re-drives its stages); at least 30, above courier's longest countdown
    visibility_timeout_s: int = Field(3600, ge=30)
    #: how long transient storage errors (S3 or the volume away), and a sandbox that stopped answering,
    #: are waited out before a file fails, with a notice in the chat
    storage_outage_deadline_s: float = Field(1800.0, gt=0)
    #: files one job may send (MEDIA tags of one reply, files of one send); the rest are left
    #: out with a notice in the chat (a send over it is refused)
    max_files_per_job: int = Field(50, ge=1)
    #: time limits of one task run: past the soft one the stage is retried by the ledger,
    #: past the hard one (+30 s) its process is ended
    delivery_time_limit_s: int = Field(1800, ge=10)
    extract_time_limit_s: int = Field(1800, ge=10)
    turn_time_limit_s: int = Field(3600, ge=10)
    #: events kept per turn stream (approximate)
    events_maxlen: int = 1000
    #: the pool of a worker that consumes only the delivery queue (`courier worker -Q delivery`): `threads`
    #: (deliveries wait on the platform, not the CPU) or `prefork`. Workers of other queues use prefork
    delivery_pool: Literal["threads", "prefork"] = "threads"
    #: deliveries one such worker sends at once (threads per process, or prefork processes)
    delivery_concurrency: int = Field(16, ge=1, le=256)
    #: processes of a threads-pool delivery worker, each with its own threads (one process uses one core);
    #: more for a local Bot API server or paid broadcasts (docs/benchmarks.md); 0: one per CPU, at most 8
    delivery_processes: int = Field(1, ge=0, le=64)

    # -- web process: webhooks and Server-Sent Events -------------------------
    #: address `courier web` binds (behind a TLS-terminating proxy in production)
    web_host: str = "127.0.0.1"
    #: port `courier web` listens on
    web_port: int = 8000
    #: an SSE comment line is sent after this many idle seconds
    sse_keepalive_s: float = 15.0
    #: webhook secrets: a request that does not verify gets 401 and enqueues nothing
    telegram_webhook_secret: SecretStr | None = Field(default=None, validation_alias="TELEGRAM_WEBHOOK_SECRET")
    slack_signing_secret: SecretStr | None = Field(default=None, validation_alias="SLACK_SIGNING_SECRET")
    #: the application's Ed25519 public key (hex) from the Discord developer portal
    discord_public_key: str | None = Field(default=None, validation_alias="DISCORD_PUBLIC_KEY")
    whatsapp_app_secret: SecretStr | None = Field(default=None, validation_alias="WHATSAPP_APP_SECRET")
    whatsapp_verify_token: SecretStr | None = Field(default=None, validation_alias="WHATSAPP_VERIFY_TOKEN")
    #: the agent webhook turns run (default: default_agent)
    webhook_agent: str | None = None
    #: a platform's retried update (same update/event id) within this window is dropped
    webhook_dedupe_ttl_s: int = 24 * 3600
    #: development only: send every webhook turn's reply here instead of the chat, e.g. outbox:dev
    #: or outbox:{platform}_{chat} (the placeholders name the chat the update came from)
    webhook_reply_target_override: str | None = None

    # -- operations: metrics ------------------------------------------------------
    #: operator bearer token for `GET /metrics` on the web process and the workers' exporters (unset: open;
    #: then keep them on loopback or a private network)
    metrics_token: SecretStr | None = None
    #: a worker serves its Prometheus metrics on this port (0: off); prefork pools need
    #: PROMETHEUS_MULTIPROC_DIR (an empty directory per host or container)
    metrics_port: int = Field(0, ge=0, le=65535)
    #: address a worker's metrics exporter binds
    metrics_host: str = "127.0.0.1"

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, FileSecretsSource(settings_cls), env_settings, dotenv_settings, file_secret_settings

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any, info: ValidationInfo) -> Any:
        """An empty variable (TOKEN= in compose or .env) means "not set": the default."""
        if isinstance(v, str) and v.strip() == "":
            field = cls.model_fields[info.field_name or ""]
            return field.get_default(call_default_factory=True)
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(SCHEMES):
            raise ValueError("COURIER_REDIS_URL must start with redis://, rediss://, unix:// or sentinel://")
        parse_sentinel(v)  # a malformed sentinel URL says what is wrong
        celery_ssl(v)  # so does an unknown TLS option
        return v

    @model_validator(mode="after")
    def _redis_password_in_url(self) -> "Settings":
        """COURIER_REDIS_PASSWORD goes into the URL every client is made from."""
        if self.redis_password is not None and self.redis_password.get_secret_value():
            self.redis_url = with_password(self.redis_url, self.redis_password.get_secret_value())
        return self

    @field_validator("browser_allowed_hosts")
    @classmethod
    def _browser_allowed_hosts(cls, v: list[str] | None) -> list[str] | None:
        from adapters.agents.egress import parse_allowed_hosts

        parse_allowed_hosts(v or ())  # a malformed entry is a ValueError now, not at the first screenshot
        return v

    # -- derived -----------------------------------------------------------
    @property
    def storage(self) -> str:
        return self.storage_url or (self.data_dir / "storage").absolute().as_uri()

    @property
    def outbox(self) -> Path:
        return (self.outbox_dir or self.data_dir / "outbox").absolute()

    @property
    def sandbox_dir(self) -> Path:
        return (self.data_dir / "sandbox").absolute()

    @property
    def local_sandbox_roots(self) -> tuple[str, ...]:
        if self.local_roots is not None:
            return tuple(str(Path(r).absolute()) for r in self.local_roots)
        return (str(self.sandbox_dir), "/tmp", "/workspace")

    def agent(self, name: str) -> AgentSpec | None:
        return self.agents.get(name)

    @property
    def agent_sandbox_dirs(self) -> tuple[str, ...]:
        """The directories of agents whose sandbox is local (their turn workspaces live under them)."""
        out = []
        for a in self.agents.values():
            if a.sandbox and a.sandbox.startswith("local:"):
                try:
                    out.append(parse_uri(a.sandbox)[1])
                except ConfigError:
                    continue
        return tuple(out)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


reset_settings = get_settings.cache_clear
