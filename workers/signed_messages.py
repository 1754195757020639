"""Celery's task messages, signed: a kombu serializer (`courier-signed`, the app's only accepted task content
type) that seals each body with the control plane's key (tasks/ledger/signing.py) and opens it, verified, in
the worker. A message without the key (plain JSON pushed into Redis, another key's, a tampered one) is never
run: it is logged, counted (`courier_forged_total{what="message"}`) and dropped by Celery (acked, never
retried). Results and events stay plain JSON: nothing is executed from them.
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
