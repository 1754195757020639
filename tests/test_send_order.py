"""Operators' sends published back to back (Flower's async-apply, `courier.delivery.send`) reach the
chat in the order they were published. Measured on e82a350: sends published through Flower 10 ms
apart arrived swapped 14 times in 300 (the delivery pool registers several at once)."""

from __future__ import annotations

import pytest

from adapters.platforms.outbox import read_log
from tasks import task_names
from tasks.ledger import keys
from tasks.ops import sendorder
from tests.fixtures.services import wait_until

N = 60


@pytest.mark.slow
def test_sends_published_back_to_back_arrive_in_publish_order(courier_env):
    env = courier_env()
    env.start_worker(queues="delivery", pool="threads", concurrency=8)
    app = env.celery_app()
    sent: dict[str, list[str]] = {"ord-a": [], "ord-b": []}  # two chats interleaved: each keeps its own order
    for i in range(N):  # as Flower publishes them: one message each, nothing between
        chat = "ord-a" if i % 3 else "ord-b"
        text = f"{chat} m{i:03d}"
        app.send_task(task_names.SEND, kwargs={"target": f"outbox:{chat}", "text": text})
        sent[chat].append(text)
    for chat, texts in sent.items():
        wait_until(lambda c=chat, n=len(texts): len(read_log(env.outbox, c)) >= n, timeout_s=180,
                   what=f"{chat}'s sends")
        got = [rec.get("text") for rec in read_log(env.outbox, chat)]
        assert got == texts, (chat, [t for t, w in zip(got, texts) if t != w][:5])


def test_a_send_whose_predecessor_never_comes_waits_once_and_loses_nothing(redis_client):
    """A number stamped but never registered (its publish failed, its message lost) delays the next
    send to that chat by at most the wait, once; order moves on, never back."""
    r, target = redis_client, "outbox:gap"
    first, lost, third = (sendorder.stamp(r, target) for _ in range(3))
    assert (first, lost, third) == (1, 2, 3)
    assert sendorder.wait_turn(r, target, first, wait_s=0)  # its turn at once
    assert not sendorder.wait_turn(r, target, lost, wait_s=0)  # first has not registered yet
    sendorder.done(r, target, first)
    assert sendorder.wait_turn(r, target, lost, wait_s=0)
    assert not sendorder.wait_turn(r, target, third, wait_s=0.05)  # `lost` never registers: gives up
    sendorder.done(r, target, third)
    assert r.hget(keys.send_order(target), "next") == "4"
    sendorder.done(r, target, lost)  # it turns up after all: registers at once, order does not move back
    assert sendorder.wait_turn(r, target, lost, wait_s=0) and r.hget(keys.send_order(target), "next") == "4"
    assert 0 < r.ttl(keys.send_order(target)) <= sendorder.TTL_S
