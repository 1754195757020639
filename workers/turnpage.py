"""A turn's live page on the web process: `GET /turns/{id}?token=…` (the events' token, workers/eventauth.py).

One self-contained HTML page that follows the turn's SSE stream (history first: a page opened
late shows everything): phases, tool activity, deliveries, a thumbnail of each delivered image
(`GET /turns/{id}/thumbs/{delivery id}`, at most THUMB_MAX_BYTES, streamed from storage). All
data is set as text (textContent), never parsed as HTML; a strict Content-Security-Policy lets
only the page's own script (by nonce) run and connect to its own origin.
"""

from __future__ import annotations

import asyncio
import html
import json
import posixpath
import secrets

from starlette.concurrency import iterate_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}
#: images over this are not shown as thumbnails (the page is a status view, not a download)
THUMB_MAX_BYTES = 20 * 1024 * 1024
NO_TOKEN = "a turn's page needs its token: ?token="


async def turn_page(request: Request) -> Response:
    from tasks.ledger import keys
    from workers.eventauth import authorize

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
    from adapters.errors import CourierError
    from tasks.delivery import specs
    from tasks.ledger import keys, signing
    from workers.eventauth import JOB_ID, authorize
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


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>{{TITLE}}</title>
<style nonce="{{NONCE}}">
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:60em}
h1{font-size:1.2em;margin:0 0 .2em} .meta{color:#666;margin-bottom:1em}
#phase{font-weight:bold} #conn{color:#999;font-size:.9em;margin-left:.5em}
ol#phases{display:flex;flex-wrap:wrap;gap:.4em;list-style:none;padding:0}
ol#phases li{background:#eef;border-radius:1em;padding:.1em .7em}
ol#phases li.completed{background:#cfc} ol#phases li.error{background:#fcc}
ol#phases li.cancelled,ol#phases li.no_reply{background:#eee}
ul#tools{padding-left:1.2em} ul#tools li.running{color:#a60} ul#tools li.error{color:#c00}
table{border-collapse:collapse;width:100%} td,th{border-bottom:1px solid #ddd;padding:.3em;text-align:left;
vertical-align:top} tr.delivered td.state{color:#080} tr.failed td.state{color:#c00}
tr.cancelled td.state{color:#888} img.thumb{max-width:160px;max-height:120px;border:1px solid #ccc}
</style></head>
<body>
<script type="application/json" id="info">{{INFO}}</script>
<h1 id="title"></h1><div class="meta" id="meta"></div>
<div>phase: <span id="phase">queued</span><span id="conn"></span></div>
<h2>phases</h2><ol id="phases"></ol>
<h2>tool activity</h2><ul id="tools"></ul>
<h2>deliveries</h2>
<table><thead><tr><th>delivery</th><th>name</th><th>kind</th><th>state</th><th>size / reason</th><th></th></tr>
</thead><tbody id="deliveries"></tbody></table>
<script nonce="{{NONCE}}">
"use strict";
const info = JSON.parse(document.getElementById("info").textContent);
const token = new URLSearchParams(location.search).get("token") || "";
const base = "/turns/" + encodeURIComponent(info.job);
const $ = (id) => document.getElementById(id);
function el(tag, text, cls) { const e = document.createElement(tag); if (text !== undefined && text !== null)
  e.textContent = String(text); if (cls) e.className = cls; return e; }
$("title").textContent = (info.kind || "job") + " " + info.job;
$("meta").textContent = [info.agent && ("agent " + info.agent), info.target && ("to " + info.target)]
  .filter(Boolean).join(" · ");
if (info.state) $("phase").textContent = info.state;
function when(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : ""; }
function size(n) { n = Number(n); if (!isFinite(n) || n <= 0) return "";
  const u = ["B", "KiB", "MiB", "GiB"]; let i = 0; while (n >= 1024 && i < 3) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i]; }
// the page renders events itself, in the browser (phases, tools and deliveries in their own lists);
// everywhere in Python an event's words are tasks/ledger/events.py describe()'s: keep the two saying the same
function phase(ev) {
  const st = String(ev.status || ""); if (!st) return;
  $("phase").textContent = st;
  const li = el("li", st + (ev.message ? ": " + ev.message : "") + (ev.reason ? " (" + ev.reason + ")" : ""), st);
  li.dataset.status = st; li.title = when(ev.ts); $("phases").appendChild(li);
}
const tools = {};
function tool(ev) {
  const id = String(ev.tool_call_id || ev.tool_name || "");
  if (ev.kind === "tool_start") {
    const li = el("li", (ev.activity || ev.tool_name || "tool") + " …", "running");
    li.dataset.tool = ev.tool_name || ""; $("tools").appendChild(li); tools[id] = li; return;
  }
  const li = tools[id] || $("tools").appendChild(el("li", ev.tool_name || "tool"));
  const ok = ev.status !== "error";
  const took = typeof ev.duration_ms === "number" ? " " + (ev.duration_ms / 1000).toFixed(1) + "s" : "";
  li.textContent = li.textContent.replace(/ …$/, "") + (ok ? " ✓" : " ✗ " + (ev.error || "")) + took;
  li.className = ok ? "done" : "error"; delete tools[id];
}
const rows = {};
function delivery(ev) {
  const id = String(ev.delivery_id || ""); if (!id) return;
  let tr = rows[id];
  if (!tr) {
    tr = document.createElement("tr"); tr.id = "d-" + id; tr.dataset.delivery = id;
    for (const c of ["id", "name", "kind", "state", "detail", "thumb"]) tr.appendChild(el("td", "", c));
    tr.querySelector(".id").textContent = id; $("deliveries").appendChild(tr); rows[id] = tr;
  }
  const st = String(ev.state || ""); tr.className = st; tr.dataset.state = st;
  tr.querySelector(".state").textContent = st;
  if (ev.name) tr.querySelector(".name").textContent = ev.name;
  if (ev.media) tr.querySelector(".kind").textContent = ev.media;
  const detail = ev.reason || size(ev.size_bytes);
  if (detail) tr.querySelector(".detail").textContent = detail;
  const name = String(ev.name || tr.querySelector(".name").textContent || "");
  if (st === "delivered" && /\\.(png|jpe?g|gif|webp)$/i.test(name) && !tr.querySelector("img")) {
    const img = document.createElement("img"); img.className = "thumb"; img.alt = name;
    img.src = base + "/thumbs/" + encodeURIComponent(id) + "?token=" + encodeURIComponent(token);
    tr.querySelector(".thumb").appendChild(img);
  }
}
const src = new EventSource(base + "/events?token=" + encodeURIComponent(token));
src.onopen = () => { $("conn").textContent = ""; };
src.onerror = () => { $("conn").textContent = src.readyState === 2 ? "(stream closed)" : "(reconnecting…)"; };
function on(kind, fn) { src.addEventListener(kind, (m) => { let ev; try { ev = JSON.parse(m.data); }
  catch (e) { return; } fn(ev); }); }
on("status", phase); on("tool_start", tool); on("tool_result", tool); on("delivery", delivery);
</script></body></html>
"""
