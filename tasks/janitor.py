"""The janitor: expire screenshots (24 h), delivered files, hook-output spills."""

from __future__ import annotations

from tasks.runtime import Context

#: storage prefix -> context extra holding its time to live
RETENTION = {
    "screenshots/": "screenshot_ttl_s",
    "files/": "file_ttl_s",
    "inbound/": "file_ttl_s",
    "hook_outputs/": "spill_ttl_s",
}
DEFAULT_TTL_S = {"screenshot_ttl_s": 24 * 3600, "file_ttl_s": 7 * 24 * 3600, "spill_ttl_s": 7 * 24 * 3600}


def sweep(ctx: Context) -> dict:
    from storage.retention import expire

    out: dict[str, int] = {}
    for prefix, setting in RETENTION.items():
        ttl = int(ctx.extras.get(setting, DEFAULT_TTL_S[setting]))
        out[prefix.rstrip("/")] = expire(ctx.store, prefix, ttl)
    out["partial_writes"] = ctx.store.sweep_tmp()  # temp files, unfinished multipart uploads
    out["outbox_partial_writes"] = ctx.platform("outbox").sweep_partial()
    return out
