"""The web process: platform webhooks in, phase events out.

    courier web --host 127.0.0.1 --port 8080
    uvicorn workers.web:app --host 127.0.0.1 --port 8080

Routes
- `GET /turns/{id}/events`: the job's phase events as Server-Sent Events
  (`id:` the stream id, `event:` the kind, `data:` the JSON event). Resumable:
  with `Last-Event-ID` (header, or `?last_event_id=`) it goes on right after
  that id, skipping nothing and repeating nothing. The stream ends after the
  terminal status and the final state of every delivery; while waiting, an
  idle connection gets a `: keep-alive` comment every `sse_keepalive_s`. A
  resume of a stream that is already over answers 204 (EventSource stops).
- `GET /healthz`: 200 when Redis answers, else 503.
- `POST /webhooks/telegram | slack | discord | whatsapp` (and `GET
  /webhooks/whatsapp`, the hub.challenge check): each verifies its platform's
  signature or secret first (401, nothing enqueued, when it does not verify;
  404 when the platform's secret is not configured), drops a retried update
  (Redis SET NX with a TTL on the platform's update / event id,
  `keys.webhook_seen`), then enqueues an `agent_turn` whose reply goes back
  to the chat (`<platform>:<chat>`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tasks import events, keys
from workers.settings import Settings, get_settings

log = logging.getLogger(__name__)

__all__ = ["app", "create_app", "format_sse"]

MAX_WEBHOOK_BODY_BYTES = 1024 * 1024
MAX_MESSAGE_CHARS = 32_000
SSE_RETRY_MS = 2000
_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")
_SLACK_MENTION = re.compile(r"<@[A-Z0-9]+>\s*")


def format_sse(eid: str, ev: dict) -> str:
    """One SSE message: id, event (the kind), data (one JSON line)."""
    data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
    kind = re.sub(r"[\r\n]", "", str(ev.get("kind") or "message"))
    return f"id: {eid}\nevent: {kind}\ndata: {data}\n\n"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Web:
    """The app's state: settings, Redis clients (sync for webhooks, async for SSE)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._redis = None
        self._aredis = None
        self._celery = None

    @property
    def redis(self):
        if self._redis is None:
            from workers.wiring import redis_client

            self._redis = redis_client(self.settings.redis_url)
        return self._redis

    @property
    def aredis(self):
        if self._aredis is None:
            import redis.asyncio

            self._aredis = redis.asyncio.Redis.from_url(self.settings.redis_url, socket_connect_timeout=3,
                                                        health_check_interval=30)
        return self._aredis

    async def close(self) -> None:
        if self._aredis is not None:
            await self._aredis.aclose()
            self._aredis = None

    # -- turns from webhooks ------------------------------------------------------------
    @property
    def celery(self):
        """Courier's Celery app, checked once (see `courier_celery`)."""
        if self._celery is None:
            self._celery = courier_celery(self.settings)
        return self._celery

    def accept(self, platform: str, update_id: str, chat: str, message: str) -> dict:
        """Enqueue a turn for one platform update, once (blocking: call in a thread).

        The de-dup key is set first ("pending", so a concurrent retry is
        dropped) and kept only once the turn is queued: when the enqueue
        fails, the key and the turn's job record are deleted again (no
        orphan "queued" job) and the caller answers 503, so the platform's
        retry goes through."""
        s = self.settings
        app = self.celery
        seen = keys.webhook_seen(platform, update_id)
        if not self.redis.set(seen, "pending", nx=True, ex=s.webhook_dedupe_ttl_s):
            log.info("%s webhook: dropped a retried update %s", platform, update_id)
            return {"ok": True, "duplicate": True}
        origin = f"{platform}:{chat}"
        override = s.webhook_reply_target_override
        target = override.replace("{platform}", platform).replace("{chat}", chat) if override else origin
        from tasks import chains

        job_id = chains.new_job_id("turn")
        try:
            app.set_current()  # this thread publishes through courier's app, whatever else set its current app
            chains.enqueue_turn(self.redis, target, message[:MAX_MESSAGE_CHARS], job_id=job_id,
                                agent=s.webhook_agent or s.default_agent, origin=origin)
            self.redis.set(seen, job_id, ex=s.webhook_dedupe_ttl_s)
        except Exception:
            self._forget(seen, job_id)
            raise
        log.info("%s webhook: update %s -> turn %s", platform, update_id, job_id)
        return {"ok": True, "job": job_id}

    def _forget(self, seen: str, job_id: str) -> None:
        """After a failed enqueue: no de-dup key (the retry goes through), no job record."""
        try:
            self.redis.delete(seen, keys.job(job_id))
        except Exception as exc:  # noqa: BLE001 - both expire anyway; the 503 stands
            log.error("webhook: could not clear %s after a failed enqueue: %s", job_id, type(exc).__name__)


class BrokerMismatch(RuntimeError):
    """The web process would publish turns somewhere else than COURIER_REDIS_URL."""


def courier_celery(settings: Settings):
    """Courier's Celery app, once it is checked that every thread publishes
    through it and that its broker is `settings.redis_url` (Celery reads
    CELERY_BROKER_URL from the environment before its own configuration)."""
    import threading

    from celery import current_app

    from workers.celery_app import app
    from workers.embedded import redact_url

    broker = app.conf.broker_url
    if broker != settings.redis_url:
        why = " (CELERY_BROKER_URL is set in the environment)" if os.environ.get("CELERY_BROKER_URL") else ""
        raise BrokerMismatch(f"the Celery broker is {redact_url(str(broker))}, not COURIER_REDIS_URL "
                             f"{redact_url(settings.redis_url)}{why}: webhook turns would be lost")
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(current_app._get_current_object()), name="courier-app-check")
    t.start()
    t.join()
    if seen[0] is not app:
        raise BrokerMismatch(f"another thread publishes through Celery app {seen[0].main!r}, not courier's")
    return app


async def _body(request: Request) -> bytes | None:
    """The raw body, or None when it is over the webhook limit."""
    chunks: list[bytes] = []
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_WEBHOOK_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _secret(v) -> bytes:
    return v.get_secret_value().encode() if v is not None else b""


def _unauthorized(platform: str, why: str) -> Response:
    log.warning("%s webhook: rejected (%s)", platform, why)
    return JSONResponse({"ok": False, "error": "signature does not verify"}, status_code=401)


def _not_configured(platform: str, setting: str) -> Response:
    return JSONResponse({"ok": False, "error": f"{platform} webhook is not configured ({setting})"}, status_code=404)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


async def _accept(web: _Web, platform: str, update_id: str, chat: str, message: str) -> Response | dict:
    try:
        return await run_in_threadpool(web.accept, platform, update_id, chat, message)
    except Exception as exc:  # noqa: BLE001 - the platform retries on 5xx
        log.error("%s webhook: could not enqueue a turn: %s", platform, type(exc).__name__)
        return JSONResponse({"ok": False, "error": "could not enqueue the turn"}, status_code=503)


# -- routes ---------------------------------------------------------------------------
def create_app(settings: Settings | None = None) -> Starlette:
    web = _Web(settings or get_settings())

    async def healthz(request: Request) -> Response:
        try:
            await asyncio.wait_for(web.aredis.ping(), timeout=3)
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"ok": False, "redis": type(exc).__name__}, status_code=503)
        return JSONResponse({"ok": True, "redis": "ok"})

    async def turn_events(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or ""
        last = last.strip()
        if not _JOB_ID.fullmatch(job_id):
            return JSONResponse({"error": "bad job id"}, status_code=404)
        if last and not _STREAM_ID.fullmatch(last):
            return JSONResponse({"error": "Last-Event-ID must be a stream id like 1700000000000-0"},
                                status_code=400)
        r = web.aredis
        key = keys.events(job_id)
        job = {_s(k): _s(v) for k, v in (await r.hgetall(keys.job(job_id))).items()}
        if not job and not await r.exists(key):
            return JSONResponse({"error": f"no turn or send {job_id!r}"}, status_code=404)
        tracker = events.EndTracker()
        if job.get("kind") == "send":
            tracker.expect_deliveries(int(await r.llen(keys.job_deliveries(job_id)) or 0))
        if last:  # what was already sent still counts towards the end
            for _eid, fields in await r.xrange(key, "-", last):
                ev = events.decode(fields)
                if ev is not None:
                    tracker.feed(ev)
            if tracker.done and not await r.xrange(key, f"({last}", "+", count=1):
                return Response(status_code=204)
        keepalive_s = max(0.05, float(web.settings.sse_keepalive_s))

        async def stream():
            cursor = last or "0-0"
            yield f"retry: {SSE_RETRY_MS}\n\n"
            idle_since = time.monotonic()
            while not tracker.done:
                block_ms = max(10, int((idle_since + keepalive_s - time.monotonic()) * 1000))
                res = await r.xread({key: cursor}, count=200, block=block_ms)
                got = False
                for _stream, entries in res or []:
                    for eid, fields in entries:
                        cursor = _s(eid)
                        ev = events.decode(fields)
                        if ev is None:
                            continue
                        got = True
                        tracker.feed(ev)
                        yield format_sse(cursor, ev)
                now = time.monotonic()
                if got:
                    idle_since = now
                elif now - idle_since >= keepalive_s:
                    yield ": keep-alive\n\n"
                    idle_since = now

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- Telegram: X-Telegram-Bot-Api-Secret-Token, update_id -----------------------------
    async def telegram(request: Request) -> Response:
        secret = web.settings.telegram_webhook_secret
        if secret is None:
            return _not_configured("telegram", "TELEGRAM_WEBHOOK_SECRET")
        got = request.headers.get("x-telegram-bot-api-secret-token", "").encode()
        if not hmac.compare_digest(got, _secret(secret)):
            return _unauthorized("telegram", "bad secret token")
        body = await _body(request)
        update = _json(body) if body is not None else None
        if not isinstance(update, dict) or not isinstance(update.get("update_id"), int):
            return JSONResponse({"ok": False, "error": "not a Telegram update"}, status_code=400)
        msg = update.get("message") or update.get("channel_post")
        text = (msg.get("text") or msg.get("caption")) if isinstance(msg, dict) else None
        chat = (msg.get("chat") or {}).get("id") if isinstance(msg, dict) else None
        if not isinstance(text, str) or not text.strip() or chat is None:
            return JSONResponse({"ok": True, "ignored": "no text message"})
        out = await _accept(web, "telegram", str(update["update_id"]), str(chat), text)
        return out if isinstance(out, Response) else JSONResponse(out)

    # -- Slack: signing secret, url_verification, event_id / X-Slack-Retry-Num ------------------
    async def slack(request: Request) -> Response:
        secret = web.settings.slack_signing_secret
        if secret is None:
            return _not_configured("slack", "SLACK_SIGNING_SECRET")
        from slack_sdk.signature import SignatureVerifier

        body = await _body(request)
        if body is None:
            return JSONResponse({"ok": False, "error": "body too large"}, status_code=413)
        verifier = SignatureVerifier(secret.get_secret_value())
        if not verifier.is_valid(body=body, timestamp=request.headers.get("x-slack-request-timestamp", ""),
                                 signature=request.headers.get("x-slack-signature", "")):
            return _unauthorized("slack", "bad or stale signature")
        payload = _json(body)
        if not isinstance(payload, dict):
            return JSONResponse({"ok": False, "error": "not a Slack event"}, status_code=400)
        if payload.get("type") == "url_verification":
            return JSONResponse({"challenge": payload.get("challenge", "")})
        event = payload.get("event")
        if payload.get("type") != "event_callback" or not isinstance(event, dict):
            return JSONResponse({"ok": True, "ignored": payload.get("type")})
        if event.get("type") not in ("message", "app_mention") or event.get("bot_id") or event.get("subtype"):
            return JSONResponse({"ok": True, "ignored": "not a user message"})
        text = _SLACK_MENTION.sub("", str(event.get("text") or "")).strip()
        channel = event.get("channel")
        # one user message is one turn: a mention comes as both `app_mention` and `message`
        # (different event ids) when the app subscribes to both; a retry repeats either
        event_id = f"{channel}:{event['ts']}" if event.get("ts") else payload.get("event_id")
        if not text or not channel or not event_id:
            return JSONResponse({"ok": True, "ignored": "no text message"})
        out = await _accept(web, "slack", str(event_id), str(channel), text)
        if isinstance(out, Response):
            return out
        headers = {"X-Slack-No-Retry": "1"} if out.get("duplicate") or request.headers.get("x-slack-retry-num") \
            else None
        return JSONResponse(out, headers=headers)

    # -- Discord interactions: Ed25519 over timestamp + body; PING -> PONG ----------------------
    async def discord(request: Request) -> Response:
        public_key = web.settings.discord_public_key
        if not public_key:
            return _not_configured("discord", "DISCORD_PUBLIC_KEY")
        from nacl.exceptions import BadSignatureError
        from nacl.signing import VerifyKey

        body = await _body(request)
        if body is None:
            return JSONResponse({"ok": False, "error": "body too large"}, status_code=413)
        sig = request.headers.get("x-signature-ed25519", "")
        ts = request.headers.get("x-signature-timestamp", "")
        try:
            VerifyKey(bytes.fromhex(public_key)).verify(ts.encode() + body, bytes.fromhex(sig))
        except (BadSignatureError, ValueError, TypeError):
            return _unauthorized("discord", "bad signature")
        payload = _json(body)
        if not isinstance(payload, dict):
            return JSONResponse({"error": "not an interaction"}, status_code=400)
        if payload.get("type") == 1:
            return JSONResponse({"type": 1})
        if payload.get("type") != 2:
            return JSONResponse({"type": 4, "data": {"content": "This interaction is not supported.", "flags": 64}})
        data = payload.get("data") or {}
        text = next((o.get("value") for o in data.get("options") or []
                     if isinstance(o, dict) and isinstance(o.get("value"), str) and o["value"].strip()), None)
        channel = payload.get("channel_id") or (payload.get("channel") or {}).get("id")
        if not text or not channel or not payload.get("id"):
            return JSONResponse({"type": 4, "data": {"content": "Ask me something: /" + str(data.get("name", "ask"))
                                                     + " <message>", "flags": 64}})
        out = await _accept(web, "discord", str(payload["id"]), str(channel), text)
        if isinstance(out, Response):
            return out
        # the user's own words, quoted back: they never ping anyone (as the adapter's agent text)
        return JSONResponse({"type": 4, "data": {"content": f"> {text[:1900]}", "allowed_mentions": {"parse": []}}})

    # -- WhatsApp Cloud API: hub.challenge; X-Hub-Signature-256 ----------------------------------
    async def whatsapp_verify(request: Request) -> Response:
        token = web.settings.whatsapp_verify_token
        if token is None:
            return _not_configured("whatsapp", "WHATSAPP_VERIFY_TOKEN")
        q = request.query_params
        if q.get("hub.mode") == "subscribe" and hmac.compare_digest(q.get("hub.verify_token", "").encode(),
                                                                     _secret(token)):
            return PlainTextResponse(q.get("hub.challenge", ""))
        log.warning("whatsapp webhook: verification refused (bad verify token)")
        return JSONResponse({"ok": False, "error": "verify token does not match"}, status_code=403)

    async def whatsapp(request: Request) -> Response:
        secret = web.settings.whatsapp_app_secret
        if secret is None:
            return _not_configured("whatsapp", "WHATSAPP_APP_SECRET")
        body = await _body(request)
        if body is None:
            return JSONResponse({"ok": False, "error": "body too large"}, status_code=413)
        want = "sha256=" + hmac.new(_secret(secret), body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(request.headers.get("x-hub-signature-256", "").encode(), want.encode()):
            return _unauthorized("whatsapp", "bad signature")
        payload = _json(body)
        if not isinstance(payload, dict):
            return JSONResponse({"ok": False, "error": "not a WhatsApp notification"}, status_code=400)
        jobs: list[str] = []
        duplicates = 0
        for entry in payload.get("entry") or []:
            for change in (entry or {}).get("changes") or []:
                value = (change or {}).get("value") or {}
                for m in value.get("messages") or []:
                    if not isinstance(m, dict) or m.get("type") != "text" or not m.get("id") or not m.get("from"):
                        continue
                    text = (m.get("text") or {}).get("body")
                    if not isinstance(text, str) or not text.strip():
                        continue
                    chat = str(m["from"])
                    out = await _accept(web, "whatsapp", str(m["id"]), chat if chat.startswith("+") else f"+{chat}",
                                        text)
                    if isinstance(out, Response):
                        return out
                    if out.get("duplicate"):
                        duplicates += 1
                    else:
                        jobs.append(out["job"])
        return JSONResponse({"ok": True, "jobs": jobs, "duplicates": duplicates})

    async def shutdown() -> None:
        await web.close()

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/turns/{job_id}/events", turn_events, methods=["GET"]),
        Route("/webhooks/telegram", telegram, methods=["POST"]),
        Route("/webhooks/slack", slack, methods=["POST"]),
        Route("/webhooks/discord", discord, methods=["POST"]),
        Route("/webhooks/whatsapp", whatsapp_verify, methods=["GET"]),
        Route("/webhooks/whatsapp", whatsapp, methods=["POST"]),
    ]
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        web.celery  # noqa: B018 - refuse to start when turns would be published anywhere else
        yield
        await shutdown()

    application = Starlette(routes=routes, lifespan=lifespan)
    application.state.web = web
    return application


app = create_app()
