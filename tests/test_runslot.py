"""The run slot (adapters/runslot.py) and the adapters' event loops (adapters/platforms/_aio.py):
one drive at a time runs Python in a process, the slot changes hands where a drive waits on a
platform, a holder stuck elsewhere never stalls the others, and an async SDK call runs on the
calling thread's own loop (no hand-off between threads), its client bound to that loop."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time

import pytest

from adapters import runslot
from adapters.platforms import _aio

#: a generous wait for something that must happen (never reached when it works)
SOON_S = 20.0


@pytest.fixture
def patient(monkeypatch):
    """A waiter never gives up on the slot within a test (the valve has its own test)."""
    monkeypatch.setattr(runslot, "HANDOVER_WAIT_S", 60.0)


def _thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _stuck_holder(release: threading.Event) -> threading.Thread:
    """A thread that holds the slot (a drive stuck in a slow call) until `release`."""
    stuck = threading.Event()

    def holder() -> None:
        with runslot.holding():
            stuck.set()
            release.wait(SOON_S)

    t = _thread(holder)
    assert stuck.wait(SOON_S)
    return t


def test_one_holder_at_a_time_and_the_slot_changes_hands_where_the_holder_waits(patient):
    order: list[str] = []
    a_in, a_wait, b_in, b_out = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def a() -> None:
        with runslot.holding():
            order.append("a holds")
            a_in.set()
            a_wait.wait(SOON_S)
            with runslot.waiting():  # a platform call: b may run
                order.append("a waits")
                assert b_in.wait(SOON_S)
                assert not runslot.held()
                b_out.wait(SOON_S)
            order.append("a holds again")
            assert runslot.held()

    def b() -> None:
        a_in.wait(SOON_S)
        with runslot.holding():
            order.append("b holds")
            b_in.set()
            assert runslot.held()
        order.append("b done")
        b_out.set()

    ta, tb = _thread(a), _thread(b)
    a_in.wait(SOON_S)
    assert not b_in.wait(0.3), "b ran while a held the slot and did not wait"
    a_wait.set()
    ta.join(SOON_S), tb.join(SOON_S)
    assert order == ["a holds", "a waits", "b holds", "b done", "a holds again"]


def test_nested_holding_and_waiting_without_the_slot_do_nothing(patient):
    assert not runslot.held()
    with runslot.waiting():  # not held: nothing to give up
        assert not runslot.held()
    with runslot.holding():
        with runslot.holding():  # the outer one holds it
            assert runslot.held()
        assert runslot.held()
    assert not runslot.held()
    with runslot.holding():  # and it was given back
        assert runslot.held()


def test_a_holder_stuck_elsewhere_does_not_stall_the_others(monkeypatch):
    """A drive stuck in a slow call that is not a platform wait (Redis timing out) keeps the
    slot; another thread runs without it after HANDOVER_WAIT_S instead of waiting it out."""
    monkeypatch.setattr(runslot, "HANDOVER_WAIT_S", 0.2)
    release = threading.Event()
    got: list[bool] = []

    t = _stuck_holder(release)
    done = threading.Event()

    def other() -> None:
        with runslot.holding():
            got.append(runslot.held())
        done.set()

    _thread(other)
    assert done.wait(SOON_S), "the other thread waited for the stuck holder"
    assert got == [False]  # it ran without the slot
    release.set()
    t.join(SOON_S)
    with runslot.holding():  # and the slot is free again
        assert runslot.held()


def _child_takes_the_slot(q) -> None:
    with runslot.holding():
        q.put(runslot.held())


def test_a_forked_child_has_a_slot_of_its_own(patient):
    """A child forked while a parent thread held the slot must not wait for that thread
    (it does not exist in the child)."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with runslot.holding():
        p = ctx.Process(target=_child_takes_the_slot, args=(q,))
        p.start()
        assert q.get(timeout=SOON_S) is True
        p.join(SOON_S)
    assert p.exitcode == 0


def test_a_drives_async_call_runs_on_its_own_threads_loop(patient):
    """In a drive (a thread holding the run slot): the call runs in the calling thread, on
    its own loop, kept for its next call, with an SDK client of that loop's own."""
    seen: dict[str, list] = {"a": [], "b": []}
    clients = _aio.PerLoop(object)

    async def where() -> tuple[int, asyncio.AbstractEventLoop, object]:
        return threading.get_ident(), asyncio.get_running_loop(), clients.get()

    def calls(name: str) -> None:
        for _ in range(2):
            with runslot.holding():
                seen[name].append((threading.get_ident(), *_aio.run(where(), 10)))

    for t in (_thread(lambda: calls("a")), _thread(lambda: calls("b"))):
        t.join(SOON_S)
    for rows in seen.values():
        assert len(rows) == 2
        (caller, ran_on, loop, client), again = rows
        assert caller == ran_on  # no other thread ran it
        assert again[2] is loop and again[3] is client  # one loop per thread, one client per loop
    assert seen["a"][0][2] is not seen["b"][0][2]
    assert seen["a"][0][3] is not seen["b"][0][3]


def test_any_other_callers_async_call_runs_on_the_shared_loop():
    """A turn's activity thread (one per turn), the CLI, a test: the process's shared loop,
    so a short-lived thread leaves no loop, client or connection of its own behind."""
    clients = _aio.PerLoop(object)
    seen: list[tuple[int, int, asyncio.AbstractEventLoop, object]] = []

    async def where() -> tuple[int, asyncio.AbstractEventLoop, object]:
        return threading.get_ident(), asyncio.get_running_loop(), clients.get()

    def call() -> None:
        seen.append((threading.get_ident(), *_aio.run(where(), 10)))
        assert _aio.thread_loop(make=False) is None

    for _ in range(2):
        _thread(call).join(SOON_S)
    (c1, r1, loop1, client1), (c2, r2, loop2, client2) = seen
    assert r1 == r2 and r1 not in (c1, c2)  # the shared loop's thread ran both
    assert loop1 is loop2 is _aio.loop() and client1 is client2


@pytest.mark.parametrize("shared", [False, True], ids=["own loop", "shared loop"])
def test_the_loop_gives_the_slot_up_while_it_waits_on_the_network(patient, shared):
    """A drive's platform call (an SDK awaiting its answer) lets the other drives run, on the
    thread's own loop (its selector) and on the shared one (its caller's wait)."""
    order: list[str] = []
    a_in, b_in = threading.Event(), threading.Event()

    async def answer_later() -> str:
        a_in.set()
        await asyncio.get_running_loop().run_in_executor(None, b_in.wait, SOON_S)  # until b ran
        return "answered"

    def a() -> None:
        with runslot.holding():
            order.append(_aio.run(answer_later(), SOON_S, shared=shared))
            assert runslot.held()  # taken back before the call returned

    def b() -> None:
        a_in.wait(SOON_S)
        with runslot.holding():
            order.append("b ran")
        b_in.set()

    ta, tb = _thread(a), _thread(b)
    ta.join(SOON_S), tb.join(SOON_S)
    assert order == ["b ran", "answered"]


@pytest.mark.parametrize("drive", [True, False], ids=["own loop", "shared loop"])
def test_a_call_past_its_timeout_raises_and_the_loop_serves_the_next_call(patient, drive):
    with runslot.holding() if drive else contextlib.nullcontext():
        with pytest.raises(TimeoutError):
            _aio.run(asyncio.sleep(30), 0.2)
        assert _aio.run(asyncio.sleep(0, "next"), 10) == "next"


def test_a_thread_that_ran_on_without_the_slot_asks_for_it_again_after_its_next_wait(monkeypatch):
    monkeypatch.setattr(runslot, "HANDOVER_WAIT_S", 0.2)
    release, ran_on = threading.Event(), threading.Event()
    seen: list[tuple[bool, bool]] = []

    t = _stuck_holder(release)

    def other() -> None:
        with runslot.holding():
            seen.append((runslot.held(), runslot.wanted()))  # on without it
            ran_on.set()
            t.join(SOON_S)  # the stuck holder is done
            with runslot.waiting():
                pass
            seen.append((runslot.held(), runslot.wanted()))  # and has it again

    o = _thread(other)
    assert ran_on.wait(SOON_S)
    release.set()
    o.join(SOON_S)
    assert seen == [(False, True), (True, True)]


def test_the_slot_goes_to_the_thread_that_waited_longest(patient):
    """A release hands the slot over in turn: the releasing thread cannot take it straight back."""
    from tests.fixtures.services import wait_until

    order: list[str] = []
    queued = []

    def waiter(name: str) -> None:
        with runslot.holding():
            order.append(name)

    with runslot.holding():
        for name in ("first", "second", "third"):
            queued.append(_thread(lambda n=name: waiter(n)))
            slot = runslot._process_slot()
            wait_until(lambda n=len(queued): len(slot._waiters) == n, timeout_s=SOON_S, what="the waiter queued")
        with runslot.waiting():  # the holder waits, then wants it back: it queues behind the three
            for t in queued:
                t.join(SOON_S)
            order.append("holder waited")
        order.append("holder again")
    assert order == ["first", "second", "third", "holder waited", "holder again"]


def _short_wait_with_another_thread_queued(before=None) -> list[str]:
    """In a drive on a new thread loop: `before()`, then a wait shorter than HOLD_S while
    another thread waits for the slot; what ran in which order."""
    from tests.fixtures.services import wait_until

    order: list[str] = []

    def other() -> None:
        with runslot.holding():
            order.append("other ran")

    loop = _aio.thread_loop()
    assert loop is not None
    _aio._drop_thread_loop(loop)  # (a loop of its own: no earlier test's waits count)
    with runslot.holding():
        if before is not None:
            before()
        t = _thread(other)
        slot = runslot._process_slot()
        wait_until(lambda: len(slot._waiters) == 1, timeout_s=SOON_S, what="the other thread queued")
        _aio.run(asyncio.sleep(_aio.HOLD_S / 4), SOON_S)
        order.append("short wait over")
    t.join(SOON_S)
    return order


def test_a_wait_shorter_than_the_hold_keeps_the_slot(patient):
    """A platform answering within HOLD_S (a local Bot API server) is waited for in place:
    handing the slot over and back would cost more than the wait."""
    assert _short_wait_with_another_thread_queued() == ["short wait over", "other ran"]


def test_after_a_wait_longer_than_the_hold_the_next_gives_the_slot_up_at_once(patient):
    """Once a wait outlasts HOLD_S (a remote API), the loop's next waits give the slot up at
    once instead of holding it idle for the first HOLD_S of each; a wait that ends within
    HOLD_S again brings the hold back."""

    def long_wait() -> None:
        # a wait that outlasts HOLD_S; on a starved CPU the loop may reach its select only after the
        # timer is due (no wait seen at all), so wait again until the selector has seen one
        selector = _aio.thread_loop()._selector  # type: ignore[union-attr]
        deadline = time.monotonic() + SOON_S
        while True:
            _aio.run(asyncio.sleep(_aio.HOLD_S * 25), SOON_S)
            if not selector.quick or time.monotonic() > deadline:
                break
        assert not selector.quick, "no wait longer than HOLD_S was seen"

    assert _short_wait_with_another_thread_queued(long_wait) == ["other ran", "short wait over"]

    async def answered_at_once() -> None:  # a socket ready within HOLD_S: the hold is back
        a, b = await asyncio.open_connection(*_listening())
        b.close()

    def long_then_quick() -> None:
        long_wait()
        _aio.run(answered_at_once(), SOON_S)

    assert _short_wait_with_another_thread_queued(long_then_quick) == ["short wait over", "other ran"]


def _listening() -> tuple[str, int]:
    """A loopback port that accepts connections (the kernel completes the handshake at once)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    _listening.keep = getattr(_listening, "keep", []) + [srv]  # type: ignore[attr-defined]
    return srv.getsockname()
