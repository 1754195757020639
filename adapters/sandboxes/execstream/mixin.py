"""Sandbox methods on top of an exec channel (:class:`ExecStreamMixin`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from adapters.errors import SandboxError
from adapters.sandboxes.base import DEFAULT_EXEC_OUTPUT_BYTES, ExecRun, PathPolicy
from adapters.sandboxes.execstream.channel import ExecChannel, default_roots
from adapters.sandboxes.execstream.run import exec_command
from adapters.sandboxes.execstream.transfer import exec_iter_file, exec_resolve


class ExecStreamMixin:
    """Sandbox methods on top of an :class:`ExecChannel`.

    The class using it provides ``self.policy`` (a PathPolicy, or None to
    build defaults from the sandbox's $HOME on first use), ``self.ref`` and
    ``exec_channel() -> ExecChannel``. It gets ``resolve``, ``open_stream``,
    and ``exec`` when the backend provides ``exec_start``.
    """

    policy: PathPolicy | None
    #: roots used when neither the ref nor the constructor gave any
    exec_default_roots: tuple[str, ...] = ("/workspace", "/tmp")

    def exec_channel(self) -> ExecChannel:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def policy_for(self, home: str | None) -> PathPolicy:
        if self.policy is None:
            ref = getattr(self, "ref", None)
            roots = tuple(ref.roots) if ref is not None and ref.roots else default_roots(home, self.exec_default_roots)
            self.policy = PathPolicy(roots=roots, home=home)
        return self.policy

    def resolve(self, path: str) -> tuple[str, int]:
        r = exec_resolve(self.exec_channel(), path, policy_for=self.policy_for)
        self.policy_for(r.home).check(r.path, shown=path)
        return r.path, r.size

    def open_stream(self, resolved: str) -> Iterator[bytes]:
        return exec_iter_file(self.exec_channel(), resolved, policy=self.policy)

    def exec_start(self, argv: list[str], run_id: str, *, backstop_s: int | None = None) -> ExecRun:
        """Start `argv` (stdin empty) as an ExecRun whose `kill` runs ``kill_argv(run_id)``."""
        raise SandboxError(f"{type(self).__name__} does not support running commands (exec)")

    def exec(self, argv: Sequence[str], *, timeout_s: float, cwd: str | None = None,
             max_output_bytes: int = DEFAULT_EXEC_OUTPUT_BYTES) -> tuple[int, bytes, bytes]:
        """Sandbox.exec through the channel (:func:`exec_command`); `cwd`
        None: the first allowed root that is a directory."""
        policy = self.policy
        ref = getattr(self, "ref", None)
        defaults = policy.roots if policy is not None else (
            tuple(ref.roots) if ref is not None and ref.roots else self.exec_default_roots)
        cache = self.__dict__.setdefault("_exec_cwds", {})
        return exec_command(self.exec_channel(), self.policy_for, self.exec_start, argv, timeout_s=timeout_s,
                            cwd=cwd, max_output_bytes=max_output_bytes, defaults=defaults, cwd_cache=cache)

