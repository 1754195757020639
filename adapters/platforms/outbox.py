"""The outbox platform: a real adapter that writes each delivery to ``<outbox dir>/<chat>/`` as the file
itself plus one JSON line in ``deliveries.jsonl`` (kind, name, caption, size, sha256). The console email
backend of courier, for development, demos and tests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path

from adapters.errors import Permanent, Transient
from adapters.platforms.base import FileSource, Kind, Limits, Platform, Sent
from storage.volume import sweep_stale, unique_name

_SAFE = re.compile(r"[^A-Za-z0-9._@+-]")
LOG_NAME = "deliveries.jsonl"


def safe_name(name: str) -> str:
    return _SAFE.sub("_", os.path.basename(name)).lstrip(".")[:120] or "file"


class OutboxPlatform(Platform):
    name = "outbox"
    limits = Limits(text_chars=100_000, caption_chars=4096, upload_bytes=2 * 1024**3)

    #: a 0-byte file is written as it is (chat platforms refuse one before any upload)
    takes_empty_files = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._made: dict[str, str] = {}  # chat -> its directory (a string), known to exist

    def _chat_dir(self, chat: str) -> str:
        d = self._made.get(chat)
        if d is not None:
            return d
        safe = _SAFE.sub("_", chat).strip(".")
        if not safe:
            raise Permanent(f"invalid outbox chat {chat!r}")
        path = self.root / safe
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Transient(f"outbox {path} is not writable: {exc.strerror}") from exc
        if len(self._made) > 10_000:
            self._made.clear()
        d = self._made[chat] = str(path)
        return d

    def _log(self, chat: str, d: str, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(f"{d}/{LOG_NAME}", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._made.pop(chat, None)
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
        self._log(chat, d, {"delivery_id": delivery_id, "kind": Kind.TEXT.value, "text": text, "ts": time.time()})
        return Sent(message_id=delivery_id)

    def send_file(self, chat: str, kind: Kind, file: FileSource, *, caption: str | None, delivery_id: str,
                  file_id: str | None = None) -> Sent:
        d = self._chat_dir(chat)
        # the whole delivery id: same-named files of one job are kept apart
        fname = f"{_SAFE.sub('_', delivery_id)}-{safe_name(file.name)}"
        tmp = f"{d}/.{unique_name()}.part"
        digest = hashlib.sha256()
        size = 0
        try:
            with file.open() as src:
                # a plain descriptor (a name of our own, O_EXCL): no buffered file object around it
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    while chunk := src.read(1024 * 1024):
                        digest.update(chunk)
                        size += len(chunk)
                        _write_all(out, chunk)
                finally:
                    os.close(out)
            os.replace(tmp, f"{d}/{fname}")
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self._made.pop(chat, None)  # made again on the retry
            raise Transient(f"outbox write failed: {exc.strerror or exc}") from exc
        self._log(chat, d, {
            "delivery_id": delivery_id, "kind": kind.value, "name": file.name, "file": fname,
            "caption": caption, "size_bytes": size, "sha256": digest.hexdigest(), "ts": time.time(),
        })
        return Sent(message_id=delivery_id)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_log(outbox_dir: str | os.PathLike[str], chat: str) -> list[dict]:
    """The outbox log of one chat, in delivery order ([] when nothing arrived)."""
    p = Path(outbox_dir) / _SAFE.sub("_", chat).strip(".") / LOG_NAME
    if not p.exists():
        return []
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
