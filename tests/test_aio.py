"""The adapters' event loop (adapters/platforms/_aio.py): every async SDK call of a process
runs on its one loop, from any thread, over one client per loop; a call past its timeout
raises and the loop serves the next; a forked child gets a loop of its own."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest

from adapters.platforms import _aio

#: a generous wait for something that must happen (never reached when it works)
SOON_S = 20.0


def test_calls_from_many_threads_run_at_once_on_the_process_loop_over_one_client():
    """A threads pool's drives (and a turn's activity thread, the CLI): the process's loop,
    one client for all, and the calls overlap (a slow platform answer holds no other thread)."""
    clients = _aio.PerLoop(object)
    inside = 0
    most = 0
    seen: list[tuple[int, int, asyncio.AbstractEventLoop, object]] = []
    lock = threading.Lock()
    all_in = threading.Barrier(4)

    async def where() -> tuple[int, asyncio.AbstractEventLoop, object]:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await asyncio.get_running_loop().run_in_executor(None, all_in.wait, SOON_S)  # all four in at once
        inside -= 1
        return threading.get_ident(), asyncio.get_running_loop(), clients.get()

    def call() -> None:
        got = _aio.run(where(), SOON_S)
        with lock:
            seen.append((threading.get_ident(), *got))

    threads = [threading.Thread(target=call, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOON_S)
    assert len(seen) == 4 and most == 4
    callers = {c for c, _, _, _ in seen}
    runners = {r for _, r, _, _ in seen}
    assert len(runners) == 1 and not runners & callers  # the loop's own thread ran all four
    assert {id(loop) for _, _, loop, _ in seen} == {id(_aio.loop())}
    assert len({id(client) for _, _, _, client in seen}) == 1


def test_a_call_past_its_timeout_raises_and_the_loop_serves_the_next_call():
    with pytest.raises(TimeoutError):
        _aio.run(asyncio.sleep(30), 0.2)
    assert _aio.run(asyncio.sleep(0, "next"), 10) == "next"


def _child_call(q) -> None:
    import os

    try:
        q.put((_aio.run(asyncio.sleep(0, "answered"), 10), _aio._pid == os.getpid()))
    except TimeoutError:  # on the parent's loop, which no thread runs here
        q.put(("timed out", False))


def test_a_forked_child_runs_its_calls_on_a_loop_of_its_own():
    """The parent's loop thread does not exist in a forked child (prefork's children): the
    child makes its own on its first call instead of waiting on the parent's."""
    parent = _aio.loop()
    assert _aio.run(asyncio.sleep(0, "up"), 10) == "up"
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_call, args=(q,))
    p.start()
    assert q.get(timeout=SOON_S) == ("answered", True)
    p.join(SOON_S)
    assert p.exitcode == 0
    assert _aio.loop() is parent
