"""Routing by extension: which platform `Kind` a file goes as (`route`; DESIGN.md,
"Routing by extension", whose table the `*_EXT` sets are, with dots, lower case).
`DOCUMENT_EXT` route as documents like any other extension and only help
`tasks.turn.reply`'s glued-text rule (`KNOWN_EXT`)."""

from __future__ import annotations

import os

from adapters.platforms.base import Kind

PHOTO_EXT: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp"})
ANIMATION_EXT: frozenset[str] = frozenset({".gif"})
VIDEO_EXT: frozenset[str] = frozenset({".mp4", ".mov", ".avi", ".mkv", ".3gp", ".webm"})
VOICE_EXT: frozenset[str] = frozenset({".ogg", ".opus"})
AUDIO_EXT: frozenset[str] = frozenset({".mp3", ".wav", ".m4a", ".flac"})
MEDIA_EXTENSIONS: frozenset[str] = PHOTO_EXT | ANIMATION_EXT | VIDEO_EXT | VOICE_EXT | AUDIO_EXT

#: common document types; routed as DOCUMENT like any unknown extension
DOCUMENT_EXT: frozenset[str] = frozenset({
    ".pdf", ".txt", ".md", ".csv", ".tsv", ".json", ".jsonl", ".xml", ".yaml", ".yml", ".html", ".htm", ".zip",
    ".gz", ".tgz", ".tar", ".bz2", ".xz", ".7z", ".rar", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".odt",
    ".ods", ".odp", ".rtf", ".epub", ".svg", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".log", ".ipynb",
    ".parquet", ".mpeg", ".mpg", ".m4v", ".aac"})

#: every extension the glued-text rule knows
KNOWN_EXT: frozenset[str] = MEDIA_EXTENSIONS | DOCUMENT_EXT


def route(filename: str | os.PathLike[str], *, voice: bool = False, as_document: bool = False,
          animation: bool = True, voice_notes: bool = True) -> Kind:
    """Kind for a file by extension (case-insensitive), per DESIGN.md's table. `animation`,
    `voice_notes`: the platform has those kinds (else a .gif is a PHOTO, a voice note AUDIO)."""
    name = os.fspath(filename).replace("\\", "/").rsplit("/", 1)[-1]
    ext = os.path.splitext(name)[1].lower()
    if as_document and ext in PHOTO_EXT | ANIMATION_EXT | VIDEO_EXT:
        return Kind.DOCUMENT
    if ext in PHOTO_EXT:
        return Kind.PHOTO
    if ext in ANIMATION_EXT:
        return Kind.ANIMATION if animation else Kind.PHOTO
    if ext in VIDEO_EXT:
        return Kind.VIDEO
    if ext in VOICE_EXT or ext in AUDIO_EXT:
        return Kind.VOICE if voice and voice_notes else Kind.AUDIO
    return Kind.DOCUMENT
