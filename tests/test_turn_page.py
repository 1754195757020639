"""A turn's live page (`GET /turns/{id}` on the web process, workers/turnpage.py)
in headless Chromium (Debian's /usr/bin/chromium driven by playwright's
Python package; no browser is downloaded), against a real turn: the demo
agent through a real worker, the web process served by uvicorn, real Redis.
The page is opened while the turn is still queued; the phases, the tool
activity and the delivered chart's thumbnail appear on it as they happen."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from tests.fixtures.services import need, stop_process, wait_until
from tests.fixtures.webstack import _web

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = os.environ.get("COURIER_CHROMIUM_PATH", "/usr/bin/chromium")


@pytest.fixture
def browser():
    need(os.access(CHROMIUM, os.X_OK), f"no Chromium at {CHROMIUM} (scripts/setup installs it)")
    from playwright.sync_api import sync_playwright

    from adapters.agents.tools import CHROMIUM_ARGS

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS))
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def web(courier_env, tmp_path):
    env = courier_env()
    proc, base, log = _web(env.env, tmp_path, "web")
    try:
        wait_until(lambda: proc.poll() is None and httpx.get(base + "/healthz", timeout=1).status_code == 200,
                   timeout_s=30, what="the web process")
        yield env, base
    finally:
        stop_process(proc)
        log.close()


# the page's state, read in the browser: what a person sees
STATE_JS = """() => ({
  phase: document.getElementById('phase').textContent,
  phases: [...document.querySelectorAll('#phases li')].map(li => li.dataset.status),
  tools: [...document.querySelectorAll('#tools li')].map(li => li.textContent),
  rows: [...document.querySelectorAll('#deliveries tr')].map(tr => ({
    id: tr.dataset.delivery, state: tr.dataset.state, name: tr.querySelector('.name').textContent,
    kind: tr.querySelector('.kind').textContent,
    thumb: (img => img ? {w: img.naturalWidth, h: img.naturalHeight, done: img.complete} : null)(
      tr.querySelector('img.thumb'))})),
})"""


def test_the_page_shows_a_real_turns_phases_and_thumbnail_as_they_happen(web, browser):
    env, base = web
    res = env.cli("turn", "outbox:page", "make a chart of x^2", "--agent", "demo", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    job, token = got["job"], got["events_token"]
    # the token is needed, and must be this job's
    assert httpx.get(f"{base}/turns/{job}", timeout=10).status_code == 401
    assert httpx.get(f"{base}/turns/{job}?token={'0' * 32}", timeout=10).status_code == 403
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
            if r.status >= 400 and not r.url.endswith("/favicon.ico") else None)
    resp = page.goto(f"{base}/turns/{job}?token={token}", wait_until="load")
    assert resp.status == 200 and "script-src 'nonce-" in resp.headers["content-security-policy"]
    page.wait_for_function("() => document.getElementById('phase').textContent === 'queued'")
    before = page.evaluate(STATE_JS)
    assert before["phases"] == [] and before["rows"] == []  # nothing has happened yet: no worker
    # record every phase the page shows, in order, as it changes
    page.evaluate("""() => { window.seen = [];
      new MutationObserver(() => window.seen.push(document.getElementById('phase').textContent))
        .observe(document.getElementById('phase'), {childList: true, characterData: true, subtree: true}); }""")

    env.start_worker()
    page.wait_for_function("() => document.querySelector('#phases li[data-status=completed]') !== null", timeout=120_000)
    page.wait_for_function("""() => [...document.querySelectorAll('#deliveries tr')].length === 3 &&
        [...document.querySelectorAll('#deliveries tr')].every(tr => tr.dataset.state === 'delivered')""",
                           timeout=120_000)
    page.wait_for_function("() => { const i = document.querySelector('img.thumb'); "
                           "return i && i.complete && i.naturalWidth > 0; }", timeout=60_000)
    now = page.evaluate(STATE_JS)
    seen = page.evaluate("() => window.seen")
    # the phases, live, in order (the page was loaded before any of them)
    assert now["phases"][:2] == ["started", "thinking"] and now["phases"][-1] == "completed", now["phases"]
    assert list(dict.fromkeys(p for p in seen if p in ("started", "thinking", "completed"))) == [
        "started", "thinking", "completed"], seen
    assert len(now["tools"]) == 2 and all("✓" in t and "writing" in t for t in now["tools"]), now["tools"]
    # workspace-relative paths, never the worker host's (the demo agent writes into <data dir>/sandbox/...)
    assert [t.split(" ✓")[0] for t in now["tools"]] == ["writing chart.png", "writing report.csv"], now["tools"]
    assert str(env.data_dir) not in page.inner_text("body")
    rows = {r["name"]: r for r in now["rows"] if r["name"]}
    chart = rows["chart.png"]
    assert chart["kind"] == "photo" and chart["thumb"]["w"] > 50 and chart["thumb"]["h"] > 50
    assert rows["report.csv"]["thumb"] is None  # not an image: no thumbnail
    assert errors == []
    # the thumbnail is the stored image, behind the job's token
    thumb = httpx.get(f"{base}/turns/{job}/thumbs/{chart['id']}?token={token}", timeout=10)
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/png"
    assert thumb.content.startswith(b"\x89PNG")
    assert httpx.get(f"{base}/turns/{job}/thumbs/{chart['id']}", timeout=10).status_code == 401
    other = rows["report.csv"]["id"]
    assert httpx.get(f"{base}/turns/{job}/thumbs/{other}?token={token}", timeout=10).status_code == 404

    # a page opened after the end shows the same (the stream replays the turn)
    late = browser.new_page()
    late.goto(f"{base}/turns/{job}?token={token}", wait_until="load")
    late.wait_for_function("() => document.querySelector('#phases li[data-status=completed]') !== null")
    late.wait_for_function("() => { const i = document.querySelector('img.thumb'); "
                           "return i && i.complete && i.naturalWidth > 0; }")
    assert late.evaluate(STATE_JS)["phases"] == now["phases"]
    _screenshot(late, "turn-page.png")


def _screenshot(page, name: str) -> None:
    """A screenshot of what a person sees, kept as a CI artifact (COURIER_SCREENSHOT_DIR, else the
    system's temp dir): a PNG of the whole page, not blank."""
    import struct
    import tempfile
    from pathlib import Path

    out = Path(os.environ.get("COURIER_SCREENSHOT_DIR") or tempfile.gettempdir()) / f"courier-{name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out), full_page=True)
    with open(out, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", out
    width, height = struct.unpack(">II", head[16:24])
    assert width >= 600 and height >= 300 and out.stat().st_size > 8000, (out, width, height, out.stat().st_size)
    print(f"screenshot: {out} ({width}x{height})")


def test_flower_shows_the_workers_in_a_browser(courier_env, browser):
    """Flower, as an operator opens it (basic auth, in Chromium): its dashboard counts courier's worker
    online, with no page error; a screenshot is kept."""
    env = courier_env()
    env.start_worker(name="screens@localhost")
    with env.flower("--basic_auth=ops:pw") as base:
        ctx = browser.new_context(http_credentials={"username": "ops", "password": "pw"},
                                  viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        resp = page.goto(f"{base}/", wait_until="load")
        assert resp.status == 200

        def listed() -> bool:  # (Flower inspects the workers when asked to refresh; the page shows what it knows)
            httpx.get(f"{base}/api/workers?refresh=1", auth=("ops", "pw"), timeout=30)
            page.reload(wait_until="networkidle")
            text = page.inner_text("body")
            online = re.search(r"Online workers\s+(\d+)", text) or re.search(r"screens@localhost.*?Online", text, re.S)
            return bool(online) and (online.lastindex is None or int(online.group(1)) >= 1)

        wait_until(listed, timeout_s=90, interval_s=1.0,
                   what=lambda: "Flower's dashboard to list the worker: " + page.inner_text("body")[:1500])
        assert errors == [], errors
        _screenshot(page, "flower.png")
        ctx.close()


def test_data_on_the_page_is_text_never_markup(web, browser):
    """A file named like HTML is shown as its name; nothing in it runs or loads."""
    env, base = web
    env.start_worker()
    name = "<img src=x onerror=window.pwned=1>.txt"
    f = env.sandbox / name
    f.write_text("x")
    res = env.cli("send", "outbox:mk", str(f), "--wait", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["job"]
    token = json.loads(env.cli("status", job, "--json").stdout)["events_token"]
    page = browser.new_page()
    page.goto(f"{base}/turns/{job}?token={token}", wait_until="load")
    page.wait_for_function("() => document.querySelector('#deliveries tr[data-state=delivered]') !== null")
    state = page.evaluate(STATE_JS)
    assert [r["name"] for r in state["rows"]] == [name]
    assert page.evaluate("() => window.pwned === undefined && document.querySelectorAll('img').length === 0")
    assert page.evaluate("() => document.getElementById('title').textContent") == f"send {job}"
