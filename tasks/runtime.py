"""What tasks need from the outside world, handed in by `workers/`: tasks never read the
environment; the worker installs a context factory (`set_factory`), and plain code receives
a `Context` (tests build one directly)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from adapters.defaults import CHROMIUM_PATH, MAX_FILE_BYTES
from adapters.platforms.base import Platform
from adapters.sandboxes.base import Sandbox, SandboxRef
from storage import BlobStore, prefixes

if TYPE_CHECKING:  # types only: a delivery worker never loads the hooks
    from redis import Redis

    from adapters.agents.hooks import HookRunner
    from adapters.agents.jail import JailConfig
    from storage.spill import SpillConfig


class AgentLimitsConfig(Protocol):
    """A sandboxed agent's limits (workers.settings.AgentLimits; 0: none)."""

    processes: int
    open_files: int
    memory_bytes: int
    workspace_bytes: int


class AgentConfig(Protocol):
    """An agent as turns read it (workers.settings.AgentSpec)."""

    runtime: Literal["bridge", "openai"]
    command: list[str]
    env: dict[str, str]
    env_passthrough: list[str]
    timeout_s: float
    sandbox: str | None
    cwd: str | None
    roots: list[str]
    isolation: Literal["bwrap", "host"]
    network: Literal["none", "proxy"] | None  # None: the runtime's default
    allowed_hosts: list[str]
    # runtime "openai"
    model: str | None
    system_prompt: str | None
    base_url: str | None
    max_steps: int | None

    @property  # read-only: a settings model's AgentLimits is one
    def limits(self) -> AgentLimitsConfig: ...


@dataclass(frozen=True)
class Retention:
    """How long the janitor keeps what (seconds), and where else it looks."""

    screenshot_ttl_s: int = 24 * 3600
    file_ttl_s: int = 7 * 24 * 3600
    spill_ttl_s: int = 7 * 24 * 3600
    workspace_ttl_s: int = 24 * 3600
    #: where hook outputs spill (the setting may move them from the default prefix)
    spill_prefix: str = prefixes.SPILL
    #: local sandbox directories agents name, beside the default one
    agent_sandbox_dirs: tuple[str, ...] = ()
    #: S3: the bucket's lifecycle rules expire the blobs (the sweep only installs them)
    s3_lifecycle: bool = False

    def ttls(self) -> dict[str, int]:
        """Each storage prefix the janitor expires, with its time to live."""
        return {prefixes.SCREENSHOTS: self.screenshot_ttl_s, prefixes.FILES: self.file_ttl_s,
                prefixes.INBOUND: self.file_ttl_s, self.spill_prefix: self.spill_ttl_s}


@dataclass
class TurnTools:
    """What agent turns need beyond the rest of the context, built on first use (a delivery
    worker never builds hooks)."""

    openai: dict[str, Any] = field(default_factory=dict)
    hooks: HookRunner | None = None
    spill: SpillConfig | None = None
    chromium_path: str = CHROMIUM_PATH
    browser_allowed_hosts: tuple[str, ...] = ()
    #: the agents' namespace sandbox on this host (adapters.agents.jail)
    jail: JailConfig = field(default_factory=lambda: _jail_config())
    #: network of the built-in loop's terminal commands and of hooks in a sandbox
    tool_network: Literal["none", "proxy"] = "none"


def _jail_config() -> JailConfig:
    from adapters.agents.jail import JailConfig

    return JailConfig()


@dataclass
class Context:
    redis: Redis
    store: BlobStore
    platform: Callable[[str], Platform]
    sandbox: Callable[[SandboxRef], Sandbox]
    agent: Callable[[str], AgentConfig | None]
    #: the local sandbox directory a turn runs in when its agent names none
    default_sandbox_dir: str = "/tmp/courier-sandbox"
    max_file_bytes: int = MAX_FILE_BYTES
    events_maxlen: int = 1000
    max_transient_attempts: int = 8
    #: how long storage errors and a sandbox that stopped answering are waited out before a file fails
    outage_deadline_s: float = 1800.0
    #: the read deadline of sandbox channels (docker, ssh, modal): also the first period of a
    #: sandbox's circuit breaker and how long an answer keeps it trusted (tasks/turn/breaker.py)
    sandbox_io_timeout_s: float = 60.0
    #: the longest period a sandbox's breaker stays open before its next probe
    sandbox_breaker_max_s: float = 600.0
    #: files one job may send (MEDIA tags of a reply, files of a send); 0: no cap
    max_files_per_job: int = 0
    retention: Retention = field(default_factory=Retention)
    #: the turn's tools, built once on first call (see `TurnTools`)
    turn_tools: Callable[[], TurnTools] = TurnTools
    #: the roots this worker allows for a sandbox ref (a spec's may narrow them, never widen); None: no configuration
    allowed_roots: Callable[[SandboxRef], tuple[str, ...]] | None = None
    #: how often a turn refreshes the chat's typing indicator and edits its progress message (None: defaults)
    typing_interval_s: float | None = None
    progress_edit_interval_s: float | None = None


_factory: Callable[[], Context] | None = None
_ctx: Context | None = None
_pid: int | None = None
_lock = threading.Lock()


def set_factory(factory: Callable[[], Context]) -> None:
    global _factory, _ctx
    _factory = factory
    _ctx = None


def ctx() -> Context:
    """The process's context (rebuilt after a fork: connections are per process)."""
    global _ctx, _pid
    c = _ctx
    if c is not None and _pid == os.getpid():
        return c
    with _lock:  # a threads pool's first tasks start together: one context, built once
        if _ctx is None or _pid != os.getpid():
            if _factory is None:
                raise RuntimeError("no courier context: import workers.celery_app (or call tasks.runtime.set_factory)")
            _ctx = _factory()
            _pid = os.getpid()
        return _ctx
