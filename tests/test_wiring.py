"""workers.wiring: a platform's limits are read from its adapter class, as
configured, without building the adapter (what `courier send` needs before
it enqueues), and they are the limits the built adapter has."""

from __future__ import annotations

import pytest

from adapters.errors import ConfigError
from workers import wiring
from workers.settings import Settings

CONFIGURED = {
    "COURIER_TELEGRAM_LOCAL_API": "true", "COURIER_TELEGRAM_BOT_PER_S": "7",
    "COURIER_DISCORD_UPLOAD_BYTES": "123456", "COURIER_SLACK_UPLOAD_BYTES": "654321",
    "TELEGRAM_BOT_TOKEN": "123:abc", "DISCORD_BOT_TOKEN": "d-token", "SLACK_BOT_TOKEN": "xoxb-1",
    "WHATSAPP_ACCESS_TOKEN": "wa-token", "WHATSAPP_PHONE_NUMBER_ID": "1000",
}


def test_platform_limits_are_the_built_adapters_and_build_none(monkeypatch, tmp_path):
    monkeypatch.setenv("COURIER_DATA_DIR", str(tmp_path))
    for k, v in CONFIGURED.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    limits = {name: wiring.platform_limits(name, s) for name in wiring.PLATFORMS}
    for name in wiring.PLATFORMS:
        wiring.check_platform(name, s)
    assert not [k for k in wiring._platforms if k[1] == id(s)]  # neither read built an adapter
    assert limits["telegram"].upload_bytes == 2000 * 1000 * 1000 and limits["telegram"].per_bot_per_s == 7
    assert (limits["discord"].upload_bytes, limits["slack"].upload_bytes) == (123456, 654321)
    assert {n: lim.album_max for n, lim in limits.items()} == \
        {"outbox": 0, "telegram": 10, "discord": 10, "slack": 10, "whatsapp": 0}
    assert {n: wiring.platform(n, s).limits for n in wiring.PLATFORMS} == limits


@pytest.mark.parametrize("name,unset,says", [
    ("telegram", "TELEGRAM_BOT_TOKEN", "TELEGRAM_BOT_TOKEN is not set"),
    ("whatsapp", "WHATSAPP_PHONE_NUMBER_ID", "WHATSAPP_PHONE_NUMBER_ID is not set"),
    ("slack", "SLACK_BOT_TOKEN", "SLACK_BOT_TOKEN is not set"),
])
def test_an_unconfigured_platform_is_refused_by_the_check_and_the_limits(monkeypatch, tmp_path, name, unset, says):
    monkeypatch.setenv("COURIER_DATA_DIR", str(tmp_path))
    for k, v in CONFIGURED.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(unset)
    s = Settings()
    for check in (wiring.check_platform, wiring.platform_limits, wiring.platform):
        with pytest.raises(ConfigError, match=says):
            check(name, s)
    with pytest.raises(ConfigError, match="unknown platform 'fax'"):
        wiring.platform_limits("fax", s)
