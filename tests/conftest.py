"""Fixture modules live in tests/fixtures/; every one is loaded here."""

from pathlib import Path

import pytest

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}"
    for p in (Path(__file__).parent / "fixtures").glob("*.py")
    if not p.stem.startswith("_")
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (scripts/test): files costliest first, the attack table
    one unit per backend (tests/fixtures/_schedule.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.fixtures._schedule import make_scheduler

    return make_scheduler(config, log)


#: the signing key of the whole test session (tasks/ledger/signing.py): set in the environment before anything
#: reads the settings, so the test process and every worker, web and CLI process it starts share it
TEST_SIGNING_KEY = "courier-test-signing-key-0123456789abcdef"


def pytest_configure(config):
    import os

    os.environ.setdefault("COURIER_SIGNING_KEY", TEST_SIGNING_KEY)
    from tasks.ledger import signing

    signing.install(signing.Signer([os.environ["COURIER_SIGNING_KEY"].encode()]))
