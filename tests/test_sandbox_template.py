"""The flow of a transfer is the base class's: `Sandbox.extract` and
`Sandbox.put` are templates (lexical check, the size cap through
`check_size`, then the backend's `_copy_out` / `_copy_in`) that no backend
overrides, so no backend can skip a check. And the size cap's words are
written once."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import adapters.sandboxes as sandboxes_pkg
from adapters.errors import TooLarge, UnsafePath
from adapters.sandboxes.base import NoInbound, PathPolicy, Sandbox, SandboxRef

ROOT = Path(__file__).resolve().parents[1]


def _backend_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(sandboxes_pkg.__path__)
                  if m.name not in ("base", "routing", "execstream", "hostroot", "hostopen"))


def _backends(module: str) -> list[type]:
    mod = importlib.import_module(f"adapters.sandboxes.{module}")
    return [c for _, c in inspect.getmembers(mod, inspect.isclass) if issubclass(c, Sandbox) and c is not Sandbox]


def test_every_backend_module_is_seen():
    assert {"local", "docker", "ssh", "modal", "singularity"} <= set(_backend_modules())


@pytest.mark.parametrize("module", _backend_modules())
def test_no_backend_overrides_the_templates(module):
    classes = _backends(module)
    assert classes, f"no Sandbox class in adapters.sandboxes.{module}"
    for cls in classes:
        for name in ("extract", "put", "check_size"):
            assert getattr(cls, name) is getattr(Sandbox, name), f"{cls.__name__} overrides {name}"


def test_the_size_cap_words_are_written_once():
    """'byte cap' is written in base.py (check_size, grew_over_cap) and in no backend."""
    hits = [p.relative_to(ROOT) for p in (ROOT / "adapters" / "sandboxes").rglob("*.py")
            if p.name != "base.py" and "byte cap" in p.read_text(encoding="utf-8")]
    assert hits == []


class _Bare(Sandbox):
    """A backend with only the two abstract methods: the default copies."""

    kind = "bare"

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(SandboxRef("local"), PathPolicy(roots=("/w",)))
        self.files = files
        self.opened: list[str] = []

    def resolve(self, path: str) -> tuple[str, int]:
        self.policy.check(path)
        return path, len(self.files[path])

    def open_stream(self, resolved: str):
        self.opened.append(resolved)
        yield self.files[resolved]


def test_template_checks_before_the_backend_copies(tmp_path):
    from storage.volume import VolumeStore

    store = VolumeStore(tmp_path / "store")
    sb = _Bare({"/w/a": b"12345"})
    assert sb.extract("/w/a", store, "files/a", max_bytes=5).size_bytes == 5
    with pytest.raises(UnsafePath):  # lexical check first: the backend never sees it
        sb.extract("/w/../etc/passwd", store, "files/b")
    with pytest.raises(TooLarge) as exc:  # the cap before a byte moves
        sb.extract("/w/a", store, "files/c", max_bytes=4)
    assert str(exc.value) == "/w/a: 5 bytes is over the 4 byte cap"
    assert (exc.value.size_bytes, exc.value.limit_bytes) == (5, 4)
    assert sb.opened == ["/w/a"]
    # inbound: checked the same way, then the backend says it takes no files
    with pytest.raises(TooLarge):
        sb.put(store, "files/a", "/w/b", max_bytes=4)
    with pytest.raises(UnsafePath):
        sb.put(store, "files/a", "w/b")
    with pytest.raises(NoInbound) as no:
        sb.put(store, "files/a", "/w/b")
    assert isinstance(no.value, NotImplementedError)  # what the agent's write_file tool catches
