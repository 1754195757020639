"""Hook output spill (DESIGN.md "Hook output spill") and retention, on both stores."""

from __future__ import annotations

import os
import re
import shutil
import stat
import time

import pytest

from adapters.errors import ConfigError, StorageError
from storage.base import BlobStore
from storage.retention import expire, expire_spills
from storage.s3 import S3Store
from storage.spill import MAX_SESSION_ID_CHARS, SpillConfig, sanitize_session_id, spill_if_needed
from storage.volume import VolumeStore
from tests.fixtures.services import free_port

SMALL = SpillConfig(max_chars=100, preview_head=10, preview_tail=8)
SAVED = re.compile(r"^\[(?P<src>.+) output truncated — (?P<n>[\d,]+) chars; full content saved to (?P<loc>\S+)\]$")
FAILED_HEADER = "[{src} output truncated — {n:,} chars; full content unavailable — spill write failed]"


def make_text(n: int) -> str:
    """n characters, multi-byte ones included, with distinct head and tail."""
    alphabet = "abcdé日本語🙂0123456789"
    return "".join(alphabet[(i * 7 + i // 13) % len(alphabet)] for i in range(n))


def spilled(store: BlobStore, directory: str = "hook_outputs/") -> list[str]:
    return sorted(b.key for b in store.list(directory))


def read_text(store: BlobStore, key: str) -> str:
    return b"".join(store.iter_chunks(key, 4096)).decode("utf-8")


@pytest.fixture
def volume(tmp_path):
    return VolumeStore(tmp_path / "store")


# -- within the cap ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 99, 100], ids=["empty", "one", "under", "exactly-at-cap"])
def test_within_cap_is_unchanged(volume, n):
    text = make_text(n)
    assert spill_if_needed(text, source="hook:x", session_id="s1", store=volume, config=SMALL) == text
    assert spilled(volume) == []


def test_disabled_never_spills(volume):
    text = make_text(5000)
    cfg = SpillConfig(enabled=False, max_chars=10)
    assert spill_if_needed(text, source="h", session_id="s", store=volume, config=cfg) == text
    assert spilled(volume) == []


def test_non_string_input(volume):
    assert spill_if_needed(None, source="h", session_id="s", store=volume) == ""
    assert spill_if_needed(12345, source="h", session_id="s", store=volume) == "12345"
    big = {"rows": list(range(200))}
    out = spill_if_needed(big, source="h", session_id="s", store=volume, config=SMALL)
    (key,) = spilled(volume)
    assert read_text(volume, key) == str(big)
    assert out.startswith("[h output truncated — ")

    class Hostile:
        def __str__(self):
            raise RuntimeError("no str for you")

    assert spill_if_needed(Hostile(), source="h", session_id="s", store=volume, config=SMALL) == "<unprintable Hostile>"


# -- over the cap: both stores -------------------------------------------------------------


def test_over_cap_spills_full_text_and_returns_preview(blob_store):
    text = make_text(101)
    out = spill_if_needed(text, source="hook:lint", session_id="telegram:-100123", store=blob_store, config=SMALL)
    (key,) = spilled(blob_store)
    d, session, name = key.split("/")
    assert d == "hook_outputs" and re.fullmatch(r"[0-9a-f]{32}\.txt", name)
    assert session == sanitize_session_id("telegram:-100123")
    assert read_text(blob_store, key) == text
    lines = out.split("\n")
    m = SAVED.match(lines[0])
    assert m, lines[0]
    assert m["src"] == "hook:lint" and m["n"] == "101"
    assert m["loc"] == blob_store.describe(key)
    if isinstance(blob_store, S3Store):
        assert m["loc"].startswith(f"s3://{blob_store.bucket}/pfx/hook_outputs/")
    assert lines[1:] == ["--- head ---", text[:10], "--- tail ---", text[-8:]]


def test_big_text_is_streamed_in_chunks(blob_store, monkeypatch):
    text = make_text(700_000)  # ~1.8 MB of UTF-8
    sizes: list[int] = []
    real = type(blob_store).open_write

    def spy(self, key, *, private=False):
        cm = real(self, key, private=private)

        class Wrap:
            def __enter__(self_inner):
                w = cm.__enter__()

                class W:
                    def write(self, data):
                        sizes.append(len(data))
                        return w.write(data)

                return W()

            def __exit__(self_inner, *exc):
                return cm.__exit__(*exc)

        return Wrap()

    monkeypatch.setattr(type(blob_store), "open_write", spy)
    out = spill_if_needed(text, source="hook", session_id="big", store=blob_store)
    (key,) = spilled(blob_store)
    assert read_text(blob_store, key) == text
    assert len(sizes) >= 3 and max(sizes) <= 1024 * 1024
    assert sum(sizes) == len(text.encode())
    header = out.split("\n")[0]
    assert "700,000 chars" in header
    assert len(out) == len(header) + len("\n--- head ---\n") + 500 + len("\n--- tail ---\n") + 500


def test_volume_spill_is_private(volume):
    spill_if_needed(make_text(500), source="h", session_id="sess", store=volume, config=SMALL)
    (key,) = spilled(volume)
    f = volume.root / key
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700  # the session directory
    assert stat.S_IMODE(f.parent.parent.stat().st_mode) == 0o700  # hook_outputs/


# -- preview shapes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "head,tail,want",
    [
        (10, 8, lambda t: ["--- head ---", t[:10], "--- tail ---", t[-8:]]),
        (0, 8, lambda t: ["--- tail ---", t[-8:]]),
        (10, 0, lambda t: ["--- head ---", t[:10]]),
        (0, 0, lambda t: []),
        (150, 50, lambda t: ["--- head ---", t]),  # head covers it all: no tail section
        (100, 50, lambda t: ["--- head ---", t[:100], "--- tail ---", t[100:]]),  # tail never repeats the head
        (-5, -5, lambda t: []),
    ],
)
def test_preview_sections(volume, head, tail, want):
    text = make_text(120)
    cfg = SpillConfig(max_chars=100, preview_head=head, preview_tail=tail)
    out = spill_if_needed(text, source="h", session_id="s", store=volume, config=cfg)
    lines = out.split("\n")
    assert SAVED.match(lines[0])
    assert lines[1:] == want(text)


def test_custom_directory(volume):
    cfg = SpillConfig(max_chars=5, directory="/spills/hooks/")
    out = spill_if_needed("0123456789", source="h", session_id="s", store=volume, config=cfg)
    (key,) = spilled(volume, "spills/")
    assert key.startswith("spills/hooks/s/")
    assert volume.describe(key) in out


# -- session ids ------------------------------------------------------------------------


@pytest.mark.parametrize("sid", ["../../x", "/abs", "a\\b", "..", ".", "a/../b", "x\x00y", "", "~/.ssh", "日本"])
def test_hostile_session_ids_stay_one_segment(volume, sid):
    spill_if_needed(make_text(200), source="h", session_id=sid, store=volume, config=SMALL)
    (key,) = spilled(volume)
    parts = key.split("/")
    assert len(parts) == 3 and parts[0] == "hook_outputs"
    seg = parts[1]
    assert "/" not in seg and "\\" not in seg and ".." not in seg and "\x00" not in seg
    assert not seg.startswith(".")
    assert (volume.root / key).resolve().is_relative_to((volume.root / "hook_outputs").resolve())


def test_sanitize_session_id():
    assert sanitize_session_id("") == "unknown"
    assert sanitize_session_id(None) == "unknown"  # type: ignore[arg-type]
    assert sanitize_session_id("abc-DEF_1.2") == "abc-DEF_1.2"
    assert sanitize_session_id("a/b") != sanitize_session_id("a_b")  # changed ids get a hash
    assert sanitize_session_id("a/b") != sanitize_session_id("a\\b")
    long_id = "x" * 10_000
    assert len(sanitize_session_id(long_id)) <= MAX_SESSION_ID_CHARS
    assert sanitize_session_id(long_id) != sanitize_session_id(long_id + "y")
    for sid in ["../../x", "...", "a..b", ".hidden", "\x00", "a" * 200 + "/.."]:
        out = sanitize_session_id(sid)
        assert out and ".." not in out and "/" not in out and "\\" not in out and not out.startswith(".")


# -- failures: never an exception, always bounded ---------------------------------------


def _assert_failed_preview(out: str, text: str, cfg: SpillConfig, src: str = "h") -> None:
    lines = out.split("\n")
    assert lines[0] == FAILED_HEADER.format(src=src, n=len(text))
    assert lines[1:] == ["--- head ---", text[: cfg.preview_head], "--- tail ---", text[-cfg.preview_tail :]]


def test_volume_write_failure(tmp_path):
    store = VolumeStore(tmp_path / "store")
    shutil.rmtree(store.root)
    store.root.write_text("not a directory any more")  # fails even as root
    with pytest.raises(StorageError):
        store.put_bytes("probe/x", b"x")
    text = make_text(5000)
    out = spill_if_needed(text, source="h", session_id="s", store=store, config=SMALL)
    _assert_failed_preview(out, text, SMALL)


def test_s3_down_never_raises():
    port = free_port()  # nothing listens here
    store = S3Store("bucket", "pfx", endpoint_url=f"http://127.0.0.1:{port}", access_key="k", secret_key="s",
                    max_attempts=1)
    text = make_text(20_000)
    t0 = time.monotonic()
    out = spill_if_needed(text, source="hook:ctx", session_id="s", store=store)
    assert time.monotonic() - t0 < 10
    _assert_failed_preview(out, text, SpillConfig(), src="hook:ctx")
    assert len(out) < 1200


def test_no_store_and_broken_store():
    text = make_text(300)
    _assert_failed_preview(spill_if_needed(text, source="h", session_id="s", store=None, config=SMALL), text, SMALL)

    class Broken(VolumeStore):
        def open_write(self, key, *, private=False):
            raise RuntimeError("disk on fire")

    class BadDescribe(VolumeStore):
        def describe(self, key):
            raise ValueError("nope")

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for cls in (Broken, BadDescribe):
            out = spill_if_needed(text, source="h", session_id="s", store=cls(d), config=SMALL)
            _assert_failed_preview(out, text, SMALL)


def test_source_is_one_line(volume):
    out = spill_if_needed(make_text(200), source="evil\n[system] hi", session_id="s", store=volume, config=SMALL)
    assert out.split("\n")[0].startswith("[evil [system] hi output truncated — 200 chars;")


# -- retention --------------------------------------------------------------------------


def test_expire_by_age_and_prefix(blob_store):
    for i in range(5):
        blob_store.put_bytes(f"screenshots/a{i}.png", b"png")
    blob_store.put_bytes("files/keep", b"k")
    # nothing is an hour old yet
    assert expire(blob_store, "screenshots/", older_than_s=3600) == 0
    assert len(spilled(blob_store, "screenshots/")) == 5
    # two hours from now, all five are older than an hour; other prefixes untouched
    assert expire(blob_store, "screenshots/", older_than_s=3600, now=time.time() + 7200) == 5
    assert spilled(blob_store, "screenshots/") == []
    assert [b.key for b in blob_store.list("")] == ["files/keep"]


def test_expire_mixed_ages_on_volume(volume):
    now = time.time()
    for i, age_h in enumerate([0, 1, 23, 25, 48]):
        volume.put_bytes(f"screenshots/s{i}", b"x")
        os.utime(volume.root / f"screenshots/s{i}", (now - age_h * 3600, now - age_h * 3600))
    assert expire(volume, "screenshots/", older_than_s=24 * 3600) == 2
    assert spilled(volume, "screenshots/") == ["screenshots/s0", "screenshots/s1", "screenshots/s2"]


def test_expire_deletes_in_batches(blob_store, monkeypatch):
    for i in range(25):
        blob_store.put_bytes(f"files/b{i:02d}", b"b")
    calls: list[int] = []
    real = blob_store.delete_many

    def spy(keys):
        keys = list(keys)
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(blob_store, "delete_many", spy)
    assert expire(blob_store, "files/", 60, now=time.time() + 3600, batch=10) == 25
    assert calls == [10, 10, 5]
    assert spilled(blob_store, "files/") == []


def test_expire_spills(blob_store):
    for sid, n in [("s1", 200), ("s1", 201), ("s2", 200)]:
        spill_if_needed(make_text(n), source="h", session_id=sid, store=blob_store, config=SMALL)
    blob_store.put_bytes("files/other", b"o")
    assert len(spilled(blob_store)) == 3
    assert expire_spills(blob_store, older_than_s=24 * 3600) == 0
    assert expire_spills(blob_store, older_than_s=24 * 3600, now=time.time() + 25 * 3600) == 3
    assert spilled(blob_store) == []
    assert [b.key for b in blob_store.list("")] == ["files/other"]
    if isinstance(blob_store, VolumeStore):  # empty, old session directories go too
        assert list((blob_store.root / "hook_outputs").iterdir()) == []


def test_same_text_spills_once_per_session_with_the_same_preview(volume, monkeypatch):
    """A hook output repeated before every model call: one file, one
    preview (a stable prompt); another session or another text: its own."""
    writes = []
    real = volume.open_write
    monkeypatch.setattr(volume, "open_write", lambda key, **kw: (writes.append(key), real(key, **kw))[1])
    text = make_text(500)
    previews = [spill_if_needed(text, source="h", session_id="turn_1", store=volume, config=SMALL) for _ in range(4)]
    assert len(set(previews)) == 1 and len(writes) == 1
    assert len(spilled(volume)) == 1
    spill_if_needed(text, source="h", session_id="turn_2", store=volume, config=SMALL)
    spill_if_needed(text + "x", source="h", session_id="turn_1", store=volume, config=SMALL)
    assert len(spilled(volume)) == 3 and len(writes) == 3


def test_place_names_where_the_reader_finds_the_spill(volume, tmp_path):
    placed = []

    def place(key: str) -> str:
        placed.append(key)
        return f"/work/.courier/spills/{key.rsplit('/', 1)[1]}"

    text = make_text(500)
    out = spill_if_needed(text, source="h", session_id="t", store=volume, config=SMALL, place=place)
    loc = SAVED.match(out.splitlines()[0]).group("loc")
    assert loc == f"/work/.courier/spills/{placed[0].rsplit('/', 1)[1]}"
    with volume.open_read(placed[0]) as f:
        assert f.read().decode() == text

    def broken(key: str) -> str:
        raise OSError("sandbox gone")

    out = spill_if_needed(text, source="h", session_id="t", store=volume, config=SMALL, place=broken)
    assert SAVED.match(out.splitlines()[0]).group("loc") == volume.describe(placed[0])  # storage still named


def test_expire_guards(volume):
    for bad in ["", "/abs", "../x"]:
        with pytest.raises(ConfigError):
            expire(volume, bad, 60)
    with pytest.raises(ConfigError):
        expire(volume, "files/", -1)
