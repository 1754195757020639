"""The only code in courier that reaches into kombu's private internals, kept in
one module so a kombu upgrade has one place to check (pyproject allows
``kombu>=5.4,<6``; tests/test_kombu_internals.py runs it against both ends).

What it touches, and why:

- ``kombu.transport.redis.Channel._create_client`` (wrapped by
  :func:`install`): a channel that closes after Redis went away restores its
  unacked messages with a new client, but kombu has let go of the connection's
  parameters and ``Channel._connparams`` raises AttributeError, which ends the
  worker ("Unrecoverable error"). The wrapper raises a redis ``ConnectionError``
  instead: Celery ignores those while it closes, reconnects, and the unacked
  messages come back later (kombu 5.4 to 5.7 still need it).
- ``Channel.connection.client`` (the channel's transport's ``kombu.Connection``,
  None once released): read to tell that case from any other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install"]


def install() -> None:
    """Wrap kombu's Redis channel's client creation (idempotent; Sentinel's channel inherits it)."""
    from kombu.transport import redis as kredis

    channel: Any = kredis.Channel
    if getattr(channel, "_courier_closing_guard", False):
        return
    original = channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        transport = getattr(self, "connection", None)
        if getattr(transport, "client", None) is None:
            from redis.exceptions import ConnectionError as RedisConnectionError

            raise RedisConnectionError("the broker connection is closed")
        return original(self, asynchronous=asynchronous)

    channel._create_client = _create_client
    channel._courier_closing_guard = True
