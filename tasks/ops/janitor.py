"""The janitor: expire screenshots, delivered files, hook-output spills, partial writes and
old turn workspaces of local sandboxes. One sweep at a time: it holds a Redis lock, renewed
while it runs (a dead sweeper's lapses within LOCK_TTL_S); a second sweep finds it held and
leaves. `dry_run` counts what would go and touches nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import time

from tasks.ledger import keys, ledger
from tasks.messages import JsonObject
from tasks.runtime import Context
from tasks.workspaces import TURNS_DIR

#: partial writes (volume temp files, S3 multipart uploads, outbox `.part` files) this old are a dead writer's
PARTIAL_AGE_S = 3600
#: the sweep's lock lives this long unless renewed (every third of it, while the sweep runs)
LOCK_TTL_S = 60
#: `older_than_s` may not go below this: younger files may still be waiting for their delivery
MIN_OLDER_THAN_S = 3600

log = logging.getLogger(__name__)


def sweep(ctx: Context, *, dry_run: bool = False, older_than_s: float | None = None) -> JsonObject:
    """One sweep under the janitor's lock. Returns {"dry_run", "took_s", <what>: {"count",
    "bytes"}} for every prefix and the workspaces (partial writes: a count, none in a dry
    run), or {"skipped", "holder"} when another sweep runs. `older_than_s` replaces every
    TTL (at least MIN_OLDER_THAN_S)."""
    if older_than_s is not None and older_than_s < MIN_OLDER_THAN_S:
        raise ValueError(f"older_than_s must be at least {MIN_OLDER_THAN_S} s (files younger may still be waiting "
                         f"for their delivery), got {older_than_s:g}")
    r = ctx.redis
    key = keys.janitor_lock()
    token = ledger.new_token()
    if not ledger.take(r, key, token, LOCK_TTL_S):
        holder = r.get(key)
        log.info("janitor: another sweep is running (%s): this one is skipped", holder)
        return {"skipped": "another sweep is running", "holder": holder}
    try:
        with ledger.renewing(r, key, token, LOCK_TTL_S):
            return _sweep(ctx, dry_run=dry_run, older_than_s=older_than_s)
    finally:
        with contextlib.suppress(Exception):  # it lapses by itself
            ledger.release(r, key, token)


def install_lifecycle(ctx: Context) -> JsonObject:
    """Put the retention rules on the S3 bucket (ConfigError on another store)."""
    from adapters.errors import ConfigError

    if not hasattr(ctx.store, "install_lifecycle"):
        raise ConfigError("lifecycle rules are for S3 storage (COURIER_STORAGE_URL=s3://...); a volume is swept")
    # each prefix's TTL in whole days, rounded up (what an S3 lifecycle rule takes)
    days = {prefix: max(1, -(-int(ttl) // 86400)) for prefix, ttl in ctx.retention.ttls().items()}
    rules: JsonObject = ctx.store.install_lifecycle(days,  # S3Store's (checked above)
                                                    abort_multipart_days=max(1, -(-PARTIAL_AGE_S // 86400)))
    return rules


def _sweep(ctx: Context, *, dry_run: bool, older_than_s: float | None) -> JsonObject:
    from storage.retention import expire_stats

    t0 = time.monotonic()
    out: JsonObject = {"dry_run": dry_run}
    if ctx.retention.s3_lifecycle and hasattr(ctx.store, "install_lifecycle") and not dry_run \
            and older_than_s is None:
        # the S3 service expires the blobs (and stale multipart uploads) itself: the rules are all it takes
        res = install_lifecycle(ctx)
        out.update({prefix.rstrip("/"): None for prefix in ctx.retention.ttls()})  # not counted
        out["partial_writes"] = None
        out["s3_lifecycle"] = {"rules": len(res["rules"]), "changed": res["changed"]}
    else:
        for prefix, prefix_ttl in ctx.retention.ttls().items():
            ttl = older_than_s if older_than_s is not None else int(prefix_ttl)
            n, size = expire_stats(ctx.store, prefix, ttl, dry_run=dry_run)
            what = prefix.rstrip("/")
            if what in out:  # two prefixes of one kind would add up
                n, size = n + out[what]["count"], size + out[what]["bytes"]
            out[what] = {"count": n, "bytes": size}
        # a dry run counts no partial writes: nothing is touched
        out["partial_writes"] = None if dry_run else {"count": ctx.store.sweep_tmp(PARTIAL_AGE_S), "bytes": None}
    out["outbox_partial_writes"] = None if dry_run else {"count": ctx.platform("outbox").sweep_partial(),
                                                          "bytes": None}
    ttl = older_than_s if older_than_s is not None else int(ctx.retention.workspace_ttl_s)
    n, size = workspace_stats(_agent_dirs(ctx), int(ttl), dry_run=dry_run)
    out["workspaces"] = {"count": n, "bytes": size}
    out["took_s"] = round(time.monotonic() - t0, 3)
    return out


def _agent_dirs(ctx: Context) -> list[str]:
    """Local agent sandbox directories: every one under the default sandbox
    dir, plus those agents name (`retention.agent_sandbox_dirs`)."""
    dirs = list(ctx.retention.agent_sandbox_dirs)
    with contextlib.suppress(OSError), os.scandir(ctx.default_sandbox_dir) as it:
        dirs += [e.path for e in it if e.is_dir(follow_symlinks=False)]
    return dirs


def sweep_workspaces(agent_dirs: list[str], ttl_s: int, now: float | None = None) -> int:
    """Delete `<agent dir>/turns/<job>` entries last modified more than `ttl_s` ago (a link
    is removed, never followed). Returns how many went."""
    return workspace_stats(agent_dirs, ttl_s, now=now)[0]


def _du(path: str) -> int:
    """Bytes under `path` (links not followed)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def workspace_stats(agent_dirs: list[str], ttl_s: int, now: float | None = None, *,
                    dry_run: bool = False) -> tuple[int, int]:
    """`sweep_workspaces`, returning (workspaces, bytes): deleted, or with
    `dry_run` the ones that would be."""
    cutoff = (time.time() if now is None else now) - ttl_s
    n = size = 0
    for d in dict.fromkeys(agent_dirs):
        try:
            entries = list(os.scandir(os.path.join(d, TURNS_DIR)))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
                if st.st_mtime > cutoff:
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                bytes_ = _du(e.path) if is_dir else st.st_size
                if not dry_run:
                    if is_dir:
                        shutil.rmtree(e.path)
                    else:
                        os.unlink(e.path)
                n += 1
                size += bytes_
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("could not delete the old turn workspace %s: %s", e.path, exc)
    return n, size
