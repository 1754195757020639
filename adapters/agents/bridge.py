"""The agent bridge runtime: any agent as a subprocess.

The user's message goes on stdin (and in `COURIER_MESSAGE`); the command
writes lines on stdout. A line `AX_GATEWAY_EVENT <json object>` is an event
for `on_event`; every other stdout line is part of the final reply. A
malformed event line is dropped (logged), never leaked into the reply;
stderr never becomes the reply. A non-zero exit, a crash or a timeout ends
as one `error` result with a reason.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EVENT_PREFIX = "AX_GATEWAY_EVENT"
NO_REPLY_STATUSES = frozenset({"no_reply", "declined", "skipped", "not_responding"})
MAX_REPLY_CHARS = 1_000_000
STDERR_TAIL_CHARS = 2000


@dataclass
class BridgeResult:
    status: str  # completed | error | no_reply
    reply: str = ""
    reason: str = ""
    exit_code: int | None = None
    stderr_tail: str = ""
    events: int = 0
    extra: dict = field(default_factory=dict)


def parse_event_line(line: str) -> dict | None | bool:
    """Returns the event dict, False for a malformed event line, None for a reply line."""
    stripped = line.rstrip("\r\n")
    if not stripped.startswith(EVENT_PREFIX):
        return None
    rest = stripped[len(EVENT_PREFIX):]
    if rest and not rest[0].isspace():
        return None  # e.g. AX_GATEWAY_EVENTS: not our prefix
    try:
        ev = json.loads(rest)
    except ValueError:
        return False
    if not isinstance(ev, dict):
        return False
    if "kind" not in ev and "type" in ev:
        ev["kind"] = ev["type"]
    if not isinstance(ev.get("kind"), str):
        return False
    return ev


def run_bridge(
    command: list[str],
    message: str,
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
    on_event: Callable[[dict], None] | None = None,
) -> BridgeResult:
    if not command:
        return BridgeResult("error", reason="agent has no command")
    full_env = {**os.environ, **(env or {}), "COURIER_MESSAGE": message}
    try:
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, env=full_env, start_new_session=True,
        )
    except OSError as exc:
        return BridgeResult("error", reason=f"agent could not start: {exc.strerror or exc}")

    reply_parts: list[str] = []
    reply_len = 0
    stderr_tail: list[str] = []
    n_events = 0
    no_reply = False
    reported_error: str | None = None

    def feed_stdin() -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(message.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def read_stderr() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            stderr_tail.append(raw.decode("utf-8", "replace"))
            while sum(map(len, stderr_tail)) > STDERR_TAIL_CHARS and len(stderr_tail) > 1:
                stderr_tail.pop(0)

    def read_stdout() -> None:
        nonlocal reply_len, n_events, no_reply, reported_error
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            ev = parse_event_line(line)
            if ev is None:
                if reply_len < MAX_REPLY_CHARS:
                    reply_parts.append(line)
                    reply_len += len(line)
                continue
            if ev is False:
                log.warning("dropped a malformed agent event line (%d chars)", len(line))
                continue
            n_events += 1
            if ev["kind"] == "status":
                st = str(ev.get("status", ""))
                if st in NO_REPLY_STATUSES:
                    no_reply = True
                elif st == "error":
                    reported_error = str(ev.get("reason") or ev.get("message") or "agent reported an error")
                # terminal statuses are courier's to publish (exactly one per turn)
                if st in ("completed", "error") or st in NO_REPLY_STATUSES:
                    continue
            if on_event is not None:
                try:
                    on_event(ev)
                except Exception:  # noqa: BLE001 - a failing sink must not kill the turn
                    log.exception("event sink failed")

    threads = [threading.Thread(target=f, daemon=True) for f in (feed_stdin, read_stderr, read_stdout)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    for t in threads:
        t.join(timeout=5)

    tail = "".join(stderr_tail)[-STDERR_TAIL_CHARS:]
    reply = "".join(reply_parts)
    if timed_out:
        return BridgeResult("error", reason="runtime_timeout", exit_code=proc.returncode, stderr_tail=tail,
                            events=n_events)
    if proc.returncode != 0:
        why = f"agent exited with code {proc.returncode}" if proc.returncode > 0 else \
            f"agent was killed by signal {-proc.returncode}"
        return BridgeResult("error", reason=why, exit_code=proc.returncode, stderr_tail=tail, events=n_events)
    if reported_error is not None:
        return BridgeResult("error", reason=reported_error, exit_code=0, stderr_tail=tail, events=n_events)
    if no_reply:
        return BridgeResult("no_reply", exit_code=0, events=n_events)
    return BridgeResult("completed", reply=reply.strip("\n"), exit_code=0, stderr_tail=tail, events=n_events)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired, PermissionError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
