"""The outbox platform: a real adapter that writes each delivery to
``<outbox dir>/<chat>/`` as the file itself plus one JSON line in
``deliveries.jsonl`` (kind, name, caption, size, sha256). The console email
backend of courier, for development, demos and tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from pathlib import Path

from adapters.errors import Permanent, Transient
from adapters.platforms.base import FileSource, Kind, Limits, Platform, Sent
from storage.volume import sweep_stale

_SAFE = re.compile(r"[^A-Za-z0-9._@+-]")
LOG_NAME = "deliveries.jsonl"


def safe_name(name: str, fallback: str = "file") -> str:
    name = _SAFE.sub("_", os.path.basename(name)).lstrip(".")
    return name[:120] or fallback


class OutboxPlatform(Platform):
    name = "outbox"
    limits = Limits(
        text_chars=100_000,
        caption_chars=4096,
        upload_bytes=2 * 1024**3,
        photo_bytes=None,
        native_kinds=frozenset(Kind),
    )

    #: a 0-byte file is written as it is (chat platforms refuse one before any upload)
    takes_empty_files = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._made: set[Path] = set()  # chat dirs known to exist

    def _chat_dir(self, chat: str) -> Path:
        safe = _SAFE.sub("_", chat).strip(".")
        if not safe:
            raise Permanent(f"invalid outbox chat {chat!r}")
        d = self.root / safe
        if d in self._made:
            return d
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Transient(f"outbox {d} is not writable: {exc.strerror}") from exc
        if len(self._made) > 10_000:
            self._made.clear()
        self._made.add(d)
        return d

    def _log(self, d: Path, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(d / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            self._made.discard(d)
            raise Transient(f"outbox log write failed: {exc.strerror or exc}") from exc
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def sweep_partial(self, older_than_s: float = 3600) -> int:
        """`.part` files of sends killed mid-write, older than `older_than_s`."""
        if not self.root.is_dir():
            return 0
        return sweep_stale(self.root.glob("*/.*.part"), older_than_s)

    def send_text(self, chat: str, text: str, *, delivery_id: str) -> Sent:
        d = self._chat_dir(chat)
        self._log(d, {"delivery_id": delivery_id, "kind": Kind.TEXT.value, "text": text, "ts": time.time()})
        return Sent(message_id=delivery_id)

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        d = self._chat_dir(chat)
        # the whole delivery id: same-named files of one job are kept apart
        fname = f"{_SAFE.sub('_', delivery_id)}-{safe_name(file.name)}"
        tmp = d / f".{uuid.uuid4().hex}.part"
        digest = hashlib.sha256()
        size = 0
        try:
            with file.open() as src, open(tmp, "wb") as out:
                while chunk := src.read(1024 * 1024):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            os.replace(tmp, d / fname)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._made.discard(d)  # made again on the retry
            raise Transient(f"outbox write failed: {exc.strerror or exc}") from exc
        self._log(d, {
            "delivery_id": delivery_id, "kind": kind.value, "name": file.name, "file": fname,
            "caption": caption, "size_bytes": size, "sha256": digest.hexdigest(), "ts": time.time(),
        })
        return Sent(message_id=delivery_id)


def read_log(outbox_dir: str | os.PathLike[str], chat: str) -> list[dict]:
    """The outbox log of one chat, in delivery order ([] when nothing arrived)."""
    p = Path(outbox_dir) / _SAFE.sub("_", chat).strip(".") / LOG_NAME
    if not p.exists():
        return []
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
