"""The janitor: expire screenshots (24 h), delivered files, hook-output spills,
and old turn workspaces of local sandboxes."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time

from tasks.runtime import Context

#: storage prefix -> context extra holding its time to live
RETENTION = {
    "screenshots/": "screenshot_ttl_s",
    "files/": "file_ttl_s",
    "inbound/": "file_ttl_s",
    "hook_outputs/": "spill_ttl_s",
}
DEFAULT_TTL_S = {"screenshot_ttl_s": 24 * 3600, "file_ttl_s": 7 * 24 * 3600, "spill_ttl_s": 7 * 24 * 3600}
DEFAULT_WORKSPACE_TTL_S = 24 * 3600

log = logging.getLogger(__name__)


def sweep(ctx: Context) -> dict:
    from storage.retention import expire

    out: dict[str, int] = {}
    for prefix, setting in RETENTION.items():
        ttl = int(ctx.extras.get(setting, DEFAULT_TTL_S[setting]))
        out[prefix.rstrip("/")] = expire(ctx.store, prefix, ttl)
    out["partial_writes"] = ctx.store.sweep_tmp()  # temp files, unfinished multipart uploads
    out["outbox_partial_writes"] = ctx.platform("outbox").sweep_partial()
    out["workspaces"] = sweep_workspaces(_agent_dirs(ctx), int(ctx.extras.get("workspace_ttl_s",
                                                                              DEFAULT_WORKSPACE_TTL_S)))
    return out


def _agent_dirs(ctx: Context) -> list[str]:
    """Local agent sandbox directories: every one under the default sandbox
    dir, plus those agents name (`extras["agent_sandbox_dirs"]`)."""
    dirs = list(ctx.extras.get("agent_sandbox_dirs") or ())
    try:
        with os.scandir(ctx.default_sandbox_dir) as it:
            dirs += [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        pass
    return dirs


def sweep_workspaces(agent_dirs: list[str], ttl_s: int, now: float | None = None) -> int:
    """Delete `<agent dir>/turns/<job>` directories last modified more than
    `ttl_s` ago (links are never followed: a link standing there is removed,
    not what it points to). Returns how many went."""
    from tasks.turn import TURNS_DIR

    cutoff = (time.time() if now is None else now) - ttl_s
    n = 0
    for d in dict.fromkeys(agent_dirs):
        turns = os.path.join(d, TURNS_DIR)
        try:
            entries = list(os.scandir(turns))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
                if st.st_mtime > cutoff:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(e.path)
                else:
                    os.unlink(e.path)
                n += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("could not delete the old turn workspace %s: %s", e.path, exc)
    return n
