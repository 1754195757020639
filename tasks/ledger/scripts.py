"""The Lua scripts courier runs in Redis, and the only way it runs them.

Each script is `lua/<name>.lua`; its header names every `KEYS[i]` and `ARGV[i]` (`KEYS[2...]`: the rest,
`KEYS[6?]`: optional), bound to named locals; every key it touches comes in `KEYS`, state names as
arguments (`tests/test_lua.py` checks it all). `run` checks the numbers of keys and arguments against the
header and runs the script: on a client through redis-py's `Script` (EVALSHA), on a pipeline as EVAL with
its text (a `Script` would cost a SCRIPT EXISTS round trip of its own). Keys are not hash-tagged
(deployments hold their names): scripts assume one Redis node (or Sentinel).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from redis.commands.core import AsyncScript, Script

#: where the scripts are: beside this module, wherever the package moves
DIR = Path(__file__).resolve().parent / "lua"

_DECL = re.compile(r"^--\s+(KEYS|ARGV)\[(\d+)(\.\.\.|\?)?\]\s+(\w+):", re.M)

Arg = str | int | float


@dataclass(frozen=True)
class Lua:
    """One script: its text and what its header declares."""

    name: str
    text: str
    keys: int  # KEYS it needs
    args: int  # ARGV it needs
    more_keys: int  # how many optional KEYS may follow (-1: any number)
    more_args: int  # the same for ARGV

    def check(self, keys: Sequence[str], args: Sequence[Arg]) -> Lua:
        for what, n, need, more in (("KEYS", len(keys), self.keys, self.more_keys),
                                    ("ARGV", len(args), self.args, self.more_args)):
            if n < need or (more >= 0 and n > need + more):
                raise ValueError(f"{self.name}.lua takes {need}{'+' if more else ''} {what}, given {n}")
        return self


def names() -> frozenset[str]:
    """Every script's name (the files in `DIR`)."""
    return frozenset(p.stem for p in DIR.glob("*.lua"))


@cache
def load(name: str) -> Lua:
    """The script `name` (`DIR/<name>.lua`), read once."""
    text = (DIR / f"{name}.lua").read_text(encoding="utf-8")
    fixed, more = {"KEYS": 0, "ARGV": 0}, {"KEYS": 0, "ARGV": 0}
    for kind, i, mark, _ in _DECL.findall(text):
        if mark == "...":  # the rest: any number
            more[kind] = -1
        elif mark == "?":  # one more, optional
            more[kind] += 1 if more[kind] >= 0 else 0
        else:
            fixed[kind] = max(fixed[kind], int(i))
    return Lua(name, text, fixed["KEYS"], fixed["ARGV"], more["KEYS"], more["ARGV"])


_sync: dict[str, Script] = {}
_async: dict[str, AsyncScript] = {}


def run(r: Redis | Pipeline, name: str, *, keys: Sequence[str], args: Sequence[Arg] = ()) -> Any:
    """Run script `name` with `keys` and `args` (its answer), or queue it on the pipeline `r`."""
    lua = load(name).check(keys, args)
    if isinstance(r, Pipeline):
        return r.eval(lua.text, len(keys), *keys, *args)
    script = _sync.get(name) or _sync.setdefault(name, r.register_script(lua.text))
    return script(keys=keys, args=args, client=r)


async def run_async(r: AsyncRedis | AsyncPipeline, name: str, *, keys: Sequence[str], args: Sequence[Arg] = ()) -> Any:
    """`run` on an asyncio client (or queued on its pipeline)."""
    lua = load(name).check(keys, args)
    if isinstance(r, AsyncPipeline):
        return r.eval(lua.text, len(keys), *keys, *args)
    script = _async.get(name) or _async.setdefault(name, r.register_script(lua.text))
    return await script(keys=keys, args=args, client=r)
