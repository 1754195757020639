"""Native activity on the chat while a turn runs, plain code: one thread per turn re-sends the
typing indicator every `typing_interval_s` (Telegram shows it 5 s) and keeps a progress message
with the current activity (at most one edit per `edit_interval_s`, latest text wins), removed
when the turn ends; a platform with neither starts no thread. A platform call's error (or rate
limit, which pauses that call) is logged and never fails the turn. The progress message id is
kept in Redis so a redelivered turn removes a stale one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

from adapters.errors import CourierError, RateLimited
from adapters.platforms.base import Platform, split_target
from tasks.ledger import keys
from tasks.ledger.events import Event, describe
from tasks.runtime import Context
from tasks.states import JobState

log = logging.getLogger(__name__)

TYPING_INTERVAL_S = 4.0
EDIT_INTERVAL_S = 2.0
STOP_JOIN_S = 5.0
PROGRESS_TTL_S = 24 * 3600


def activity_text(ev: Event) -> str | None:
    """What a progress message shows for an event (None: keep the current text): a tool
    starting, or a thinking/processing status that says what (`events.describe`'s words)."""
    kind, says = ev.get("kind"), ev.get("activity") or ev.get("message")
    if kind == "tool_start" or (kind == "status" and ev.get("status") in ("thinking", "processing") and says):
        return describe(ev)
    return None


def _overrides(platform: Platform, name: str) -> bool:
    return getattr(type(platform), name, None) is not getattr(Platform, name)


class TurnActivity:
    def __init__(self, ctx: Context, target: str, job_id: str) -> None:
        self.ctx = ctx
        self.redis = ctx.redis
        self.target = target
        self.job_id = job_id
        self.typing_interval_s = float(ctx.typing_interval_s or TYPING_INTERVAL_S)
        self.edit_interval_s = float(ctx.progress_edit_interval_s or EDIT_INTERVAL_S)
        self.platform: Platform | None = None
        self.chat = ""
        self.platform_name = ""
        self.typing = self.progress = False
        self._began = self._ended = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._want: str | None = None
        self._shown: str | None = None
        self._msg_id: str | None = None
        self._last_edit = float("-inf")
        self._paused_until: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> "TurnActivity":
        return self  # started by the first event after `started` (on_event)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Resolve the platform and start the thread if it shows activity at all. Never raises."""
        if self._began:
            return
        self._began = True
        try:
            self.platform_name, self.chat = split_target(self.target)
            self.platform = self.ctx.platform(self.platform_name)
        except Exception as exc:  # noqa: BLE001 - no activity, the turn goes on
            log.info("no native activity for %s: %s", self.job_id, _why(exc))
            return
        self.typing = _overrides(self.platform, "typing")
        self.progress = _overrides(self.platform, "start_progress")
        if not (self.typing or self.progress):
            return
        self._end_stale()
        self._thread = threading.Thread(target=self._run, name=f"activity-{self.job_id}", daemon=True)
        self._thread.start()

    def on_event(self, ev: Event) -> None:
        """Follow a turn's phase events: start once the agent is on its way (after `started`),
        show its activity, stop at the terminal status or the first delivery."""
        if self._ended:
            return
        kind = ev.get("kind")
        if kind == "delivery" or (kind == "status"
                                  and ev.get("status") in ("completed", JobState.ERROR, JobState.NO_REPLY)):
            self._ended = True
            self.stop()
            return
        if kind == "status" and ev.get("status") == "started":
            return
        self.start()
        text = activity_text(ev) if self.progress else None
        if text:  # for the thread: never blocks on the platform
            with self._lock:
                self._want = text
            self._wake.set()

    def stop(self) -> None:
        """Stop typing, remove the progress message. Never raises."""
        if self._thread is None:
            return
        self._stopped.set()
        self._wake.set()
        self._thread.join(STOP_JOIN_S)
        if self._thread.is_alive():
            log.warning("activity thread of %s is stuck in a platform call; leaving it", self.job_id)
        self._thread = None
        msg = self._msg_id
        if msg is not None:
            self._call("end_progress", self.chat, msg, force=True)
            self._msg_id = None
            self._forget()

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        next_typing = time.monotonic()
        while not self._stopped.is_set():
            if self.typing and time.monotonic() >= next_typing:
                self._call("typing", self.chat)
                next_typing = time.monotonic() + self.typing_interval_s
            with self._lock:
                want = self._want
            now = time.monotonic()
            pending = want is not None and want != self._shown
            if want is not None and pending and now - self._last_edit >= self.edit_interval_s:
                self._show(want)
                pending = False
            waits = [next_typing - now] if self.typing else []
            if pending:
                waits.append(self._last_edit + self.edit_interval_s - now)
            timeout = max(0.01, min(waits)) if waits else None
            self._wake.wait(timeout)
            self._wake.clear()

    def _show(self, text: str) -> None:
        if self._stopped.is_set():
            return
        self._last_edit = time.monotonic()
        if self._msg_id is None:
            msg = self._call("start_progress", self.chat, text)
            if msg is None:
                if "start_progress" not in self._paused_until:
                    self.progress = False  # this platform (or chat) has no progress messages
                return
            self._msg_id = str(msg)
            self._remember()
        else:
            self._call("edit_progress", self.chat, self._msg_id, text)
        self._shown = text

    def _call(self, name: str, *args: Any, force: bool = False) -> object:
        """A platform call (`start` resolved the platform before any), paused while it is rate limited."""
        if not force and time.monotonic() < self._paused_until.get(name, 0.0):
            return None
        self._paused_until.pop(name, None)
        try:
            return getattr(self.platform, name)(*args)
        except RateLimited as exc:
            self._paused_until[name] = time.monotonic() + exc.retry_after_s
            log.info("%s.%s rate limited for %gs (turn %s)", self.platform_name, name, exc.retry_after_s,
                     self.job_id)
        except Exception as exc:  # noqa: BLE001 - activity never fails a turn
            log.warning("%s.%s failed (turn %s): %s", self.platform_name, name, self.job_id, _why(exc))
        return None

    # -- the progress message in Redis (a redelivered turn removes a stale one) ------------
    def _remember(self) -> None:
        try:
            k = keys.progress_message(self.job_id)
            self.redis.hset(k, mapping={"platform": self.platform_name, "chat": self.chat,
                                        "message_id": self._msg_id or ""})
            self.redis.expire(k, PROGRESS_TTL_S)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not record the progress message of %s: %s", self.job_id, _why(exc))

    def _forget(self) -> None:
        try:
            self.redis.delete(keys.progress_message(self.job_id))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not clear the progress message of %s: %s", self.job_id, _why(exc))

    def _end_stale(self) -> None:
        if not self.progress:
            return
        try:
            rec = cast("dict[str, str]", self.redis.hgetall(keys.progress_message(self.job_id)))
        except Exception:  # noqa: BLE001
            return
        if not rec:
            return
        if rec.get("platform") == self.platform_name and rec.get("message_id"):
            self._call("end_progress", rec.get("chat") or self.chat, rec["message_id"], force=True)
        self._forget()


def _why(exc: BaseException) -> str:
    """An error's reason without vendor detail (URLs may carry tokens)."""
    return exc.reason if isinstance(exc, CourierError) else type(exc).__name__
