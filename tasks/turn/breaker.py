"""A circuit breaker per sandbox, in the ledger: a stalled sandbox costs one slot, once.

A sandbox whose channel stops answering (a container whose shell stalls, a
wedged ssh host) holds each extraction that reaches it for `io_timeout_s`
before its read deadline frees the worker slot (ReadTimeout). Without a
breaker every file named on it pays that, once per attempt, and every other
chat's file on the sandbox queue waits behind them. Here:

- **scout**: a sandbox that has not answered within the last `io_timeout_s`
  (a cold one, or one whose breaker has run out: half-open) is tried by ONE
  extraction at a time (`keys.breaker_scout`); its other extractions are
  postponed until the scout's verdict, so a sandbox that stalled while quiet
  holds one slot, not one per worker process. A sandbox that answered lately
  runs its files in parallel (only a stall in the middle of a burst can catch
  the extractions already on their way, each once).
- **open**: an I/O timeout (`is_timeout`) opens the sandbox's breaker (`trip`)
  for a period that doubles while it keeps timing out (from `io_timeout_s`,
  capped at `max_s`). Until its end that sandbox's extractions, in flight
  (re-driven) and queued, are postponed (`SandboxStalled`): their due time is
  the breaker's end, no attempt counted, nothing reaches the sandbox, no slot
  held beyond one script. Other sandboxes' files never wait behind it.
- **half-open, closed**: at its end one extraction scouts (the probe); any
  answer from the sandbox (a file, a missing file, ...) closes the breaker
  and hands the postponed extractions on at once (`Gate.woke`: their due
  times brought in, the task publishes them; the reconciler re-drives any
  message lost); a timeout opens it again, longer.
- a file postponed past the outage deadline fails with a clear reason, as a
  storage outage does (`tasks.ledger.ledger.gives_up`).

A sandbox is `<kind>:<host>:<target>` (`ident_of`), the identity routing
uses (adapters/sandboxes/routing.py). Only kinds whose reads have a deadline
take part (`STALLABLE`); a local or singularity file is read from the
worker's own disk and costs nothing here (no round trip).

State (tasks/ledger/keys.py): `breakers()` (open and half-open sandboxes, scored by
the breaker's end), `breaker(ident)` (opens in a row, since, reason),
`breaker_scout(ident)`, `breaker_waiting(ident)` (the postponed delivery
ids) and `sandboxes_answered()` (when each sandbox last answered).
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
#: a handed-on extraction is published by the task that closed the breaker; the reconciler
#: re-drives it after this long if that message was lost
HANDOFF_GRACE_S = 5.0


def ident_of(sandbox: Mapping[str, Any]) -> str:
    """`<kind>:<host>:<target>` of a sandbox ref's dict (as the ledger's spec holds it):
    a container is one sandbox per host it lives on. The target goes last (it may hold `:`)."""
    options = sandbox.get("options") or {}
    return f"{sandbox.get('kind', '')}:{options.get('host') or ''}:{sandbox.get('target') or ''}"


def is_timeout(exc: BaseException) -> bool:
    """The transient timeout a backend raises when the sandbox sent nothing within its read deadline."""
    return isinstance(exc, ReadTimeout)


@dataclass
class Gate:
    """One extraction's passage through its sandbox's breaker: `enter` before
    the sandbox is touched, `after` once it is over (or postponed)."""

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
        """Raises SandboxStalled (postponed, not tried) while the breaker is
        open, or while another extraction scouts an unproven sandbox; else
        the extraction goes on (as the scout when the sandbox is unproven)."""
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
        """The extraction is over: `exc` None (a result, ok or not) or what it
        raised. Returns the seconds until it is due again when the breaker
        decides that (postponed, or the timeout that opened it), else None
        (its own back-off). An answer (a result, or any courier error but a
        timeout: the sandbox said something) is stamped on `pipe`; a scout's answer
        closes the breaker in a round trip of its own and lists the
        extractions it hands on in `woke` (the caller publishes them)."""
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


def queue_of(sandbox: Mapping[str, Any]) -> str:
    """The extraction queue of a sandbox's files (chains.sandbox_queue's, from a ref's dict)."""
    from adapters.sandboxes.base import SandboxRef
    from adapters.sandboxes.routing import queue_for

    return queue_for(SandboxRef.from_dict(dict(sandbox)))


def state(r: Redis, ident: str) -> dict[str, str]:
    """A sandbox's breaker as operators (and tests) read it: `state` closed,
    open or half_open, with `until_s`, `opens`, `since_s`, `reason`, and
    `waiting` (postponed extractions)."""
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
