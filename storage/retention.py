"""Retention: delete blobs older than an age under a prefix (the janitor calls these).

Listing streams (``store.list`` with ages) and deletes go in batches
(``delete_many``; S3 sends up to 1000 keys a request), so memory stays at
one batch whatever the number of blobs. On a volume, directories under the
prefix that are empty and themselves older than the cutoff are removed too
(spill session directories would pile up otherwise); a directory touched
within the age window is left alone so a concurrent writer never loses it.
"""

from __future__ import annotations

import logging
import os
import time

from adapters.errors import ConfigError
from storage.base import BlobStore
from storage.spill import SpillConfig

log = logging.getLogger(__name__)

DELETE_BATCH = 1000


def expire(store: BlobStore, prefix: str, older_than_s: float, *, now: float | None = None,
           batch: int = DELETE_BATCH) -> int:
    """Delete every blob under `prefix` last modified more than `older_than_s` ago.

    Returns how many the store reports deleted. `prefix` must not be empty
    (expiring a whole store is never what a janitor means); `now` is for tests.
    """
    return expire_stats(store, prefix, older_than_s, now=now, batch=batch)[0]


def expire_stats(
    store: BlobStore,
    prefix: str,
    older_than_s: float,
    *,
    now: float | None = None,
    batch: int = DELETE_BATCH,
    dry_run: bool = False,
) -> tuple[int, int]:
    """`expire`, returning (blobs, bytes): deleted, or with `dry_run` the
    ones that would be (nothing is touched then)."""
    if not prefix or prefix.startswith("/") or ".." in prefix.split("/"):
        raise ConfigError(f"expire needs a non-empty relative prefix, got {prefix!r}")
    if older_than_s < 0:
        raise ConfigError(f"older_than_s must be >= 0, got {older_than_s!r}")
    cutoff = (time.time() if now is None else now) - older_than_s
    batch = max(1, int(batch))
    deleted = size = 0
    pending: list[str] = []
    for info in store.list(prefix):
        if info.modified_s < cutoff:
            size += int(info.size_bytes or 0)
            if dry_run:
                deleted += 1
                continue
            pending.append(info.key)
            if len(pending) >= batch:
                deleted += store.delete_many(pending)
                pending = []
    if pending:
        deleted += store.delete_many(pending)
    if not dry_run:
        _prune_empty_dirs(store, prefix, cutoff)
    return deleted, size


def expire_spills(
    store: BlobStore,
    older_than_s: float,
    directory: str = SpillConfig.directory,
    *,
    now: float | None = None,
) -> int:
    """Expire hook-output spills (``<directory>/<session>/<uuid>.txt``)."""
    d = directory.strip("/")
    return expire(store, f"{d}/", older_than_s, now=now)


def _prune_empty_dirs(store: BlobStore, prefix: str, cutoff: float) -> int:
    """Volume stores only: remove empty, old directories below `prefix`'s directory."""
    from storage.volume import VolumeStore

    if not isinstance(store, VolumeStore):
        return 0
    root = str(store.root)
    base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    if not base_rel:
        return 0  # never prune at the store root
    base = os.path.join(root, base_rel)
    removed = 0
    for dirpath, _dirnames, _files in os.walk(base, topdown=False):
        if os.path.samefile(dirpath, base):
            continue
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if not (rel + "/").startswith(prefix) and not rel.startswith(prefix):
            continue
        try:
            if os.stat(dirpath).st_mtime < cutoff:
                os.rmdir(dirpath)  # fails (and is skipped) unless empty
                removed += 1
        except OSError:
            pass
    return removed
