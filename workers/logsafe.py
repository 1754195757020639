"""What every courier process logs, whatever its level: no secret, no chat text.

Secrets and chat text reach log lines from libraries (python-telegram-bot and httpx log the Bot API URL
with its token, SDKs log request bodies at DEBUG, a traceback may quote a URL with a password). A filter
on one SDK's logger misses its children and the next SDK, so `install` puts one `Redactor` on every
handler configured so far and in the record factory (a handler a library adds later gets only redacted
records too). The rules, for every record:
- every secret courier knows (`secrets_of`), and its URL-encoded form, becomes `<redacted>` in the
  message, its exception text and its stack;
- a DEBUG record of a `PAYLOAD_LOGGERS` logger keeps its format string with each argument shown as `…`;
  one without arguments (an f-string) is withheld whole.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from pydantic import SecretStr

#: what a secret becomes in a log line
REDACTED = "<redacted>"
#: secrets shorter than this are not searched for (they would blank out ordinary words)
MIN_SECRET_CHARS = 4
#: loggers of SDKs that log request or response bodies (the chat's text, a file's bytes) at DEBUG
PAYLOAD_LOGGERS = ("telegram", "discord", "slack_sdk", "slack_bolt", "botocore.endpoint", "botocore.parsers",
                   "openai")
#: a variable of the process named like this holds a secret (its value is redacted)
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)(KEY|PASS)$", re.I)
#: ... unless it names where the secret is, or what is not one
_NOT_SECRET = re.compile(r"_(FILE|PATH|DIR|ID|URL|TTL_S)$", re.I)
#: a %-style placeholder of a log format string
_PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsa]")


def url_password(url: str | None) -> str | None:
    """The password in a URL's user info (`scheme://user:pw@host`, several hosts too), or None."""
    cred, at, _ = (url or "").partition("://")[2].split("/", 1)[0].rpartition("@")
    if not at:
        return None
    return unquote(cred.split(":", 1)[1] if ":" in cred else cred) or None


def secrets_of(settings: Any, environ: dict[str, str] | None = None) -> set[str]:
    """Every secret value a process with `settings` (and `environ`) knows: each SecretStr setting,
    the password in a URL setting or variable, any variable named like a secret."""
    out: set[str] = set()
    for name in type(settings).model_fields:
        value = getattr(settings, name, None)
        if isinstance(value, SecretStr):
            out.add(value.get_secret_value())
        elif isinstance(value, str) and name.endswith("_url"):
            out.add(url_password(value) or "")
    for agent in (getattr(settings, "agents", None) or {}).values():
        out.update(v for k, v in agent.env.items() if _SECRET_NAME.search(k) and not _NOT_SECRET.search(k))
    for k, v in (os.environ if environ is None else environ).items():
        if _SECRET_NAME.search(k) and not _NOT_SECRET.search(k):
            out.add(v)
        elif "://" in v:  # a URL with a password in it (a proxy's, a database's)
            out.add(url_password(v) or "")
    return {s for s in out if s and len(s) >= MIN_SECRET_CHARS}


class Redactor(logging.Filter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: set[str] = set()
        self.pattern: re.Pattern[str] | None = None
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        """Redact `secrets` too (a process may know more after a second settings object)."""
        with self._lock:
            forms = set(self._secrets)
            for s in secrets:
                if s and len(s) >= MIN_SECRET_CHARS:
                    forms.update({s, quote(s, safe=""), quote(s)})
            if forms != self._secrets:
                self._secrets = forms
                # longest first: a secret that contains another is replaced whole
                self.pattern = re.compile("|".join(re.escape(s) for s in sorted(forms, key=len, reverse=True)))

    def redact(self, text: str) -> str:
        pattern = self.pattern
        return pattern.sub(REDACTED, text) if pattern is not None and text else text

    def filter(self, record: logging.LogRecord) -> bool:
        clean(record, self)
        return True


def clean(record: logging.LogRecord, redactor: Redactor) -> logging.LogRecord:
    """Apply the rules to `record` in place, once. A record with nothing to hide keeps its
    arguments (formatters such as uvicorn's access log read them); a secret is replaced in the
    arguments, or where that is not enough the message is formatted here without them."""
    if getattr(record, "_courier_clean", False):
        return record
    record._courier_clean = True
    if record.levelno < logging.INFO and any(record.name == lg or record.name.startswith(lg + ".")
                                             for lg in PAYLOAD_LOGGERS):  # one of them or a child
        record.msg = _PLACEHOLDER.sub("…", str(record.msg)).replace("%%", "%") if record.args else \
            f"(a {record.name} debug line withheld: it may carry message text)"
        record.args = None
    if redactor.pattern is None:
        return record
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record: the handler reports it, without its arguments
        text, record.args = str(record.msg), None
    if redactor.pattern.search(text):
        args = _redacted_args(record.args, redactor)
        if args is not None:
            record.args = args
        if args is None or redactor.pattern.search(record.getMessage()):
            record.msg, record.args = redactor.redact(text), None
    if record.exc_info and not record.exc_text:
        shown = logging.Formatter().formatException(record.exc_info)
        if redactor.pattern.search(shown):
            record.exc_text = shown  # the formatter shows exc_text when it is set
    if record.exc_text:
        record.exc_text = redactor.redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redactor.redact(record.stack_info)
    return record


def _redacted_args(args: Any, redactor: Redactor) -> Any:
    """`args` with the secrets in their strings replaced; None when an argument that is
    not a string shows one (its str or repr is not ours to rewrite)."""
    def one(a: Any) -> Any:
        if isinstance(a, str):
            return redactor.redact(a)
        if a is None or isinstance(a, (int, float)):
            return a
        if redactor.pattern is not None and (redactor.pattern.search(str(a)) or redactor.pattern.search(repr(a))):
            raise LookupError
        return a

    try:
        if isinstance(args, tuple):
            return tuple(one(a) for a in args)
        if isinstance(args, dict):
            return {k: one(v) for k, v in args.items()}
    except LookupError:
        return None
    return None


_redactor = Redactor()
_factory_installed = False


def install(settings: Any = None) -> Redactor:
    """The process's one `Redactor` on every handler so far and in the record factory, with the
    secrets of `settings` added. Idempotent; called wherever logging is configured."""
    global _factory_installed
    if settings is not None:
        _redactor.add(secrets_of(settings))
    for handler in _handlers():
        if _redactor not in handler.filters:
            handler.addFilter(_redactor)
    if not _factory_installed:
        _factory_installed = True
        made = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return clean(made(*args, **kwargs), _redactor)

        logging.setLogRecordFactory(factory)
    return _redactor


def _handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers]
