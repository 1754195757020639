"""A turn's live page on the web process: `GET /turns/{id}?token=…` (the events' token, workers/eventauth.py).

One self-contained HTML page that follows the turn's SSE stream (history first: a page opened late shows
everything) and shows each delivered image (`turn_thumb`). All data is set as text (textContent), never
parsed as HTML; a strict Content-Security-Policy lets only the page's own script (by nonce) run and
connect to its own origin.
"""

from __future__ import annotations

import asyncio
import html
import json
import posixpath
import secrets
from importlib.resources import files

from starlette.concurrency import iterate_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from adapters.errors import CourierError
from tasks.delivery import specs
from tasks.ledger import keys, signing
from workers.eventauth import JOB_ID, authorize

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}
#: images over this are not shown as thumbnails (the page is a status view, not a download)
THUMB_MAX_BYTES = 20 * 1024 * 1024
NO_TOKEN = "a turn's page needs its token: ?token="
#: the page itself (turnpage.html beside this module, shipped as package data)
PAGE = files("workers").joinpath("turnpage.html").read_text(encoding="utf-8")


async def turn_page(request: Request) -> Response:
    job_id = request.path_params["job_id"]
    refused = await authorize(request, job_id, NO_TOKEN)
    if refused is not None:
        return refused
    r = request.app.state.web.aredis
    job = await r.hgetall(keys.job(job_id))
    if not job and not await r.exists(keys.events(job_id)):
        return JSONResponse({"error": f"no turn or send {job_id!r}"}, status_code=404)
    nonce = secrets.token_urlsafe(16)
    info = {"job": job_id, "kind": job.get("kind", ""), "target": job.get("target", ""),
            "agent": job.get("agent", ""), "state": job.get("state", "")}
    # JSON inside <script type=application/json>: "<" escaped so no data can close the element
    blob = json.dumps(info).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = PAGE.replace("{{NONCE}}", nonce).replace("{{INFO}}", blob).replace(
        "{{TITLE}}", html.escape(f"{info['kind'] or 'job'} {job_id}"))
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
           "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return HTMLResponse(page, headers={"Content-Security-Policy": csp, "Cache-Control": "no-store",
                                       "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"})


async def turn_thumb(request: Request) -> Response:
    from workers.wiring import store

    job_id, did = request.path_params["job_id"], request.path_params["delivery_id"]
    refused = await authorize(request, job_id, NO_TOKEN)
    if refused is not None:
        return refused
    if not did.startswith(job_id + ".") or not JOB_ID.fullmatch(did):
        return JSONResponse({"error": "not a delivery of this job"}, status_code=404)
    web = request.app.state.web
    raw = await web.aredis.hget(keys.delivery(did), "spec")
    try:
        spec = specs.open_delivery(did, raw) if raw else None
    except (signing.Forged, ValueError):
        spec = None
    if spec is None or spec.job_id != job_id or not spec.key:
        return JSONResponse({"error": "no such file"}, status_code=404)
    key = spec.key
    name = spec.name or posixpath.basename(key)
    ctype = IMAGE_TYPES.get(posixpath.splitext(name.lower())[1])
    if ctype is None:
        return JSONResponse({"error": "not an image"}, status_code=404)
    st = store(web.settings)
    try:
        info = await asyncio.to_thread(st.stat, key)
    except (CourierError, OSError):
        return JSONResponse({"error": "no such file (not stored yet, or expired)"}, status_code=404)
    if info.size_bytes > THUMB_MAX_BYTES:
        return JSONResponse({"error": "too large for a thumbnail"}, status_code=404)
    return StreamingResponse(iterate_in_threadpool(st.iter_chunks(key)), media_type=ctype,
                             headers={"Content-Length": str(info.size_bytes), "Cache-Control": "private, max-age=300",
                                      "X-Content-Type-Options": "nosniff",
                                      "Content-Security-Policy": "default-src 'none'"})
