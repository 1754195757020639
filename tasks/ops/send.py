"""An operator's send from its JSON form (Flower's async-apply, the `courier.delivery.send`
task): plain code, no Celery.

    {"target": "telegram:-100123",                 # required: <platform>:<chat id>
     "text": "nightly report",                     # optional: a text message, sent first
     "files": ["local:///srv/out/report.pdf",      # optional: sandbox URIs (local, docker, ssh,
               "docker://build-7/workspace/a.png?host=gpu1",  # modal, singularity) or absolute
               "/srv/out/chart.png"],              # paths (= local:///..., the local sandbox's roots apply)
     "caption": "for the first file",              # optional
     "voice": false, "as_document": false}         # optional

At least a text or one file; bad input raises `ConfigError`. It goes through the ledger like
`courier send`. The pre-checks (`check_send`, shared with `courier send`) refuse what can be
known before enqueueing: a remote sandbox's path the path policy refuses as written (relative,
`..`, the system denylist); a local one resolved (links, roots), its size checked against the
extraction cap and the platform's upload limit.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.errors import ConfigError, CourierError, SandboxError
from adapters.platforms.base import FileSource, Platform, split_target
from adapters.sandboxes.base import PathPolicy, Sandbox, SandboxRef, check_lexical, parse_uri
from tasks.delivery.delivery import choose_kind
from tasks.delivery.text import human_bytes
from tasks.dispatch import chains
from tasks.messages import SendResult
from tasks.runtime import Context

FIELDS = ("text", "files", "caption", "voice", "as_document", "job_id")


class NothingToSend(ConfigError):
    """A send with neither a text nor a file (the CLI words it for its own options)."""


@dataclass(frozen=True)
class HostFile:
    """A file on the sender's own host (`courier send ./report.pdf`): checked when the send is,
    stored (uploaded) only when its plan is made, after every check passed."""

    path: str
    name: str


#: how a sender takes a file given without `://`: checks it (ConfigError when refused) and
#: says what it is; without one, an absolute path is a `local://` sandbox file
HostFiles = Callable[[str], HostFile]
#: stores a host file for job `job_id` as its file number `seq`
Upload = Callable[[str, int, HostFile], chains.StoredFile]


@dataclass(frozen=True)
class CheckedSend:
    """A send every pre-check passed (`check_send`); `plan` makes its ledger plan."""

    target: str
    text: str | None
    files: list[chains.SandboxFile | HostFile]
    caption: str | None
    voice: bool
    as_document: bool
    max_bytes: int
    album_max: int

    def plan(self, job_id: str | None = None, upload: Upload | None = None) -> chains.Plan:
        """The plan (a new `snd_` job id unless given); host files stored by `upload`."""
        job_id = job_id or chains.new_job_id("snd")
        files: list[chains.StoredFile | chains.SandboxFile] = []
        for seq, f in enumerate(self.files):
            if isinstance(f, HostFile):
                if upload is None:
                    raise ConfigError(f"{f.path}: a file of this host, and nothing to store it with")
                files.append(upload(job_id, seq, f))
            else:
                files.append(f)
        return chains.Plan(job_id=job_id, target=self.target, text=self.text or None, files=files,
                           caption=self.caption, voice=self.voice, as_document=self.as_document,
                           max_bytes=self.max_bytes, album_max=self.album_max)


def check_send(target: str, *, platform: Callable[[], Platform], album_max: Callable[[], int],
               open_sandbox: Callable[[SandboxRef], Sandbox], max_files: int, max_file_bytes: int,
               text: str | None = None, files: list[str] | None = None, caption: str | None = None,
               voice: bool = False, as_document: bool = False, host_files: HostFiles | None = None
               ) -> CheckedSend:
    """Every check a send gets before anything is enqueued or stored, for the operator's task
    and `courier send` alike; ConfigError (`NothingToSend`) on bad input. `platform`: the
    target's adapter (asked only when a file is checked); `host_files`: how a file given
    without `://` is taken."""
    if text is not None and not isinstance(text, str):
        raise ConfigError("text must be a string")
    if caption is not None and not isinstance(caption, str):
        raise ConfigError("caption must be a string")
    files = [] if files is None else files
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError("files must be a list of sandbox URIs or absolute paths")
    if not (text and text.strip()) and not files:
        raise NothingToSend("nothing to send: give a text, files, or both")
    if max_files and len(files) > max_files:
        raise ConfigError(f"{len(files)} files: at most {max_files} go with one send (COURIER_MAX_FILES_PER_JOB)")
    checked: list[chains.SandboxFile | HostFile] = []
    for f in files:
        if "://" not in f and host_files is not None:
            checked.append(host_files(f))
            continue
        uri = f if "://" in f else ("local://" + f if f.startswith("/") else None)
        if uri is None:
            raise ConfigError(f"not a sandbox URI or an absolute path: {f!r}")
        ref, path = parse_uri(uri)
        check_file(open_sandbox, platform(), ref, path, f, voice=bool(voice), as_document=bool(as_document),
                   max_file_bytes=max_file_bytes)
        checked.append(chains.SandboxFile(ref=ref, path=path))
    return CheckedSend(target=target, text=text or None, files=checked, caption=caption, voice=bool(voice),
                       as_document=bool(as_document), max_bytes=max_file_bytes, album_max=album_max())


def check_size(platform: Platform, shown: str, name: str, size: int, *, voice: bool, as_document: bool,
               path: str | None = None) -> None:
    """ConfigError when a file of `size` bytes is over the platform's upload limit for what
    it would go as (after routing, the platform's own too when the file is at `path`)."""
    kind = choose_kind(platform, name, size, voice=voice, as_document=as_document)
    route = getattr(platform, "route_file", None)
    if route is not None and path is not None:
        src = FileSource(name=name, size_bytes=size, sha256="", opener=lambda: open(path, "rb"), path=Path(path))
        try:
            kind = route(kind, src)
        except (OSError, CourierError):  # FileRefused (a type it does not take): the worker sends its notice
            return
    limit = platform.limits.upload_limit(kind)
    if size > limit:
        raise ConfigError(f"{shown}: {human_bytes(size)} is over {platform.name}'s upload limit for a {kind.value} "
                          f"({human_bytes(limit)}); nothing was enqueued")


def check_file(open_sandbox: Callable[[SandboxRef], Sandbox], platform: Platform, ref: SandboxRef, path: str,
               shown: str, *, voice: bool, as_document: bool, max_file_bytes: int) -> None:
    """The pre-checks of one sandbox file (see the module's doc); ConfigError when refused."""
    try:
        if ref.kind != "local":
            check_lexical(path)
            PathPolicy(roots=tuple(ref.roots) or ("/",)).check(posixpath.normpath(path), shown=shown)
            return
        resolved, size = open_sandbox(ref).resolve(path)
    except SandboxError as exc:
        raise ConfigError(str(exc)) from None
    check_size(platform, shown, posixpath.basename(resolved), size, voice=voice, as_document=as_document,
               path=resolved)
    if size > max_file_bytes:
        raise ConfigError(f"{shown}: {human_bytes(size)} is over the extraction cap of {human_bytes(max_file_bytes)} "
                          "(COURIER_MAX_FILE_BYTES); nothing was enqueued")


def send(ctx: Context, target: str, **kw: Any) -> SendResult:
    """Check (`check_send` with the worker's configuration) and enqueue a send; returns {"job",
    "deliveries"}. ConfigError on bad input, nothing enqueued."""
    unknown = set(kw) - set(FIELDS)
    if unknown:
        raise ConfigError(f"unknown send field(s) {', '.join(sorted(unknown))}: known are {', '.join(FIELDS)}")
    if not isinstance(target, str):
        raise ConfigError("target must be a string: <platform>:<chat id>")
    job_id = kw.pop("job_id", None)
    platform = ctx.platform(split_target(target)[0])  # unknown or unconfigured: ConfigError
    plan = check_send(target, platform=lambda: platform, album_max=lambda: platform.limits.album_max,
                      open_sandbox=ctx.sandbox, max_files=ctx.max_files_per_job,
                      max_file_bytes=ctx.max_file_bytes, **kw).plan(job_id)
    ids = chains.enqueue(ctx.redis, plan, job_kind="send")
    return {"job": plan.job_id, "deliveries": ids}
