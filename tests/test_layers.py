"""The house's layering, read from the source (every import, at module level
or inside a function; `if TYPE_CHECKING:` blocks are types only and skipped):
dependencies point one way (workers → tasks → adapters, storage) and no two
modules import each other, directly or around a circle.

Inside `tasks/`, the subsystems point one way too, lowest first (ARCHITECTURE.md):
`ledger/` (receipts, leases, due times, keys, states, signing, the event stream,
the Lua scripts: it knows no delivery format) → `delivery/` (a chat's lane, its
items, albums, parts, the send lock, rate limits) → `dispatch/` (plans to
messages, the reconciler) → `turn/` (the agent's turn, its reply, activity,
the extraction) → `ops/` (an operator's send, retry, cancel, listings, queues,
the janitor). Each may import the ones before it, never one after. Beside them,
`tasks/` itself holds the base every subsystem may import (it imports none of
them) and the Celery tasks over them all (which nothing in `tasks/` imports)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "tasks", "adapters", "storage")

#: tasks/'s subsystems, lowest first: each may import those before it, never one after it
SUBSYSTEMS = ("ledger", "delivery", "dispatch", "turn", "ops")
#: tasks/'s own modules that every subsystem may import (they import no subsystem)
BASE = frozenset({"tasks", "tasks.runtime", "tasks.messages", "tasks.task_names", "tasks.metrics",
                  "tasks.workspaces", "tasks.states"})
#: what the ledger may import of the base: not the Context, not the message shapes (it knows no
#: delivery format)
LEDGER_BASE = frozenset({"tasks", "tasks.metrics", "tasks.workspaces", "tasks.task_names", "tasks.states"})
#: the Celery tasks, over every subsystem (nothing in tasks/ imports them)
TOP = frozenset({"tasks.celery_tasks"})


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _graph() -> dict[str, set[str]]:
    mods: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = _imports(ast.parse(p.read_text(encoding="utf-8")))
    return {m: {d for d in deps if d in mods and d != m} for m, deps in mods.items()}


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def _subsystem(module: str) -> str | None:
    """The subsystem a tasks module sits in ('base', one of SUBSYSTEMS, 'top'; None: none)."""
    if module in BASE:
        return "base"
    if module in TOP:
        return "top"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tasks" and parts[1] in SUBSYSTEMS else None


def _rank(subsystem: str) -> int:
    return 0 if subsystem == "base" else len(SUBSYSTEMS) + 1 if subsystem == "top" else SUBSYSTEMS.index(subsystem) + 1


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_dependencies_point_one_way():
    g = _graph()
    allowed = {"workers": PACKAGES, "tasks": ("tasks", "adapters", "storage"),
               "adapters": ("adapters", "storage"), "storage": ("storage", "adapters")}
    wrong = [(m, d) for m, deps in g.items() for d in deps if d.split(".")[0] not in allowed[m.split(".")[0]]]
    assert wrong == []


def test_every_tasks_module_sits_in_one_subsystem():
    """A new module goes into a subsystem (or, shared by all and importing none, the base)."""
    loose = sorted(m for m in _graph() if m.startswith("tasks") and _subsystem(m) is None)
    assert loose == [], f"place these in one of tasks/{{{','.join(SUBSYSTEMS)}}}/ (or the base): {loose}"


def test_tasks_subsystems_point_one_way():
    g = _graph()
    wrong = []
    for m, deps in sorted(g.items()):
        sub = _subsystem(m)
        if sub is None:
            continue
        for d in sorted(deps):
            dsub = _subsystem(d)
            if dsub is None:
                continue
            if dsub == "top" and sub != "top" or _rank(dsub) > _rank(sub) \
                    or (sub == "base" and dsub != "base") or (sub == "ledger" and dsub == "base" and d not in LEDGER_BASE):
                wrong.append(f"{m} ({sub}) imports {d} ({dsub})")
    assert wrong == []


def test_the_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_check_sees_an_import_up():
    assert _rank("ledger") < _rank("delivery") < _rank("dispatch") < _rank("turn") < _rank("ops") < _rank("top")
    assert _subsystem("tasks.ledger.receipts") == "ledger" and _subsystem("tasks.lanes") is None
