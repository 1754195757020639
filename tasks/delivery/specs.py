"""A delivery's spec sealed into its receipt and opened from it: the signed wire form
(tasks/ledger/signing.py) of a `DeliverySpec` (tasks/messages.py)."""

from __future__ import annotations

import logging

from tasks.ledger.signing import Forged, open_json, seal_json
from tasks.messages import DeliverySpec

log = logging.getLogger(__name__)


def seal_delivery(spec: DeliverySpec) -> str:
    """A delivery spec sealed for its receipt (its wire form, `DeliverySpec.to_json`)."""
    return seal_json("delivery", spec.delivery_id, spec.to_json())


def open_delivery(did: str, sealed: str | bytes) -> DeliverySpec:
    """Delivery `did`'s spec, verified (Forged, logged and counted, when it does not) and read. One
    that verifies but is no delivery spec is Forged too (not counted): never acted on."""
    obj = open_json("delivery", did, sealed)
    try:
        return DeliverySpec.from_json(obj)
    except ValueError as exc:
        log.warning("delivery %s: its spec is unreadable (%s)", did, exc)
        raise Forged(f"delivery {did}: {exc}") from None
