"""Fitting text and captions into a platform's limits: one place for all adapters."""

from __future__ import annotations


def split_text(text: str, limit_chars: int) -> list[str]:
    """Split `text` into parts of at most `limit_chars`, preferring paragraph,
    then line, then word boundaries; never loses or reorders characters
    (bar the whitespace at the cut)."""
    if limit_chars <= 0:
        raise ValueError("limit_chars must be positive")
    text = text.strip()
    parts: list[str] = []
    while len(text) > limit_chars:
        window = text[:limit_chars]
        cuts = (window.rfind(sep) for sep in ("\n\n", "\n", " "))
        cut = next((i for i in cuts if i > limit_chars // 4), limit_chars)
        part, text = text[:cut].rstrip(), text[cut:].lstrip()
        if part:
            parts.append(part)
    if text:
        parts.append(text)
    return parts


def fit_caption(caption: str | None, limit_chars: int, text_chars: int = 4096) -> tuple[str | None, list[str]]:
    """A caption that fits, plus the text messages that carry what did not: a caption over
    `limit_chars` goes as text messages after the file, split at the platform's text limit."""
    if not caption:
        return None, []
    caption = caption.strip()
    if 0 < limit_chars and len(caption) <= limit_chars:
        return caption, []
    return None, split_text(caption, text_chars)


def human_bytes(n: int) -> str:
    """Binary units, everywhere a size is shown (10 MiB is "10.0 MiB", never "10.5 MB")."""
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024 or unit == "GiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"
