"""GET /v1/sharing: the sharing document, answered from its body encoded once per change."""

from __future__ import annotations

from aiohttp import web

from gpud.api.responses import encoded_json_response
from gpud.sharing.service import SharingView


class SharingRoutes:
    def __init__(self, sharing: SharingView):
        self.sharing = sharing

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/sharing", self.get)

    async def get(self, request: web.Request) -> web.Response:
        return encoded_json_response(self.sharing.body)
