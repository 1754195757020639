"""How every courier process's log lines look (`COURIER_LOG_FORMAT`): ``plain`` (the default, `PLAIN`) or
``json`` (`JsonFormatter`: one object a line, with the ids of the task the line was logged for, never the
chat's text). Records are redacted before they are formatted (workers/logsafe.py).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any

from tasks import task_names
from workers.logsafe import _handlers

PLAIN = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"
#: the ids of the task this thread runs (a threads pool runs several at once: a context var each)
_task: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("courier_log_task", default=None)


def task_fields(task_name: str, task_id: str, args: Any) -> None:
    """Note the running task's ids for this thread's log lines: a delivery's and its job's (an
    extraction), a job's (a turn), a lane's target (a drive). Never the arguments' text."""
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


def _fields(record: logging.LogRecord) -> bool:
    """A handler's filter: copies the running task's ids onto each record (as `courier_fields`)."""
    fields = _task.get()
    if fields and not hasattr(record, "courier_fields"):
        record.courier_fields = fields
    return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "process": record.processName, "pid": record.process,
            "logger": record.name, "message": record.getMessage(),
        }
        out.update(getattr(record, "courier_fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def install(fmt: str) -> None:
    """The format `fmt` (the setting COURIER_LOG_FORMAT: json, else plain) on every handler so far."""
    f: logging.Formatter
    if fmt == "json":
        f = JsonFormatter()
    else:
        f = logging.Formatter(PLAIN)
        f.converter = time.gmtime  # UTC, as the JSON lines and the ledger's times
        f.default_msec_format = "%s.%03dZ"
    for handler in _handlers():
        handler.setFormatter(f)
        if _fields not in handler.filters:
            handler.addFilter(_fields)
