"""Celery task messages made once per process by Celery, then filled in per
task: the web process publishes its webhook turns with them from inside the
Lua script that claims the update (workers/web.py: one atomic step and one
round trip per batch, no Celery call per turn).

A `Template` is made by Celery itself: a probe signature goes through
`app.send_task` (routing, protocol-2 headers and properties, the
`before_task_publish` receivers, kombu's envelope and priority queue) on a
private kombu channel whose final step, the Redis transport's `_put` (its
LPUSH), keeps the message instead of pushing it. A second probe with other
values shows which fields are the task's own; anything else that differs
between the two (a Celery or kombu that adds a per-message field) refuses
the template, so a message is never sent with another task's values.

`render(task_id, args, argsrepr)` then gives the queue's Redis key and the
message as kombu would LPUSH it: the task's id (also its root id and
correlation id), its arguments, its label (`argsrepr`; the chat text is
never in a header), a new delivery tag, and the `before_task_publish`
receivers run on its headers as on Celery's path (courier's `_stamp`:
`sent_s` and the queue registry).
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from tasks import task_names

if TYPE_CHECKING:
    from celery import Celery, Signature

_T = TypeVar("_T")


__all__ = ["Template", "TemplateError"]

#: the fields that are a task's own (everything else is the same for every message of the template)
_OWN = {("headers", "id"), ("headers", "root_id"), ("headers", "parent_id"), ("headers", "argsrepr"),
        ("headers", "sent_s"),
        ("properties", "correlation_id"), ("properties", "argsrepr"), ("properties", "delivery_tag"), ("body",)}


class TemplateError(RuntimeError):
    """Celery's message cannot be made into a template (see the module doc)."""


class Template:
    """The messages of one task signature's publish (its task, queue and options)."""

    def __init__(self, app: Celery, sig: Signature, probe_args: tuple[list[Any], list[Any]],
                 probe_reprs: tuple[str, str]) -> None:
        """`sig`: the signature (its task and options; its args are replaced); `probe_args`,
        `probe_reprs`: two different argument lists and labels the probes go out with."""
        self.app = app
        self.task = sig.task
        first, second = self._in_a_thread(lambda: [
            self._capture(sig, "probe-1-" + uuid.uuid4().hex, probe_args[0], probe_reprs[0]),
            self._capture(sig, "probe-2-" + uuid.uuid4().hex, probe_args[1], probe_reprs[1])])
        if first["key"] != second["key"] or first["route"] != second["route"]:
            raise TemplateError("two probes of one signature went to different queues")
        diff = _diff(first["message"], second["message"])
        if not diff <= _OWN:
            raise TemplateError(f"Celery's message has per-message fields courier does not fill in: {sorted(diff - _OWN)}")
        msg = first["message"]
        self._serializer = app.conf.task_serializer
        body = _loads(msg) if msg["properties"].get("body_encoding") == "base64" else None
        if not isinstance(body, list) or len(body) != 3 or body[0] != probe_args[0]:
            raise TemplateError("Celery's message is not a base64 protocol-2 body")
        self.key = first["key"]
        self.exchange, self.routing_key = first["route"]
        self._kwargs, self._embed = body[1], body[2]
        self._headers = {k: v for k, v in msg["headers"].items() if ("headers", k) not in _OWN}
        self._props = {k: v for k, v in msg["properties"].items() if ("properties", k) not in _OWN}
        self._env = {k: v for k, v in msg.items() if k not in ("body", "headers", "properties")}
        self._stamped = "sent_s" in msg["headers"]
        # the template must give back what Celery made (but the delivery tag and the stamp time)
        again = json.loads(self.render(first["id"], probe_args[0], probe_reprs[0])[1])
        # (a signed body carries its signing time: the bodies are compared decoded)
        if _diff(again, msg) - {("headers", "sent_s"), ("properties", "delivery_tag"), ("body",)} or \
                _loads(again) != _loads(msg):
            raise TemplateError(f"the template does not give back Celery's message: {sorted(_diff(again, msg))}")

    def render(self, task_id: str, args: list[Any], argsrepr: str, *, parent_id: str | None = None,
               root_id: str | None = None) -> tuple[str, str]:
        """(the queue's Redis key, the message as the Redis transport pushes it) for one task;
        `parent_id`, `root_id`: the task that sends it and its root (Celery's own, from a task)."""
        from celery.signals import before_task_publish

        headers = {**self._headers, "id": task_id, "root_id": root_id or task_id, "parent_id": parent_id,
                   "argsrepr": argsrepr}
        props = {**self._props, "correlation_id": task_id, "argsrepr": argsrepr}
        body = [args, self._kwargs, self._embed]
        if before_task_publish.receivers:
            before_task_publish.send(sender=self.task, body=body, exchange=self.exchange,
                                     routing_key=self.routing_key, declare=[], headers=headers,
                                     properties=props, retry_policy=None)
        props["delivery_tag"] = str(uuid.uuid4())
        # the body as Celery's serializer makes it (courier's signs it: workers/signed_messages.py)
        raw = _dumps(body, self._serializer)
        msg = {**self._env, "body": base64.b64encode(raw).decode("ascii"), "headers": headers, "properties": props}
        return self.key, json.dumps(msg)

    # -- the probe -------------------------------------------------------------------------
    @staticmethod
    def _in_a_thread(fn: Callable[[], _T]) -> _T:
        """`fn()` in a thread of its own: no task runs there (Celery would give the probes
        the running task as their parent and root)."""
        import threading

        out: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                out.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                out.append((False, exc))

        t = threading.Thread(target=run, name="courier-task-template")
        t.start()
        t.join()
        ok, value = out[0]
        if not ok:
            raise value
        return cast(_T, value)

    def _capture(self, sig: Signature, task_id: str, args: list[Any], argsrepr: str) -> dict[str, Any]:
        """Celery's publish of `sig` with these values, kept at the transport's LPUSH."""
        from kombu.messaging import Producer

        got: dict[str, Any] = {}
        app = self.app
        with app.connection_for_write() as conn:
            channel = conn.channel()
            try:
                def keep(queue: str, message: dict[str, Any], **_kw: Any) -> None:
                    if channel._expires.get(queue):
                        raise TemplateError(f"queue {queue!r} has an expiry: its publish is more than one LPUSH")
                    pri = channel._get_message_priority(message, reverse=False)
                    got.update(key=channel._q_for_pri(queue, pri), message=copy.deepcopy(message))

                channel._put = keep  # this private channel only: the probe is never pushed
                producer = Producer(channel)  # type: ignore[no-untyped-call]  # kombu is not typed through
                options = {**sig.options, "argsrepr": argsrepr}
                app.send_task(sig.task, args=args, kwargs=sig.kwargs, task_id=task_id, producer=producer,
                              declare=[], ignore_result=task_names.ignores_result(app, sig.task), retry=False, **options)
            finally:
                channel.close()
        if "message" not in got:
            raise TemplateError(f"Celery did not publish {sig.task} as one message to one queue")
        info = got["message"]["properties"]["delivery_info"]
        got.update(id=task_id, route=(info.get("exchange"), info.get("routing_key")))
        return got


def _loads(msg: dict[str, Any]) -> Any:
    """A captured message's body, through kombu's serializer registry (its content type's)."""
    from kombu import serialization

    loads: Any = serialization.loads  # kombu is not typed
    return loads(base64.b64decode(msg["body"]), msg.get("content-type"), msg.get("content-encoding") or "utf-8",
                 accept=[msg.get("content-type")])


def _dumps(body: Any, serializer: str) -> bytes:
    from kombu import serialization

    dumps: Any = serialization.dumps  # kombu is not typed
    _ctype, _enc, data = dumps(body, serializer=serializer)
    return data if isinstance(data, bytes) else data.encode("utf-8")


def _diff(a: dict[str, Any], b: dict[str, Any]) -> set[tuple[str, ...]]:
    """The paths (top-level key, or (section, key) in headers / properties) where a and b differ."""
    out: set[tuple[str, ...]] = set()
    for k in set(a) | set(b):
        if k in ("headers", "properties") and isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out |= {(k, j) for j in set(a[k]) | set(b[k]) if a[k].get(j, _MISSING) != b[k].get(j, _MISSING)}
        elif a.get(k, _MISSING) != b.get(k, _MISSING):
            out.add((k,))
    return out


_MISSING = object()
