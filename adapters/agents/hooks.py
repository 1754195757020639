"""Hooks: extra prompt context from shell commands and Python plugins.

They run before each LLM call of the OpenAI-compatible runtime (``step`` from 1)
and once before a bridge agent starts (``step`` 0; the context goes in env
``COURIER_HOOK_CONTEXT``), get ``{"job", "target", "message", "step", "agent"}``
and may return ``{"context": "…"}``: a **shell hook** (an argv command, no shell,
given the context on stdin) as JSON on stdout; a **Python plugin** (a callable in
the entry point group ``courier.hooks``) as its return value. The text is spilled
(:func:`storage.spill.spill_if_needed`, source: the hook's name, into the turn's
workspace through its ``place``) once per text and turn, so the prompt stays
stable. Hooks of one call run concurrently, their contexts joined in order by
blank lines; one that fails or times out (a shell hook's process group is killed)
is logged and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from adapters.agents.jail import Jail, Network, bind_paths
from storage.spill import SpillConfig, spill_if_needed

__all__ = ["ENTRY_POINT_GROUP", "Hook", "HookRunner", "PluginHook", "ShellHook", "TurnHooks", "load_plugins"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "courier.hooks"
DEFAULT_TIMEOUT_S = 10.0


class HookSkipped(Exception):
    """A hook failed, timed out or returned something unusable (logged, never raised to the turn)."""


@dataclass(frozen=True)
class ShellHook:
    command: tuple[str, ...]
    name: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def label(self) -> str:
        return self.name or (os.path.basename(self.command[0]) if self.command else "hook")

    def call(self, context: dict, jail: Jail | None = None, network: Network = "none") -> Any:
        """Run the hook (in the turn's namespace sandbox when `jail` is given:
        the workspace read-only, `network`, an allowlisted environment)."""
        argv, env = list(self.command), None
        if jail is not None:
            base = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
            argv = jail.argv(argv, base, network=network, writable=False, also_ro=bind_paths(argv))
            env = {"PATH": os.environ.get("PATH") or os.defpath}
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, env=env)
        except OSError as exc:
            raise HookSkipped(f"could not start: {exc.strerror or exc}") from None
        try:
            out, err = proc.communicate(json.dumps(context, ensure_ascii=False).encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.communicate()
            raise HookSkipped(f"timed out after {self.timeout_s:g}s") from None
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise HookSkipped(f"exit code {proc.returncode}: {tail[0][:200]}")
        text = out.decode("utf-8", "replace").strip()
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise HookSkipped(f"stdout is not JSON ({len(text):,} chars)") from None


@dataclass(frozen=True)
class PluginHook:
    name: str
    func: Callable[[dict], Any] = field(repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def label(self) -> str:
        return self.name

    def call(self, context: dict, jail: Jail | None = None, network: Network = "none") -> Any:
        # a plugin is the operator's own Python, in the worker's process: no sandbox applies
        return self.func(dict(context))


Hook = ShellHook | PluginHook


def load_plugins(group: str = ENTRY_POINT_GROUP, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[PluginHook]:
    """Every callable registered in the entry point `group`; one that fails
    to load, or is not callable, is logged and left out."""
    from importlib.metadata import entry_points

    out: list[PluginHook] = []
    try:
        eps = sorted(entry_points(group=group), key=lambda e: e.name)
    except Exception:  # noqa: BLE001 - broken metadata must not stop turns
        log.exception("could not list %s entry points", group)
        return out
    for ep in eps:
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001
            log.warning("hook plugin %s (%s) failed to load: %r", ep.name, ep.value, exc)
            continue
        if not callable(obj):
            log.warning("hook plugin %s (%s) is not callable", ep.name, ep.value)
            continue
        out.append(PluginHook(ep.name, obj, timeout_s))
    return out


class HookRunner:
    """Runs a fixed list of hooks (a turn uses it through :class:`TurnHooks`)."""

    def __init__(self, hooks: Sequence[Hook], *, store=None, spill: SpillConfig = SpillConfig()) -> None:
        self.hooks = list(hooks)
        self.store = store
        self.spill = spill

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def run(self, context: dict, place=None, jail: Jail | None = None,
            network: Network = "none") -> list[tuple[str, str]]:
        """(hook label, spilled context text) for each hook that added something, in order.
        `place`: see :func:`storage.spill.spill_if_needed` (where the agent can read a spill);
        `jail`: the turn's namespace sandbox, where shell hooks run (with `network`)."""
        if not self.hooks:
            return []
        session = str(context.get("job") or "unknown")
        pool = ThreadPoolExecutor(max_workers=len(self.hooks), thread_name_prefix="courier-hook")
        started = time.monotonic()
        try:
            futures: list[Future] = [pool.submit(h.call, context, jail, network) for h in self.hooks]
            out: list[tuple[str, str]] = []
            for hook, fut in zip(self.hooks, futures):
                # shell hooks enforce their own timeout; this bounds plugins (and leaves a stuck one behind)
                left = max(0.0, started + hook.timeout_s + 2.0 - time.monotonic())
                try:
                    text = _context_text(fut.result(timeout=left))
                except TimeoutError:
                    log.warning("hook %s skipped (job %s): timed out after %gs", hook.label, session, hook.timeout_s)
                    continue
                except Exception as exc:  # noqa: BLE001 - a failing hook is skipped, the turn goes on
                    why = exc if isinstance(exc, HookSkipped) else repr(exc)
                    log.warning("hook %s skipped (job %s): %s", hook.label, session, why)
                    continue
                if text:
                    out.append((hook.label, spill_if_needed(text, source=hook.label, session_id=session,
                                                            store=self.store, config=self.spill, place=place)))
            return out
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class TurnHooks:
    """A runner bound to one turn's `place` (its spills land where that
    turn's agent can read them) and its sandbox (`jail`, where its shell
    hooks run)."""

    runner: HookRunner
    place: Any
    jail: Jail | None = None
    network: Network = "none"

    def context_for(self, context: dict) -> str:
        """The hooks' contexts joined by blank lines ("" when none)."""
        return "\n\n".join(text for _, text in self.runner.run(context, self.place, self.jail, self.network))


def _context_text(value: Any) -> str:
    if value is not None and not isinstance(value, dict):
        raise HookSkipped(f"returned {type(value).__name__}, not a JSON object")
    ctx = (value or {}).get("context")
    if ctx is None or isinstance(ctx, str):
        return ctx or ""
    try:
        return json.dumps(ctx, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(ctx)

