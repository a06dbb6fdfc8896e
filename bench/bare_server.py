"""The baseline for bench/api.py: a bare aiohttp app that answers every GET with fixed bytes."""

import asyncio
import sys

from aiohttp import web


async def main(socket_path: str, body_path: str) -> None:
    body = open(body_path, "rb").read()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/gpus", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, socket_path).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
