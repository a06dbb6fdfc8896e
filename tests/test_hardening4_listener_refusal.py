"""A newcomer the TCP metrics listener refuses is closed quietly (issue 38, defect 1's refusals)."""

from __future__ import annotations

import asyncio
import gc
import logging

from aiohttp import web

from gpud.api.metrics_listener import HEAD_TIMEOUT_S, Slots

HEAD = b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


# Guards the refusal's close: done inside connection_made, aiohttp's handler for the connection
# started on a lost connection (Python < 3.12) and every refusal logged a traceback, "Task exception
# was never retrieved": 17,514 of them, 13 MB, in 11 s of a flood of 30 trickling connections from
# each of 127.0.0.1-9 (bench/metrics_lockout.py with 30 per address).
async def test_a_newcomer_refused_when_every_slot_is_answering_is_closed_without_a_traceback(caplog):
    release = asyncio.Event()

    async def slow(request: web.BaseRequest) -> web.Response:
        await asyncio.wait_for(release.wait(), 30)
        return web.Response(text="answered")

    server = web.Server(slow)
    Slots(max_connections=1, per_address=1, head_timeout_s=HEAD_TIMEOUT_S).attach(server)
    listening = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    host, port = listening.sockets[0].getsockname()[:2]
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(HEAD)
        await asyncio.sleep(0.2)  # fixed time: its request is being answered
        refused_reader, refused_writer = await asyncio.open_connection(host, port)
        refused_writer.write(HEAD)  # a whole head: weighed at once, and refused
        try:  # closed unanswered: at its end, or reset (its head unread)
            assert await asyncio.wait_for(refused_reader.read(), 5) == b""
        except ConnectionResetError:
            pass
        refused_writer.close()
        release.set()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        await asyncio.sleep(0.1)  # fixed time: the refused connection's handler has run
        gc.collect()  # asyncio logs a task's unretrieved exception when the task is collected
        assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text
    finally:
        listening.close()
        await server.shutdown(1)
