"""What tasks need from the outside world, handed in by `workers/`.

Tasks never read the environment: the worker process installs a context
factory at start-up (`set_factory`), and plain code receives a `Context`.
Tests can build a Context directly and call the plain code without a broker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters.platforms.base import Platform
from adapters.sandboxes.base import Sandbox, SandboxRef
from storage import BlobStore


class AgentConfig(Protocol):
    command: list[str]
    env: dict[str, str]
    timeout_s: float
    sandbox: str | None
    cwd: str | None


@dataclass
class Context:
    redis: Any
    store: BlobStore
    platform: Callable[[str], Platform]
    sandbox: Callable[[SandboxRef], Sandbox]
    agent: Callable[[str], AgentConfig | None]
    #: the local sandbox directory a turn runs in when its agent names none
    default_sandbox_dir: str = "/tmp/courier-sandbox"
    max_file_bytes: int = 50 * 1000 * 1000
    events_maxlen: int = 1000
    max_transient_attempts: int = 8
    #: how long transient storage errors are waited out before a file fails (with a notice)
    outage_deadline_s: float = 1800.0
    #: files one job may send (MEDIA tags of a reply, files of a send); 0: no cap
    max_files_per_job: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


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
