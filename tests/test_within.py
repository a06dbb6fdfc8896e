"""gpud.base.loops.within, the one way gpud's loops wait with a time limit, and the watch that CI caught losing
a cancellation with asyncio.wait_for: on Python 3.10 and 3.11, a loop cancelled in the same loop turn as
what it waited for ended carried on (python/cpython#86296), so a Kubernetes watch cancelled as its
connection closed listed again for ever and the stop that had cancelled it never ended (the DRA slice
publisher's test, on the pure tree: five minutes, then pytest-timeout)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from helpers import until_async

from gpud.base.loops import within
from gpud.kubernetes.node_api import KubeError, watch_events


async def test_within_hands_back_the_result_or_times_out():
    assert await within(asyncio.sleep(0, "done"), 5) == "done"
    assert await within(asyncio.sleep(0.01, "no limit"), None) == "no limit"  # fixed time: any short one
    with pytest.raises(asyncio.TimeoutError):
        await within(asyncio.Event().wait(), 0.05)


async def test_a_cancellation_in_the_turn_an_item_arrives_ends_the_loop_and_leaves_the_item():
    queue: asyncio.Queue[int] = asyncio.Queue()
    taken = []

    async def consume():
        while True:
            taken.append(await within(queue.get(), 10))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)  # fixed time: the loop reaches its wait
    queue.put_nowait(1)
    task.cancel()
    await asyncio.wait([task], timeout=2)
    assert task.cancelled(), f"the loop went on: it took {taken}"
    assert taken == [] and queue.get_nowait() == 1


async def test_a_cancellation_in_the_turn_the_awaited_fails_is_a_cancellation():
    failing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(within(failing, 10))
    await asyncio.sleep(0.01)  # fixed time: the task reaches its wait
    failing.set_exception(RuntimeError("Connection closed."))
    task.cancel()
    await asyncio.wait([task], timeout=2)
    assert task.cancelled(), f"the failure was handed back instead: {task.exception()!r}"


class _Protocol:
    """What aiohttp's StreamReader asks of its connection (aiohttp/streams.py: `connected`, and flow control)."""

    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Response:
    """A watch's answer as watch_events reads it: aiohttp's own StreamReader as its content."""

    status = 200

    def __init__(self) -> None:
        self.content = aiohttp.StreamReader(_Protocol(), 2 ** 16, loop=asyncio.get_running_loop())
        self.closed = False

    def close(self) -> None:
        self.closed = True


async def _answer(response: _Response) -> _Response:
    return response


async def test_a_watch_cancelled_as_its_connection_closes_ends():
    response = _Response()
    seen = []

    async def follow():
        async for kind, obj in watch_events("watch own resourceslices", _answer(response)):
            seen.append((kind, obj["metadata"]["name"]))

    task = asyncio.create_task(follow())
    event = {"type": "ADDED", "object": {"metadata": {"name": "slice-a", "resourceVersion": "5"}}}
    response.content.feed_data(json.dumps(event).encode() + b"\n")
    await until_async(lambda: seen, timeout=2, what="the event")
    assert seen == [("ADDED", "slice-a")]
    response.content.set_exception(aiohttp.ClientConnectionError("Connection closed."))  # the stop's close
    task.cancel()  # ... and the stop's cancel, in the same loop turn
    await asyncio.wait([task], timeout=2)
    assert task.cancelled(), f"the watch went on: {task.exception()!r}"
    assert response.closed


async def test_a_watch_whose_connection_closes_is_a_kube_error():
    response = _Response()
    task = asyncio.create_task(anext(watch_events("watch own resourceslices", _answer(response))))
    await asyncio.sleep(0.01)  # fixed time: the watch reaches its read
    response.content.set_exception(aiohttp.ClientConnectionError("Connection closed."))
    with pytest.raises(KubeError, match="Connection closed"):
        await asyncio.wait_for(task, 2)
    assert response.closed
