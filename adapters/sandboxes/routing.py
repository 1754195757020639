"""Per-host routing of sandbox work: a ref may name the host its container
or instance lives on (``options["host"]``, for the fast channels that only
work there); the task layer routes its work to the queue ``sandbox.<host>``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from adapters.errors import ConfigError

if TYPE_CHECKING:  # only a type here: base.parse_uri calls host_of
    from adapters.sandboxes.base import SandboxRef

_HOST_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def host_of(ref: SandboxRef) -> str | None:
    """The host a sandbox lives on (`ref.options["host"]`), or None when any worker
    can reach it. Only hostname characters are accepted: the value is safe in a queue name."""
    host = (ref.options or {}).get("host")
    if not host:
        return None
    if not _HOST_OK.match(host):
        raise ConfigError(f"invalid sandbox host {host!r}")
    return host


def queue_for(ref: SandboxRef, default: str = "sandbox") -> str:
    """`sandbox.<host>` for a pinned ref, else `default`."""
    host = host_of(ref)
    return f"{default}.{host}" if host else default
