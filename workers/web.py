"""The web process (`courier web`, or `uvicorn workers.web:app`): platform webhooks in, phase events out.

- `GET /turns/{id}/events`: the job's events as SSE, behind its token (workers/eventauth.py); resumable
  with `Last-Event-ID` (header or `?last_event_id=`): nothing skipped or repeated; it ends after the
  terminal status and every delivery's final state (a resume of an ended stream: 204).
- `GET /healthz` (503 while Redis does not answer, or `?consumers=` names a queue nobody consumes),
  `GET /metrics`, `GET /files/{key}` (signed links), the turn page (workers/turnpage.py).
- `POST /webhooks/<platform>`: the headers checked before the body is read, the body capped (413), the
  signature verified before it is parsed (401; 404 when the platform's secret is not set); a retried
  update is dropped, else its turn is enqueued atomically (`_Web._drain`; 503 when it cannot be).
- uvicorn's access log and ASGI trace show no query string (tokens travel in it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import os
import re
import threading
import time
import urllib.parse
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from adapters.platforms.webhooks import discord as discord_webhook
from adapters.platforms.webhooks import slack as slack_webhook
from adapters.platforms.webhooks import telegram as telegram_webhook
from adapters.platforms.webhooks import whatsapp as whatsapp_webhook
from adapters.platforms.webhooks.base import MALFORMED, Answer, Refusal
from tasks import metrics
from tasks.ledger import durable, events, keys, scripts
from workers import turnpage
from workers.eventauth import authorize
from workers.settings import Settings, get_settings

if TYPE_CHECKING:
    from tasks.messages import TurnSpec

log = logging.getLogger(__name__)

__all__ = ["app", "create_app", "format_sse"]

MAX_MESSAGE_CHARS = 32_000
ENQUEUE_BATCH = 64
ENQUEUE_TIMEOUT_S = 10.0
SSE_RETRY_MS = 2000
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


def format_sse(eid: str, ev: dict) -> str:
    """One SSE message: id, event (the kind), data (one JSON line)."""
    data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
    kind = re.sub(r"[\r\n]", "", str(ev.get("kind") or "message"))
    return f"id: {eid}\nevent: {kind}\ndata: {data}\n\n"


class _Web:
    """The app's state: settings, Redis clients (sync for webhooks, async for SSE), the webhook
    turns waiting for their batch."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pending: list[_Turn] = []
        self.draining = False

    @cached_property
    def redis(self):
        from workers.wiring import redis_client

        return redis_client(self.settings.redis_url)

    @cached_property
    def aredis(self):
        from workers.redis_url import async_client

        return async_client(self.settings.redis_url)

    @cached_property
    def durability(self):
        """How a batch of webhook turns is confirmed on replicas, within half the time a request waits."""
        from dataclasses import replace

        from workers.wiring import durability

        d = durability(self.settings)
        return replace(d, within_s=min(d.within_s, ENQUEUE_TIMEOUT_S / 2))

    @cached_property
    def aredis_turns(self):
        """Webhook turns' asyncio client: a stalled Redis is waited for as long as the sync clients
        do (a turn sent is not given up early); one batch is out at a time: one connection, no pool."""
        from workers.redis_url import SOCKET_TIMEOUT_S, async_client

        return async_client(self.settings.redis_url, socket_timeout=SOCKET_TIMEOUT_S, single_connection=True)

    async def close(self) -> None:
        self.pending.clear()
        for name in ("aredis", "aredis_turns"):
            c = self.__dict__.pop(name, None)
            if c is not None:
                await c.aclose()

    # -- turns from webhooks ------------------------------------------------------------
    @cached_property
    def celery(self):
        """Courier's Celery app, checked once (see `courier_celery`)."""
        return courier_celery(self.settings)

    async def accept(self, platform: str, update_id: str, chat: str, message: str) -> dict:
        """Enqueue a turn for one platform update, once: {"ok", "job"}, or
        {"ok", "duplicate"} for an update already enqueued. Raises when the
        turn could not be enqueued (nothing is left behind then)."""
        s = self.settings
        self.celery  # noqa: B018 - checked once: never publish anywhere else
        from tasks.dispatch import chains
        from tasks.ledger import receipts, signing

        origin = f"{platform}:{chat}"
        override = s.webhook_reply_target_override
        target = override.replace("{platform}", platform).replace("{chat}", chat) if override else origin
        job_id = chains.new_job_id("turn")
        spec = chains.turn_spec(job_id, target, message[:MAX_MESSAGE_CHARS], agent=s.webhook_agent or s.default_agent)
        fields = receipts.job_fields(job_id, kind="turn", target=target, agent=spec["agent"], origin=origin,
                                     spec=signing.seal_json("turn", job_id, spec))
        turn = _Turn(platform=platform, update_id=update_id, seen=keys.webhook_seen(platform, update_id),
                     job_id=job_id, spec=spec, fields=fields, future=asyncio.get_running_loop().create_future())
        self.pending.append(turn)
        if not self.draining:  # the batch gathers until the loop runs the drain
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        # Redis stalling: a 503 after a while (the future cancelled: the platforms give up after a few
        # seconds anyway); the turn goes on: queued after all, the platform's retry is a duplicate;
        # not queued, nothing of it is left and the retry goes through
        return await asyncio.wait_for(turn.future, ENQUEUE_TIMEOUT_S)

    async def _drain(self) -> None:
        """Enqueues webhook turns in batches of what came in while the previous batch was out (at
        most ENQUEUE_BATCH). Per batch: one webhook_claim.lua call drops each retried update (its
        de-dup key is there) or atomically sets the de-dup key and records the job and its due time;
        then one thread publishes the new turns (the job id as task id). A failed publish takes its
        claim back (webhook_unclaim.lua, a 503: the platform's retry goes through); should that fail
        too, the reconciler publishes the turn at its due time and the retry is a duplicate."""
        try:
            while self.pending:
                batch, self.pending = self.pending[:ENQUEUE_BATCH], self.pending[ENQUEUE_BATCH:]
                try:
                    await self._enqueue(batch)
                except Exception as exc:  # noqa: BLE001 - every request gets an answer; the next batch goes on
                    for t in batch:
                        _settle(t, exc=exc)
                for t in batch:
                    _settle(t, exc=RuntimeError("not enqueued"))
        finally:
            self.draining = False

    async def _enqueue(self, batch: list[_Turn]) -> None:
        from tasks.dispatch import chains
        from tasks.ledger import receipts

        r = self.aredis_turns
        ks: list = [keys.due("turn")]
        args: list = [self.settings.webhook_dedupe_ttl_s, receipts.RETENTION_S]
        due_at = time.time() + chains.TURN_GRACE_S  # the ledger watches each turn from its claim on
        for t in batch:
            ks += (t.seen, keys.job(t.job_id))
            args += (t.job_id, due_at, json.dumps(t.fields, separators=(",", ":"), ensure_ascii=False))
        d = self.durability
        if d.replicas > 0:  # confirmed on replicas, else claimed again (a deposed master: tasks/ledger/durable.py)
            res, confirmed = await durable.write_async(
                r, lambda p: scripts.run_async(p, "webhook_claim", keys=ks, args=args), d)
            if not confirmed:
                log.warning("webhook: %d turns are recorded on the Redis master, but no replica confirmed them "
                            "within %g s", len(batch), d.within_s)
        else:
            res = await scripts.run_async(r, "webhook_claim", keys=ks, args=args)
        new = []
        for t, got in zip(batch, res):
            if got == 1:
                new.append(t)
            else:
                log.info("%s webhook: dropped a retried update %s", t.platform, t.update_id)
                _settle(t, {"ok": True, "duplicate": True})
        if not new:
            return
        failed = await asyncio.to_thread(self._publish, new)
        done = []
        for t in new:
            exc = failed.get(t.job_id)
            if exc is not None:
                log.warning("webhook: the turn %s could not be published: %s", t.job_id, type(exc).__name__)
                try:
                    await scripts.run_async(r, "webhook_unclaim", args=[t.job_id],
                                            keys=[t.seen, keys.job(t.job_id), keys.due("turn")])
                except Exception:  # noqa: BLE001 - kept in the ledger: the reconciler publishes it
                    log.warning("webhook: the turn %s is left to the reconciler", t.job_id)
                    exc = None
            if exc is None:
                done.append(t)
            _settle(t, None if exc else {"ok": True, "job": t.job_id}, exc)
        if done:
            log.info("webhook: %d turns queued: %s", len(done),
                     ", ".join(f"{t.platform} {t.update_id} -> {t.job_id}" for t in done))

    def _publish(self, turns: list[_Turn]) -> dict[str, BaseException]:
        """Each turn's `agent_turn` through Celery (one producer for the batch); the errors by job id.
        Nobody here waits for a turn's result (`denied_join_result`): else Celery's Redis result
        backend would SUBSCRIBE to every published turn's result channel in this process."""
        from celery.result import denied_join_result

        from tasks.dispatch import chains

        app = self.celery
        failed: dict[str, BaseException] = {}
        with denied_join_result(), app.producer_or_acquire() as producer:
            for t in turns:
                try:
                    chains.spec_sig(t.spec).apply_async(task_id=t.job_id, producer=producer)
                except Exception as exc:  # noqa: BLE001 - answered per turn
                    failed[t.job_id] = exc
        return failed


@dataclass
class _Turn:
    platform: str
    update_id: str
    seen: str
    job_id: str
    spec: TurnSpec
    fields: dict[str, str]  # its job record's (receipts.job_fields)
    future: asyncio.Future  # the request's answer


def _settle(t: _Turn, result: dict | None = None, exc: BaseException | None = None) -> None:
    """The request gets its turn's outcome, unless it has one (or gave up waiting)."""
    if t.future.done():
        return
    if exc is not None:
        t.future.set_exception(exc)
    else:
        t.future.set_result(result)


class BrokerMismatch(RuntimeError):
    """The web process would publish turns somewhere else than COURIER_REDIS_URL."""


def courier_celery(settings: Settings):
    """Courier's Celery app, once it is checked that every thread publishes
    through it and that its broker is `settings.redis_url` (Celery reads
    CELERY_BROKER_URL from the environment before its own configuration)."""
    from celery import current_app

    from workers.celery_app import app
    from workers.embedded import redact_url
    from workers.redis_url import celery_url

    broker = app.conf.broker_url
    if broker != celery_url(settings.redis_url)[0]:
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


#: the largest body each webhook reads (more: a 413, read no further); a WhatsApp notification batches
BODY_CAPS = {"telegram": 128 * 1024, "slack": 256 * 1024, "discord": 128 * 1024, "whatsapp": 512 * 1024}


def _refuse(platform: str, status: int, reason: str) -> Response:
    log.warning("%s webhook: %d %s", platform, status, reason)
    return JSONResponse({"ok": False, "error": reason}, status_code=status)


async def _body(request: Request, cap: int) -> bytes:
    """The raw body, read as it streams in; Refusal 413 as soon as it is over `cap`
    (at once when Content-Length says so)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise Refusal(400, "bad Content-Length")
        if int(declared) > cap:
            raise Refusal(413, f"body over {cap} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > cap:
            raise Refusal(413, f"body over {cap} bytes")
    return bytes(body)


def _answer(a: Answer) -> Response:
    return (PlainTextResponse if a.plain else JSONResponse)(a.body, headers=a.headers)


def _not_configured(platform: str, setting: str) -> Response:
    return JSONResponse({"ok": False, "error": f"{platform} webhook is not configured ({setting})"}, status_code=404)


def _webhook(platform: str, handler):
    """`handler` as a webhook route: a refused request (Refusal) is its status with a one-line reason;
    anything a payload's shape makes the handler trip over is a 400, never a 500."""

    async def route(request: Request) -> Response:
        try:
            resp = await handler(request)
        except Refusal as exc:
            resp = _refuse(platform, exc.status, exc.reason)
        except MALFORMED as exc:
            resp = _refuse(platform, 400, f"malformed {platform} payload ({type(exc).__name__})")
        metrics.record_webhook(platform, resp.status_code)
        return resp

    return route


# -- logs: no secret in a request line --------------------------------------------------------
def _no_query_strings(record: logging.LogRecord) -> bool:
    """uvicorn's access log without query strings (the WhatsApp verify token, an events
    token), and its ASGI trace without the scope's query string."""
    if isinstance(record.args, tuple) and record.args:
        record.args = tuple(_without_query(a) for a in record.args)
    return True


def _without_query(a):
    if isinstance(a, str) and "?" in a and a.startswith("/"):
        return a.split("?", 1)[0] + "?…"
    if isinstance(a, dict) and a.get("query_string"):
        return {**a, "query_string": b"<...>"}
    return a


def quiet_query_strings() -> None:
    """Install the filter on uvicorn's access and ASGI loggers (idempotent)."""
    for name in ("uvicorn.access", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        if _no_query_strings not in lg.filters:
            lg.addFilter(_no_query_strings)


async def _confirm(web: _Web, platform: str, parser, body: bytes) -> int:
    """A verified notification's delivery statuses (a parser with `statuses`: WhatsApp's) moved onto
    their receipts (tasks/delivery/confirm.py). Returns how many were applied."""
    found = getattr(parser, "statuses", None)
    updates = found(body) if found is not None else []
    if not updates:
        return 0
    from tasks.delivery import confirm

    done = await asyncio.to_thread(
        confirm.apply, web.redis, [confirm.Status(platform, u.message_id, u.status, u.reason) for u in updates],
        events_maxlen=web.settings.events_maxlen)
    return sum(1 for _mid, what in done if what in ("failed", "confirmed"))


# -- routes ---------------------------------------------------------------------------
def create_app(settings: Settings | None = None) -> Starlette:
    web = _Web(settings or get_settings())
    quiet_query_strings()
    from workers import logformat, logsafe

    logsafe.install(web.settings)  # uvicorn's handlers exist by now (it configures logging first)
    logformat.install(web.settings.log_format)  # and their lines get a time and a level, as every process's

    async def files(request: Request) -> Response:
        """A volume's blob behind a signed, expiring link (storage/links.py), streamed."""
        from storage.base import check_key
        from workers.wiring import file_links, store

        key = request.path_params["key"]
        try:
            check_key(key)
        except Exception:  # noqa: BLE001 - a key that cannot be one
            return JSONResponse({"ok": False, "error": "bad key"}, status_code=400)
        why = await asyncio.to_thread(file_links(web.settings).check, key, request.query_params.get("exp", ""),
                                      request.query_params.get("sig", ""))
        if why is not None:
            return JSONResponse({"ok": False, "error": why}, status_code=403)
        st = store(web.settings)
        try:
            info = await asyncio.to_thread(st.stat, key)
        except Exception:  # noqa: BLE001 - gone (expired by the janitor) or never there
            return JSONResponse({"ok": False, "error": "no such file"}, status_code=404)
        name = key.rsplit("/", 1)[-1]
        headers = {"Content-Length": str(info.size_bytes),
                   "Content-Disposition": f"attachment; filename*=UTF-8''{urllib.parse.quote(name)}"}
        return StreamingResponse(iterate_in_threadpool(st.iter_chunks(key)), headers=headers,
                                 media_type=mimetypes.guess_type(name)[0] or "application/octet-stream")

    async def healthz(request: Request) -> Response:
        need = [q for q in request.query_params.get("consumers", "").split(",") if q]
        try:
            await asyncio.wait_for(web.aredis.ping(), timeout=3)
            now = time.time()
            pipe = web.aredis.pipeline(transaction=False)
            for q in ("turns", *need):
                keys.count_consumers(pipe, q, now)
            counts = await asyncio.wait_for(pipe.execute(), timeout=3)
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"ok": False, "redis": type(exc).__name__}, status_code=503)
        body = {"ok": True, "redis": "ok", "turns_consumers": int(counts[0])}
        missing = [q for q, n in zip(need, counts[1:]) if not n]
        if missing:  # ?consumers=turns: unhealthy while no worker consumes it (webhook turns would wait)
            return JSONResponse({**body, "ok": False, "no_consumer": missing}, status_code=503)
        return JSONResponse(body)

    metrics_registry: list = []  # made on the first scrape

    async def metrics_endpoint(request: Request) -> Response:
        from workers import metrics as exposition

        if not exposition.authorized(request.headers.get("authorization"), web.settings.metrics_token):
            return JSONResponse({"error": "metrics need the operator token: Authorization: Bearer "
                                          "(COURIER_METRICS_TOKEN)"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        if not metrics_registry:
            # the worker processes of this host (`courier worker`) count in their directory: added to ours
            metrics_registry.append(exposition.registry(web.redis,
                                                        workers_dir=exposition.default_multiproc_dir(web.settings)))
        body = await run_in_threadpool(exposition.render, metrics_registry[0])
        return Response(body, media_type=exposition.CONTENT_TYPE)

    async def turn_events(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        last = (request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "").strip()
        refused = await authorize(request, job_id, "the events of a turn need its token: ?token= or "
                                                   "Authorization: Bearer")
        if refused is not None:
            return refused
        if last and not _STREAM_ID.fullmatch(last):
            return JSONResponse({"error": "Last-Event-ID must be a stream id like 1700000000000-0"},
                                status_code=400)
        r = web.aredis
        events_key = keys.events(job_id)
        job = await r.hgetall(keys.job(job_id))
        if not job and not await r.exists(events_key):
            return JSONResponse({"error": f"no turn or send {job_id!r}"}, status_code=404)
        tracker = events.EndTracker()
        if job.get("kind") == "send":
            tracker.expect_deliveries(int(await r.llen(keys.job_deliveries(job_id)) or 0))
        if last:  # what was already sent still counts towards the end
            for _eid, fields in await r.xrange(events_key, "-", last):
                ev = events.decode(fields)
                if ev is not None:
                    tracker.feed(ev)
            if tracker.done and not await r.xrange(events_key, f"({last}", "+", count=1):
                return Response(status_code=204)
        keepalive_s = max(0.05, float(web.settings.sse_keepalive_s))

        async def stream():
            cursor = last or "0-0"
            yield f"retry: {SSE_RETRY_MS}\n\n"
            idle_since = time.monotonic()
            while not tracker.done:
                block_ms = max(10, int((idle_since + keepalive_s - time.monotonic()) * 1000))
                res = await r.xread({events_key: cursor}, count=200, block=block_ms)
                for _stream, entries in res or []:
                    for eid, fields in entries:
                        cursor = eid
                        ev = events.decode(fields)
                        if ev is not None:
                            tracker.feed(ev)
                            idle_since = time.monotonic()
                            yield format_sse(cursor, ev)
                if time.monotonic() - idle_since >= keepalive_s:
                    yield ": keep-alive\n\n"
                    idle_since = time.monotonic()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- platform webhooks: headers, capped body, signature and payload (adapters/platforms/webhooks) --
    def webhook(parser, secret_of):
        """The route of a platform's webhook: its parser checks the headers before the body
        is read, then the signature and the payload; each message it finds is enqueued."""
        platform = parser.PLATFORM

        async def route(request: Request) -> Response:
            secret = secret_of(web.settings)
            if secret is None:
                return _not_configured(platform, parser.SETTING)
            refused = parser.check_headers(request.headers, secret, time.time())
            if refused is not None:
                raise refused
            body = await _body(request, BODY_CAPS[platform])
            got = parser.parse_webhook(request.headers, body, secret, time.time())
            if isinstance(got, Refusal):
                raise got
            if isinstance(got, Answer):
                return _answer(got)
            outs = []
            for inbound in got:
                try:
                    out = await web.accept(platform, inbound.update_id, inbound.chat, inbound.text)
                    metrics.record_webhook_turn(platform, bool(out.get("duplicate")))
                except Exception as exc:  # noqa: BLE001 - the platform retries on 5xx
                    log.error("%s webhook: could not enqueue a turn: %s", platform, type(exc).__name__)
                    return JSONResponse({"ok": False, "error": "could not enqueue the turn"}, status_code=503)
                outs.append(out)
            confirmed = await _confirm(web, platform, parser, body)
            answered = parser.answer(got, outs, request.headers)
            if confirmed and isinstance(answered.body, dict):
                answered = Answer({**answered.body, "statuses": confirmed}, headers=answered.headers, plain=answered.plain)
            return _answer(answered)

        return _webhook(platform, route)

    async def whatsapp_verify(request: Request) -> Response:
        token = web.settings.whatsapp_verify_token
        if token is None:
            return _not_configured("whatsapp", whatsapp_webhook.VERIFY_SETTING)
        got = whatsapp_webhook.verify_subscription(request.query_params, token)
        if isinstance(got, Refusal):
            raise got
        return _answer(got)

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/turns/{job_id}/events", turn_events, methods=["GET"]),
        Route("/turns/{job_id}", turnpage.turn_page, methods=["GET"]),  # the turn's live page
        Route("/turns/{job_id}/thumbs/{delivery_id}", turnpage.turn_thumb, methods=["GET"]),
        Route("/files/{key:path}", files, methods=["GET"]),
        Route("/webhooks/telegram", webhook(telegram_webhook, lambda s: s.telegram_webhook_secret), methods=["POST"]),
        Route("/webhooks/slack", webhook(slack_webhook, lambda s: s.slack_signing_secret), methods=["POST"]),
        Route("/webhooks/discord", webhook(discord_webhook, lambda s: s.discord_public_key or None),
              methods=["POST"]),
        Route("/webhooks/whatsapp", _webhook("whatsapp", whatsapp_verify), methods=["GET"]),
        Route("/webhooks/whatsapp", webhook(whatsapp_webhook, lambda s: s.whatsapp_app_secret), methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(_app):
        web.celery  # noqa: B018 - refuse to start when turns would be published anywhere else
        if web.settings.discord_public_key:
            discord_webhook.verify_key(web.settings.discord_public_key)  # a bad key: no start
        quiet_query_strings()
        yield
        await web.close()

    application = Starlette(routes=routes, lifespan=lifespan)
    application.state.web = web
    return application


app = create_app()
