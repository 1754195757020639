"""What the console prints and how it waits: shared by the CLI commands and
`courier demo` (plain functions; the commands themselves are in `cli.py`).
Every piece of data is escaped or set as Text: never read as markup."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import TypeVar

import typer
from rich import box
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from adapters.display import visible
from tasks.ledger import events, receipts
from tasks.ledger.events import describe
from tasks.states import TURN_OVER, DeliveryState, JobState

EXIT_FAILED, EXIT_INPUT, EXIT_SERVICE, EXIT_TIMEOUT = 1, 2, 3, 4
#: a delivery's state as a table shows it (any other: yellow)
STATE_COLORS: dict[str, str] = {DeliveryState.DELIVERED: "green", DeliveryState.FAILED: "red"}
T = TypeVar("T")

# piped (not a terminal): tables are as wide as their content, never wrapped at 80 columns
out = Console() if sys.stdout.isatty() else Console(width=1000, soft_wrap=True)
err = Console(stderr=True)


def new_table(title: str, columns: Iterable[str] = (), *, numeric: bool = False, **col_kw) -> Table:
    """A table whose title is data; piped, without vertical rules (one line per row, for grep and awk).
    `numeric`: the columns after the first are right-justified."""
    t = Table(title=Text(visible(title)), title_justify="left",
              box=box.HEAVY_HEAD if out.is_terminal else box.SIMPLE)
    for i, col in enumerate(columns):
        t.add_column(col, justify="right" if numeric and i else "left", **col_kw)
    return t


def cell(value: object, style: str = "") -> Text:
    """A table cell: data as Text (never markup), with every invisible or reordering
    character escaped (`adapters.display.visible`: a name's right-to-left override)."""
    return Text(visible(str(value if value is not None else "")), style=style)


def delivery_cells(row: dict, where: str = "platform") -> list[Text]:
    """A receipt's cells: id, `where`, kind, name, size, attempts, state, message id (delivered) or reason."""
    state = row.get("state") or ""
    note = row.get("message_id") if state == DeliveryState.DELIVERED else row.get("reason")
    return [*(cell(row.get(k) or "") for k in ("id", where, "kind", "name", "size_bytes", "attempts")),
            cell(state, STATE_COLORS.get(state, "yellow")), cell(note or "")]


def delivery_columns(where: str = "platform") -> tuple[str, ...]:
    return ("delivery", where, "kind", "name", "size", "attempts", "state", "message id / reason")


def warn(msg: str) -> None:
    """A warning on stderr (the command goes on)."""
    err.print(f"[bold yellow]warning:[/] {esc(msg)}", highlight=False, soft_wrap=True)


def die(msg: str, code: int) -> "typer.Exit":
    err.print(f"[bold red]error:[/] {esc(msg)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


#: at most this long between two looks when no event comes (a state set without its event is still seen)
LOOK_MS = 250


def follow(r, job_ids: Iterable[str], look: Callable[[], tuple[T, bool]], timeout_s: float,
           on_event: Callable[[str, dict], None] | None = None) -> tuple[T, bool]:
    """`look()` (-> its value, and whether it is done) until done or `timeout_s` is up: the
    last look's value and whether it was done. Between looks it blocks on the jobs' event
    streams (read from their start, then after the last event seen), so an event, even one
    that lands between a look and the next read, wakes it at once; each event read goes to
    `on_event(stream id, event)`, in order."""
    deadline = time.monotonic() + timeout_s
    cursors = dict.fromkeys(job_ids, "0-0")
    while True:
        value, done = look()
        left = deadline - time.monotonic()
        if done or left <= 0 or not cursors:
            return value, done
        for job_id, eid, ev in events.read_many(r, cursors, block_ms=int(min(left * 1000, LOOK_MS)) or 1,
                                                count=200):
            cursors[job_id] = eid
            if on_event is not None:
                on_event(eid, ev)


def wait_deliveries(r, job_id: str, timeout_s: float) -> tuple[list[dict], bool]:
    """The job's deliveries once all are final (`follow`); done at once for a turn that
    ended with none (no reply, an empty reply)."""

    def look() -> tuple[list[dict], bool]:
        rows = receipts.job_deliveries(r, job_id)
        if rows:
            return rows, all(row.get("state") in receipts.TERMINAL for row in rows)
        return rows, (receipts.get_job(r, job_id) or {}).get("state") in TURN_OVER

    return follow(r, [job_id], look, timeout_s)


def deliveries_table(job_id: str, rows: list[dict]) -> Table:
    t = new_table(f"deliveries of {job_id}", delivery_columns(), overflow="fold")
    for row in rows:
        t.add_row(*delivery_cells(row))
    return t


def watch_job(r, job_id: str, timeout_s: float, *, quiet: bool = False, as_json: bool = False) -> bool | None:
    """Follow a job's events until its terminal status and every delivery's final state: a
    live status line above a log of the events (`as_json`: one JSON line per event, `id` the
    stream id). True: completed (or no reply: the agent chose so) and all delivered; False:
    error or a failed delivery; None: timed out."""
    tracker = events.EndTracker.for_job(r, job_id)
    view = _WatchView(job_id)
    shown = not (quiet or as_json)

    def on_event(eid: str, ev: dict) -> None:
        tracker.feed(ev)
        line = view.feed(ev)
        if as_json:
            print(json.dumps({"id": eid, **ev}, ensure_ascii=False), flush=True)
        elif shown and line:
            out.print(line, highlight=False)

    with Live(view, console=out, transient=True, refresh_per_second=8) if shown and out.is_terminal else nullcontext():
        _, done = follow(r, [job_id], lambda: (None, tracker.done), timeout_s, on_event)
    if not done:
        return None
    if shown:
        out.print(view.summary(tracker), highlight=False)
    return _ok(tracker)


def _ok(tracker) -> bool:
    """Over as it should be: completed or no reply, and no delivery failed."""
    st = (tracker.terminal or {}).get("status")
    return st in ("completed", JobState.NO_REPLY) and DeliveryState.FAILED not in tracker.final.values()


class _WatchView:
    """The live status line of `courier watch` (a rich renderable)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.phase: str = JobState.QUEUED
        self.activity = ""
        self.t0 = time.monotonic()
        self.deliveries: dict[str, str] = {}
        self.tools = 0
        self.spinner = Spinner("dots", style="cyan")

    def feed(self, ev: dict) -> str | None:
        """Update the status line; returns the log line for the event (or None)."""
        kind = ev.get("kind")
        if kind == "status":
            self.phase = ev.get("status", self.phase)
            if ev.get("activity") or ev.get("message"):
                self.activity = describe(ev)
        elif kind == "tool_start":
            self.tools += 1
            self.activity = describe(ev)
        elif kind == "delivery" and ev.get("delivery_id"):
            self.deliveries[ev["delivery_id"]] = ev.get("state", "")
        return render_event(ev)

    def __rich__(self):
        done = sum(1 for s in self.deliveries.values() if s in (DeliveryState.DELIVERED, DeliveryState.FAILED))
        line = Text.assemble((self.job_id, "bold"), " · ", (self.phase, "cyan"))
        if self.activity:
            line.append(f" · {self.activity}")
        line.append(f" · {time.monotonic() - self.t0:.1f}s", style="dim")
        if self.deliveries:
            line.append(f" · deliveries {done}/{len(self.deliveries)}", style="dim")
        self.spinner.update(text=line)
        return self.spinner

    def summary(self, tracker) -> str:
        st = (tracker.terminal or {}).get("status") or self.phase
        color = ("yellow" if st == JobState.NO_REPLY else "green") if _ok(tracker) else "red"
        n = len(tracker.final)
        failed = sum(1 for s in tracker.final.values() if s == DeliveryState.FAILED)
        tail = f", {failed} failed" if failed else ""
        return (f"[{color}]{esc(self.job_id)}: {esc(st)}[/] · {self.tools} tool call{'s' * (self.tools != 1)} · "
                f"{n} deliver{'ies' if n != 1 else 'y'}{tail} · {time.monotonic() - self.t0:.1f}s")


def render_event(ev: dict) -> str:
    """One console line for an event: `events.describe`'s words, with a mark and colour."""
    text = describe(ev)
    kind = ev.get("kind")
    if kind == "status":
        st = ev.get("status", "")
        color = {"completed": "green", JobState.ERROR: "red", JobState.NO_REPLY: "yellow"}.get(st, "cyan")
        return f"[{color}]● {esc(st)}[/] {esc(text) if text != st else ''}".rstrip()
    if kind == "tool_start":
        return f"  [dim]→[/] {esc(text)}"
    if kind == "tool_result":
        mark = "[green]✓[/]" if ev.get("status") != "error" else "[red]✗[/]"
        took = f" {ev['duration_ms'] / 1000:.1f}s" if isinstance(ev.get("duration_ms"), (int, float)) else ""
        return f"  {mark} [dim]{esc(text)}{took}[/]"
    if kind == "delivery":
        color = STATE_COLORS.get(ev.get("state", ""), "yellow")
        return f"  [{color}]⇢[/] {esc(text)}"
    return f"  {esc(text)}"


def esc(v) -> str:
    return escape(str(v)) if v is not None else ""


