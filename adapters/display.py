r"""Names and short texts as they may be shown to a person: nothing invisible, nothing reordered.

A right-to-left override (U+202E) in `invoice\u202efdp.exe` makes a chat show `invoiceexe.pdf`;
`visible` escapes it as `\u202e`, as it does every control (Cc), format (Cf: bidi controls, zero-width
characters, tags), surrogate (Cs), private-use (Co), line and paragraph separator (Zl, Zp) and filler
that renders as nothing. A zero-width joiner between two emoji is kept (👩‍💻). It is the one function
used wherever a name is shown.
"""

from __future__ import annotations

import re
import unicodedata

#: characters that are not in an escaped category yet render as nothing
_INVISIBLE = frozenset("\u034f\u115f\u1160\u3164\uffa0")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
#: a quick pre-check: no character past ASCII's printable range and no control: nothing to escape
_PLAIN = re.compile(r"[\x20-\x7e]*")
_ZWJ = "\u200d"


def _emoji_side(c: str) -> bool:
    return unicodedata.category(c) in ("So", "Sk") or c == "\ufe0f"


def visible(text: str) -> str:
    """`text` with every invisible or reordering character escaped (see the module)."""
    if _PLAIN.fullmatch(text):
        return text
    out: list[str] = []
    last = len(text) - 1
    for i, c in enumerate(text):
        if c not in _INVISIBLE and unicodedata.category(c) not in _ESCAPED_CATEGORIES:
            out.append(c)
        elif c == _ZWJ and 0 < i < last and _emoji_side(text[i - 1]) and _emoji_side(text[i + 1]):
            out.append(c)  # an emoji sequence (👩‍💻), not a hidden character
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return "".join(out)
