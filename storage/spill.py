"""Hook output spill: context over the cap goes to storage, the prompt gets a preview.

Hooks run before each LLM call and may return ``{"context": "..."}``. When that
text is longer than ``max_chars`` the full text is written to the blob store at
``<directory>/<sanitised session id>/<sha256 of the text>.txt`` (once per text
and session; ``private=True``: 0600
files in 0700 directories on a volume) and the prompt gets::

    [<source> output truncated — <N:,> chars; full content saved to <location>]
    --- head ---
    <first preview_head chars>
    --- tail ---
    <last preview_tail chars>

Decisions (beyond DESIGN.md):

* within the cap means ``len(text) <= max_chars``: a text exactly at the cap is
  returned unchanged; ``enabled=False`` returns every text unchanged;
* lengths are in characters (``str`` length), as is the header's ``N``;
* the tail section appears only when the text is longer than the head, and it
  never repeats characters already in the head (it starts at
  ``max(preview_head, N - preview_tail)``);
* ``preview_head = 0`` drops the head section, ``preview_tail = 0`` the tail
  section (both 0: the header line only); negative values count as 0;
* the preview's size is set by ``preview_head + preview_tail`` plus the header,
  not by ``max_chars``;
* no store (None) is reported like a failed write; the written file is UTF-8
  (unencodable lone surrogates become U+FFFD), streamed in chunks from the
  original string (no second full copy is built);
* it never raises: a failed write (or anything else going wrong) gives the
  ``full content unavailable — spill write failed`` header and the preview
  still bounds the prompt.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from storage import prefixes
from storage.base import BlobStore, check_key

log = logging.getLogger(__name__)

#: characters encoded and written per chunk (~256 KiB to 1 MiB of UTF-8)
WRITE_CHUNK_CHARS = 256 * 1024
#: longest sanitised session id (a hash keeps long ids distinct)
MAX_SESSION_ID_CHARS = 96

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_DOTS = re.compile(r"\.{2,}")


@dataclass(frozen=True)
class SpillConfig:
    enabled: bool = True
    max_chars: int = 10000
    preview_head: int = 500
    preview_tail: int = 500
    directory: str = prefixes.SPILL


def sanitize_session_id(s: str) -> str:
    """A single safe path segment for a session id.

    Keeps ``[A-Za-z0-9._-]``; everything else (``/``, ``\\``, NUL, ``:``,
    non-ASCII) becomes ``_``; runs of dots become ``_`` and a leading dot too
    (no ``..``, no hidden names). When anything changed, or the id is longer
    than :data:`MAX_SESSION_ID_CHARS`, a short hash of the original is added
    so different ids stay different. Empty -> ``unknown``.
    """
    s = "" if s is None else str(s)
    if not s:
        return "unknown"
    safe = _DOTS.sub("_", _UNSAFE.sub("_", s))
    if safe.startswith("."):
        safe = "_" + safe[1:]
    if safe == s and len(safe) <= MAX_SESSION_ID_CHARS:
        return safe
    digest = hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{safe[: MAX_SESSION_ID_CHARS - 11]}-{digest}"


def _as_text(text: object) -> str:
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    try:
        return str(text)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not break the turn
        return f"<unprintable {type(text).__name__}>"


def _one_line(s: object, limit: int = 120) -> str:
    s = " ".join(_as_text(s).split())
    return s[:limit] or "hook"


def _preview(text: str, header: str, head_n: int, tail_n: int) -> str:
    n = len(text)
    head_n = min(max(0, head_n), n)
    tail_n = max(0, tail_n)
    parts = [header]
    if head_n > 0:
        parts += ["--- head ---", text[:head_n]]
    if n > head_n and tail_n > 0:
        parts += ["--- tail ---", text[max(head_n, n - tail_n):]]
    return "\n".join(parts)


def _write(store: BlobStore, key: str, text: str) -> None:
    with store.open_write(key, private=True) as out:
        for i in range(0, len(text), WRITE_CHUNK_CHARS):
            out.write(text[i : i + WRITE_CHUNK_CHARS].encode("utf-8", "replace"))


def spill_key(session_id: str, directory: str = SpillConfig.directory, text: str | None = None) -> str:
    """``<directory>/<sanitised session id>/<name>.txt``: the name is the
    text's sha256 (first 32 hex digits) when `text` is given — one text, one
    key per session, so it is written once and the preview naming it stays
    the same from call to call (a stable prompt prefix for caching) — else a
    fresh uuid4."""
    d = directory.strip("/")
    key = f"{d}/" if d else ""
    return check_key(f"{key}{sanitize_session_id(session_id)}/{_name(text)}.txt")


def _name(text: str | None) -> str:
    if text is None:
        return uuid.uuid4().hex
    h = hashlib.sha256()
    for i in range(0, len(text), WRITE_CHUNK_CHARS):
        h.update(text[i : i + WRITE_CHUNK_CHARS].encode("utf-8", "replace"))
    return h.hexdigest()[:32]


def spill_if_needed(
    text: object,
    *,
    source: str,
    session_id: str,
    store: BlobStore | None,
    config: SpillConfig = SpillConfig(),
    place: Callable[[str], str] | None = None,
) -> str:
    """Return text unchanged when within ``max_chars`` (or disabled); else spill it.

    The full text goes to ``store`` at ``<directory>/<sanitised session id>/<sha256>.txt``
    (private; written once: the same text of the same session is not written
    again) and the preview comes back (see the module docstring). `place(key)`
    (optional) puts the spilled blob where the reader of the preview can open
    it (e.g. into an agent's workspace) and returns that path, which the
    header then names; if it fails, the header names the storage location.
    Never raises; non-str input is ``str()``-ed (None -> "").
    """
    try:
        text = _as_text(text)
        if not config.enabled or len(text) <= config.max_chars:
            return text
        n = len(text)
        label = _one_line(source)
        location = None
        try:
            if store is None:
                raise RuntimeError("no blob store configured")
            key = spill_key(session_id, config.directory, text)
            where = store.describe(key)
            if not store.exists(key):
                _write(store, key, text)
            location = where
            if place is not None:
                try:
                    location = place(key)
                except Exception as exc:  # noqa: BLE001 - the storage location still stands
                    log.warning("spilled output %s not placed for its reader: %s", key, exc)
        except Exception as exc:  # noqa: BLE001 - reported in the header, never raised
            log.warning("hook output spill failed (%s, %s chars): %s", label, f"{n:,}", exc)
        if location is not None:
            header = f"[{label} output truncated — {n:,} chars; full content saved to {location}]"
        else:
            header = f"[{label} output truncated — {n:,} chars; full content unavailable — spill write failed]"
        return _preview(text, header, config.preview_head, config.preview_tail)
    except Exception:  # noqa: BLE001 - last resort: still bounded, still no exception
        log.exception("hook output spill crashed")
        try:
            cap = max(0, int(config.max_chars))
        except Exception:  # noqa: BLE001
            cap = SpillConfig.max_chars
        return text[:cap] if isinstance(text, str) else ""
