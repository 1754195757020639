"""The egress guard: a small filtering forward proxy in front of every browser and
sandboxed agent connection. :mod:`~adapters.agents.egress.policy` decides what may be
reached; :mod:`~adapters.agents.egress.proxy` is the relay that enforces it."""

from adapters.agents.egress.policy import (
    ALLOW_SETTING, DEFAULT_PORTS, EgressPolicy, Refused, address_problem, parse_allowed_hosts)
from adapters.agents.egress.proxy import MARK_HEADER, EgressProxy, Refusal

__all__ = ["ALLOW_SETTING", "DEFAULT_PORTS", "MARK_HEADER", "EgressPolicy", "EgressProxy", "Refusal", "Refused",
           "address_problem", "parse_allowed_hosts"]
