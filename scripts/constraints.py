"""Print constraints.txt: the installed version of every distribution courier's
dependencies (core, every extra, test) pull in, as pins. Run in an environment
where `./scripts/test` passed: python scripts/constraints.py > constraints.txt"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement


def closure(roots: list[str]) -> dict[str, str]:
    seen: dict[str, tuple[str, frozenset[str]]] = {}
    stack = [Requirement(x) for x in roots]
    while stack:
        req = stack.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # a marker-only or platform-specific dependency not installed here
        extras = frozenset(req.extras)
        if name in seen and extras <= seen[name][1]:
            continue
        seen[name] = (dist.version, extras | (seen[name][1] if name in seen else frozenset()))
        for raw in dist.requires or []:
            child = Requirement(raw)
            if child.marker is None or any(child.marker.evaluate({**default_environment(), "extra": e})
                                           for e in (*extras, "")):
                stack.append(child)
    return {k: v for k, (v, _) in seen.items()}


def main() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    roots = list(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        roots += [x for x in reqs if not x.startswith("courier[")]
    print("# Versions CI installs and tests (scripts/setup: pip install -c constraints.txt -e '.[test]').")
    print("# Made from a working environment: python scripts/constraints.py > constraints.txt")
    for name, version in sorted(closure(roots).items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
