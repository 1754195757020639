"""Every exception type a platform adapter's SDK (or HTTP client) can raise
becomes one of courier's errors (adapters/errors.py) through the adapter's
one `map_error` table (adapters/platforms/base.py: ErrorMap): the SDK's
exception classes are enumerated (every subclass of its root), one instance
of each is mapped, and none escapes raw or as the table's "unexpected"
fallback alone. Plain objects, no server: the SDK classes are the real ones;
an HTTP response a class needs is a stand-in object with the attributes the
SDK reads (named where used)."""

from __future__ import annotations

import types

import pytest

from adapters.errors import DeliveryError, Permanent, RateLimited, Transient
from adapters.platforms.base import ErrorMap, FileRefused


def subclasses(root: type) -> list[type]:
    """`root` and every subclass of it loaded now, in a stable order."""
    seen: dict[type, None] = {root: None}
    todo = [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                todo.append(sub)
    return sorted(seen, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def instance(cls: type, args: dict) -> BaseException:
    """One instance of `cls`: with the arguments given for it, else `cls("boom")`,
    `cls()`, else made without its constructor."""
    if cls in args:
        return cls(*args[cls])
    for a in (("boom",), ()):
        try:
            return cls(*a)
        except Exception:  # noqa: BLE001 - a constructor that needs more: try the next way
            continue
    exc = cls.__new__(cls)
    Exception.__init__(exc, "boom")
    return exc


def check_every(mapper: ErrorMap, classes: list[type], args: dict, *context) -> dict[str, type]:
    """Each class is taken by a row of the table and maps to a courier error; what each became."""
    got = {}
    for cls in classes:
        assert mapper.covers(cls), f"{cls.__module__}.{cls.__qualname__} has no row in {mapper.platform}'s map_error"
        out = mapper(instance(cls, args), *context)
        assert isinstance(out, DeliveryError), (cls, out)
        assert out.reason.startswith(f"{mapper.platform}: "), (cls, out.reason)
        got[cls.__name__] = type(out)
    return got


def test_the_table_passes_courier_errors_and_keeps_the_first_matching_row():
    m = ErrorMap("x", [(KeyError, lambda e: None), (LookupError, lambda e: Permanent("x: lookup"))])
    assert type(m(KeyError("k"))) is Permanent  # a rule that gives None leaves it to the rows below
    assert type(m(ValueError("v"))) is Transient and m(ValueError("v")).reason == "x: unexpected ValueError: v"
    mine = RateLimited(3)
    assert m(mine) is mine
    assert m.covers(IndexError) and not m.covers(ValueError)


def test_telegram_every_telegram_error_is_mapped():
    from telegram import error as te

    from adapters.platforms.telegram import _HTTPStatus, map_error

    classes = subclasses(te.TelegramError)
    assert te.RetryAfter in classes and _HTTPStatus in classes
    got = check_every(map_error, classes, {te.RetryAfter: (7,), te.ChatMigrated: (-100123,),
                                           _HTTPStatus: (413, "Request Entity Too Large")}, "secret-token")
    assert got["RetryAfter"] is RateLimited and got["_HTTPStatus"] is FileRefused
    for name in ("BadRequest", "Forbidden", "ChatMigrated", "InvalidToken", "Conflict"):
        assert got[name] is Permanent, name
    for name in ("NetworkError", "TimedOut", "TelegramError"):
        assert got[name] is Transient, name
    assert "<token>" in map_error(te.BadRequest("no chat for secret-token"), "secret-token").reason


def test_discord_every_discord_exception_is_mapped():
    import discord

    from adapters.platforms.discord import map_error

    def response(status: int):  # stands in for aiohttp's ClientResponse: discord.py reads these two
        return types.SimpleNamespace(status=status, reason="Reason")

    http = {discord.HTTPException: (response(400), {"message": "bad", "code": 50035}),
            discord.Forbidden: (response(403), {"message": "no", "code": 50013}),
            discord.NotFound: (response(404), {"message": "gone", "code": 10003}),
            discord.DiscordServerError: (response(503), "unavailable"),
            discord.RateLimited: (2.5,)}
    http[discord.app_commands.CommandSyncFailure] = (discord.HTTPException(response(400), {"message": "bad", "code": 50035}), [])
    classes = subclasses(discord.DiscordException)
    assert discord.HTTPException in classes and discord.ClientException in classes
    got = check_every(map_error, classes, http, "send a message")
    assert got["RateLimited"] is RateLimited and got["DiscordServerError"] is Transient
    for name in ("HTTPException", "Forbidden", "NotFound", "LoginFailure", "ClientException"):
        assert got[name] is Permanent, name
    assert type(map_error(discord.HTTPException(response(413), "too big"), "send")) is FileRefused
    import aiohttp

    assert all(map_error.covers(cls) for cls in subclasses(aiohttp.ClientError))  # the transport under discord.py
    assert type(map_error(aiohttp.ClientConnectionError("refused"), "send")) is Transient


def test_slack_every_slack_client_error_is_mapped():
    import httpx
    from slack_sdk import errors as se

    from adapters.platforms.slack import map_error

    def response(status: int, error: str):  # stands in for SlackResponse: the three attributes read
        return types.SimpleNamespace(status_code=status, headers={"Retry-After": "4"}, data={"ok": False,
                                                                                          "error": error})

    api = se.SlackApiError("nope", response(200, "channel_not_found"))
    classes = subclasses(se.SlackClientError)
    assert se.SlackApiError in classes and se.SlackRequestError in classes
    got = check_every(map_error, classes, {se.SlackApiError: ("nope", response(200, "channel_not_found")),
                                           se.SlackTokenRotationError: (api,)}, "chat.postMessage")
    assert got["SlackApiError"] is Permanent and got["SlackRequestError"] is Permanent
    assert got["SlackClientNotConnectedError"] is Transient
    assert type(map_error(se.SlackApiError("x", response(429, "ratelimited")), "post")) is RateLimited
    assert type(map_error(se.SlackApiError("x", response(200, "file_too_large")), "post")) is FileRefused
    assert all(map_error.covers(cls) for cls in subclasses(httpx.TransportError))  # the upload's own client
    assert type(map_error(httpx.ConnectError("refused"), "upload")) is Transient


def test_whatsapp_every_httpx_error_and_error_answer_is_mapped():
    import httpx

    from adapters.platforms.whatsapp import map_error

    req = httpx.Request("POST", "http://127.0.0.1/v1/messages")
    resp = httpx.Response(400, request=req, json={"error": {"code": 100, "message": "Invalid parameter"}})
    classes = subclasses(httpx.HTTPError)
    assert httpx.ConnectError in classes and httpx.HTTPStatusError in classes
    got = check_every(map_error, classes, {})
    assert all(v is Transient for v in got.values()), got
    assert type(map_error(resp)) is Permanent and "Invalid parameter" in map_error(resp).reason
    assert type(map_error(httpx.Response(429, request=req, json={}))) is RateLimited
    assert type(map_error(httpx.Response(503, request=req, json={}))) is Transient
    assert map_error.covers(httpx.Response)


@pytest.mark.parametrize("module", ["telegram", "discord", "slack", "whatsapp"])
def test_each_adapter_maps_through_one_error_map(module):
    import importlib

    mod = importlib.import_module(f"adapters.platforms.{module}")
    assert isinstance(mod.map_error, ErrorMap) and mod.map_error.platform == module
    assert not hasattr(mod, "_translate")
