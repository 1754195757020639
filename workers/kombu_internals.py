"""The only code in courier that reaches into kombu's private internals (pyproject allows ``kombu>=5.4,<6``;
tests/test_kombu_internals.py runs it against both ends).

``kombu.transport.redis.Channel._create_client`` is wrapped (:func:`install`): a channel that closes after
Redis went away restores its unacked messages with a new client, but kombu has let go of the connection's
parameters (``Channel.connection.client`` is None) and ``_connparams`` raises AttributeError, which ends the
worker ("Unrecoverable error"). The wrapper raises a redis ``ConnectionError`` instead: Celery ignores those
while it closes, reconnects, and the unacked messages come back later.
"""

from __future__ import annotations

from typing import Any

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
