"""What crosses Redis is signed: every ledger spec and task message courier writes
carries an HMAC-SHA256 over its content, and a worker refuses one that does not verify.

Whoever can write to the shared Redis could otherwise make a worker act (a spec naming a
wider root or another chat, a task message with arguments of its own). The key is the
control plane's, never in Redis: ``COURIER_SIGNING_KEY`` (or ``_FILE``; a fleet sets it),
else one generated into the data dir; ``COURIER_SIGNING_KEY_PREVIOUS`` is accepted while rotating.

A sealed text is ``s1.<key id>.<unix time>.<mac>.<payload>``, the MAC over the purpose
(``delivery``, ``turn``, ``message``), the id it belongs to (a message's is empty), the
time and the payload. A spec copied under another id, tampered, signed with an unknown
key or too old is :class:`Forged`: permanent, logged, counted, never acted on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from adapters.errors import CourierError

log = logging.getLogger(__name__)

PREFIX = "s1"
#: how old a signature may be (the receipts' retention: nothing courier keeps is older)
DEFAULT_MAX_AGE_S = 30 * 24 * 3600
#: how far in the future a signature's time may be (clocks of a fleet differ a little)
CLOCK_SKEW_S = 300


class Forged(CourierError):
    """A spec or message that is unsigned, tampered, bound to another id, too
    old or signed with a key this process does not have. Permanent."""

    transient = False


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"courier-key-id\0" + key).hexdigest()[:8]


class Signer:
    """Seals with the first key; opens with any of `keys` (the current one and,
    while rotating, the previous one)."""

    def __init__(self, keys: Sequence[bytes], *, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        usable = [k for k in keys if k]
        if not usable:
            raise ValueError("a signer needs a key")
        if any(len(k) < 16 for k in usable):
            raise ValueError("a signing key must be at least 16 bytes")
        self._keys = {key_id(k): k for k in usable}
        self._current = key_id(usable[0])
        self.max_age_s = max_age_s

    @staticmethod
    def _mac(key: bytes, purpose: str, ident: str, ts: str, payload: bytes) -> str:
        m = hmac.new(key, digestmod=hashlib.sha256)
        for part in (purpose.encode(), ident.encode(), ts.encode()):
            m.update(len(part).to_bytes(4, "big") + part)
        m.update(payload)
        return base64.urlsafe_b64encode(m.digest()).rstrip(b"=").decode("ascii")

    def seal(self, purpose: str, ident: str, payload: str, *, now: float | None = None) -> str:
        ts = str(int(time.time() if now is None else now))
        mac = self._mac(self._keys[self._current], purpose, ident, ts, payload.encode("utf-8"))
        return f"{PREFIX}.{self._current}.{ts}.{mac}.{payload}"

    def open(self, purpose: str, ident: str, sealed: str | bytes, *, now: float | None = None) -> str:
        """The payload of `sealed`, verified as `purpose` of `ident`; raises Forged."""
        if isinstance(sealed, bytes):
            try:
                sealed = sealed.decode("utf-8")
            except UnicodeDecodeError:
                raise Forged(f"unsigned {purpose}: not UTF-8") from None
        what = purpose + (f" {ident}" if ident else "")
        parts = sealed.split(".", 4)
        if len(parts) != 5 or parts[0] != PREFIX:
            raise Forged(f"unsigned {what}")
        _, kid, ts, mac, payload = parts
        key = self._keys.get(kid)
        if key is None:
            raise Forged(f"{what} is signed with an unknown key ({kid})")
        if not hmac.compare_digest(mac, self._mac(key, purpose, ident, ts, payload.encode("utf-8"))):
            raise Forged(f"{what} does not verify (tampered, or another's)")
        try:
            age = (time.time() if now is None else now) - int(ts)
        except ValueError:
            raise Forged(f"{purpose} {ident}: bad signature time") from None
        if age > self.max_age_s or age < -CLOCK_SKEW_S:
            raise Forged(f"{what} was signed {int(age)} s ago: too old")
        return payload


_signer: Signer | None = None
_loader: Callable[[], Signer] | None = None
_lock = threading.Lock()


def install(s: Signer | None) -> None:
    """Make `s` this process's signer (tests install a test key)."""
    global _signer
    _signer = s


def set_loader(load: Callable[[], Signer] | None) -> None:
    """How this process makes its signer on first use (workers/wiring.py: from the settings)."""
    global _loader
    _loader = load


def signer() -> Signer:
    global _signer
    if _signer is None:
        with _lock:
            if _signer is None:
                if _loader is None:
                    raise CourierError("no signing key in this process (workers.wiring sets its loader)")
                _signer = _loader()
    return _signer


def seal_json(purpose: str, ident: str, obj: Any) -> str:
    """`obj` as compact JSON, sealed as `purpose` of `ident`."""
    return signer().seal(purpose, ident, json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


def open_json(purpose: str, ident: str, sealed: str | bytes) -> Any:
    """The JSON `seal_json` sealed, verified; a forgery is logged, counted and raised (Forged)."""
    try:
        return json.loads(signer().open(purpose, ident, sealed))
    except Forged as exc:
        refused(purpose, exc)
        raise


def refused(what: str, exc: Exception) -> None:
    """Log and count a refused forgery (never its content)."""
    from tasks import metrics

    log.error("refused a forged %s: %s", what, exc)
    metrics.record_forged(what)
