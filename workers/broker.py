"""Two costs of Celery's Redis transport a delivery worker pays per task, removed.

1. One Redis client object per kombu channel, not one per publish.

kombu's Redis channel builds a new `redis.Redis` around its (shared)
connection pool for every publish, event and ack (`Channel._create_client`).
The pool is what holds connections; the client object is only a front, yet
redis-py's constructor is costly (it copies the response-callback table):
in a delivery worker it was ~6% of the process's CPU under load, paid for
every task-received/started/succeeded event and every ack.

`install()` makes each channel keep the front it built and hand it out again
while the pool under it is the same (a pool replaced after a connection error
gets a new front). redis-py's clients are safe to share between threads:
every command takes a connection from the pool. Only the synchronous client
is kept; the asynchronous one (BRPOP in the event loop) is kombu's own
`Channel.client`, cached by kombu already.

2. Task events publish with their exchange bound once (`Events`, given to
`Celery(events=...)`; see `EventDispatcher`).
"""

from __future__ import annotations

from typing import Any

_ATTR = "_courier_sync_client"


def install() -> None:
    """Patch kombu's Redis channel (idempotent; Sentinel's channel inherits it)."""
    from kombu.transport import redis as kredis

    channel: Any = kredis.Channel
    if getattr(channel, "_courier_cached_client", False):
        return
    original = channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        transport = getattr(self, "connection", None)
        if getattr(transport, "client", None) is None:
            # a channel closing after Redis went away: kombu has let go of the connection's
            # parameters, and making a pool from them would be an AttributeError that ends the
            # worker (Celery's "Unrecoverable error"). A connection error instead: Celery ignores
            # those while it closes, reconnects, and the unacked messages come back later.
            from redis.exceptions import ConnectionError as RedisConnectionError

            raise RedisConnectionError("the broker connection is closed")
        if asynchronous:
            return original(self, asynchronous=True)
        pool = self.pool
        cached = self.__dict__.get(_ATTR)
        if cached is None or cached.connection_pool is not pool:
            cached = original(self, asynchronous=False)
            self.__dict__[_ATTR] = cached
        return cached

    channel._create_client = _create_client
    channel._courier_cached_client = True



# -- task events: the event exchange bound once ---------------------------------------------
from celery.app.events import Events as _CeleryEvents  # noqa: E402 - the patch above needs no Celery
from celery.events.dispatcher import EventDispatcher as _CeleryDispatcher  # noqa: E402


class EventDispatcher(_CeleryDispatcher):
    """Celery's event dispatcher with its exchange bound to a channel once.

    Each event publish passes the exchange in `declare=[...]`; kombu's
    `maybe_declare` binds an unbound entity to the channel again (a copy of
    the exchange: `Object.__copy__` → `as_dict`) before finding it in the
    declared cache, so every task-received/started/succeeded event paid for a
    copy it threw away (~10% of a delivery worker's CPU when the platform
    answers at once). Bound once, the cached declaration is all that is
    looked at. A bound exchange only names where events go; declaring (a
    no-op for Redis's fanout exchange) still uses the producer's own channel.
    """

    def enable(self) -> None:
        super().enable()
        me: Any = self  # Celery is untyped
        if me.producer is not None and not me.exchange.is_bound:
            me.exchange = me.exchange(me.producer.channel)


class Events(_CeleryEvents):
    """`app.events` with :class:`EventDispatcher` (`Celery(events=...)`)."""

    dispatcher_cls = "workers.broker:EventDispatcher"
