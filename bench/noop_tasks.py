"""Bare Celery tasks for baselines: the cheapest possible two-task chain."""

from celery import shared_task


@shared_task(name="bench.noop_first", acks_late=True, reject_on_worker_lost=True)
def noop_first(i: int) -> int:
    return i


@shared_task(name="bench.noop_last", acks_late=True, reject_on_worker_lost=True)
def noop_last(prev: int, counter_key: str, redis_url: str) -> int:

    r = _client(redis_url)
    r.incr(counter_key)
    return prev


_clients: dict = {}


def _client(url: str):
    import redis

    c = _clients.get(url)
    if c is None:
        c = _clients[url] = redis.Redis.from_url(url)
    return c
