"""The baseline of bench_webhooks: a bare Starlette app that answers 200 to
every webhook path without reading the body (served by uvicorn like courier's)."""

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


async def ok(request):
    return JSONResponse({"ok": True})


app = Starlette(routes=[Route(f"/webhooks/{p}", ok, methods=["POST"])
                        for p in ("telegram", "slack", "discord", "whatsapp")])
