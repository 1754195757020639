"""A circuit breaker per sandbox, in the ledger: a stalled sandbox costs one slot, once
(docs/guarantees.md, "A stalled sandbox"). A sandbox not heard from within `io_timeout_s`
(cold, or half-open) is tried by ONE extraction, the scout, while its others wait for the
verdict. An I/O timeout (`is_timeout`) opens the breaker for a period that doubles while it
keeps timing out (at most `max_s`): its extractions are postponed untried (`SandboxStalled`:
due at its end, no attempt counted, no slot held). At its end one probes: any answer closes
it and hands the postponed ones on at once (`Gate.woke`, published by the task; the
reconciler re-drives a lost message). A file postponed past the outage deadline fails.

A sandbox is `<kind>:<host>:<target>` (`ident_of`), of a kind whose reads have a deadline
(`STALLABLE`); its state: `keys.breakers()`, `breaker`, `breaker_scout`, `breaker_waiting`
and `sandboxes_answered()`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline

from adapters.errors import CourierError, SandboxStalled
from adapters.sandboxes.base import ReadTimeout
from tasks import metrics
from tasks.ledger import keys, ledger, scripts

log = logging.getLogger(__name__)

#: sandbox kinds whose reads have a deadline (io_timeout_s): the ones that can stall a worker
STALLABLE = frozenset({"docker", "ssh", "modal"})
#: how long the breaker's own keys live without a trip or a postponement refreshing them
STATE_TTL_S = 24 * 3600
#: an entry of `keys.breakers()` whose end is older than this has had no extraction come for it:
#: forgotten at the next trip anywhere (and not shown as half-open)
STALE_S = 3600.0
#: the reconciler re-drives a handed-on extraction after this long if its message was lost
HANDOFF_GRACE_S = 5.0


def ident_of(sandbox: Mapping[str, Any]) -> str:
    """`<kind>:<host>:<target>` of a sandbox ref's dict (the target last: it may hold `:`)."""
    options = sandbox.get("options") or {}
    return f"{sandbox.get('kind', '')}:{options.get('host') or ''}:{sandbox.get('target') or ''}"


def is_timeout(exc: BaseException) -> bool:
    """The transient timeout a backend raises when the sandbox sent nothing within its read deadline."""
    return isinstance(exc, ReadTimeout)


@dataclass
class Gate:
    """One extraction's passage through its breaker: `enter` before the sandbox is touched, `after` once over."""

    ident: str
    kind: str
    io_timeout_s: float
    max_s: float
    #: run | scout | open | wait (`enter`); off: a kind that cannot stall
    verdict: str = "off"
    woke: list[str] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.kind in STALLABLE

    def _keys(self) -> list[str]:
        return [keys.breakers(), keys.breaker(self.ident), keys.breaker_scout(self.ident),
                keys.breaker_waiting(self.ident), keys.sandboxes_answered(), keys.due("extract")]

    def enter(self, r: Redis, did: str) -> None:
        """Raises SandboxStalled (postponed, not tried) while the breaker is open or another
        extraction scouts an unproven sandbox; else the extraction goes on (maybe as the scout)."""
        if not self.on:
            return
        now = time.time()
        k = self._keys()
        verdict, at = cast("list[str]", scripts.run(
            r, "breaker_admit", keys=[k[0], k[4], k[2], k[3]],
            args=[self.ident, did, f"{now:.6f}", self.io_timeout_s, math.ceil((self.io_timeout_s +
                  ledger.LEASE_TTL_S) * 1000), STATE_TTL_S]))
        self.verdict = verdict
        if verdict in ("run", "scout"):
            return
        metrics.record_breaker(self.kind, "postponed")
        what = "is not answering (its reads timed out)" if verdict == "open" else "is being tried by another file first"
        raise SandboxStalled(f"{self.kind} sandbox {self.target} {what}", until_s=float(at))

    @property
    def target(self) -> str:
        return self.ident.split(":", 2)[2] or "(default)"

    def after(self, r: Redis, pipe: Pipeline, did: str, exc: BaseException | None) -> float | None:
        """The extraction is over: `exc` None (a result, ok or not) or what it raised.
        Returns the seconds until it is due again when the breaker decides (postponed, or
        the timeout that opened it), else None (its own back-off). An answer (a result, or
        a courier error but a timeout) is stamped on `pipe`; a scout's answer closes the
        breaker at once and lists the extractions it hands on in `woke`."""
        if not self.on:
            return None
        now = time.time()
        if isinstance(exc, SandboxStalled):
            return max(0.0, exc.until_s - now)
        k = self._keys()
        if exc is not None and is_timeout(exc):
            until, opens = cast("list[str]", scripts.run(
                r, "breaker_trip", keys=k, args=[self.ident, did, f"{now:.6f}", self.io_timeout_s, self.max_s,
                              getattr(exc, "reason", str(exc))[:500], STATE_TTL_S, f"{now - STALE_S:.6f}"]))
            if opens != "0":
                metrics.record_breaker(self.kind, "opened")
                log.warning("sandbox %s stopped answering (%s): its extractions wait %.0f s (opened %s times in a row)",
                            self.ident, getattr(exc, "reason", exc), float(until) - now, opens)
            return max(0.0, float(until) - now)
        if exc is not None and not isinstance(exc, CourierError):
            return None  # no word from the sandbox either way (a bug, a task's time limit): its scout key lapses
        args: list[str | float] = [self.ident, did, f"{now:.6f}", self.io_timeout_s]
        if self.verdict == "scout":
            self.woke = cast("list[str]", scripts.run(r, "breaker_answered", keys=k,
                                                      args=[*args, f"{now + HANDOFF_GRACE_S:.6f}"]))
            if self.woke:
                log.info("sandbox %s answers again: %d extractions handed on", self.ident, len(self.woke))
        else:  # an answer that closes nothing (the common case) rides on the stage's last round trip
            scripts.run(pipe, "breaker_answered", keys=k, args=[*args, f"{now:.6f}"])
        return None


def gate(sandbox: Mapping[str, Any], *, io_timeout_s: float, max_s: float) -> Gate:
    """The gate of an extraction from sandbox `sandbox` (a ref's dict)."""
    return Gate(ident_of(sandbox), str(sandbox.get("kind", "")), io_timeout_s, max_s)


def state(r: Redis, ident: str) -> dict[str, str]:
    """A sandbox's breaker: `state` closed, open or half_open, with `until_s`, `opens`, `since_s`,
    `reason`, and `waiting` (postponed extractions)."""
    pipe = r.pipeline(transaction=False)
    pipe.zscore(keys.breakers(), ident)
    pipe.hgetall(keys.breaker(ident))
    pipe.scard(keys.breaker_waiting(ident))
    until, fields, waiting = pipe.execute()
    out = dict(cast("dict[str, str]", fields))
    if until is None:
        out["state"] = "closed"
    else:
        out["state"] = "open" if float(until) > time.time() else "half_open"
        out["until_s"] = str(float(until))
    out["waiting"] = str(int(waiting))
    return out


def counts(r: Redis, *, now: float | None = None) -> dict[str, int]:
    """How many sandboxes' breakers are open, and half-open (run out, waiting for a probe) (for /metrics)."""
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    pipe.zcount(keys.breakers(), f"({now}", "+inf")
    pipe.zcount(keys.breakers(), now - STALE_S, now)
    opened, half = pipe.execute()
    return {"open": int(opened), "half_open": int(half)}
