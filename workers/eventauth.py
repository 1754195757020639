"""Who may read a turn's events over HTTP (`GET /turns/{id}/events`).

A per-job token: HMAC-SHA256 of the job id under a random server key, the
first 32 hex characters. The key is made once (32 random bytes, SET NX) and
kept in Redis (`keys.events_key`), so every web process and the CLI derive
the same token without any configuration; whoever can read courier's Redis
is an operator anyway. The CLI gives the token back when it creates a turn
(`courier turn --json`) and shows it (`courier status ID`); the stream takes
it as `?token=` (EventSource cannot set headers) or `Authorization: Bearer`.
Rotating the key (deleting it) invalidates every token given so far.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from tasks.ledger import keys


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


def verify(key: bytes, job_id: str, token: str) -> bool:
    return hmac.compare_digest(token_for(key, job_id).encode(), token.encode("utf-8", "replace"))


def request_token(query_params, headers) -> str:
    """The token a request carries: `Authorization: Bearer <token>`, else `?token=`
    ("" when neither)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return query_params.get("token") or ""
