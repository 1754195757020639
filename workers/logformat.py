"""How every courier process's log lines look (`COURIER_LOG_FORMAT`).

- ``plain`` (the default): ``<time> <LEVEL> <process> <logger>: <message>``,
  the same in the worker, beat, the web process, Flower and the CLI (the web
  process's lines had no time or level; a threads-pool delivery worker's
  processes all said ``MainProcess``).
- ``json``: one JSON object a line, for a log pipeline: ``ts`` (ISO 8601,
  UTC), ``level``, ``process``, ``pid``, ``logger``, ``message``, and
  ``job``, ``delivery``, ``lane``, ``task``, ``task_id`` when the line was
  logged while a task ran for them (set from the task's arguments as it
  starts: ids and a chat's target, never the chat's text), ``exc`` with the
  traceback. Records are redacted before they are formatted
  (workers/logsafe.py): no secret, no chat text, in either format.

`install(fmt)` puts the formatter on every handler configured so far and is
called wherever logging is configured (the same places as logsafe's).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
from datetime import datetime, timezone
from typing import Any

__all__ = ["FORMATS", "JsonFormatter", "PLAIN", "install", "task_fields", "clear_task_fields"]

FORMATS = ("plain", "json")
PLAIN = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"
#: the ids of the task this thread runs (a threads pool runs several at once: a context var each)
_task: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("courier_log_task", default=None)
_fields_filter_name = "courier-task-fields"


def task_fields(task_name: str, task_id: str, args: Any) -> None:
    """Note the running task's ids for this thread's log lines: a delivery's and its job's (an
    extraction), a job's (a turn), a lane's target (a drive). Never the arguments' text."""
    from tasks import task_names

    out = {"task": task_name.rsplit(".", 1)[-1], "task_id": task_id}
    first = args[0] if isinstance(args, (list, tuple)) and args else None
    if task_name == task_names.EXTRACT_FILE and isinstance(first, str):
        out["delivery"], out["job"] = first, first.rsplit(".", 1)[0]
    elif task_name == task_names.DRIVE_LANE and isinstance(first, str) and first:
        out["lane"] = first
    elif isinstance(first, dict) and isinstance(first.get("job"), str):
        out["job"] = first["job"]
    _task.set(out)


def clear_task_fields() -> None:
    _task.set(None)


class _TaskFields(logging.Filter):
    """Copies the running task's ids onto each record (as `courier_fields`)."""

    name_ = _fields_filter_name

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _task.get()
        if fields and not hasattr(record, "courier_fields"):
            record.courier_fields = fields
        return True


class JsonFormatter(logging.Formatter):
    """A record as one JSON object (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "process": record.processName,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "courier_fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


_fields = _TaskFields()


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    f = logging.Formatter(PLAIN)
    f.converter = __import__("time").gmtime  # UTC, as the JSON lines and the ledger's times
    f.default_msec_format = "%s.%03dZ"
    return f


def install(fmt: str | None = None) -> None:
    """The format `fmt` (default COURIER_LOG_FORMAT, plain) on every handler configured so far."""
    fmt = (fmt or os.environ.get("COURIER_LOG_FORMAT") or "plain").lower()
    if fmt not in FORMATS:
        fmt = "plain"
    f = formatter(fmt)
    from workers.logsafe import _handlers

    for handler in _handlers():
        handler.setFormatter(f)
        if _fields not in handler.filters:
            handler.addFilter(_fields)


def name_process(name: str) -> None:
    """This process's name in log lines (`processName`)."""
    import multiprocessing

    multiprocessing.current_process().name = name
