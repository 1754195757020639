"""One event, one set of words: `events.describe` says an event, and every
Python place that shows one (the console's lines, the chat's progress
message, the turn's PROGRESS state) says it with those words. Pure functions:
no services."""

from __future__ import annotations

import pytest
from rich.text import Text

from tasks.turn.activity import activity_text
from tasks.celery_tasks import progress_meta
from tasks.ledger.events import describe
from workers.console import render_event

EVENTS = [
    ({"kind": "status", "status": "started"}, "started"),
    ({"kind": "status", "status": "thinking", "activity": "planning"}, "planning"),
    ({"kind": "status", "status": "processing", "message": "received 2 files"}, "received 2 files"),
    ({"kind": "status", "status": "error", "reason": "agent exited with code 2"}, "agent exited with code 2"),
    ({"kind": "tool_start", "tool_name": "terminal", "activity": "$ pytest -q"}, "$ pytest -q"),
    ({"kind": "tool_start", "tool_name": "browser"}, "using browser"),
    ({"kind": "tool_start"}, "using a tool"),
    ({"kind": "tool_result", "tool_name": "terminal", "activity": "$ make", "status": "tool_complete",
      "duration_ms": 1500}, "$ make (tool_complete)"),
    ({"kind": "tool_result", "tool_name": "terminal", "status": "error", "error": "exit 2"},
     "terminal (error: exit 2)"),
    ({"kind": "delivery", "delivery_id": "turn_1.0", "state": "delivered", "name": "chart.png", "media": "photo"},
     "delivered chart.png photo"),
    ({"kind": "delivery", "delivery_id": "turn_1.1", "state": "failed", "reason": "too\nlarge"},
     "failed turn_1.1 too large"),
]


@pytest.mark.parametrize(("ev", "words"), EVENTS)
def test_describe_says_an_event_in_one_line(ev, words):
    assert describe(ev) == words


def test_an_unknown_event_is_its_json():
    assert describe({"kind": "mystery", "x": "ü"}) == '{"kind": "mystery", "x": "ü"}'


@pytest.mark.parametrize(("ev", "words"), EVENTS)
def test_every_place_that_shows_an_event_uses_its_words(ev, words):
    shown = Text.from_markup(render_event(ev)).plain
    assert words in shown or (ev["kind"] == "status" and shown.strip() == f"● {words}"), shown
    meta = progress_meta("turn_1", ev)
    if meta is not None:
        assert meta["activity"] == words[:80]
    text = activity_text(ev)
    assert text is None or text == words


def test_the_console_keeps_its_marks():
    assert Text.from_markup(render_event(EVENTS[1][0])).plain == "● thinking planning"
    assert Text.from_markup(render_event(EVENTS[4][0])).plain == "  → $ pytest -q"
    assert Text.from_markup(render_event(EVENTS[7][0])).plain == "  ✓ $ make (tool_complete) 1.5s"
    assert Text.from_markup(render_event(EVENTS[8][0])).plain == "  ✗ terminal (error: exit 2)"
    assert Text.from_markup(render_event(EVENTS[9][0])).plain == "  ⇢ delivered chart.png photo"


def test_what_the_progress_message_and_the_progress_state_show():
    assert activity_text(EVENTS[0][0]) is None  # started: nothing to show yet
    assert activity_text({"kind": "status", "status": "thinking"}) is None  # keeps the current text
    assert activity_text(EVENTS[1][0]) == "planning"
    assert progress_meta("turn_1", EVENTS[9][0]) is None  # deliveries are not a turn's activity
    assert progress_meta("turn_1", EVENTS[0][0]) == {"job": "turn_1", "phase": "started", "activity": "started"}
