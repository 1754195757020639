"""Who may read a turn's events and page over HTTP (`GET /turns/{id}[/events]`).

A per-job token: HMAC-SHA256 of the job id under a random server key kept in Redis (`keys.events_key`,
made once with SET NX), first 32 hex characters: every web process and the CLI derive the same token
without configuration (whoever reads courier's Redis is an operator anyway). Requests give it as
`?token=` (EventSource cannot set headers) or `Authorization: Bearer`. Deleting the key revokes every
token given so far.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from tasks.ledger import keys

JOB_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def server_key(r, name: str | None = None) -> bytes:
    """A random server key kept in Redis at `name` (default: the events key),
    made on first use: every process gets the same one."""
    name = name or keys.events_key()
    key = r.get(name)
    if key is None:
        r.set(name, secrets.token_hex(32), nx=True)
        key = r.get(name)
    return key.encode()  # hex text: courier's clients decode replies


def token_for(key: bytes, job_id: str) -> str:
    return hmac.new(key, job_id.encode(), hashlib.sha256).hexdigest()[:32]


def events_token(r, job_id: str) -> str:
    """The token that opens `GET /turns/{job_id}/events`."""
    return token_for(server_key(r), job_id)


async def authorize(request, job_id: str, missing: str):
    """None when the request carries the job's token (`Authorization: Bearer`, else `?token=`),
    else the refusal (404 a bad id, 401 no token: `missing` says how to give one, 403 a wrong one).
    The key is read each time: deleting it revokes."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    if not JOB_ID.fullmatch(job_id):
        return JSONResponse({"error": "bad job id"}, status_code=404)
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.query_params.get("token") or ""
    if not token:
        return JSONResponse({"error": f"{missing} (courier turn --json, courier status ID)"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})
    key = await run_in_threadpool(server_key, request.app.state.web.redis)
    if not hmac.compare_digest(token_for(key, job_id).encode(), token.encode("utf-8", "replace")):
        return JSONResponse({"error": "wrong token for this turn"}, status_code=403)
    return None
