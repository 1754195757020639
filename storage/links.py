"""Signed, expiring download links for a volume store, served by the web
process (`GET /files/<key>?exp=<epoch s>&sig=<hex>`).

S3 signs its own links; a shared volume has nobody to sign for it, so the
web process does: a link is an HMAC-SHA256 of the key and its expiry under a
server key, and the web process checks it before streaming the blob. The
server key is fetched lazily (`key_fn`, e.g. a random key kept in Redis), so
every worker and web process derives the same links with no configuration.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from urllib.parse import quote

#: the longest a link may live (as S3's presigned URLs)
MAX_EXPIRES_S = 7 * 24 * 3600


class LinkSigner:
    def __init__(self, base_url: str, key_fn: Callable[[], bytes]) -> None:
        self.base_url = base_url.rstrip("/")
        self.key_fn = key_fn

    def _sig(self, key: str, exp: int) -> str:
        return hmac.new(self.key_fn(), f"{key}\n{exp}".encode(), hashlib.sha256).hexdigest()

    def url(self, key: str, expires_s: int) -> str:
        exp = int(time.time()) + max(1, min(int(expires_s), MAX_EXPIRES_S))
        return f"{self.base_url}/files/{quote(key)}?exp={exp}&sig={self._sig(key, exp)}"

    def check(self, key: str, exp: str, sig: str) -> str | None:
        """None when the link is good, else why not (one line)."""
        if not (exp.isascii() and exp.isdigit()) or len(exp) > 12:
            return "bad expiry"
        if int(exp) < time.time():
            return "link expired"
        if not hmac.compare_digest(self._sig(key, int(exp)).encode(), sig.encode("utf-8", "replace")):
            return "bad signature"
        return None
