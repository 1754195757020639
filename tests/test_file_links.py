"""Download links for a volume store: signed and expiring, served by the real
web process (`GET /files/<key>`), so a too-large file's notice carries a link
on every deployment, not only on S3."""

from __future__ import annotations

import hashlib
import os
import time

import httpx
import pytest

from storage.links import LinkSigner
from storage.volume import VolumeStore
from tasks.ledger import keys
from tests.fixtures.webstack import web_only
from workers.eventauth import server_key

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with web_only(tmp_path_factory.mktemp("links")) as w:
        yield w


def _store(web) -> VolumeStore:
    # what wiring builds for a worker when COURIER_PUBLIC_URL names the web process
    return VolumeStore(web.env.data_dir / "storage",
                       links=LinkSigner(web.base, lambda: server_key(web.r, keys.files_key())))


def test_a_signed_link_streams_the_blob_and_nothing_else(web):
    store = _store(web)
    data = os.urandom(3 * 1024 * 1024 + 17)
    store.put_bytes("files/job_1/0-big video.mp4", data)
    url = store.signed_url("files/job_1/0-big video.mp4", expires_s=600)
    assert url.startswith(web.base + "/files/files/job_1/0-big%20video.mp4?exp=")
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and hashlib.sha256(r.content).digest() == hashlib.sha256(data).digest()
    assert r.headers["content-type"] == "video/mp4" and "0-big%20video.mp4" in r.headers["content-disposition"]

    signer = store.links
    good_exp, good_sig = url.split("?exp=")[1].split("&sig=")
    other = store.signed_url("files/job_1/other.bin", expires_s=600)
    cases = {
        "tampered": (f"{web.base}/files/files/job_1/0-big%20video.mp4?exp={good_exp}&sig={'0' * 64}", 403),
        "another key's signature": (f"{web.base}/files/files/job_1/0-big%20video.mp4?{other.split('?')[1]}", 403),
        "no signature": (f"{web.base}/files/files/job_1/0-big%20video.mp4", 403),
        "longer life than signed": (f"{web.base}/files/files/job_1/0-big%20video.mp4?exp={int(good_exp) + 1}"
                                    f"&sig={good_sig}", 403),
        "traversal": (f"{web.base}/files/files/%2e%2e/%2e%2e/etc/passwd?exp={good_exp}&sig={good_sig}", 400),
    }
    for what, (u, status) in cases.items():
        r = httpx.get(u, timeout=10)
        assert r.status_code == status and len(r.json()["error"]) < 80, (what, r.status_code, r.text)
    # expired: a genuine signature over a time already past
    past = int(time.time()) - 5
    sig = signer._sig("files/job_1/0-big video.mp4", past)
    expired = f"{web.base}/files/files/job_1/0-big%20video.mp4?exp={past}&sig={sig}"
    r = httpx.get(expired, timeout=10)
    assert r.status_code == 403 and r.json()["error"] == "link expired"
    # a key the janitor removed: 404
    store.delete("files/job_1/0-big video.mp4")
    assert httpx.get(url, timeout=10).status_code == 404


def test_wiring_gives_a_volume_links_only_with_a_public_url(tmp_path, monkeypatch):
    from workers.settings import Settings
    from workers.wiring import store

    monkeypatch.setenv("COURIER_DATA_DIR", str(tmp_path))
    assert store(Settings()).signed_url("files/x/0-a.bin") is None
    monkeypatch.setenv("COURIER_PUBLIC_URL", "https://bot.example.com/")
    st = store(Settings())
    assert st.can_sign and st.links.base_url == "https://bot.example.com"
