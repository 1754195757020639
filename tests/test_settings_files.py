"""Secrets from files: `<NAME>_FILE` (the Docker / Kubernetes secrets
convention) for every secret setting and for COURIER_REDIS_URL, so a
secret need not sit in any process's environment; COURIER_REDIS_PASSWORD
(from a file too) completes a URL that carries none. Plain settings, no
broker: `Settings()` reads the environment the test sets."""

from __future__ import annotations

import os

import pytest
from pydantic import SecretStr

from adapters.errors import ConfigError
from workers.settings import Settings, file_variables

SECRET = "s3cr3t-Token_value"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No courier setting of the test process leaks in (CI may set some)."""
    for k in list(os.environ):
        if k.startswith(("COURIER_", "TELEGRAM_", "DISCORD_", "SLACK_", "WHATSAPP_", "AWS_")):
            monkeypatch.delenv(k)


def _secret_fields() -> dict[str, str]:
    """Every SecretStr setting -> its variable: what must take a _FILE."""
    out = {}
    for name, field in Settings.model_fields.items():
        if SecretStr in (field.annotation, *getattr(field.annotation, "__args__", ())):
            alias = field.validation_alias
            out[name] = str(getattr(alias, "choices", [alias])[0]) if alias else f"COURIER_{name.upper()}"
    return out


def test_every_secret_setting_and_the_redis_url_come_from_a_file(monkeypatch, tmp_path):
    fields = _secret_fields()
    assert {"telegram_bot_token", "discord_bot_token", "slack_bot_token", "whatsapp_access_token",
            "openai_api_key", "slack_signing_secret", "aws_secret_access_key", "redis_password"} <= set(fields)
    for name, var in fields.items():
        p = tmp_path / name
        p.write_text(f"{SECRET}-{name}\n")  # `echo x > file` leaves a newline: stripped
        monkeypatch.setenv(f"{var}_FILE", str(p))
    url = tmp_path / "url"
    url.write_text("redis://:pw@127.0.0.1:6390/2\r\n")
    monkeypatch.setenv("COURIER_REDIS_URL_FILE", str(url))
    monkeypatch.delenv("COURIER_REDIS_PASSWORD_FILE")  # the URL carries one
    s = Settings()
    for name in fields:
        if name != "redis_password":
            assert getattr(s, name).get_secret_value() == f"{SECRET}-{name}", name
    assert s.redis_url == "redis://:pw@127.0.0.1:6390/2"
    assert {f"{v}_FILE" for v in fields.values()} | {"COURIER_REDIS_URL_FILE"} <= set(file_variables())
    assert SECRET not in repr(s) and "pw@" not in repr(s)


def test_a_secret_field_added_later_takes_a_file_without_a_list_to_keep(monkeypatch, tmp_path):
    """The source is generic over SecretStr fields (COURIER_SIGNING_KEY is being added elsewhere)."""

    class More(Settings):
        signing_key: SecretStr | None = None

    p = tmp_path / "key"
    p.write_text("k1\n")
    monkeypatch.setenv("COURIER_SIGNING_KEY_FILE", str(p))
    assert More().signing_key.get_secret_value() == "k1"


def test_the_variable_and_its_file_both_set_is_an_error(monkeypatch, tmp_path):
    p = tmp_path / "tok"
    p.write_text(SECRET)
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "from-env")
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN_FILE", str(p))
    with pytest.raises(ConfigError) as e:
        Settings()
    assert "TELEGRAM_BOT_TOKEN" in str(e.value) and "TELEGRAM_BOT_TOKEN_FILE" in str(e.value)
    assert SECRET not in str(e.value) and "from-env" not in str(e.value)
    # an empty variable means "not set": no conflict
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "")
    assert Settings().telegram_bot_token.get_secret_value() == SECRET


@pytest.mark.parametrize("case", ["missing", "unreadable", "directory", "fifo", "huge"])
def test_an_unreadable_file_is_an_error_naming_the_variable_never_the_content(monkeypatch, tmp_path, case):
    p = tmp_path / "tok"
    if case == "missing":
        pass
    elif case == "unreadable":
        p.write_text(SECRET)
        p.chmod(0)
        if os.geteuid() == 0:  # root reads any file, but not a write-only sysctl (EACCES for root too)
            p = tmp_path / "sysctl"
            p.symlink_to("/proc/sys/vm/drop_caches")
    elif case == "directory":
        p.mkdir()
    elif case == "fifo":
        os.mkfifo(p)  # would block a reader forever
    elif case == "huge":
        p.write_text(SECRET * 10_000)
    monkeypatch.setenv("SLACK_BOT_TOKEN_FILE", str(p))
    with pytest.raises(ConfigError) as e:
        Settings()
    msg = str(e.value)
    assert "SLACK_BOT_TOKEN_FILE" in msg and str(p) in msg, msg
    assert SECRET not in msg


def test_the_redis_password_completes_every_kind_of_url(monkeypatch, tmp_path):
    p = tmp_path / "pw"
    p.write_text("p@ss/w:rd\n")
    monkeypatch.setenv("COURIER_REDIS_PASSWORD_FILE", str(p))
    quoted = "p%40ss%2Fw%3Ard"
    for url, want in [
        ("redis://redis:6379/0", f"redis://:{quoted}@redis:6379/0"),
        ("rediss://app@redis:6380/1?ssl_cert_reqs=required", f"rediss://app:{quoted}@redis:6380/1?ssl_cert_reqs=required"),
        ("sentinel://h1:26379,h2:26379/mymaster/0", f"sentinel://:{quoted}@h1:26379,h2:26379/mymaster/0"),
        ("unix:///run/redis.sock?db=0", f"unix://:{quoted}@/run/redis.sock?db=0"),
    ]:
        monkeypatch.setenv("COURIER_REDIS_URL", url)
        assert Settings().redis_url == want, url
    from workers.redis_url import parse_sentinel

    monkeypatch.setenv("COURIER_REDIS_URL", "sentinel://h1:26379/mymaster/0")
    assert parse_sentinel(Settings().redis_url).password == "p@ss/w:rd"
    # a URL with its own password and the password setting: which one is meant?
    monkeypatch.setenv("COURIER_REDIS_URL", "redis://:other@redis:6379/0")
    with pytest.raises(ValueError, match="COURIER_REDIS_PASSWORD"):
        Settings()


def test_s3_credentials_from_files_reach_the_store(monkeypatch, tmp_path):
    """AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (boto3 reads only the
    variables) come from files too: the store gets them from the settings."""
    from workers import wiring

    for var, val in (("AWS_ACCESS_KEY_ID", "AKIDFILE"), ("AWS_SECRET_ACCESS_KEY", SECRET)):
        p = tmp_path / var
        p.write_text(val + "\n")
        monkeypatch.setenv(f"{var}_FILE", str(p))
    monkeypatch.setenv("COURIER_STORAGE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = wiring.store(Settings())
    creds = store._session.get_credentials()
    assert (creds.access_key, creds.secret_key) == ("AKIDFILE", SECRET)


def test_the_cli_says_which_file_and_stops(tmp_path):
    import subprocess
    import sys

    from tests.fixtures.workers import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("COURIER_")}
    env.update(PYTHONPATH=str(ROOT), COURIER_DATA_DIR=str(tmp_path), COURIER_REDIS_URL_FILE=str(tmp_path / "nope"))
    res = subprocess.run([sys.executable, "-m", "workers.cli", "queues"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT))
    assert res.returncode == 2, res.stderr
    assert f"COURIER_REDIS_URL_FILE: cannot read {tmp_path / 'nope'}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_bad_redis_url_is_refused_without_showing_its_password(monkeypatch):
    """The error quoted the URL it refused, password and all, into the worker's log."""
    from pydantic import ValidationError

    for bad in ("http://:hunter2-pw@redis:6379/0", "rediss://:hunter2-pw@redis:6380/0?ssl_ca_cert=/ca.pem"):
        monkeypatch.setenv("COURIER_REDIS_URL", bad)
        with pytest.raises(ValidationError) as e:
            Settings()
        assert "COURIER_REDIS_URL" in str(e.value) and "hunter2" not in str(e.value), str(e.value)


def test_an_empty_secret_file_counts_as_unset(monkeypatch, tmp_path):
    """compose mounts a file for every platform's token; a deployment fills in the ones it uses: an
    empty file (or one holding only a newline) means that platform is not configured, as an empty
    variable does."""
    empty = tmp_path / "telegram_bot_token"
    empty.write_text("\n")
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN_FILE", str(empty))
    full = tmp_path / "slack_bot_token"
    full.write_text("xoxb-1\n")
    monkeypatch.setenv("SLACK_BOT_TOKEN_FILE", str(full))
    s = Settings()
    assert s.telegram_bot_token is None
    assert s.slack_bot_token is not None and s.slack_bot_token.get_secret_value() == "xoxb-1"
