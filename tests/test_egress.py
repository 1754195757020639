"""The browser's egress guard: the policy as plain code, the filtering proxy
with real sockets and real local HTTP servers, and the real headless Chromium
sending every connection (loopback ones too) through it."""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from adapters.agents.egress import (
    MARK_HEADER, EgressPolicy, EgressProxy, Refused, address_problem, parse_allowed_hosts)
from adapters.agents.tools import ScreenshotError, Toolbox, take_screenshot
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tests.fixtures.services import free_port, need, port_open, wait_until

HINT = "(allow it with COURIER_BROWSER_ALLOWED_HOSTS)"
BIG = 5 * 1024 * 1024


# -- the policy -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("addr, problem", [
    ("127.0.0.1", "a loopback address"),
    ("127.0.0.2", "a loopback address"),
    ("::1", "a loopback address"),
    ("10.1.2.3", "a private address"),
    ("172.16.0.1", "a private address"),
    ("192.168.1.1", "a private address"),
    ("fd00::1", "a private address"),
    ("169.254.169.254", "a link-local address"),
    ("fe80::1", "a link-local address"),
    ("::ffff:127.0.0.1", "a loopback address"),
    ("::ffff:169.254.169.254", "a link-local address"),
    ("2002:7f00:1::", "a loopback address"),  # 6to4 wrapping 127.0.0.1
    ("64:ff9b::a9fe:a9fe", "a link-local address"),  # NAT64 wrapping 169.254.169.254
    ("0.0.0.0", "an unspecified address"),
    ("::", "an unspecified address"),
    ("224.0.0.1", "a multicast address"),
    ("ff02::1", "a multicast address"),
    ("100.64.0.1", "not a public address"),  # carrier-grade NAT
    ("240.0.0.1", "a private address"),
    ("fec0::1", "a site-local address"),
    ("8.8.8.8", None),
    ("::ffff:8.8.8.8", None),
    ("2606:4700:4700::1111", None),
])
def test_address_problem(addr, problem):
    assert address_problem(addr) == problem


@pytest.mark.parametrize("allowed, host, port, ok", [
    ((), "127.0.0.1", 80, False),
    ((), "::1", 443, False),
    ((), "10.1.2.3", 80, False),
    ((), "169.254.169.254", 80, False),
    ((), "::ffff:127.0.0.1", 80, False),
    ((), "fe80::1", 80, False),
    ((), "0.0.0.0", 80, False),
    ((), "224.0.0.1", 80, False),
    ((), "8.8.8.8", 80, True),
    ((), "8.8.8.8", 443, True),
    ((), "8.8.8.8", 22, False),  # only 80 and 443 by default
    ((), "localhost", 80, False),
    (("localhost",), "localhost", 8080, True),  # by name, every port
    (("LOCALHOST.",), "localhost", 80, True),
    (("localhost",), "127.0.0.1", 80, False),  # a name matches the name, not its addresses
    (("10.0.0.0/8",), "10.1.2.3", 9000, True),  # by CIDR, every port
    (("10.0.0.0/8",), "11.1.2.3", 9000, False),
    (("10.0.0.0/8",), "192.168.0.1", 80, False),
    (("10.0.0.0/8:8080",), "10.1.2.3", 8080, True),  # host:port
    (("10.0.0.0/8:8080",), "10.1.2.3", 8081, False),
    (("127.0.0.1",), "127.0.0.1", 5000, True),
    (("127.0.0.1",), "127.0.0.2", 5000, False),
    (("127.0.0.1",), "::ffff:127.0.0.1", 5000, True),
    (("127.0.0.1:5000",), "127.0.0.1", 5000, True),
    (("127.0.0.1:5000",), "127.0.0.1", 5001, False),
    (("localhost:3000",), "localhost", 3000, True),
    (("localhost:3000",), "localhost", 3001, False),
    (("[::1]:8080",), "::1", 8080, True),
    (("[::1]:8080",), "::1", 8081, False),
    (("fd00::/8",), "fd12::5", 80, True),
    (("[fd00::]/8:443",), "fd12::5", 443, True),
    (("8.8.8.8:22",), "8.8.8.8", 22, True),  # an explicit port opens it for a public host too
])
def test_policy(allowed, host, port, ok):
    policy = EgressPolicy(allowed)
    if ok:
        addrs = policy.check(host, port)
        assert addrs and all(sockaddr[1] == port for _, sockaddr in addrs)
    else:
        with pytest.raises(Refused) as exc:
            policy.check(host, port)
        assert exc.value.status == 403 and exc.value.host == host


def test_refusal_reasons_name_the_address_and_the_setting():
    p = EgressPolicy()
    with pytest.raises(Refused, match=r"^127\.0\.0\.1 is a loopback address \(allow it with "
                                      r"COURIER_BROWSER_ALLOWED_HOSTS\)$"):
        p.check("127.0.0.1", 80)
    with pytest.raises(Refused, match=r"^localhost resolves to 127\.0\.0\.1, a loopback address"):
        p.check("localhost", 80)
    with pytest.raises(Refused, match=r"^port 8443 is not allowed \(only 80 and 443; allow 8\.8\.8\.8:8443"):
        p.check("8.8.8.8", 8443)
    with pytest.raises(Refused) as exc:
        p.check("nothing.invalid", 80)
    assert exc.value.status == 502 and "does not resolve" in exc.value.reason


def test_every_resolved_address_is_checked():
    """A name with one public and one private answer is refused (no DNS
    server here: the resolver is the policy's one parameter)."""
    def resolve(host, port, *_):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("8.8.8.8", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    with pytest.raises(Refused, match=r"^mixed\.example resolves to 10\.0\.0\.7, a private address"):
        EgressPolicy(resolve=resolve).check("mixed.example", 443)
    assert EgressPolicy(["10.0.0.0/8"], resolve=resolve).check("mixed.example", 443) == [
        (socket.AF_INET, ("8.8.8.8", 443)), (socket.AF_INET, ("10.0.0.7", 443))]


@pytest.mark.parametrize("bad", ["", "a b", "10.0.0.0/8:x", "host:0", "host:70000", "[::1", "[zz]:80", "::1]:80",
                                 "http://x/"])
def test_malformed_allow_list_entries(bad):
    with pytest.raises(ValueError):
        parse_allowed_hosts([bad])


def test_the_setting(monkeypatch):
    from pydantic import ValidationError

    from workers.settings import Settings

    monkeypatch.setenv("COURIER_BROWSER_ALLOWED_HOSTS", '["dash.intranet", "10.1.0.0/16:8080", "[::1]:3000"]')
    assert Settings().browser_allowed_hosts == ["dash.intranet", "10.1.0.0/16:8080", "[::1]:3000"]
    monkeypatch.setenv("COURIER_BROWSER_ALLOWED_HOSTS", "")  # empty: not set, nothing allowed
    assert not Settings().browser_allowed_hosts
    monkeypatch.setenv("COURIER_BROWSER_ALLOWED_HOSTS", '["10.0.0.0/8:port"]')
    with pytest.raises(ValidationError, match="bad port"):
        Settings()


# -- the proxy, with real local servers ---------------------------------------------------------------------------
class _Origin(BaseHTTPRequestHandler):
    """Records what reaches it; keeps connections open whatever the client
    asks, so a request the proxy wrongly forwarded on a reused upstream
    connection would be served and seen."""

    protocol_version = "HTTP/1.1"

    def _record(self) -> None:
        self.server.hits.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path == "/big":
            block = bytes(range(256)) * 256  # 64 KiB
            self.send_response(200)
            self.send_header("Content-Length", str(BIG))
            self.end_headers()
            for _ in range(BIG // len(block)):
                self.wfile.write(block)
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path.startswith("/img"):
            self._send(200, _PNG, "image/png")
        else:
            self._send(200, self.server.page.encode(), "text/html; charset=utf-8")
        self.close_connection = False

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        h = hashlib.sha256()
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                h.update(self.rfile.read(size))
                self.rfile.readline()
        else:
            left = int(self.headers["Content-Length"])
            while left:
                data = self.rfile.read(min(65536, left))
                h.update(data)
                left -= len(data)
        self._send(200, h.hexdigest().encode(), "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        return None


# a 1x1 PNG
_PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                     "1f15c4890000000d4944415478da63f8cf00000301010018dd8db00000000049454e44ae426082")


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


@pytest.fixture
def origins():
    """Start origin servers on demand: origins("127.0.0.1"), origins("127.0.0.2"), origins("::1")."""
    started: list[ThreadingHTTPServer] = []

    def start(host: str = "127.0.0.1", page: str = "<html><body>hello</body></html>") -> ThreadingHTTPServer:
        srv = (_V6Server if ":" in host else ThreadingHTTPServer)((host, 0), _Origin)
        srv.daemon_threads = True
        srv.hits, srv.page, srv.redirect_to = [], page, ""
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def proxy_for():
    started: list[EgressProxy] = []

    def start(*allowed: str, **kw) -> EgressProxy:
        p = EgressProxy(EgressPolicy(allowed), **kw).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def _raw(proxy: EgressProxy, data: bytes) -> bytes:
    """Send `data` to the proxy; everything it answers, up to its close."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(data)
        out = bytearray()
        while chunk := s.recv(65536):
            out += chunk
        return bytes(out)


def test_refused_connect_gets_403_and_nothing_is_reached(origins, proxy_for):
    origin = origins()
    port = origin.server_address[1]
    proxy = proxy_for()
    reply = _raw(proxy, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 ")
    assert body.decode() == f"127.0.0.1 is a loopback address {HINT}\n"
    assert [(r.host, r.port, r.status) for r in proxy.refusals] == [("127.0.0.1", port, 403)]
    assert origin.hits == []


def test_refused_plain_get_gets_403_with_the_mark(origins, proxy_for):
    origin = origins()
    port = origin.server_address[1]
    proxy = proxy_for()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", f"http://127.0.0.1:{port}/secret?token=abc")
    resp = conn.getresponse()
    assert resp.status == 403
    assert resp.read().decode() == f"127.0.0.1 is a loopback address {HINT}\n"
    assert proxy.refusal_marked({MARK_HEADER.lower(): resp.getheader(MARK_HEADER)}) == proxy.refusals[0]
    assert proxy.refusal_marked({MARK_HEADER.lower(): "forged 0"}) is None
    conn.close()
    assert origin.hits == []


def test_refusals_are_logged_with_the_host_and_never_the_url(origins, proxy_for, caplog):
    port = origins().server_address[1]
    proxy = proxy_for()
    with caplog.at_level("INFO", logger="adapters.agents.egress"):
        reply = _raw(proxy, f"GET http://10.9.8.7:{port}/x?token=s3cr3t HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 403 ")
    assert f"refused 10.9.8.7:{port}" in caplog.text and "s3cr3t" not in caplog.text


def test_unresolvable_host_gets_502(proxy_for):
    proxy = proxy_for()
    reply = _raw(proxy, b"CONNECT nothing.invalid:443 HTTP/1.1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 502 ") and b"nothing.invalid does not resolve" in reply
    assert proxy.refusals[0].status == 502


@pytest.mark.parametrize("request_line", [
    b"GET /relative HTTP/1.1", b"GET ftp://example.com/ HTTP/1.1", b"CONNECT example.com HTTP/1.1", b"garbage",
])
def test_malformed_requests_get_400(proxy_for, request_line):
    reply = _raw(proxy_for(), request_line + b"\r\nHost: example.com\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")


def _read_stream(resp, h) -> int:
    n = 0
    while chunk := resp.read(65536):
        h.update(chunk)
        n += len(chunk)
    return n


def _expected_big() -> str:
    h, block = hashlib.sha256(), bytes(range(256)) * 256
    for _ in range(BIG // len(block)):
        h.update(block)
    return h.hexdigest()


def test_allowed_connect_tunnels_5_mb_intact(origins, proxy_for):
    origin = origins()
    port = origin.server_address[1]
    proxy = proxy_for("127.0.0.1")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.set_tunnel("127.0.0.1", port)
    conn.request("GET", "/big")
    resp = conn.getresponse()
    h = hashlib.sha256()
    assert resp.status == 200 and _read_stream(resp, h) == BIG and h.hexdigest() == _expected_big()
    # the tunnel is a plain pipe: a second request on it reaches the same origin
    conn.request("GET", "/again")
    assert conn.getresponse().read() == b"<html><body>hello</body></html>"
    conn.close()
    assert [x["path"] for x in origin.hits] == ["/big", "/again"] and proxy.refusals == []


def test_allowed_plain_http_streams_both_ways(origins, proxy_for):
    origin = origins()
    port = origin.server_address[1]
    proxy = proxy_for("127.0.0.1")
    expected_big, block = _expected_big(), os.urandom(65536)
    h = hashlib.sha256()
    for _ in range(BIG // len(block)):
        h.update(block)
    expected_upload = h.hexdigest()
    tracemalloc.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        conn.request("GET", f"http://127.0.0.1:{port}/big",
                     headers={"Proxy-Authorization": "Basic eDp5", "Proxy-Connection": "keep-alive",
                              "Keep-Alive": "timeout=5", "X-Kept": "yes", "Connection": "keep-alive, X-Dropped",
                              "X-Dropped": "1"})
        resp = conn.getresponse()
        h = hashlib.sha256()
        assert resp.status == 200 and _read_stream(resp, h) == BIG and h.hexdigest() == expected_big
        assert resp.getheader("Connection") == "close"
        conn.close()
        # request bodies stream too: Content-Length and chunked
        for chunked in (False, True):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
            body = (block for _ in range(BIG // len(block)))
            headers = {} if chunked else {"Content-Length": str(BIG)}
            conn.request("POST", f"http://127.0.0.1:{port}/upload", body=body, headers=headers,
                         encode_chunked=chunked)
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.read().decode() == expected_upload
            conn.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BIG // 2, f"{peak:,} bytes at the peak: a body was buffered whole"
    got = origin.hits[0]
    assert got["path"] == "/big"  # origin-form
    headers = {k.lower(): v for k, v in got["headers"].items()}
    assert headers["host"] == f"127.0.0.1:{port}" and headers["connection"] == "close" and headers["x-kept"] == "yes"
    assert not {"proxy-authorization", "proxy-connection", "keep-alive", "x-dropped"} & set(headers)
    assert [x["headers"].get("Transfer-Encoding") for x in origin.hits[1:]] == [None, "chunked"]


def test_a_second_request_on_one_client_connection_never_reaches_the_first_origin(origins, proxy_for):
    first, second = origins("127.0.0.1"), origins("127.0.0.2")
    proxy = proxy_for("127.0.0.0/8")
    one = f"GET http://127.0.0.1:{first.server_address[1]}/one HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"
    two = f"GET http://127.0.0.2:{second.server_address[1]}/two HTTP/1.1\r\nHost: y\r\n\r\n"
    # pipelined in one write (the worst case), and again with the second sent after the first answer
    reply = _raw(proxy, (one + two).encode())
    assert reply.count(b"HTTP/1.1 200 ") == 1 and reply.endswith(b"hello</body></html>")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(one.encode())
        got = bytearray()
        while not got.endswith(b"</html>"):
            chunk = s.recv(65536)
            assert chunk
            got += chunk
        try:
            s.sendall(two.encode())
        except OSError:
            pass  # already closed by the proxy
        assert s.recv(65536) == b""  # closed after one request
    assert [x["path"] for x in first.hits] == ["/one", "/one"]
    assert second.hits == []


def test_stop_closes_the_listener_and_open_tunnels(origins, proxy_for):
    port = origins().server_address[1]
    proxy = proxy_for("127.0.0.1")
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert s.recv(1024).startswith(b"HTTP/1.1 200 Connection established")
    proxy.stop()
    assert s.recv(1024) == b""
    s.close()
    wait_until(lambda: not port_open(proxy.port), timeout_s=5, what="the proxy's port to close")


# -- the real Chromium ---------------------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def chromium():
    need(os.access(CHROMIUM, os.X_OK), "chromium is not installed (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        need(False, "the playwright package is not installed (pip install playwright)")
    return CHROMIUM


def _toolbox(tmp_path, *allowed: str) -> Toolbox:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return Toolbox(sandbox=LocalSandbox.with_roots((str(tmp_path),)), workdir=str(work),
                   store=VolumeStore(tmp_path / "store"), job_id="job_egress", chromium_path=CHROMIUM,
                   browser_allowed_hosts=allowed)


@pytest.mark.parametrize("kind", ["http", "https", "localhost", "ipv6", "metadata"])
def test_screenshot_of_a_loopback_page_is_refused(tmp_path, chromium, origins, kind):
    """Without the allow-list nothing on loopback (nor link-local) is reached:
    Chromium sends even loopback URLs through the proxy (`<-loopback>`),
    which refuses them; the model gets the reason and nothing is stored."""
    v4, v6 = origins("127.0.0.1"), origins("::1")
    p4, p6 = v4.server_address[1], v6.server_address[1]
    url, reason = {
        "http": (f"http://127.0.0.1:{p4}/page.html", f"127.0.0.1 is a loopback address {HINT}"),
        "https": (f"https://127.0.0.1:{p4}/", f"127.0.0.1 is a loopback address {HINT}"),
        "localhost": (f"http://localhost:{p4}/", None),
        "ipv6": (f"http://[::1]:{p6}/", f"::1 is a loopback address {HINT}"),
        "metadata": ("http://169.254.169.254/latest/meta-data/", f"169.254.169.254 is a link-local address {HINT}"),
    }[kind]
    tools = _toolbox(tmp_path)
    res = tools.call("browser_screenshot", {"url": url})
    assert not res.ok
    if reason is None:  # localhost resolves to 127.0.0.1 and maybe ::1
        assert res.text.startswith(f"error: screenshot of {url} refused: localhost resolves to ")
        assert res.text.endswith(f", a loopback address {HINT}")
    else:
        assert res.text == f"error: screenshot of {url} refused: {reason}"
    assert v4.hits == [] and v6.hits == []
    assert tools.marked == [] and tools.stored == {}
    assert not (tmp_path / "store" / "screenshots").exists() or not any((tmp_path / "store" / "screenshots").rglob("*"))
    assert not (tmp_path / "work" / "screenshots").exists()


def test_refused_subresource_does_not_load_and_the_screenshot_succeeds(tmp_path, chromium, origins):
    denied = origins("127.0.0.2")
    dport = denied.server_address[1]
    page = origins("127.0.0.1", page=(
        "<html><body style='background:#1e6fd9'><h1>allowed page</h1>"
        f"<img src='http://127.0.0.2:{dport}/img.png'><img src='/img-ok.png'></body></html>"))
    url = f"http://127.0.0.1:{page.server_address[1]}/page.html"
    refused: list = []
    png = take_screenshot(url, chromium_path=chromium, allowed_hosts=("127.0.0.1",), refused=refused, timeout_s=30)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    paths = [x["path"] for x in page.hits]
    assert "/page.html" in paths and "/img-ok.png" in paths
    assert denied.hits == []
    mine = [r for r in refused if r.status == 403]
    assert {(r.host, r.port) for r in mine} == {("127.0.0.2", dport)}
    assert mine[0].reason == f"127.0.0.2 is a loopback address {HINT}"
    # through the tool: stored, and the model is told what was blocked
    tools = _toolbox(tmp_path, "127.0.0.1")
    res = tools.call("browser_screenshot", {"url": url})
    assert res.ok and res.text.startswith("MEDIA:") and f"blocked (not public): 127.0.0.2:{dport}" in res.text
    assert len(tools.stored) == 1 and denied.hits == []


def test_redirect_to_a_denied_origin_is_refused(tmp_path, chromium, origins):
    """A navigation redirect (which page.route would not see) goes through the
    proxy like everything else."""
    denied = origins("127.0.0.2")
    start = origins("127.0.0.1")
    start.redirect_to = f"http://127.0.0.2:{denied.server_address[1]}/landing?token=abc"
    url = f"http://127.0.0.1:{start.server_address[1]}/redirect"
    with pytest.raises(ScreenshotError) as exc:
        take_screenshot(url, chromium_path=chromium, allowed_hosts=("127.0.0.1",), timeout_s=30)
    assert exc.value.reason == f"screenshot of {url} refused: 127.0.0.2 is a loopback address {HINT}"
    assert [x["path"] for x in start.hits][:1] == ["/redirect"] and denied.hits == []


def test_https_port_refusal_maps_to_the_reason(chromium):
    """A CONNECT refused by port (no connection attempted) fails the page load;
    the error names the port, not net::ERR_TUNNEL_CONNECTION_FAILED."""
    url = f"https://8.8.8.8:{free_port()}/"
    with pytest.raises(ScreenshotError) as exc:
        take_screenshot(url, chromium_path=chromium, timeout_s=30)
    assert exc.value.reason.startswith(f"screenshot of {url} refused: port ")
    assert "not allowed (only 80 and 443" in exc.value.reason


def test_settings_reach_the_toolbox(tmp_path):
    """settings -> wiring's agent tools -> tasks/turn/turn.py's Toolbox (the worker
    test in test_openai_runtime.py screenshots an allow-listed 127.0.0.1 page)."""
    from workers.settings import Settings
    from workers.wiring import agent_tools

    s = Settings(browser_allowed_hosts=["127.0.0.1", "dash.intranet:8080"], hook_plugins=False)
    tools = agent_tools(s, VolumeStore(tmp_path / "store"))
    assert tools.browser_allowed_hosts == ("127.0.0.1", "dash.intranet:8080")
