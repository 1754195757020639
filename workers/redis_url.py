"""COURIER_REDIS_URL made into every client courier uses: `redis://[[user]:password@]host:port/db`,
`rediss://...[?ssl_ca_certs=/ca.pem&...]` (TLS: redis-py's options, taken apart for Celery by `celery_ssl`
and `celery_url`), `unix:///path?db=0`, or `sentinel://[:password@]h1:p1,h2:p2/<master>/<db>`.

With Sentinel, every client (the task context's, the web's async one, Celery's through kombu) asks for
the current master again after a failover. courier's own clients decode replies: all they read is text.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from workers.logsafe import url_password

SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
#: the TLS options a rediss:// URL's query may carry
SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}

#: client timeouts: a dead master is noticed in seconds, never hangs a worker
CONNECT_TIMEOUT_S = 3
SOCKET_TIMEOUT_S = 30


@dataclass(frozen=True)
class SentinelUrl:
    hosts: tuple[tuple[str, int], ...]
    master: str
    db: int
    password: str | None


def parse_sentinel(url: str) -> SentinelUrl | None:
    """The parts of a `sentinel://` URL (None for any other scheme); a malformed one is a ValueError."""
    if not url.startswith("sentinel://"):
        return None
    u = urlsplit(url)
    hosts = []
    for part in u.netloc.rpartition("@")[2].split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel URL: {part!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in u.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("sentinel URL must be sentinel://host:port[,host:port]/<master name>[/<db>]")
    return SentinelUrl(tuple(hosts), path[0], int(path[1]) if len(path) == 2 else 0, url_password(url))


def _connect(url: str, mod, timeout_s: float, plain: dict, **options):
    """(a client of `mod`, redis or redis.asyncio, for `url` with `options`, and `plain`'s for one Redis;
    the Sentinel URL's parts or None). `timeout_s`: to connect, and a Sentinel's every call."""
    options.update(socket_connect_timeout=timeout_s, decode_responses=True)
    s = parse_sentinel(url)
    if s is None:
        return mod.Redis.from_url(url, **plain, **options), None
    sentinel = mod.Sentinel(list(s.hosts), socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return sentinel.master_for(s.master, db=s.db, password=s.password, **options), s


def client(url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, socket_timeout_s: float = SOCKET_TIMEOUT_S,
           watch: bool = True):
    """The redis-py client for `url` every courier process and command uses. `watch`: a Sentinel
    client drops its connections the moment a new master is announced (a one-off probe needs none)."""
    import redis

    c, s = _connect(url, redis, connect_timeout_s, {}, socket_timeout=socket_timeout_s,
                    health_check_interval=30)
    if s is not None and watch:
        threading.Thread(target=_watch_switches, args=(s, c.connection_pool), name="courier-sentinel-watch",
                         daemon=True).start()
    return c


def _watch_switches(s: SentinelUrl, pool) -> None:
    """Drops a Sentinel client's connections on `+switch-master`. Without it the client
    keeps writing to the old master until it becomes a replica, and those writes are
    discarded: the ledger would replay, and re-send, everything done in that window."""
    import redis

    while True:
        for host, port in s.hosts:
            with contextlib.suppress(Exception):  # that sentinel is away: try the next one
                conn = redis.Redis(host=host, port=port, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                   socket_timeout=None, decode_responses=True)
                sub = conn.pubsub(ignore_subscribe_messages=True)
                sub.subscribe("+switch-master")
                for msg in sub.listen():
                    if str(msg.get("data")).split(" ", 1)[0] == s.master:
                        pool.disconnect(inuse_connections=True)
        threading.Event().wait(1.0)


def async_client(url: str, *, socket_timeout: float | None = None, single_connection: bool = False):
    """The asyncio twin of `client` (the web process's event streams and webhook turns)."""
    import redis.asyncio

    extra: dict = {}
    if socket_timeout is not None:
        extra["socket_timeout"] = socket_timeout
    if single_connection:
        extra["single_connection_client"] = True
    return _connect(url, redis.asyncio, CONNECT_TIMEOUT_S, {"health_check_interval": 30}, **extra)[0]


def with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo (a username is kept); a ValueError if it has one."""
    u = urlsplit(url)
    userinfo, _, hosts = u.netloc.rpartition("@")
    user, _, own = userinfo.partition(":")
    if own:
        raise ValueError("COURIER_REDIS_URL carries a password and COURIER_REDIS_PASSWORD is set: set one of them")
    return urlunsplit(u._replace(netloc=f"{user}:{quote(password, safe='')}@{hosts}"))


def celery_ssl(url: str) -> dict | None:
    """`broker_use_ssl` / `redis_backend_use_ssl` for a rediss:// URL (None for any other scheme).
    An unknown `ssl_` option or value is a ValueError (a typo must not turn checks off)."""
    if not url.startswith("rediss://"):
        return None
    query = dict(parse_qsl(urlsplit(url).query))
    unknown = sorted(k for k in query if k.startswith("ssl_") and k not in SSL_OPTIONS)
    if unknown:
        raise ValueError(f"COURIER_REDIS_URL: unknown TLS option {', '.join(unknown)} "
                         f"(known: {', '.join(SSL_OPTIONS)})")
    out: dict = {k: query[k] for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if query.get(k)}
    reqs = query.get("ssl_cert_reqs", "required").lower().removeprefix("cert_")
    if reqs not in CERT_REQS:
        raise ValueError(f"COURIER_REDIS_URL: ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
    out["ssl_cert_reqs"] = CERT_REQS[reqs]
    if "ssl_check_hostname" in query:
        out["ssl_check_hostname"] = query["ssl_check_hostname"].strip().lower() in ("1", "true", "yes", "on")
    return out


def celery_url(url: str) -> tuple[str, dict]:
    """Celery's broker / result backend URL for `url` (without a TLS query), and its transport options."""
    if url.startswith("rediss://"):
        u = urlsplit(url)
        kept = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True) if k not in SSL_OPTIONS]
        return urlunsplit(u._replace(query=urlencode(kept))), {}
    s = parse_sentinel(url)
    if s is None:
        return url, {}
    cred = f":{s.password}@" if s.password else ""
    return ";".join(f"sentinel://{cred}{h}:{p}/{s.db}" for h, p in s.hosts), {"master_name": s.master}
