"""tasks.reply: MEDIA tag parsing, directives, text tidying; tasks.routing: routing by extension."""

from __future__ import annotations

import os
import time
from pathlib import PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.platforms.base import Kind
from tasks.reply import ParsedReply, parse_reply
from tasks.routing import (
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

# (reply, expected media, expected text, audio_as_voice, as_document)
CASES = [
    # --- basics
    pytest.param("", (), "", False, False, id="empty"),
    pytest.param("   \n\n  ", (), "", False, False, id="only-whitespace"),
    pytest.param("hello world", (), "hello world", False, False, id="no-tags"),
    pytest.param("Here it is MEDIA:/tmp/a.png", ("/tmp/a.png",), "Here it is", False, False, id="tag-at-end"),
    pytest.param("MEDIA:/tmp/a.png", ("/tmp/a.png",), "", False, False, id="only-tag"),
    pytest.param("MEDIA:/tmp/a.png\nMEDIA:~/b.mp4\n[[as_document]]", ("/tmp/a.png", "~/b.mp4"), "", False, True, id="only-tags-and-directive"),
    pytest.param("MEDIA:~/out/report.pdf", ("~/out/report.pdf",), "", False, False, id="home-relative"),
    pytest.param("a MEDIA:/tmp/a.png b", ("/tmp/a.png",), "a b", False, False, id="no-double-space"),
    pytest.param("x MEDIA:/a.png MEDIA:/b.png y", ("/a.png", "/b.png"), "x y", False, False, id="two-tags-one-line"),
    pytest.param("MEDIA:/a.png MEDIA:/b.gif MEDIA:/c.mp4", ("/a.png", "/b.gif", "/c.mp4"), "", False, False, id="three-tags-one-line"),
    pytest.param("  MEDIA:/a.png caption", ("/a.png",), "caption", False, False, id="indent-then-stripped"),
    pytest.param("intro\n  - MEDIA:/a.png first\nend", ("/a.png",), "intro\n  - first\nend", False, False, id="list-item-keeps-indent"),
    pytest.param("a\nMEDIA:/x.png\nb", ("/x.png",), "a\nb", False, False, id="tag-line-removed"),
    pytest.param("a\n\nMEDIA:/x.png\n\n\n\nb", ("/x.png",), "a\n\nb", False, False, id="blank-runs-collapsed"),
    pytest.param("a\r\nMEDIA:/x.png\r\nb MEDIA:/y.png\r\n", ("/x.png", "/y.png"), "a\r\nb", False, False, id="crlf"),
    pytest.param("MEDIA:/x.png\tb", ("/x.png",), "b", False, False, id="tab-after"),
    # --- trailing punctuation
    pytest.param("Done: MEDIA:/tmp/a.png.", ("/tmp/a.png",), "Done.", False, False, id="period-after"),
    pytest.param("See MEDIA:/tmp/a.png, then MEDIA:/tmp/b.png!", ("/tmp/a.png", "/tmp/b.png"), "See, then!", False, False, id="comma-and-bang"),
    pytest.param("Wow! MEDIA:/x.png?", ("/x.png",), "Wow!", False, False, id="question-after-bang"),
    pytest.param("a, MEDIA:/b.png, c", ("/b.png",), "a, c", False, False, id="comma-both-sides"),
    pytest.param("MEDIA:/tmp/a.png;", ("/tmp/a.png",), "", False, False, id="semicolon"),
    pytest.param("files: MEDIA:/tmp/a.png:", ("/tmp/a.png",), "files:", False, False, id="colon"),
    pytest.param("(MEDIA:/tmp/a.png)", ("/tmp/a.png",), "", False, False, id="parens-wrapped"),
    pytest.param("(see MEDIA:/tmp/a.png)", ("/tmp/a.png",), "(see)", False, False, id="paren-after"),
    pytest.param("[MEDIA:/tmp/a.png]", ("/tmp/a.png",), "", False, False, id="brackets"),
    pytest.param("{MEDIA:/tmp/a.png}", ("/tmp/a.png",), "", False, False, id="braces"),
    pytest.param("<MEDIA:/tmp/a.png>", ("/tmp/a.png",), "", False, False, id="angle"),
    pytest.param('say "MEDIA:/tmp/a.png" now', ("/tmp/a.png",), "say now", False, False, id="in-double-quotes"),
    pytest.param("say 'MEDIA:/tmp/a.png' now", ("/tmp/a.png",), "say now", False, False, id="in-single-quotes"),
    pytest.param("**MEDIA:/tmp/a.png**", ("/tmp/a.png",), "", False, False, id="bold"),
    pytest.param("MEDIA:/tmp/a.png...", ("/tmp/a.png",), "", False, False, id="ellipsis"),
    pytest.param("MEDIA:/tmp/a.png.)", ("/tmp/a.png",), ")", False, False, id="period-paren"),
    pytest.param("MEDIA:/tmp/file_(1)", ("/tmp/file_(1)",), "", False, False, id="balanced-paren-kept"),
    pytest.param("(MEDIA:/tmp/file_(1))", ("/tmp/file_(1)",), "", False, False, id="balanced-paren-wrapped"),
    pytest.param("MEDIA:/tmp/noext.", ("/tmp/noext",), "", False, False, id="no-extension-period"),
    pytest.param("MEDIA:/tmp/a.png.bak", ("/tmp/a.png.bak",), "", False, False, id="double-extension"),
    pytest.param("MEDIA:/tmp/a.tar.gz.", ("/tmp/a.tar.gz",), "", False, False, id="tar-gz-period"),
    # --- CJK punctuation and unicode paths
    pytest.param("图表：MEDIA:/tmp/图表.png。", ("/tmp/图表.png",), "图表。", False, False, id="cjk-full-stop"),
    pytest.param("见MEDIA:/tmp/a.png，好的", ("/tmp/a.png",), "见，好的", False, False, id="cjk-comma"),
    pytest.param("MEDIA:/tmp/a.png！", ("/tmp/a.png",), "", False, False, id="cjk-bang"),
    pytest.param("MEDIA:/tmp/a.png？", ("/tmp/a.png",), "", False, False, id="cjk-question"),
    pytest.param("MEDIA:/tmp/a.png、MEDIA:/tmp/b.png", ("/tmp/a.png", "/tmp/b.png"), "", False, False, id="cjk-enum-comma"),
    pytest.param("「MEDIA:/tmp/a.png」", ("/tmp/a.png",), "", False, False, id="cjk-corner-quotes"),
    pytest.param("（MEDIA:/tmp/a.png）", ("/tmp/a.png",), "", False, False, id="cjk-parens"),
    pytest.param("MEDIA:/tmp/a.png；MEDIA:/tmp/b.png：", ("/tmp/a.png", "/tmp/b.png"), "", False, False, id="cjk-semicolon-colon"),
    pytest.param("MEDIA:/tmp/a.png这是图", ("/tmp/a.png",), "这是图", False, False, id="cjk-glued-after"),
    pytest.param("MEDIA:/tmp/a.png。这是图", ("/tmp/a.png",), "这是图", False, False, id="cjk-punct-glued-after"),
    pytest.param("MEDIA:/tmp/отчёт.pdfготово", ("/tmp/отчёт.pdf",), "готово", False, False, id="cyrillic-glued"),
    pytest.param("MEDIA:/données/été.jpg", ("/données/été.jpg",), "", False, False, id="accented-path"),
    pytest.param("MEDIA:/tmp/📊.png 🎉", ("/tmp/📊.png",), "🎉", False, False, id="emoji-path"),
    pytest.param("图：MEDIA:/tmp/a.png\u3000完成", ("/tmp/a.png",), "图：\u3000完成", False, False, id="ideographic-space"),
    # --- glued to the next / previous word
    pytest.param("see MEDIA:/tmp/chart.pngHere it is", ("/tmp/chart.png",), "see Here it is", False, False, id="glued-capital"),
    pytest.param("MEDIA:/tmp/a.pngand more", ("/tmp/a.png",), "and more", False, False, id="glued-lowercase-word"),
    pytest.param("hereMEDIA:/tmp/a.png", ("/tmp/a.png",), "here", False, False, id="glued-before"),
    pytest.param("hereMEDIA:/tmp/a.pngthere", ("/tmp/a.png",), "here there", False, False, id="glued-both-sides"),
    pytest.param("MEDIA:/a.pngMEDIA:/b.png", ("/a.png", "/b.png"), "", False, False, id="two-tags-glued"),
    pytest.param("MEDIA:/tmp/a.jsonHere", ("/tmp/a.json",), "Here", False, False, id="glued-longest-extension"),
    pytest.param("MEDIA:/tmp/a.JPEGok", ("/tmp/a.JPEG",), "ok", False, False, id="glued-upper-extension"),
    pytest.param("MEDIA:/tmp/a.png),more", ("/tmp/a.png",), "),more", False, False, id="glued-punct"),
    pytest.param("MEDIA:/tmp/a.png<br>", ("/tmp/a.png",), "<br>", False, False, id="glued-html"),
    pytest.param("MEDIA:/tmp/a.docs", ("/tmp/a.docs",), "", False, False, id="single-letter-kept"),
    pytest.param("MEDIA:/src/app.tsx", ("/src/app.tsx",), "", False, False, id="unknown-ext-kept"),
    pytest.param("MEDIA:/tmp/READMEthen", ("/tmp/READMEthen",), "", False, False, id="no-ext-no-cut"),
    pytest.param("MEDIA:/tmp/x.pngdir/file", ("/tmp/x.pngdir/file",), "", False, False, id="only-last-component"),
    pytest.param("MEDIA:/tmp/a.png[[as_document]]", ("/tmp/a.png",), "", False, True, id="glued-directive"),
    pytest.param("MEDIA:/tmp/a[[b]].png", ("/tmp/a[[b]].png",), "", False, False, id="non-directive-brackets-kept"),
    # --- quoted paths
    pytest.param('MEDIA:"/tmp/my file.png"', ("/tmp/my file.png",), "", False, False, id="double-quoted-spaces"),
    pytest.param("MEDIA:'/tmp/my file.png'", ("/tmp/my file.png",), "", False, False, id="single-quoted-spaces"),
    pytest.param("MEDIA:`/tmp/my file.png`", ("/tmp/my file.png",), "", False, False, id="backticked-spaces"),
    pytest.param("MEDIA:``/tmp/a `b`.png``", ("/tmp/a `b`.png",), "", False, False, id="double-backticked"),
    pytest.param("MEDIA:'/tmp/bob's file.png' ok", ("/tmp/bob's file.png",), "ok", False, False, id="apostrophe-inside"),
    pytest.param('MEDIA:"~/My Docs/q 1.pdf", done', ("~/My Docs/q 1.pdf",), "done", False, False, id="quoted-home-comma"),
    pytest.param('MEDIA:" /tmp/pad.png "', ("/tmp/pad.png",), "", False, False, id="quoted-inner-space-stripped"),
    pytest.param('MEDIA:"/tmp/a.png." x', ("/tmp/a.png.",), "x", False, False, id="quoted-keeps-punct"),
    pytest.param('MEDIA:"/tmp/a.png', ("/tmp/a.png",), "", False, False, id="unterminated-quote"),
    pytest.param('MEDIA:"/tmp/a b.png\nb.png"', ("/tmp/a",), "b.png\nb.png\"", False, False, id="quote-not-across-lines"),
    pytest.param('MEDIA:"/tmp/图 表.png"。', ("/tmp/图 表.png",), "", False, False, id="quoted-unicode"),
    pytest.param('MEDIA:"relative.png"', (), 'MEDIA:"relative.png"', False, False, id="quoted-relative-not-tag"),
    # --- duplicates
    pytest.param("MEDIA:/tmp/a.png MEDIA:/tmp/a.png", ("/tmp/a.png",), "", False, False, id="dup-plain"),
    pytest.param("MEDIA:/tmp/a.png. And MEDIA:\"/tmp/a.png\", MEDIA:`/tmp/a.png`!", ("/tmp/a.png",), "And!", False, False, id="dup-normalised"),
    pytest.param("MEDIA:/b.png MEDIA:/a.png MEDIA:/b.png", ("/b.png", "/a.png"), "", False, False, id="dup-first-wins"),
    # --- not tags
    pytest.param("MEDIA:relative.png", (), "MEDIA:relative.png", False, False, id="relative"),
    pytest.param("MEDIA:./a.png", (), "MEDIA:./a.png", False, False, id="dot-relative"),
    pytest.param("MEDIA:http://x.com/a.png", (), "MEDIA:http://x.com/a.png", False, False, id="url"),
    pytest.param("MEDIA://x.com/a.png", (), "MEDIA://x.com/a.png", False, False, id="protocol-relative"),
    pytest.param("MEDIA:/ and MEDIA:~/ x", (), "MEDIA:/ and MEDIA:~/ x", False, False, id="bare-root"),
    pytest.param("MEDIA:~user/a.png", (), "MEDIA:~user/a.png", False, False, id="tilde-user"),
    pytest.param("MEDIA: /tmp/a.png", (), "MEDIA: /tmp/a.png", False, False, id="space-after-colon"),
    pytest.param("media:/tmp/a.png", (), "media:/tmp/a.png", False, False, id="lowercase"),
    pytest.param("MEDIA:", (), "MEDIA:", False, False, id="bare-prefix"),
    pytest.param("MEDIA:C:\\Users\\me\\a.png", (), "MEDIA:C:\\Users\\me\\a.png", False, False, id="windows-path"),
    pytest.param("path C:\\tmp\\x.png and MEDIA:/tmp/a\\b.png", ("/tmp/a\\b.png",), "path C:\\tmp\\x.png and", False, False, id="backslashes-in-text"),
    pytest.param("MEDIA:/tmp/a\x00b.png", (), "MEDIA\u200b:/tmp/ab.png", False, False, id="control-char"),
    pytest.param("a\x00b\x1b[31m c\x7f\td\r\ne\x85", (), "ab[31m c\td\r\ne", False, False, id="control-chars-dropped"),
    # --- code
    pytest.param("`MEDIA:/tmp/x.png`", (), "`MEDIA:/tmp/x.png`", False, False, id="inline-code"),
    pytest.param("run `MEDIA:/tmp/x.png` then MEDIA:/tmp/y.png", ("/tmp/y.png",), "run `MEDIA:/tmp/x.png` then", False, False, id="inline-code-and-tag"),
    pytest.param("``a `MEDIA:/tmp/x.png` b``", (), "``a `MEDIA:/tmp/x.png` b``", False, False, id="nested-backticks"),
    pytest.param("`` `MEDIA:`/tmp/x.png` ``", (), "`` `MEDIA:`/tmp/x.png` ``", False, False, id="nested-backtick-tag"),
    pytest.param("`code  with  spaces` MEDIA:/a.png", ("/a.png",), "`code  with  spaces`", False, False, id="inline-code-spacing-kept"),
    pytest.param("a ` b MEDIA:/tmp/x.png", ("/tmp/x.png",), "a ` b", False, False, id="unmatched-backtick"),
    pytest.param("`a\n\nMEDIA:/tmp/x.png`", ("/tmp/x.png",), "`a\n\n`", False, False, id="inline-code-not-across-blank-line"),
    pytest.param("MEDIA:`relative.png`", (), "MEDIA:`relative.png`", False, False, id="backticked-relative-is-code"),
    pytest.param(f"{FENCE}\nMEDIA:/tmp/x.png\n{FENCE}", (), f"{FENCE}\nMEDIA:/tmp/x.png\n{FENCE}", False, False, id="fence"),
    pytest.param(f"{FENCE}python\nprint('MEDIA:/tmp/x.png')\n{FENCE}\nMEDIA:/tmp/y.png", ("/tmp/y.png",), f"{FENCE}python\nprint('MEDIA:/tmp/x.png')\n{FENCE}", False, False, id="fence-with-lang"),
    pytest.param("~~~\nMEDIA:/tmp/x.png [[as_document]]\n~~~", (), "~~~\nMEDIA:/tmp/x.png [[as_document]]\n~~~", False, False, id="tilde-fence"),
    pytest.param("~~~~md\n~~~\nMEDIA:/tmp/x.png\n~~~~\nMEDIA:/tmp/y.png", ("/tmp/y.png",), "~~~~md\n~~~\nMEDIA:/tmp/x.png\n~~~~", False, False, id="longer-fence"),
    pytest.param(f"{FENCE}\nMEDIA:/tmp/x.png\n~~~\nMEDIA:/tmp/z.png", (), f"{FENCE}\nMEDIA:/tmp/x.png\n~~~\nMEDIA:/tmp/z.png", False, False, id="fence-needs-same-char"),
    pytest.param(f"text\n{FENCE}sh\nMEDIA:/tmp/x.png\n\nmore", (), f"text\n{FENCE}sh\nMEDIA:/tmp/x.png\n\nmore", False, False, id="unterminated-fence-to-end"),
    pytest.param(f"{FENCE}\na\n\n\n\nb\n{FENCE}\n\n\n\nc", (), f"{FENCE}\na\n\n\n\nb\n{FENCE}\n\nc", False, False, id="blank-lines-in-fence-kept"),
    pytest.param(f"  {FENCE}\n  MEDIA:/tmp/x.png\n  {FENCE}", (), f"{FENCE}\n  MEDIA:/tmp/x.png\n  {FENCE}", False, False, id="indented-fence"),
    pytest.param(f"- item\n  {FENCE}\n  MEDIA:/tmp/x.png\n  {FENCE}", (), f"- item\n  {FENCE}\n  MEDIA:/tmp/x.png\n  {FENCE}", False, False, id="fence-in-list"),
    pytest.param(f"> {FENCE}\n> MEDIA:/tmp/x.png\n> {FENCE}", (), f"> {FENCE}\n> MEDIA:/tmp/x.png\n> {FENCE}", False, False, id="fence-in-quote"),
    pytest.param(f"x {FENCE}MEDIA:/tmp/x.png{FENCE} y", (), f"x {FENCE}MEDIA:/tmp/x.png{FENCE} y", False, False, id="triple-backtick-inline"),
    pytest.param(f"MEDIA:/tmp/a.png\n{FENCE}\n[[audio_as_voice]]\n{FENCE}", ("/tmp/a.png",), f"{FENCE}\n[[audio_as_voice]]\n{FENCE}", False, False, id="directive-in-fence"),
    pytest.param("`[[as_document]]` MEDIA:/a.png", ("/a.png",), "`[[as_document]]`", False, False, id="directive-in-inline-code"),
    # --- directives
    pytest.param("[[audio_as_voice]] MEDIA:/tmp/a.ogg", ("/tmp/a.ogg",), "", True, False, id="audio-as-voice"),
    pytest.param("MEDIA:/tmp/a.png\n[[as_document]]", ("/tmp/a.png",), "", False, True, id="as-document"),
    pytest.param("Here [[ AUDIO_AS_VOICE ]] you go", (), "Here you go", True, False, id="directive-case-spaces"),
    pytest.param("x[[As_Document]]y [[\taudio_as_voice\t]]", (), "x y", True, True, id="both-directives"),
    pytest.param("[[as_document]][[as_document]]hi", (), "hi", False, True, id="repeated-directive"),
    pytest.param("[[as document]] [[other]]", (), "[[as document]] [[other]]", False, False, id="unknown-directives-kept"),
    pytest.param("[[audio_as_voice\n]]", (), "[[audio_as_voice\n]]", False, False, id="directive-not-across-lines"),
    # --- odd input: never raises, never re-forms a tag
    pytest.param("MEDIA:[[as_document]]/x.png", (), "MEDIA\u200b:/x.png", False, True, id="no-tag-formed-by-cut"),
    pytest.param("MEDIA:MEDIA:/a.png", ("/a.png",), "MEDIA:", False, False, id="double-prefix"),
    pytest.param("MULTIMEDIA:/a.png", ("/a.png",), "MULTI", False, False, id="glued-prefix-word"),
]


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
    t0 = time.perf_counter()
    parse_reply(reply)
    assert time.perf_counter() - t0 < 2.0


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
