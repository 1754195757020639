"""The web process: platform webhooks in, phase events out.

    courier web --host 127.0.0.1 --port 8080
    uvicorn workers.web:app --host 127.0.0.1 --port 8080

Routes
- `GET /turns/{id}/events`: the job's phase events as Server-Sent Events
  (`id:` the stream id, `event:` the kind, `data:` the JSON event). It needs
  the job's token (`workers/eventauth.py`: `?token=` or `Authorization:
  Bearer`; 401 without one, 403 with a wrong one). Resumable:
  with `Last-Event-ID` (header, or `?last_event_id=`) it goes on right after
  that id, skipping nothing and repeating nothing. The stream ends after the
  terminal status and the final state of every delivery; while waiting, an
  idle connection gets a `: keep-alive` comment every `sse_keepalive_s`. A
  resume of a stream that is already over answers 204 (EventSource stops).
- `GET /healthz`: 200 when Redis answers, else 503; says how many workers
  consume `turns` (their heartbeats); `?consumers=turns[,delivery...]`: 503
  also while a named queue has no consumer.
- `GET /metrics`: Prometheus metrics (workers/metrics.py): this process's
  counters (every process's with PROMETHEUS_MULTIPROC_DIR), queue and ledger
  gauges read from Redis; behind `Authorization: Bearer <COURIER_METRICS_TOKEN>`
  when that is set (401 without it).
- `POST /webhooks/telegram | slack | discord | whatsapp` (and `GET
  /webhooks/whatsapp`, the hub.challenge check): each checks its platform's
  secret header, or its signature's headers (Slack and Discord: a timestamp
  within 5 minutes of now), before it reads the body; reads the body up to
  the platform's cap (`BODY_CAPS`: 413 past it, read no further); verifies
  the signature before it parses the body (401, nothing enqueued, when it
  does not verify; 404 when the platform's secret is not configured); then
  drops a retried update (Redis SET NX with a TTL on the platform's update /
  event id, `keys.webhook_seen`) and enqueues an `agent_turn` whose reply
  goes back to the chat (`<platform>:<chat>`). Every refused or malformed
  request is a 4xx with a one-line reason (`{"ok": false, "error": ...}`),
  logged as one line; a turn that cannot be enqueued is a 503.
- Logs: uvicorn's access log and ASGI trace show no query string (the
  WhatsApp verify token, an events token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from adapters.platforms.webhooks import discord as discord_webhook
from adapters.platforms.webhooks import slack as slack_webhook
from adapters.platforms.webhooks import telegram as telegram_webhook
from adapters.platforms.webhooks import whatsapp as whatsapp_webhook
from adapters.platforms.webhooks.base import MALFORMED, Answer, Refusal
from tasks import events, keys, metrics
from workers import turnpage
from workers.settings import Settings, get_settings

log = logging.getLogger(__name__)

__all__ = ["app", "create_app", "format_sse"]

MAX_WEBHOOK_BODY_BYTES = 1024 * 1024
MAX_MESSAGE_CHARS = 32_000
ENQUEUE_BATCH = 64
ENQUEUE_TIMEOUT_S = 10.0
#: how long a claimed update's de-dup key and job record live until its turn is published:
#: a web process killed in between loses no update (the platform's retry goes through then)
CLAIM_TTL_S = 60
SSE_RETRY_MS = 2000
_JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


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
        self._enqueuer: _Enqueuer | None = None

    @property
    def redis(self):
        if self._redis is None:
            from workers.wiring import redis_client

            self._redis = redis_client(self.settings.redis_url)
        return self._redis

    @property
    def aredis(self):
        if self._aredis is None:
            from workers.redis_url import async_client

            self._aredis = async_client(self.settings.redis_url)
        return self._aredis

    async def close(self) -> None:
        if self._enqueuer is not None:
            self._enqueuer.stop()
            self._enqueuer = None
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

    async def accept(self, platform: str, update_id: str, chat: str, message: str) -> dict:
        """Enqueue a turn for one platform update, once: {"ok", "job"}, or
        {"ok", "duplicate"} for an update already enqueued. Raises when the
        turn could not be enqueued (nothing is left behind then)."""
        s = self.settings
        self.celery  # noqa: B018 - checked once: never publish anywhere else
        from tasks import chains, receipts

        origin = f"{platform}:{chat}"
        override = s.webhook_reply_target_override
        turn = _Turn(platform=platform, update_id=update_id, seen=keys.webhook_seen(platform, update_id),
                     job_id=chains.new_job_id("turn"), origin=origin,
                     target=override.replace("{platform}", platform).replace("{chat}", chat) if override else origin,
                     agent=s.webhook_agent or s.default_agent, message=message[:MAX_MESSAGE_CHARS])
        spec = chains.turn_sig(turn.job_id, turn.target, turn.message, agent=turn.agent).args[0]
        receipts.create_job(None, turn.job_id, kind="turn", target=turn.target, agent=turn.agent, origin=origin,
                            pipe=turn.job, spec=json.dumps(spec, separators=(",", ":")))
        if self._enqueuer is None:
            self._enqueuer = _Enqueuer(self)
        turn.loop = asyncio.get_running_loop()
        turn.future = turn.loop.create_future()
        self._enqueuer.submit(turn)
        # Redis stalling: answer 503 after a while (platforms give up after a few seconds
        # anyway); the turn goes on: queued after all, the platform's retry is a duplicate;
        # failed, its keys are cleared and the retry goes through
        return await asyncio.wait_for(asyncio.shield(turn.future), timeout=ENQUEUE_TIMEOUT_S)


@dataclass
class _Turn:
    platform: str
    update_id: str
    seen: str
    job_id: str
    origin: str
    target: str
    agent: str
    message: str
    job: _JobFields = field(default_factory=lambda: _JobFields())
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    outcome: tuple[dict | None, BaseException | None] | None = None


def _settle(turns: list[_Turn]) -> None:
    """On the event loop: each waiting request gets its turn's outcome."""
    for t in turns:
        if t.future is None or t.future.done():
            continue
        result, exc = t.outcome or (None, RuntimeError("not enqueued"))
        if exc is not None:
            t.future.set_exception(exc)
        else:
            t.future.set_result(result)


class _Enqueuer:
    """One thread that enqueues webhook turns, in batches of what came in
    meanwhile (at most ENQUEUE_BATCH): one round trip claims them all (per
    turn `_CLAIM`: the de-dup key, SET NX with the job id as its value, and
    only when it was new, the job record; both provisional, with a
    CLAIM_TTL_S TTL), then courier's Celery app publishes the claimed turns
    as one kombu publish batch (one round trip), then one round trip gives
    their keys and records their full TTLs. When publishing fails, the
    claimed turns' keys and job records are deleted again (no orphan
    "queued" job; the platform's retry goes through) and each of their
    requests gets the error (a 503); when the process dies before
    publishing, they expire. One thread
    and a batch per round trip: the per-turn cost is Celery's message, not
    thread hand-offs and round trips."""

    def __init__(self, web: _Web) -> None:
        import queue
        import threading

        self.web = web
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.claim = web.redis.register_script(_CLAIM)
        self.thread = threading.Thread(target=self._run, name="courier-enqueue", daemon=True)
        self.thread.start()

    def submit(self, turn: _Turn) -> None:
        self.q.put(turn)

    def stop(self) -> None:
        self.q.put(None)

    def _run(self) -> None:
        import queue

        app = self.web.celery
        app.set_current()  # this thread publishes through courier's app, whatever else set its current app
        while True:
            first = self.q.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < ENQUEUE_BATCH:
                try:
                    t = self.q.get_nowait()
                except queue.Empty:
                    break
                if t is None:
                    self.q.put(None)
                    break
                batch.append(t)
            try:
                self._enqueue(app, batch)
            except BaseException as exc:  # noqa: BLE001 - every request gets an answer; the thread goes on
                for t in batch:
                    if t.outcome is None:
                        t.outcome = (None, exc)
            # one wake-up of the event loop for the whole batch
            loops = {t.loop for t in batch}
            for loop in loops:
                try:
                    loop.call_soon_threadsafe(_settle, [t for t in batch if t.loop is loop])
                except RuntimeError:  # that loop is closed: nobody waits any more
                    pass

    def _enqueue(self, app, batch: list[_Turn]) -> None:
        from tasks import chains

        r = self.web.redis
        pipe = r.pipeline(transaction=False)
        for t in batch:  # provisional: both keys expire after CLAIM_TTL_S unless the turn is published
            self.claim(keys=[t.seen, t.job.key], args=[t.job_id, CLAIM_TTL_S, CLAIM_TTL_S, *t.job.flat()], client=pipe)
        claimed = pipe.execute()
        new = []
        for t, ok in zip(batch, claimed):
            if ok:
                new.append(t)
            else:
                log.info("%s webhook: dropped a retried update %s", t.platform, t.update_id)
                t.outcome = ({"ok": True, "duplicate": True}, None)
        if not new:
            return
        try:
            with app.producer_or_acquire() as producer, producer.batch():
                for t in new:
                    sig = chains.turn_sig(t.job_id, t.target, t.message, agent=t.agent)
                    # published through courier's app by name; declare=[]: the message goes
                    # to the `turns` list itself (the anonymous exchange, see
                    # workers/celery_app.task_queue): declaring the queue again for every
                    # message only costs (the workers declare what they consume)
                    app.send_task(sig.task, args=sig.args, kwargs=sig.kwargs, task_id=t.job_id, producer=producer,
                                  declare=[], ignore_result=app.tasks[sig.task].ignore_result, **sig.options)
        except Exception as exc:  # noqa: BLE001 - answered 503: the platform retries
            self._forget(new)
            for t in new:
                t.outcome = (None, exc)
            return
        self._keep(new)
        for t in new:
            log.info("%s webhook: update %s -> turn %s", t.platform, t.update_id, t.job_id)
            t.outcome = ({"ok": True, "job": t.job_id}, None)

    def _keep(self, turns: list[_Turn]) -> None:
        """After the publish: the de-dup keys and job records get their full TTLs."""
        ttl = self.web.settings.webhook_dedupe_ttl_s
        try:
            from tasks import chains, ledger

            pipe = self.web.redis.pipeline(transaction=False)
            for t in turns:
                pipe.expire(t.seen, ttl)
                pipe.expire(t.job.key, t.job.ttl)
                ledger.set_due(pipe, "turn", t.job_id, chains.TURN_GRACE_S)  # the ledger watches it from now on
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - queued all the same: answered 200
            log.error("webhook: %d turns queued, but their de-dup keys could not be kept (%s): a retry within "
                      "%ds is dropped, a later one queued again", len(turns), type(exc).__name__, CLAIM_TTL_S)

    def _forget(self, turns: list[_Turn]) -> None:
        """After a failed publish: no de-dup keys (the retries go through), no job records."""
        try:
            self.web.redis.delete(*[k for t in turns for k in (t.seen, t.job.key)])
        except Exception as exc:  # noqa: BLE001 - both expire anyway; the 503 stands
            log.error("webhook: could not clear %d turns after a failed enqueue: %s", len(turns),
                      type(exc).__name__)


#: SET NX the de-dup key (KEYS[1]) to the job id with its TTL; only when it was
#: new, record the job: HSET KEYS[2] with the fields, EXPIRE it. 1 when claimed.
_CLAIM = """
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('hset', KEYS[2], unpack(ARGV, 4))
redis.call('expire', KEYS[2], ARGV[3])
return 1
"""


class _JobFields:
    """Takes what `receipts.create_job` writes on a pipeline (its one HSET and
    EXPIRE), for `_CLAIM` to write: the job record's fields stay defined in
    one place."""

    def __init__(self) -> None:
        self.key = ""
        self.fields: dict = {}
        self.ttl = 0

    def hset(self, key, mapping):
        self.key, self.fields = key, dict(mapping)

    def expire(self, key, ttl):
        assert key == self.key
        self.ttl = int(ttl)

    def flat(self) -> list:
        return [x for kv in self.fields.items() for x in kv]


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
    # nobody here waits for a task's result: without this, Celery's Redis result
    # backend SUBSCRIBEs to every published turn's result channel in this process
    # (one round trip more per webhook, and channels and unread results that pile up)
    from celery._state import _set_task_join_will_block

    _set_task_join_will_block(True)
    return app


#: the largest body each webhook reads (a longer one is a 413, read no further): a Telegram
#: update, a Slack event and a Discord interaction are a few KiB; a WhatsApp notification
#: may batch many messages
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
    chunks: list[bytes] = []
    n = 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > cap:
            raise Refusal(413, f"body over {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _answer(a: Answer) -> Response:
    if a.plain:
        return PlainTextResponse(a.body, headers=a.headers)
    return JSONResponse(a.body, headers=a.headers)


_WEBHOOKS = {"telegram": telegram_webhook, "slack": slack_webhook, "discord": discord_webhook,
             "whatsapp": whatsapp_webhook}


def _not_configured(platform: str, setting: str) -> Response:
    return JSONResponse({"ok": False, "error": f"{platform} webhook is not configured ({setting})"}, status_code=404)


async def _accept(web: _Web, platform: str, update_id: str, chat: str, message: str) -> Response | dict:
    try:
        out = await web.accept(platform, update_id, chat, message)
        metrics.record_webhook_turn(platform, bool(out.get("duplicate")))
        return out
    except Exception as exc:  # noqa: BLE001 - the platform retries on 5xx
        log.error("%s webhook: could not enqueue a turn: %s", platform, type(exc).__name__)
        return JSONResponse({"ok": False, "error": "could not enqueue the turn"}, status_code=503)


def _webhook(platform: str):
    """A webhook route: a refused request (Refusal) is its status with a one-line reason;
    anything a payload's shape makes the handler trip over is a 400, never a 500."""

    def wrap(handler):
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

    return wrap


# -- logs: no secret in a request line --------------------------------------------------------
class _NoQueryStrings(logging.Filter):
    """uvicorn's access log without query strings (the WhatsApp verify token, an events
    token), and its ASGI trace without the scope's query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(self._clean(a) for a in args)
        return True

    @staticmethod
    def _clean(a):
        if isinstance(a, str) and "?" in a and a.startswith("/"):
            return a.split("?", 1)[0] + "?…"
        if isinstance(a, dict) and a.get("query_string"):
            return {**a, "query_string": b"<...>"}
        return a


def quiet_query_strings() -> None:
    """Install the filter on uvicorn's access and ASGI loggers (idempotent)."""
    for name in ("uvicorn.access", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _NoQueryStrings) for f in lg.filters):
            lg.addFilter(_NoQueryStrings())


# -- routes ---------------------------------------------------------------------------
def create_app(settings: Settings | None = None) -> Starlette:
    web = _Web(settings or get_settings())
    quiet_query_strings()

    async def files(request: Request) -> Response:
        """A volume's blob behind a signed, expiring link (storage/links.py), streamed."""
        import mimetypes

        from starlette.concurrency import iterate_in_threadpool

        from storage.base import check_key
        from workers.wiring import file_links, store

        key = request.path_params["key"]
        try:
            check_key(key)
        except Exception:  # noqa: BLE001 - a key that cannot be one
            return JSONResponse({"ok": False, "error": "bad key"}, status_code=400)
        links = file_links(web.settings)
        why = await asyncio.to_thread(links.check, key, request.query_params.get("exp", ""),
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
        from tasks import queues

        need = [q for q in request.query_params.get("consumers", "").split(",") if q]
        try:
            await asyncio.wait_for(web.aredis.ping(), timeout=3)
            now = time.time()
            pipe = web.aredis.pipeline(transaction=False)
            for q in ("turns", *need):
                pipe.zcount(keys.consumers(q), now - queues.CONSUMER_STALE_S, "+inf")
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
            metrics_registry.append(exposition.registry(web.redis))
        body = await run_in_threadpool(exposition.render, metrics_registry[0])
        return Response(body, media_type=exposition.CONTENT_TYPE)

    async def turn_events(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or ""
        last = last.strip()
        if not _JOB_ID.fullmatch(job_id):
            return JSONResponse({"error": "bad job id"}, status_code=404)
        token = request.query_params.get("token") or ""
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            token = auth[7:].strip()
        if not token:
            return JSONResponse({"error": "the events of a turn need its token: ?token= or Authorization: Bearer "
                                          "(courier turn --json, courier status ID)"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        from workers import eventauth

        key = await run_in_threadpool(eventauth.server_key, web.redis)  # read each time: deleting it revokes
        if not eventauth.verify(key, job_id, token):
            return JSONResponse({"error": "wrong token for this turn"}, status_code=403)
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

    # -- platform webhooks: headers, capped body, signature and payload (adapters/platforms/webhooks) --
    def webhook(platform: str, secret_of):
        """The route of a platform's webhook: its parser checks the headers before the body
        is read, then the signature and the payload; each message it finds is enqueued."""
        parser = _WEBHOOKS[platform]

        @_webhook(platform)
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
                out = await _accept(web, platform, inbound.update_id, inbound.chat, inbound.text)
                if isinstance(out, Response):
                    return out
                outs.append(out)
            return _answer(parser.answer(got, outs, request.headers))

        return route

    telegram = webhook("telegram", lambda s: s.telegram_webhook_secret)
    slack = webhook("slack", lambda s: s.slack_signing_secret)
    discord = webhook("discord", lambda s: s.discord_public_key or None)
    whatsapp = webhook("whatsapp", lambda s: s.whatsapp_app_secret)

    @_webhook("whatsapp")
    async def whatsapp_verify(request: Request) -> Response:
        token = web.settings.whatsapp_verify_token
        if token is None:
            return _not_configured("whatsapp", whatsapp_webhook.VERIFY_SETTING)
        got = whatsapp_webhook.verify_subscription(request.query_params, token)
        if isinstance(got, Refusal):
            raise got
        return _answer(got)

    async def shutdown() -> None:
        await web.close()

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/turns/{job_id}/events", turn_events, methods=["GET"]),
        Route("/turns/{job_id}", turnpage.turn_page, methods=["GET"]),  # the turn's live page
        Route("/turns/{job_id}/thumbs/{delivery_id}", turnpage.turn_thumb, methods=["GET"]),
        Route("/files/{key:path}", files, methods=["GET"]),
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
        if web.settings.discord_public_key:
            discord_webhook.verify_key(web.settings.discord_public_key)  # a bad key: no start
        quiet_query_strings()
        yield
        await shutdown()

    application = Starlette(routes=routes, lifespan=lifespan)
    application.state.web = web
    return application


app = create_app()
