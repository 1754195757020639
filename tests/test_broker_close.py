"""A worker outlives Redis going away while it closes a channel (issue 24, measured in the chaos
suite under load: "Unrecoverable error: AttributeError('NoneType' object has no attribute
'hostname')" from kombu's `_connparams` as Celery closed its connection, and the worker exited)."""

from __future__ import annotations

from kombu import Connection
from kombu.common import ignore_errors

from workers import kombu_internals


def test_closing_a_channel_whose_connection_let_go_is_a_connection_error(redis_server):
    kombu_internals.install()
    conn = Connection(redis_server.url)
    q = conn.SimpleQueue("courier-test-close")
    q.put({"n": 1})
    q.get(timeout=10)  # received, not acked: the channel restores it as it closes
    chan = q.channel
    chan._pool = None  # as after a connection error: the pool would be made again on next use
    conn.transport.client = None  # kombu lets go of the connection's parameters as it releases it
    # Celery's consumer closes the connection this way after Redis went away: it must not raise
    ignore_errors(conn, chan.close)
