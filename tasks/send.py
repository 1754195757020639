"""An operator's send from its JSON form (Flower's async-apply, the
`courier.delivery.send` task): plain code, no Celery.

    {"target": "telegram:-100123",                 # required: <platform>:<chat id>
     "text": "nightly report",                     # optional: a text message, sent first
     "files": ["local:///srv/out/report.pdf",      # optional: sandbox URIs (local, docker, ssh,
               "docker://build-7/workspace/a.png?host=gpu1",  # modal, singularity) or absolute
               "/srv/out/chart.png"],              # paths (= local:///..., the local sandbox's roots apply)
     "caption": "for the first file",              # optional
     "voice": false, "as_document": false}         # optional

At least a text or one file. It goes through the ledger like `courier send`
(tasks.chains.enqueue with job_kind "send"): a job with receipts that
`courier status <job>` shows, the chat's lane, an extraction per file on its
sandbox's queue. Bad input raises `ConfigError` (nothing is enqueued).

The pre-checks (`check_file`, shared with `courier send`): what can be known
before enqueueing is refused then. A remote sandbox's path, which cannot be
resolved here, is refused when the path policy refuses it as written
(relative, `..`, the system denylist: /etc, /proc, ...). A local one is
resolved (links, allowed roots) and its size checked against the
extraction cap and the platform's upload limit for what it would go as.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.errors import ConfigError
from adapters.platforms.base import Platform, split_target
from adapters.sandboxes.base import Sandbox, SandboxRef
from tasks import chains
from tasks.messages import SendResult
from tasks.runtime import Context

FIELDS = ("text", "files", "caption", "voice", "as_document", "job_id")


def plan_send(ctx: Context, target: str, *, text: str | None = None, files: list[str] | None = None,
              caption: str | None = None, voice: bool = False, as_document: bool = False,
              job_id: str | None = None) -> chains.Plan:
    """The checked plan of a send (ConfigError on bad input)."""
    from adapters.sandboxes.base import parse_uri

    if not isinstance(target, str):
        raise ConfigError("target must be a string: <platform>:<chat id>")
    platform_name, _chat = split_target(target)
    platform = ctx.platform(platform_name)  # unknown or unconfigured: ConfigError
    if text is not None and not isinstance(text, str):
        raise ConfigError("text must be a string")
    if caption is not None and not isinstance(caption, str):
        raise ConfigError("caption must be a string")
    if files is None:
        files = []
    if isinstance(files, str) or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError("files must be a list of sandbox URIs or absolute paths")
    if not (text and text.strip()) and not files:
        raise ConfigError("nothing to send: give a text, files, or both")
    if ctx.max_files_per_job and len(files) > ctx.max_files_per_job:
        raise ConfigError(f"{len(files)} files: at most {ctx.max_files_per_job} go with one send "
                          "(COURIER_MAX_FILES_PER_JOB)")
    refs: list[chains.StoredFile | chains.SandboxFile] = []
    for f in files:
        uri = f if "://" in f else ("local://" + f if f.startswith("/") else None)
        if uri is None:
            raise ConfigError(f"not a sandbox URI or an absolute path: {f!r}")
        ref, path = parse_uri(uri)
        check_file(ctx.sandbox, platform, ref, path, f, voice=bool(voice), as_document=bool(as_document),
                   max_file_bytes=ctx.max_file_bytes)
        refs.append(chains.SandboxFile(ref=ref, path=path))
    return chains.Plan(job_id=job_id or chains.new_job_id("snd"), target=target, text=text or None, files=refs,
                       caption=caption, voice=bool(voice), as_document=bool(as_document),
                       max_bytes=ctx.max_file_bytes, album_max=platform.limits.album_max)


def check_size(platform: Platform, shown: str, name: str, size: int, *, voice: bool, as_document: bool,
               path: str | None = None) -> None:
    """ConfigError when a file of `size` bytes is over the platform's upload
    limit for what it would be sent as (its kind after routing, and the
    platform's own routing when it has one and the file is at `path`)."""
    from pathlib import Path

    from adapters.errors import CourierError
    from adapters.platforms.base import FileRefused, FileSource
    from tasks.delivery import choose_kind
    from tasks.text import human_bytes

    kind = choose_kind(platform, name, size, voice=voice, as_document=as_document)
    route = getattr(platform, "route_file", None)
    if route is not None and path is not None:
        src = FileSource(name=name, size_bytes=size, sha256="", opener=lambda: open(path, "rb"), path=Path(path))
        try:
            kind = route(kind, src)
        except FileRefused:
            return  # a type the platform does not take: the worker sends its notice
        except (OSError, CourierError):
            return
    limit = platform.limits.upload_limit(kind)
    if size > limit:
        raise ConfigError(f"{shown}: {human_bytes(size)} is over {platform.name}'s upload limit for a {kind.value} "
                          f"({human_bytes(limit)}); nothing was enqueued")


def check_file(open_sandbox: Callable[[SandboxRef], Sandbox], platform: Platform, ref: SandboxRef, path: str,
               shown: str, *, voice: bool, as_document: bool,
               max_file_bytes: int) -> None:
    """The pre-checks of one sandbox file (see the module's doc); ConfigError when refused."""
    import posixpath

    from adapters.errors import SandboxError
    from adapters.sandboxes.base import PathPolicy, check_lexical
    from tasks.text import human_bytes

    if ref.kind != "local":
        try:
            check_lexical(path)
            PathPolicy(roots=tuple(ref.roots) or ("/",)).check(posixpath.normpath(path), shown=shown)
        except SandboxError as exc:
            raise ConfigError(str(exc)) from None
        return
    try:
        resolved, size = open_sandbox(ref).resolve(path)
    except SandboxError as exc:
        raise ConfigError(str(exc)) from None
    check_size(platform, shown, posixpath.basename(resolved), size, voice=voice, as_document=as_document,
               path=resolved)
    if size > max_file_bytes:
        raise ConfigError(f"{shown}: {human_bytes(size)} is over the extraction cap of {human_bytes(max_file_bytes)} "
                          "(COURIER_MAX_FILE_BYTES); nothing was enqueued")


def send(ctx: Context, target: str, **kw: Any) -> SendResult:
    """Check and enqueue a send; returns {"job", "deliveries"}."""
    unknown = set(kw) - set(FIELDS)
    if unknown:
        raise ConfigError(f"unknown send field(s) {', '.join(sorted(unknown))}: known are {', '.join(FIELDS)}")
    plan = plan_send(ctx, target, **kw)
    ids = chains.enqueue(ctx.redis, plan, job_kind="send")
    return {"job": plan.job_id, "deliveries": ids}
