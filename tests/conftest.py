"""Fixture modules live in tests/fixtures/; every one is loaded here."""

from pathlib import Path

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)
