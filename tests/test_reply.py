"""tasks.turn.reply: MEDIA tag parsing, directives, text tidying; tasks.delivery.routing: routing by extension."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.platforms.base import Kind
from tasks.turn.reply import ParsedReply, parse_reply
from tasks.delivery.routing import (
    ANIMATION_EXT,
    AUDIO_EXT,
    DOCUMENT_EXT,
    KNOWN_EXT,
    MEDIA_EXTENSIONS,
    PHOTO_EXT,
    VIDEO_EXT,
    VOICE_EXT,
    route,
)

FENCE = "```"

#: the table of replies (tests/data/reply_cases.json, one case a line, in sections): each
#: reply, the media and text parse_reply must find in it, and its audio_as_voice and as_document
with open(Path(__file__).parent / "data" / "reply_cases.json", encoding="utf-8") as _f:
    CASES = [pytest.param(c["reply"], tuple(c["media"]), c["text"], c["voice"], c["as_document"], id=c["id"])
             for c in json.load(_f)]


@pytest.mark.parametrize("reply, media, text, voice, as_doc", CASES)
def test_parse_reply_table(reply: str, media: tuple[str, ...], text: str, voice: bool, as_doc: bool) -> None:
    got = parse_reply(reply)
    assert got == ParsedReply(text=text, media=media, audio_as_voice=voice, as_document=as_doc)


def test_multiline_reply() -> None:
    reply = (
        "Here are your files:\n"
        "\n"
        "- chart: MEDIA:/tmp/out/chart.png\n"
        "- data: MEDIA:\"/tmp/out/raw data.csv\"\n"
        "\n"
        "To regenerate:\n"
        f"{FENCE}bash\n"
        "python plot.py  # writes MEDIA:/tmp/out/chart.png\n"
        f"{FENCE}\n"
        "[[as_document]]\n"
    )
    got = parse_reply(reply)
    assert got.media == ("/tmp/out/chart.png", "/tmp/out/raw data.csv")
    assert got.as_document and not got.audio_as_voice
    assert got.text == (
        "Here are your files:\n\n- chart:\n- data:\n\nTo regenerate:\n"
        f"{FENCE}bash\npython plot.py  # writes MEDIA:/tmp/out/chart.png\n{FENCE}"
    )


@pytest.mark.parametrize("bad", [None, b"MEDIA:/tmp/a.png", 3, ["MEDIA:/a.png"]])
def test_parse_reply_rejects_non_str(bad: object) -> None:
    with pytest.raises(TypeError):
        parse_reply(bad)  # type: ignore[arg-type]


def test_path_length_cap() -> None:
    ok = "/" + "a" * 4091 + ".png"
    assert parse_reply(f"MEDIA:{ok}").media == (ok,)
    assert parse_reply(f'MEDIA:"{ok}"').media == (ok,)
    long = "/" + "a" * 4092 + ".png"
    assert parse_reply(f"MEDIA:{long} x") == ParsedReply(f"MEDIA:{long} x", (), False, False)
    assert parse_reply(f'MEDIA:"{long}" x').media == ()


@pytest.mark.parametrize(
    "reply",
    [
        'MEDIA:"x"x' * 5000,
        "MEDIA:'" * 8000,
        "MEDIA:`" + "`a" * 20000,
        "MEDIA:/" + "[[" * 20000,
        "MEDIA:/" + "a.png." * 8000,
        "```\n" * 10000,
        "MEDIA:[[as_document]]/x.png " * 2000,
        "`" * 50000,
    ],
    ids=["quotes", "open-quotes", "backticks", "brackets", "dots", "fences", "defuse", "one-run"],
)
def test_pathological_input_is_fast(reply: str) -> None:
    """Linear work, not backtracking: bounded in this process's own CPU time (which other
    processes' load does not stretch, as it does the wall clock's); backtracking on these takes
    minutes."""
    t0 = time.process_time()
    parse_reply(reply)
    assert time.process_time() - t0 < 2.0


def test_parsed_reply_is_frozen() -> None:
    got = parse_reply("MEDIA:/a.png")
    with pytest.raises(AttributeError):
        got.text = "x"  # type: ignore[misc]


# --------------------------------------------------------------------------
# property-based tests

# REPLY_FUZZ_EXAMPLES=20000 for a long local fuzz run
_SETTINGS = settings(max_examples=int(os.environ.get("REPLY_FUZZ_EXAMPLES", "200")), deadline=None, database=None)

_seg = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-", min_size=1, max_size=12)
_ext = st.sampled_from(sorted(KNOWN_EXT) + [".bin", ".dat", ".tsx", ".pyc", ".PNG", ".Mp4"])


@st.composite
def safe_paths(draw: st.DrawFn) -> str:
    root = draw(st.sampled_from(["/", "~/"]))
    segs = draw(st.lists(_seg, min_size=1, max_size=5))
    return root + "/".join(segs) + draw(_ext)


_fancy_char = st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="\n\"'`")


@st.composite
def spaced_paths(draw: st.DrawFn) -> str:
    segs = draw(st.lists(st.text(_fancy_char, min_size=1, max_size=10), min_size=1, max_size=4))
    path = draw(st.sampled_from(["/", "~/"])) + "/".join(segs) + " " + draw(_seg) + draw(_ext)
    if path.startswith("//") or path != path.strip():
        path = "/x " + path.strip().lstrip("/~")
    return path


_TOKENS = [
    "MEDIA:", "MEDIA:/tmp/a.png", "MEDIA:~/b.mp4", "/tmp/c.ogg", "~/", "/", '"', "'", "`", "``", "```",
    "~~~", "\n", " ", "\t", "\r\n", "[[as_document]]", "[[ AUDIO_AS_VOICE ]]", "[[", "]]", "。", "，", ",",
    ".", ")", "(", "**", "这是", "Here", "and", "\\", "png", ".png", "\u3000", "MEDIA:\"/tmp/a b.png\"",
    "MEDIA:`/tmp/c d.png`", "\u200b",
]  # fmt: skip
_reply_text = st.lists(st.one_of(st.sampled_from(_TOKENS), st.text(max_size=6)), max_size=30).map("".join)


@_SETTINGS
@given(st.one_of(st.text(), _reply_text))
def test_never_raises(text: str) -> None:
    got = parse_reply(text)
    assert isinstance(got.text, str)
    assert len(set(got.media)) == len(got.media)
    for p in got.media:
        assert p.startswith(("/", "~/")) and not p.startswith("//")


@_SETTINGS
@given(safe_paths())
def test_safe_path_found(p: str) -> None:
    got = parse_reply(f"x MEDIA:{p} y")
    assert got.media == (p,)
    assert got.text == "x y"


@_SETTINGS
@given(spaced_paths(), st.sampled_from(['"', "'", "`", "``"]), st.sampled_from(["", ".", ",", "!", "。", " ok"]))
def test_quoted_path_round_trips(p: str, q: str, tail: str) -> None:
    got = parse_reply(f"see MEDIA:{q}{p}{q}{tail}")
    assert got.media == (p,)


@_SETTINGS
@given(st.lists(st.one_of(st.sampled_from([t for t in _TOKENS if "`" not in t and "~~~" not in t]), safe_paths().map(lambda p: f"MEDIA:{p}")), max_size=25).map(" ".join))
def test_extracted_tags_leave_text(text: str) -> None:
    got = parse_reply(text)
    for p in got.media:
        assert f"MEDIA:{p}" not in got.text


@_SETTINGS
@given(
    st.lists(safe_paths(), min_size=1, max_size=4),
    st.sampled_from(["```", "```python", "~~~", "````md", "~~~ text"]),
    st.text(st.characters(blacklist_characters="`~"), max_size=30),
    st.booleans(),
)
def test_fenced_tags_never_extracted(paths: list[str], fence: str, around: str, closed: bool) -> None:
    inside = [f"/code{p.lstrip('~')}" for p in paths]
    body = "\n".join(f"line MEDIA:{p} [[as_document]]" for p in inside)
    close = "\n" + fence.split()[0].rstrip("pythonmd") if closed else ""
    reply = f"{around}\n{fence}\n{body}{close}\n{around}"
    got = parse_reply(reply)
    assert not any(m.startswith("/code/") for m in got.media)
    for p in inside:
        assert f"MEDIA:{p}" in got.text


@_SETTINGS
@given(st.one_of(st.text(), _reply_text))
def test_idempotent_without_code(text: str) -> None:
    text = text.replace("`", "'").replace("~~~", "~")
    once = parse_reply(text)
    again = parse_reply(once.text)
    assert again.media == ()
    assert not again.audio_as_voice and not again.as_document


# --------------------------------------------------------------------------
# routing


def _mixed(ext: str) -> list[str]:
    return sorted({ext.lower(), ext.upper(), ext[:2].upper() + ext[2:].lower()})


def test_tables_match_design() -> None:
    assert PHOTO_EXT == {".jpg", ".jpeg", ".png", ".webp"}
    assert ANIMATION_EXT == {".gif"}
    assert VIDEO_EXT == {".mp4", ".mov", ".avi", ".mkv", ".3gp", ".webm"}
    assert VOICE_EXT == {".ogg", ".opus"}
    assert AUDIO_EXT == {".mp3", ".wav", ".m4a", ".flac"}
    assert MEDIA_EXTENSIONS == PHOTO_EXT | ANIMATION_EXT | VIDEO_EXT | VOICE_EXT | AUDIO_EXT
    assert not (DOCUMENT_EXT & MEDIA_EXTENSIONS)
    assert KNOWN_EXT >= MEDIA_EXTENSIONS


_DEFAULT = [(e, Kind.PHOTO) for e in PHOTO_EXT] + [(".gif", Kind.ANIMATION)]
_DEFAULT += [(e, Kind.VIDEO) for e in VIDEO_EXT] + [(e, Kind.AUDIO) for e in VOICE_EXT | AUDIO_EXT]
_DEFAULT += [(e, Kind.DOCUMENT) for e in (".pdf", ".txt", ".zip", ".csv", ".tsx", ".PNGX", "")]


@pytest.mark.parametrize(
    "name, kind",
    [(f"/tmp/dir.d/file{m}", k) for e, k in sorted(_DEFAULT) for m in (_mixed(e) if e else [""])],
)
def test_route_defaults(name: str, kind: Kind) -> None:
    assert route(name) is kind


# (ext, voice, as_document, animation, voice_notes) -> kind
ROUTES = [
    (".png", False, True, True, True, Kind.DOCUMENT),
    (".JPG", True, False, True, True, Kind.PHOTO),
    (".webp", False, False, False, False, Kind.PHOTO),
    (".gif", False, False, True, True, Kind.ANIMATION),
    (".GIF", False, False, False, True, Kind.PHOTO),
    (".gif", False, True, True, True, Kind.DOCUMENT),
    (".gif", False, True, False, True, Kind.DOCUMENT),
    (".mp4", False, True, True, True, Kind.DOCUMENT),
    (".MOV", True, False, True, True, Kind.VIDEO),
    (".webm", False, False, False, False, Kind.VIDEO),
    (".ogg", True, False, True, True, Kind.VOICE),
    (".OPUS", True, False, True, True, Kind.VOICE),
    (".ogg", True, False, True, False, Kind.AUDIO),
    (".opus", False, False, True, True, Kind.AUDIO),
    (".ogg", True, True, True, True, Kind.VOICE),
    (".mp3", True, False, True, True, Kind.VOICE),
    (".M4A", True, False, True, True, Kind.VOICE),
    (".wav", True, False, True, False, Kind.AUDIO),
    (".flac", False, True, True, True, Kind.AUDIO),
    (".pdf", True, True, False, False, Kind.DOCUMENT),
    ("", True, True, True, True, Kind.DOCUMENT),
]


@pytest.mark.parametrize("ext, voice, as_doc, animation, voice_notes, kind", ROUTES)
def test_route_flags(ext: str, voice: bool, as_doc: bool, animation: bool, voice_notes: bool, kind: Kind) -> None:
    got = route(f"~/out/x{ext}", voice=voice, as_document=as_doc, animation=animation, voice_notes=voice_notes)
    assert got is kind


@pytest.mark.parametrize(
    "name, kind",
    [
        ("a.PNG", Kind.PHOTO),
        (".png", Kind.DOCUMENT),
        ("/tmp/a.png.pdf", Kind.DOCUMENT),
        ("/tmp/a.pdf.png", Kind.PHOTO),
        ("/tmp/dir.mp4/file", Kind.DOCUMENT),
        ("C:\\x\\clip.MP4", Kind.VIDEO),
        ("/tmp/my file.jpeg", Kind.PHOTO),
        ("/tmp/图表.webp", Kind.PHOTO),
        (PurePosixPath("/tmp/a.ogg"), Kind.AUDIO),
    ],
)
def test_route_names(name: str, kind: Kind) -> None:
    assert route(name) is kind


@pytest.mark.parametrize("bad", [None, 3, b"a.png"])
def test_route_rejects_non_str(bad: object) -> None:
    with pytest.raises(TypeError):
        route(bad)  # type: ignore[arg-type]


def test_parse_then_route() -> None:
    got = parse_reply("[[audio_as_voice]] MEDIA:/t/a.ogg MEDIA:/t/b.GIF MEDIA:/t/c.pdf")
    kinds = [route(p, voice=got.audio_as_voice, as_document=got.as_document) for p in got.media]
    assert kinds == [Kind.VOICE, Kind.ANIMATION, Kind.DOCUMENT]
