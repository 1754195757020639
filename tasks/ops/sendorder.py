"""Operators' sends (`courier.delivery.send`) join a chat's lane in the order they were
published: plain code. The delivery pool runs several messages at once, so sends published
close together could register swapped: the publisher stamps each with its chat's next number
(`stamp`, in the app's `before_task_publish` hook) and the task waits for the ones before it to
register (`wait_turn`), at most `WAIT_S`: a predecessor that never comes delays the chat once,
never loses anything. A redelivered message registers at once (its job id makes it a no-op).
"""

from __future__ import annotations

import time
from typing import Any

from tasks.ledger import keys, scripts

#: how long a send waits for the sends to its chat published before it
WAIT_S = 10.0
#: how often it looks
POLL_S = 0.02
#: the order's record outlives the chat's last send this long
TTL_S = 86400

#: the header that carries the number (not in the signed body: a forged one can only delay a send)
HEADER = "courier_send_seq"


def stamp(r: Any, target: str) -> int:
    """The next number of `target`'s sends (the publisher's side)."""
    return int(scripts.run(r, "send_order_stamp", keys=[keys.send_order(target)], args=[TTL_S]))


def wait_turn(r: Any, target: str, seq: int, *, wait_s: float = WAIT_S) -> bool:
    """Wait until the sends to `target` numbered before `seq` registered; False when `wait_s` passed
    first (the caller goes on: order is kept as well as it can be, nothing waits forever)."""
    deadline = time.monotonic() + wait_s
    while True:
        nxt = r.hget(keys.send_order(target), "next")
        if nxt is None or int(nxt) >= seq:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def done(r: Any, target: str, seq: int) -> None:
    """Send `seq` registered (or was refused): the next one's turn."""
    scripts.run(r, "send_order_done", keys=[keys.send_order(target)], args=[seq, TTL_S])
