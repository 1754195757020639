"""The built-in agent loop against an OpenAI-compatible chat-completions endpoint.

``run_openai`` posts the conversation and the tools' schemas, runs the answer's
``tool_calls`` (:class:`~adapters.agents.tools.Toolbox`) and sends their results
back, until a message without tool calls: the reply, plus a ``MEDIA:`` tag for
every file a tool marked. It emits the bridge's phase events and returns a
:class:`~adapters.agents.bridge.BridgeResult`. Hooks run before each call (step
from 1); their context goes into that call's user message only.

The turn ends with one short reason at ``max_steps`` (``max_steps_exceeded``),
``timeout_s`` (``runtime_timeout``) or an endpoint error once retries run out.
Response bodies are never logged or shown (they can echo credentials); the API
key goes only in the ``Authorization`` header.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlparse

import httpx

from adapters.defaults import AGENT_TIMEOUT_S
from adapters.agents.activity import activity_for
from adapters.agents.bridge import BridgeResult, event_sink, mapped_strings
from adapters.agents.tools import Toolbox, media_tag

__all__ = ["OpenAIConfig", "run_openai"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenAIConfig:
    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    system_prompt: str | None = None
    max_steps: int = 20
    call_timeout_s: float = 120.0
    #: the whole turn
    timeout_s: float = AGENT_TIMEOUT_S
    #: tries of one model call (429, 5xx, a failed or dropped connection are tried again)
    max_attempts: int = 6
    #: backoff between tries: base * 2^n with jitter, at most retry_max_s
    retry_base_s: float = 1.0
    retry_max_s: float = 30.0
    #: a server's retry-after is honoured up to this
    retry_after_max_s: float = 120.0


class _End(Exception):
    """Ends the turn; its one argument is the reason."""


def run_openai(
    config: OpenAIConfig,
    message: str,
    *,
    tools: Toolbox | None = None,
    hooks=None,
    hook_context: dict | None = None,
    on_event: Callable[[dict], None] | None = None,
    shown: Callable[[str], str] | None = None,
) -> BridgeResult:
    """One turn of the agent loop (see the module docstring). Never raises for endpoint or tool trouble.
    `shown`: applied to a tool call's arguments before its activity is written (the turn's paths
    relative to its workspace)."""
    deadline = time.monotonic() + config.timeout_s
    if tools is not None and tools.deadline is None:
        tools.deadline = deadline
    emit = event_sink(on_event)
    messages: list[dict] = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    user_index = len(messages)
    messages.append({"role": "user", "content": message})
    usage: dict[str, int] = {}
    steps = 0
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    try:
        with httpx.Client(base_url=config.base_url.rstrip("/") + "/", headers=headers, follow_redirects=False,
                          trust_env=False) as client:
            for steps in range(1, config.max_steps + 1):
                if steps > 1:
                    emit({"kind": "status", "status": "thinking"})
                call_messages = messages
                if hooks:
                    extra = hooks.context_for({**(hook_context or {}), "message": message, "step": steps})
                    if extra:
                        call_messages = list(messages)
                        call_messages[user_index] = {"role": "user", "content": f"{message}\n\n{extra}"}
                body: dict[str, Any] = {"model": config.model, "messages": call_messages}
                if tools is not None:
                    body["tools"] = tools.schemas
                reply = _call(client, config, body, deadline, emit)
                _add_usage(usage, reply.get("usage"))
                msg = reply["message"]
                calls = msg.get("tool_calls") or []
                if not calls:
                    text = msg.get("content") or ""
                    return _result(text if isinstance(text, str) else str(text), tools, steps, usage)
                messages.append({"role": "assistant", "content": msg.get("content"), "tool_calls": calls})
                for call in calls:
                    if time.monotonic() >= deadline:
                        raise _End("runtime_timeout")
                    messages.append(_run_tool(tools, call, emit, shown))
            raise _End(f"max_steps_exceeded: no answer after {config.max_steps} model calls")
    except _End as end:
        return BridgeResult("error", reason=str(end), events=0, extra={"steps": steps, "usage": usage})


#: answers worth asking again: rate limited, the server's trouble
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 520, 522, 524, 529})


def _call(client: httpx.Client, config: OpenAIConfig, body: dict, deadline: float,
          emit: Callable[[dict], None]) -> dict:
    """POST chat/completions; returns {"message": {...}, "usage": {...}} or raises _End.

    A 429 (after its ``retry-after-ms`` / ``retry-after``), a 5xx, a
    connection that fails or drops before the answer are asked again (capped
    exponential backoff with jitter, up to ``max_attempts``, never past the
    turn's deadline): the same request, so no tool runs twice."""
    host = urlparse(config.base_url).hostname or "endpoint"
    attempt = 0
    while True:
        attempt += 1
        left = deadline - time.monotonic()
        if left <= 0:
            raise _End("runtime_timeout")
        t = min(config.call_timeout_s, left)
        wait: float | None = None
        try:
            resp = client.post("chat/completions", json=body, timeout=httpx.Timeout(t, connect=min(t, 10.0)))
        except httpx.ConnectTimeout:
            why = f"openai endpoint {host} unreachable (ConnectTimeout)"
        except httpx.TimeoutException:
            if t < config.call_timeout_s:
                raise _End("runtime_timeout") from None
            raise _End(f"openai endpoint timed out after {t:g}s") from None
        except httpx.TransportError as exc:  # refused, reset, dropped before the answer
            why = f"openai endpoint {host} unreachable ({type(exc).__name__})"
        except httpx.HTTPError as exc:
            raise _End(f"openai endpoint {host} unreachable ({type(exc).__name__})") from None
        else:
            if resp.status_code < 400:
                return _parse(resp, host)
            why = f"openai endpoint returned HTTP {resp.status_code}{_HTTP_HINTS.get(resp.status_code, '')}"
            if resp.status_code not in RETRY_STATUSES:
                raise _End(why)
            wait = _retry_after(resp.headers)
            resp.close()
        if attempt >= config.max_attempts:
            raise _End(f"{why}; gave up after {attempt} attempts")
        backoff = min(config.retry_max_s, config.retry_base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        delay = backoff if wait is None else min(wait, config.retry_after_max_s)
        if time.monotonic() + delay >= deadline:
            raise _End(f"{why}; no time left in the turn to retry")
        log.warning("%s; retrying in %.1fs (attempt %d of %d)", why, delay, attempt + 1, config.max_attempts)
        emit({"kind": "status", "status": "thinking", "message": f"model endpoint busy, retrying in {delay:.0f}s"})
        time.sleep(delay)


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds the server asks to wait (``retry-after-ms``, ``retry-after``
    in seconds or as an HTTP date), None when it says nothing usable."""
    ms = headers.get("retry-after-ms")
    if ms:
        with suppress(ValueError):
            return max(0.0, float(ms) / 1000)
    ra = headers.get("retry-after")
    if not ra:
        return None
    with suppress(ValueError):
        return max(0.0, float(ra))
    try:
        return max(0.0, (parsedate_to_datetime(ra) - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError, IndexError):
        return None


def _parse(resp: httpx.Response, host: str) -> dict:
    try:
        data = resp.json()
        msg = data["choices"][0]["message"]
        if not isinstance(msg, dict):
            raise TypeError("message is not an object")
        calls = msg.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise TypeError("tool_calls is not a list of objects")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        log.warning("malformed chat-completions response from %s: %s", host, type(exc).__name__)
        raise _End("openai endpoint sent a malformed response") from None
    return {"message": msg, "usage": data.get("usage")}


_HTTP_HINTS = {
    400: " (bad request)", 401: " (unauthorized: check COURIER_OPENAI_API_KEY)", 403: " (forbidden)",
    404: " (not found: check the base URL and model)", 429: " (rate limited)",
}


def _run_tool(tools: Toolbox | None, call: dict, emit: Callable[[dict], None],
              shown: Callable[[str], str] | None = None) -> dict:
    raw_fn = call.get("function")
    fn: dict = raw_fn if isinstance(raw_fn, dict) else {}
    name = str(fn.get("name") or "unknown")
    args = fn.get("arguments")
    call_id = str(call.get("id") or f"call_{uuid.uuid4().hex[:12]}")
    activity = activity_for(name, mapped_strings(args, shown) if shown is not None else args)
    emit({"kind": "tool_start", "tool_name": name, "tool_call_id": call_id, "activity": activity,
          "status": "tool_call"})
    started = time.monotonic()
    if tools is None:
        text, ok = f"error: no tools are available (asked for {name!r})", False
    else:
        res = tools.call(name, args if args is not None else "{}")
        text, ok = res.text, res.ok
    emit({"kind": "tool_result", "tool_name": name, "tool_call_id": call_id, "activity": activity,
          "status": "tool_complete" if ok else "error", "duration_s": round(time.monotonic() - started, 3)})
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _add_usage(total: dict[str, int], usage: Any) -> None:
    if isinstance(usage, dict):
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            v = usage.get(k)
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v


def _result(text: str, tools: Toolbox | None, steps: int, usage: dict) -> BridgeResult:
    marked, stored = (list(tools.marked), dict(tools.stored)) if tools is not None else ([], {})
    text = text.strip()
    if not text and not marked:
        return BridgeResult("no_reply", exit_code=0, extra={"steps": steps, "usage": usage})
    # every marked file, even when the text names it (perhaps inside code, where a tag is only text):
    # a path named twice is delivered once
    reply = "\n".join([text, *(media_tag(p) for p in marked)]).strip()
    return BridgeResult("completed", reply=reply, exit_code=0, extra={"steps": steps, "usage": usage,
                                                                        "stored": stored})

