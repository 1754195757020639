"""Reply parsing, plain Python: `parse_reply(text)` finds the `MEDIA:<path>` tags and the
`[[audio_as_voice]]`, `[[as_document]]` directives (any case, spaces or tabs inside; they set the
flags) of an agent's reply, outside code, and returns the chat text without them (the kind a file
goes as is routing's). It never raises for a `str`; anything else is a `TypeError`.

Tags
- `MEDIA:` exactly (upper case, no space after the colon), glued to a word or not.
- Only absolute (`/x`, not `//x`) and home-relative (`~/x`) paths, returned as written;
  anything else stays text. At most 4096 characters (PATH_MAX), which bounds every
  search: parsing stays near-linear.
- A path holding a control character is a tag all the same: cut from the text and
  refused by the extraction, the chat told (`has_control`). A quoted path cut by a line
  break is one such tag when the quotes enclose no other whitespace.
- Quoted paths (`"..."`, `'...'`, a backtick run closed by a run as long) may hold spaces
  and close on the same line, whitespace just inside dropped. `"` and `'` close at the
  first quote followed by whitespace, punctuation or the line end (`'/a/bob's x.png'`),
  else at the first one; an unclosed quote is skipped and the path read unquoted.
- Unquoted paths end at whitespace, a backtick, `MEDIA:` or a directive; then trailing
  punctuation (ASCII and CJK) is dropped unless it closes a bracket opened in the path,
  and text glued after a known extension in the last component (an upper-case letter,
  two ASCII letters, a non-ASCII letter, punctuation: `/tmp/chart.pngHere`) is cut off;
  one lower-case letter, digits, `.`, `-`, `_`, `~` stay (`/tmp/a.docs`).
- Bracket, quote and emphasis pairs tightly around a tag go with it (`**MEDIA:/a.png**`).
- Duplicates deliver once, where first named.

Code: fenced blocks (three or more backticks or tildes, after optional indentation, list
markers or `>`; closed by a line of the same character at least as long, else at the
end) and inline code (a backtick run closed by one as long before the next blank line)
are kept byte for byte: no tags, no directives. A backtick run right after `MEDIA:`
quotes the path when it closes on the line around a valid path, else opens code.

Text: around a cut, a line's indentation is kept and separators after a cut at its
start dropped; at a line's end or before closing punctuation the whitespace goes, and of
two separators meeting one goes (`Done: MEDIA:/a.png.` -> `Done.`); elsewhere one
whitespace character stays, or a space between two glued words. A line a cut leaves
blank goes; outside fenced code blank runs collapse to one; the result is stripped. A
tag that cutting glues together gets a zero-width space after `MEDIA`: the text never
yields a delivery. C0/C1 controls and DEL are removed, except `\n`, `\t`, `\r`.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from dataclasses import dataclass

from tasks.delivery.routing import KNOWN_EXT

__all__ = ["ParsedReply", "has_control", "parse_reply"]

#: the extensions the glued-text rule knows
_EXT_NAMES = frozenset(e[1:] for e in KNOWN_EXT)
_EXT_BY_LEN = sorted(_EXT_NAMES, key=lambda e: (-len(e), e))

_TAG = "MEDIA:"
_TRAIL_PUNCT = frozenset(".,;:!?)]}>\"'*|" "。，！？、；：）」』】》〉”’…．")
_OPENER_OF = {")": "(", "]": "[", "}": "{", "）": "（", "」": "「", "』": "『", "】": "【", "》": "《", "〉": "〈"}
_CUT_PUNCT_ASCII = frozenset(",;:!?)]}>\"'*|<([{")
_CLOSING_PUNCT = frozenset(".,;:!?)]}>" "。，！？、；：）」』】》〉…．")
_SEP_PUNCT = frozenset(".,;:!?" "。，！？、；：…．")
_FINAL_PUNCT = frozenset(".!?" "。！？…．")
_WRAP_PAIRS = {
    "(": ")", "[": "]", "{": "}", "<": ">", '"': '"', "'": "'", "*": "*",
    "“": "”", "‘": "’", "「": "」", "『": "』", "【": "】", "（": "）", "《": "》", "〈": "〉",
}  # fmt: skip

_DIRECTIVE_RE = re.compile(r"\[\[[ \t]*(audio_as_voice|as_document)[ \t]*\]\]", re.IGNORECASE)
_FENCE_PREFIX = r"(?:[ \t]*(?:>|[-*+][ \t]|\d{1,9}[.)][ \t]))*[ \t]*"
_FENCE_OPEN_RE = re.compile(_FENCE_PREFIX + r"(`{3,}|~{3,})([^\n]*)")
_SPECIAL_RE = re.compile(r"\n|`|\[\[|MEDIA:")
_UNQUOTED_END_RE = re.compile(r"\s|`|MEDIA:|\[\[")
_BACKTICKS_RE = re.compile(r"`+")
_BLANK_LINE_RE = re.compile(r"\n[ \t\r]*(?=\n)")
_ZWSP = "\u200b"
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_CLOSING_QUOTE_RE = {
    q: re.compile(re.escape(q) + r"(?=\s|[" + re.escape("".join(sorted(_TRAIL_PUNCT))) + r"]|MEDIA:|$)")
    for q in "\"'"
}
#: longest path a tag may name (Linux PATH_MAX); bounds every search
_MAX_PATH = 4096


@dataclass(frozen=True)
class ParsedReply:
    #: reply text with MEDIA tags and directives removed, whitespace tidied
    text: str
    #: paths in reply order, duplicates removed (first occurrence wins)
    media: tuple[str, ...]
    #: the directives present
    audio_as_voice: bool
    as_document: bool


def _valid_path(path: str) -> bool:
    """A tag's path: absolute or `~/`-relative, not `//`, at most PATH_MAX (control characters allowed)."""
    home = path.startswith("~/") and len(path) > 2
    absolute = path.startswith("/") and len(path) > 1 and not path.startswith("//")
    return (home or absolute) and len(path) <= _MAX_PATH


def has_control(path: str) -> bool:
    """Whether a path holds a control character (NUL, a newline, ESC ...): a
    tag naming one is never extracted (tasks/turn/extract.py refuses it)."""
    return any(unicodedata.category(ch) == "Cc" for ch in path)


def _glued(rest: str) -> bool:
    """Does `rest`, directly after a known extension, look like glued text?"""
    c = rest[0]
    if c.isascii():
        if c.isalpha():  # upper case, or two or more letters
            return c.isupper() or (len(rest) > 1 and rest[1].isascii() and rest[1].isalpha())
        return c in _CUT_PUNCT_ASCII
    return c.isalpha() or unicodedata.category(c)[0] in "PS"


def _clean_unquoted(tok: str) -> str:
    # 1. trailing punctuation (closing brackets only when unbalanced)
    while tok and tok[-1] in _TRAIL_PUNCT:
        ch = tok[-1]
        opener = _OPENER_OF.get(ch)
        if opener is not None and tok.count(opener) >= tok.count(ch):
            break
        tok = tok[:-1]
    # 2. text glued after a known extension, in the last component
    base = tok.rfind("/") + 1
    name = tok[base:]
    dot = name.rfind(".")
    if dot > 0 and name[dot + 1 :].lower() in _EXT_NAMES:
        return tok
    j = name.find(".", 1)
    while j != -1:
        low = name[j + 1 : j + 1 + 8].lower()
        for ext in _EXT_BY_LEN:
            if low.startswith(ext):
                end = j + 1 + len(ext)
                if end < len(name) and _glued(name[end:]):
                    return tok[: base + end]
                break  # the longest matching extension decides
        j = name.find(".", j + 1)
    return tok


class _Scanner:
    """One left-to-right pass: code spans (kept), tags and directives (cut)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.n = len(text)
        self.runs: dict[int, list[int]] = {}  # backtick runs' starts, by their length
        for m in _BACKTICKS_RE.finditer(text):
            self.runs.setdefault(m.end() - m.start(), []).append(m.start())
        self.blanks = [m.start() for m in _BLANK_LINE_RE.finditer(text)]
        #: (kind, str): "t" text, "c" inline code, "f" fenced code, "x" cut
        self.pieces: list[tuple[str, str]] = []
        self.media: list[str] = []
        self.tag_starts: list[int] = []
        self.audio_as_voice = False
        self.as_document = False

    def _emit(self, kind: str, s: str) -> None:
        if s or kind == "x":
            self.pieces.append((kind, s))

    def _fence_end(self, m: re.Match[str]) -> int:
        fence = m.group(1)
        close = re.compile(_FENCE_PREFIX + re.escape(fence[0]) + "{%d,}[ \t]*\r?$" % len(fence))
        pos = m.end()
        while pos < self.n:  # pos is at the '\n' ending the previous line
            start = pos + 1
            nl = self.text.find("\n", start)
            end = self.n if nl == -1 else nl
            if close.match(self.text[start:end]):
                return end
            pos = end
        return self.n

    def _run_len(self, i: int) -> int:
        """The length of the backtick run at `i`."""
        m = _BACKTICKS_RE.match(self.text, i)
        return m.end() - i if m else 0

    def _inline_code_end(self, i: int, k: int) -> int:
        """End of the code span opened by the k-backtick run at i, or -1."""
        starts = self.runs.get(k, ())
        idx = bisect_right(starts, i)
        if idx >= len(starts):
            return -1
        b = bisect_right(self.blanks, i)
        limit = self.blanks[b] if b < len(self.blanks) else self.n
        close = starts[idx]
        return close + k if close < limit else -1

    def _split_quoted(self, q: str, start: int) -> tuple[str, int] | None:
        """A quoted path a line break cuts (`MEDIA:"/w/a<newline>b.png"`): one tag, its
        path holding the break, when what the quotes enclose has no other
        whitespace (prose spanning lines has spaces: it stays text)."""
        limit = min(self.n, start + _MAX_PATH + 1)
        m = _CLOSING_QUOTE_RE[q].search(self.text, start, limit)
        if m is None:
            return None
        inner = self.text[start : m.start()]
        if "\n" not in inner or any(ch.isspace() for ch in inner.replace("\n", "").replace("\r", "")):
            return None
        return (inner, m.end()) if _valid_path(inner) else None

    def _unquoted(self, start: int) -> tuple[str, int] | None:
        text = self.text
        limit = min(self.n, start + _MAX_PATH + 1)
        m = _UNQUOTED_END_RE.search(text, start, limit)
        while m is not None and m.group() == "[[" and _DIRECTIVE_RE.match(text, m.start()) is None:
            m = _UNQUOTED_END_RE.search(text, m.start() + 2, limit)  # `[[` of no directive: part of the path
        end = limit if m is None else m.start()
        if end - start > _MAX_PATH:
            return None
        path = _clean_unquoted(text[start:end])
        return (path, start + len(path)) if _valid_path(path) else None

    def _tag_at(self, p: int) -> tuple[str, int] | None:
        """Parse the path after `MEDIA:` (p is just past the colon)."""
        text = self.text
        if p >= self.n:
            return None
        c = text[p]
        line_end = text.find("\n", p, p + _MAX_PATH + 16)
        if line_end == -1:
            line_end = min(self.n, p + _MAX_PATH + 16)
        if c in "\"'":
            # the first quote followed by a boundary, else the first quote
            m = _CLOSING_QUOTE_RE[c].search(text, p + 1, line_end)
            q = m.start() if m is not None else text.find(c, p + 1, line_end)
            if q != -1:
                path = text[p + 1 : q].strip()
                return (path, q + 1) if _valid_path(path) else None
            return self._split_quoted(c, p + 1) or self._unquoted(p + 1)
        if c == "`":
            k = self._run_len(p)
            m = re.compile(r"(?<!`)`{%d}(?!`)" % k).search(text, p + k, line_end)
            if m is not None:
                path = text[p + k : m.start()].strip()
                return (path, m.end()) if _valid_path(path) else None
            return self._unquoted(p + k)
        return self._unquoted(p)

    def scan(self) -> _Scanner:
        text, n = self.text, self.n
        seen: set[str] = set()
        i = 0
        line_start = True
        while i < n:
            if line_start:
                line_start = False
                m = _FENCE_OPEN_RE.match(text, i)
                if m is not None and (m.group(1)[0] == "~" or "`" not in m.group(2)):
                    end = self._fence_end(m)
                    self._emit("f", text[i:end])
                    i = end
                    continue
            m = _SPECIAL_RE.search(text, i)
            if m is None:
                self._emit("t", text[i:])
                break
            j = m.start()
            self._emit("t", text[i:j])
            tok = m.group()
            if tok == "\n":
                self._emit("t", "\n")
                i = j + 1
                line_start = True
            elif tok == "`":
                k = self._run_len(j)
                end = self._inline_code_end(j, k)
                if end == -1:
                    self._emit("t", text[j : j + k])
                    i = j + k
                else:
                    self._emit("c", text[j:end])
                    i = end
            elif tok == "[[":
                d = _DIRECTIVE_RE.match(text, j)
                if d is None:
                    self._emit("t", "[[")
                    i = j + 2
                else:
                    setattr(self, d.group(1).lower(), True)  # audio_as_voice | as_document: all it matches
                    self._emit("x", "")
                    i = d.end()
            else:  # MEDIA:
                res = self._tag_at(j + len(_TAG))
                if res is None:
                    self._emit("t", _TAG)
                    i = j + len(_TAG)
                    continue
                path, end = res
                # a pair wrapped tightly around the tag goes with it (text pieces are never empty)
                while end < n and self.pieces and self.pieces[-1][0] == "t" \
                        and _WRAP_PAIRS.get(self.pieces[-1][1][-1]) == text[end]:
                    self._emit("t", self.pieces.pop()[1][:-1])
                    end += 1
                self._emit("x", "")
                self.tag_starts.append(j)
                if path not in seen:
                    seen.add(path)
                    self.media.append(path)
                i = end
        return self


def _is_hspace(ch: str) -> bool:
    return ch not in "\n\r" and ch.isspace()


def _wordy(ch: str) -> bool:
    return ch.isalnum() and ord(ch) < 0x2E80  # not CJK and friends


def _tidy_line(s: str, cuts: list[int]) -> str | None:
    cr = s.endswith("\r")
    if cr:
        s = s[:-1]
    if not s.strip():
        return None
    runs: dict[tuple[int, int], int] = {}
    for c in cuts:
        a = c
        while a > 0 and _is_hspace(s[a - 1]):
            a -= 1
        b = c
        while b < len(s) and _is_hspace(s[b]):
            b += 1
        runs[(a, b)] = min(runs.get((a, b), c), c)
    for (a, b), cmin in sorted(runs.items(), reverse=True):
        if a == 0:
            repl = s[:cmin]
            if b < len(s) and s[b] in _SEP_PUNCT:  # "MEDIA:/a.png, here" -> "here"
                while b < len(s) and s[b] in _SEP_PUNCT:
                    b += 1
                while b < len(s) and _is_hspace(s[b]):
                    b += 1
        elif b == len(s):
            repl = ""
        elif s[b] in _CLOSING_PUNCT:
            repl = ""
            if s[a - 1] in _SEP_PUNCT and s[b] in _SEP_PUNCT:
                # "Done: MEDIA:/a.png." -> "Done."; "a, MEDIA:/b.png, c" -> "a, c"
                if s[a - 1] not in _FINAL_PUNCT and s[b] in _FINAL_PUNCT:
                    a -= 1
                else:
                    b += 1
        elif b > a:
            repl = s[a]
        else:
            repl = " " if _wordy(s[a - 1]) and _wordy(s[b]) else ""
        s = s[:a] + repl + s[b:]
    if not s.strip():
        return None
    return s + ("\r" if cr else "")


def _assemble(pieces: list[tuple[str, str]]) -> str:
    lines: list[list[tuple[str, str]]] = [[]]
    for kind, s in pieces:
        if kind == "x":
            lines[-1].append(("x", ""))
            continue
        for k, part in enumerate(s.split("\n")):
            if k:
                lines.append([])
            lines[-1].append((kind, part))
    kept: list[tuple[str, bool]] = []  # (line, may collapse as blank)
    for segs in lines:
        if any(kind == "f" for kind, _ in segs):
            kept.append(("".join(part for _, part in segs), False))
            continue
        s = ""
        cuts: list[int] = []
        for kind, part in segs:
            if kind == "x":
                cuts.append(len(s))
            else:
                s += part
        if cuts:
            tidied = _tidy_line(s, cuts)
            if tidied is None:
                continue
            s = tidied
        kept.append((s, True))
    out: list[str] = []
    prev_blank = False
    for s, collapsible in kept:
        blank = collapsible and not s.strip()
        if blank and prev_blank:
            continue
        out.append("" if blank else s)
        prev_blank = blank
    return "\n".join(out).strip()


def _defuse(text: str) -> str:
    for _ in range(text.count(_TAG) + 1):
        starts = _Scanner(text).scan().tag_starts
        if not starts:
            break
        for j in sorted(set(starts), reverse=True):
            cut = j + len(_TAG) - 1
            text = text[:cut] + _ZWSP + text[cut:]
    return text


def parse_reply(text: str) -> ParsedReply:
    """Split an agent reply into chat text, MEDIA paths and directive flags."""
    if not isinstance(text, str):
        raise TypeError(f"parse_reply() wants str, not {type(text).__name__}")
    text = str(text)
    sc = _Scanner(text).scan()
    out = _assemble(sc.pieces)
    if sc.tag_starts or sc.audio_as_voice or sc.as_document:
        out = _defuse(out)
    clean = _CONTROL_RE.sub("", out)
    if clean != out:  # what a control character kept apart may now read as a tag: defuse it
        out = _defuse(clean).strip()
    return ParsedReply(text=out, media=tuple(sc.media), audio_as_voice=sc.audio_as_voice,
                       as_document=sc.as_document)
