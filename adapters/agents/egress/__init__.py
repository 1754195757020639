"""The browser's egress guard: a small filtering forward proxy.

``browser_screenshot`` opens whatever URL a model asks for, so the headless
Chromium it drives must not reach loopback, private networks, link-local
addresses (cloud metadata endpoints) or anything else that is not on the
public internet — neither for the page itself, nor for what the page
redirects to or loads. Chromium is started with ``--proxy-server`` pointing
at an :class:`EgressProxy` on 127.0.0.1 (and ``--proxy-bypass-list=<-loopback>``
so that even loopback URLs go through it); every connection it opens then
passes :class:`EgressPolicy`. What the relay does with a CONNECT (https, wss) or an absolute-form plain
http request, and what a refused or unreachable destination gets (403,
502), is told in :mod:`adapters.agents.egress.proxy`. Only ports 80 and
443 are open, plus what the allow-list names.

The allow-list (``COURIER_BROWSER_ALLOWED_HOSTS``) holds host names and
addresses or CIDR networks, each optionally with ``:port`` (``[v6]:port`` for
IPv6): an entry without a port allows every port of that host or network.
A name is matched as the URL spells it (case-insensitive); a network
matches the resolved addresses. A name that resolves to several addresses is
allowed only when every one of them is.

Two modules: :mod:`adapters.agents.egress.policy` (the address policy: what
the browser may reach) and :mod:`adapters.agents.egress.proxy` (the relay
that enforces it); their names are all importable from here.
"""

from adapters.agents.egress.policy import (
    ALLOW_SETTING,
    DEFAULT_PORTS,
    EgressPolicy,
    Refused,
    address_problem,
    parse_allowed_hosts,
)
from adapters.agents.egress.proxy import MARK_HEADER, EgressProxy, Refusal

__all__ = ["ALLOW_SETTING", "DEFAULT_PORTS", "MARK_HEADER", "EgressPolicy", "EgressProxy", "Refusal", "Refused",
           "address_problem", "parse_allowed_hosts"]
