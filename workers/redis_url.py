"""COURIER_REDIS_URL, plain or Sentinel-managed, for every client courier makes.

    redis://[[user]:password@]host:port/db      one Redis
    rediss://...[?ssl_ca_certs=/ca.pem&...]     TLS (below), unix:///path?db=0 a socket
    sentinel://[:password@]h1:p1,h2:p2/<master>/<db>
                                                the master Sentinel names (high availability)

TLS: a `rediss://` URL's query names its options, as redis-py names them:
`ssl_ca_certs` (the CA bundle; default the system's), `ssl_certfile` and
`ssl_keyfile` (a client certificate), `ssl_cert_reqs` (`required`, the
default; `optional`, `none`) and `ssl_check_hostname` (default true while
certificates are checked). redis-py reads them from the URL itself (courier's
own clients); Celery's broker, result backend and Flower take them as
`broker_use_ssl` / `redis_backend_use_ssl` (`celery_ssl`), from a URL without
them (`celery_url`).

A password may also come apart from the URL (COURIER_REDIS_PASSWORD, from a
secret file): `with_password` puts it in, for every kind of URL.

With Sentinel, every client asks the sentinels for the current master and
asks again after a failover: the task context's client (redis-py's
`Sentinel.master_for`), the web process's async client, and Celery's broker
and result backend (kombu's `sentinel://` transport with `master_name`).

courier's own clients (`client`, `async_client`) decode replies (UTF-8): what
they read is `str`, never `bytes`. Every value courier stores is text: ids,
states, JSON (receipts' specs, events, job records), stream ids, decimal
times (due times, leases, the rate-limit windows of the `limits` library,
which shares the client's pool), hex keys (eventauth); and what it reads of
Celery's keys is text too (a queue's messages: kombu's JSON envelope, the
body base64). No binary value, so no second, undecoded client. Celery's
own clients are kombu's (`celery_url`) and stay as kombu makes them.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

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
    netloc = u.netloc
    password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        password = unquote(cred.split(":", 1)[1] if ":" in cred else cred) or None
    hosts = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel URL: {part!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in u.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("sentinel URL must be sentinel://host:port[,host:port]/<master name>[/<db>]")
    return SentinelUrl(tuple(hosts), path[0], int(path[1]) if len(path) == 2 else 0, password)


def client(url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, socket_timeout_s: float = SOCKET_TIMEOUT_S,
           watch: bool = True):
    """A redis-py client for `url`: plain, TLS (`rediss://`) or the current master of a
    `sentinel://` URL — the one factory every courier process and command uses. `watch`: a
    Sentinel client drops its connections the moment a new master is announced (a long-lived
    client's; a one-off probe needs none)."""
    import redis

    s = parse_sentinel(url)
    if s is None:
        return redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                                    health_check_interval=30, decode_responses=True)
    from redis.sentinel import Sentinel

    sentinel = Sentinel(list(s.hosts), socket_timeout=connect_timeout_s, socket_connect_timeout=connect_timeout_s)
    c = sentinel.master_for(s.master, db=s.db, password=s.password, socket_connect_timeout=connect_timeout_s,
                            socket_timeout=socket_timeout_s, health_check_interval=30, decode_responses=True)
    if watch:
        _SwitchWatcher(s, c.connection_pool).start()
    return c


class _SwitchWatcher(threading.Thread):
    """Drops a Sentinel-managed client's connections the moment a sentinel
    announces a new master (`+switch-master`). Without it the client keeps
    writing to the old master until it is turned into a replica (~10 s
    later), and those writes are discarded with its history: the ledger
    would replay, and re-send, everything done in that window."""

    def __init__(self, s: SentinelUrl, pool) -> None:
        super().__init__(name="courier-sentinel-watch", daemon=True)
        self.s, self.pool = s, pool

    def run(self) -> None:
        import redis

        while True:
            for host, port in self.s.hosts:
                try:
                    conn = redis.Redis(host=host, port=port, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                       socket_timeout=None, decode_responses=True)
                    sub = conn.pubsub(ignore_subscribe_messages=True)
                    sub.subscribe("+switch-master")
                    for msg in sub.listen():
                        data = msg.get("data")
                        name = str(data).split(" ", 1)[0]
                        if name == self.s.master:
                            self.pool.disconnect(inuse_connections=True)
                except Exception:  # noqa: BLE001 - that sentinel is away: try the next one
                    pass
            threading.Event().wait(1.0)


def async_client(url: str, *, socket_timeout: float | None = None, single_connection: bool = False):
    """The asyncio twin of `client` (the web process's event streams; its webhook turns,
    with `socket_timeout` as the sync client's, on one connection: one call at a time)."""
    import redis.asyncio

    extra: dict = {"decode_responses": True}
    if socket_timeout is not None:
        extra["socket_timeout"] = socket_timeout
    if single_connection:
        extra["single_connection_client"] = True
    s = parse_sentinel(url)
    if s is None:
        return redis.asyncio.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30,
                                            **extra)
    from redis.asyncio.sentinel import Sentinel

    sentinel = Sentinel(list(s.hosts), socket_timeout=CONNECT_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S)
    return sentinel.master_for(s.master, db=s.db, password=s.password, socket_connect_timeout=CONNECT_TIMEOUT_S,
                               **extra)


def with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo (quoted; a username is kept). A URL that
    carries a password already is a ValueError: which one would be meant?"""
    u = urlsplit(url)
    userinfo, at, hosts = u.netloc.rpartition("@")
    user, colon, own = userinfo.partition(":")
    if own:
        raise ValueError("COURIER_REDIS_URL carries a password and COURIER_REDIS_PASSWORD is set: set one of them")
    return urlunsplit(u._replace(netloc=f"{user}:{quote(password, safe='')}@{hosts}"))


def celery_ssl(url: str) -> dict | None:
    """`broker_use_ssl` / `redis_backend_use_ssl` for a rediss:// URL (None for any other
    scheme): its query's TLS options, certificates required unless it says otherwise.
    An unknown `ssl_` option or value is a ValueError (a typo must not turn checks off)."""
    if not url.startswith("rediss://"):
        return None
    query = dict(parse_qsl(urlsplit(url).query))
    unknown = sorted(k for k in query if k.startswith("ssl_") and k not in SSL_OPTIONS)
    if unknown:
        raise ValueError(f"COURIER_REDIS_URL: unknown TLS option {', '.join(unknown)} "
                         f"(known: {', '.join(SSL_OPTIONS)})")
    out: dict = {k: query[k] for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if query.get(k)}
    reqs = query.get("ssl_cert_reqs", "required")
    reqs = reqs[len("CERT_"):].lower() if reqs.upper().startswith("CERT_") else reqs.lower()
    if reqs not in CERT_REQS:
        raise ValueError(f"COURIER_REDIS_URL: ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
    out["ssl_cert_reqs"] = CERT_REQS[reqs]
    if "ssl_check_hostname" in query:
        out["ssl_check_hostname"] = query["ssl_check_hostname"].strip().lower() in ("1", "true", "yes", "on")
    return out


def _without_ssl_query(url: str) -> str:
    u = urlsplit(url)
    kept = [(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True) if k not in SSL_OPTIONS]
    return urlunsplit(u._replace(query=urlencode(kept)))


def celery_url(url: str) -> tuple[str, dict]:
    """Celery's broker / result backend URL for `url`, and the transport options it needs
    (a rediss:// URL loses its TLS query: Celery gets it as `celery_ssl`)."""
    s = parse_sentinel(url)
    if s is None:
        return (_without_ssl_query(url) if url.startswith("rediss://") else url), {}
    cred = f":{s.password}@" if s.password else ""
    return ";".join(f"sentinel://{cred}{h}:{p}/{s.db}" for h, p in s.hosts), {"master_name": s.master}
