"""Celery's task messages, signed: a kombu serializer (`courier-signed`) that
seals each message body with the control plane's key (tasks/ledger/signing.py) and
opens it again, verified, in the worker.

It is registered with kombu's public registry (`kombu.serialization.register`)
and is the app's only accepted task content type: a message published
without the key — a plain JSON body pushed into Redis, one sealed with a
key this process does not have, a tampered one — is never run. Such a
message is logged and counted (`courier_forged_total{what="message"}`), and
Celery drops it (kombu's DecodeError or ContentDisallowed: acknowledged,
never retried). Results and events stay plain JSON (the result backend is
read by Flower and `AsyncResult`, and nothing is executed from them).
"""

from __future__ import annotations

from typing import Any

from kombu.serialization import register
from kombu.utils import json as kjson

NAME = "courier-signed"
CONTENT_TYPE = "application/x-courier-signed+json"


def dumps(body: Any) -> str:
    from tasks.ledger import signing

    return signing.signer().seal("message", "", kjson.dumps(body))


def loads(data: str | bytes) -> Any:
    from tasks.ledger import signing

    try:
        return kjson.loads(signing.signer().open("message", "", data))
    except signing.Forged as exc:
        signing.refused("message", exc)
        raise


def install() -> None:
    """Register the serializer (idempotent); the process's key comes from its settings (workers.wiring)."""
    import workers.wiring  # noqa: F401 - sets tasks.ledger.signing's loader

    register(NAME, dumps, loads, content_type=CONTENT_TYPE, content_encoding="utf-8")


def count_unsigned(message: Any = None, exc: Exception | None = None, **_kw: Any) -> None:
    """Celery's `task_rejected`: a message of a content type the app does not accept (unsigned JSON)."""
    from kombu.exceptions import ContentDisallowed

    from tasks.ledger import signing

    if isinstance(exc, ContentDisallowed):
        signing.refused("message", exc)
