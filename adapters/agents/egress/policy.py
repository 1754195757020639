"""The egress address policy: which (host, port) a browser a model drives, or
a sandboxed agent, may reach (adapters/agents/egress/proxy.py enforces it).

Non-public addresses (loopback, private, link-local: cloud metadata, ...) are
refused, IPv4-mapped, 6to4 and NAT64 ones judged by their IPv4 address too; a
name only when every address it resolves to is allowed. Only ports 80 and 443
are open, plus what the allow-list (``COURIER_BROWSER_ALLOWED_HOSTS``) names:
host names (matched as the URL spells them, case-insensitive), addresses or CIDR
networks (matching the resolved addresses), each optionally with ``:port``
(``[v6]:port``; no port: every port).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ALLOW_SETTING", "DEFAULT_PORTS", "EgressPolicy", "Refused", "address_problem", "parse_allowed_hosts"]

#: the setting an operator uses to open a private destination (named in refusals)
ALLOW_SETTING = "COURIER_BROWSER_ALLOWED_HOSTS"
DEFAULT_PORTS = (80, 443)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_PROBLEMS = (("is_unspecified", "an unspecified address"), ("is_loopback", "a loopback address"),
             ("is_link_local", "a link-local address"), ("is_multicast", "a multicast address"),
             ("is_site_local", "a site-local address"), ("is_private", "a private address"),
             ("is_reserved", "a reserved address"))


def address_problem(addr: str | Address) -> str | None:
    """Why `addr` may not be reached ("a loopback address", ...), or None when
    it is globally routable. IPv4-mapped, 6to4 and NAT64 addresses are judged
    by the IPv4 address inside them too."""
    ip = ipaddress.ip_address(addr) if isinstance(addr, str) else addr
    if ip.version == 6:
        inner: ipaddress.IPv4Address | None = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            problem = address_problem(inner)
            if problem:
                return problem
            if ip.ipv4_mapped:
                return None
    # the first that holds names the problem (is_site_local: IPv6 only)
    for attr, problem in _PROBLEMS:
        if getattr(ip, attr, False):
            return problem
    return None if ip.is_global else "not a public address"


@dataclass(frozen=True)
class _Entry:
    name: str | None = None
    net: Network | None = None
    port: int | None = None

    def allows_port(self, port: int) -> bool:
        return self.port is None or self.port == port


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in {ALLOW_SETTING} entry {entry!r}")
    return int(text)


def _net(text: str) -> Network | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _parse_entry(raw: str) -> _Entry:
    entry = raw.strip()
    if not entry:
        raise ValueError(f"empty {ALLOW_SETTING} entry")
    port: int | None = None
    if entry.startswith("["):  # [v6], [v6]:port, [v6/len], [v6]/len, [v6]/len:port
        close = entry.find("]")
        if close < 0:
            raise ValueError(f"unclosed [ in {ALLOW_SETTING} entry {raw!r}")
        host, rest = entry[1:close], entry[close + 1:]
        if rest.startswith("/"):
            length, _, p = rest[1:].partition(":")
            host, rest = f"{host}/{length}", (f":{p}" if p else "")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad {ALLOW_SETTING} entry {raw!r}")
            port = _port(rest[1:], raw)
        net = _net(host)
        if net is None or net.version != 6:
            raise ValueError(f"bad IPv6 address in {ALLOW_SETTING} entry {raw!r}")
        return _Entry(net=net, port=port)
    net = _net(entry)
    if net is not None:  # an address or network, IPv4 or unbracketed IPv6, no port
        return _Entry(net=net)
    if entry.count(":") == 1:
        entry, p = entry.split(":")
        port = _port(p, raw)
        net = _net(entry)
        if net is not None:
            return _Entry(net=net, port=port)
    name = entry.lower().rstrip(".")
    if not name or any(c in name for c in "/:[]@ \t") or len(name) > 253:
        raise ValueError(f"bad {ALLOW_SETTING} entry {raw!r} (a host name, address or CIDR network, "
                         "optionally with :port)")
    return _Entry(name=name, port=port)


def parse_allowed_hosts(entries: Iterable[str]) -> tuple[_Entry, ...]:
    """Parse allow-list entries; a malformed one raises ValueError."""
    return tuple(_parse_entry(e) for e in entries)


class Refused(Exception):
    """A destination the proxy will not connect to: `status` 403 (the policy)
    or 502 (does not resolve, does not answer)."""

    def __init__(self, host: str, port: int, reason: str, status: int = 403) -> None:
        super().__init__(reason)
        self.host, self.port, self.reason, self.status = host, port, reason, status


class EgressPolicy:
    """Which (host, port) the browser may connect to; `resolve` is
    `socket.getaddrinfo` (a parameter only so the policy is plain code)."""

    def __init__(self, allowed_hosts: Iterable[str] = (), *, ports: Iterable[int] = DEFAULT_PORTS,
                 resolve: Callable[..., list] = socket.getaddrinfo) -> None:
        self.entries = parse_allowed_hosts(allowed_hosts)
        self.ports = frozenset(ports)
        self._resolve = resolve

    def check(self, host: str, port: int) -> list[tuple[int, tuple]]:
        """The (family, sockaddr) pairs to connect to, every resolved address
        checked; raises Refused with the reason."""
        name = host.lower().rstrip(".")
        by_name = any(e.name == name and e.allows_port(port) for e in self.entries)
        try:
            infos = self._resolve(host, port, 0, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise Refused(host, port, f"{host} does not resolve ({getattr(exc, 'strerror', None) or exc})",
                          502) from None
        out: list[tuple[int, tuple]] = []
        for family, _type, _proto, _canon, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            addr = sockaddr[0].split("%", 1)[0]
            if not by_name:
                self._check_address(host, addr, port)
            if (family, sockaddr) not in out:
                out.append((family, sockaddr))
        if not out:
            raise Refused(host, port, f"{host} does not resolve to an IP address", 502)
        return out

    def _check_address(self, host: str, addr: str, port: int) -> None:
        ip = ipaddress.ip_address(addr)
        if any(e.net is not None and e.allows_port(port) and _in(ip, e.net) for e in self.entries):
            return
        problem = address_problem(ip)
        if problem:
            where = f"{addr} is {problem}" if _is_literal(host, ip) else f"{host} resolves to {addr}, {problem}"
            raise Refused(host, port, f"{where} (allow it with {ALLOW_SETTING})")
        if port not in self.ports:
            shown = f"[{host}]" if ":" in host else host
            raise Refused(host, port, f"port {port} is not allowed (only {' and '.join(map(str, sorted(self.ports)))}; "
                                      f"allow {shown}:{port} with {ALLOW_SETTING})")


def _in(ip: Address, net: Network) -> bool:
    if ip.version == 6 and ip.ipv4_mapped is not None and net.version == 4:
        ip = ip.ipv4_mapped
    return ip.version == net.version and ip in net


def _is_literal(host: str, ip: Address) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")) == ip
    except ValueError:
        return False
