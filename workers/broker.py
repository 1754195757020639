"""One Redis client object per kombu channel, not one per publish.

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

