"""The extraction task's own part of the attack table: `MEDIA:~/x` reaches
the backend as the sandbox's home, and an OS error a backend lets through
is one clear permanent reason, never the raw error (real Redis)."""

from __future__ import annotations

import errno

from adapters.sandboxes.base import PathPolicy, SandboxRef
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tasks.messages import Extracted, ExtractSpec
from tasks.turn.extract import extract
from tasks.runtime import Context


class LeakyOS(LocalSandbox):
    """A backend that lets the OS's own error through (what the task must not show as is)."""

    def _copy_out(self, path, store, key, **kw):
        raise OSError(errno.ELOOP, "Too many levels of symbolic links")


def test_home_path_and_raw_os_errors(redis_client, tmp_path):
    home = tmp_path / "home"
    (home / "out").mkdir(parents=True)
    (home / "out" / "m.txt").write_bytes(b"hello")
    roots = (str(home),)
    policy = PathPolicy(roots=roots, home=str(home))
    store = VolumeStore(tmp_path / "store")
    for cls, path in ((LocalSandbox, "~/out/m.txt"), (LeakyOS, "/x/loop")):
        sb = cls(SandboxRef("local", roots=roots), policy)
        ctx = Context(redis=redis_client, store=store, platform=None, sandbox=lambda ref, sb=sb: sb,
                      agent=lambda name: None)
        spec = ExtractSpec(sandbox=SandboxRef("local").to_dict(), path=path, key=f"files/{cls.__name__}")
        res = extract(ctx, spec, "j1", f"d-{cls.__name__}")
        if cls is LocalSandbox:
            assert res.ok and store.local_path(spec.key).read_bytes() == b"hello", res
        else:
            assert res == Extracted(ok=False, name="loop",
                                    reason="UnsafePath: /x/loop: a symbolic link loop (too many levels of symbolic links)",
                                    notify="the agent named a file it may not share")  # the chat's words, no path
