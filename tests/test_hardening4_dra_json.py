"""Issue 38, defect 10, in the DRA plugin: every JSON it reads from a peer is bounded in size and nesting.

The API server's answers and watch events (gpud/dra/kube.py), opaque claim parameters sent as text
(gpud/dra/config.py) and the claim specs found on disk at a restart (gpud/dra/claim_cdi.py) go through
gpud.base.bounded_json: a document nested 40,000 deep raised RecursionError out of the plugin's calls,
one nested 100 deep was handed on, a 2xx answer that was not JSON read as an empty object, and a watch
event had no size of its own. The peer here is a hostile server on the API server's address (a
kubeconfig pointing elsewhere, or a proxy in between): it answers what the test says, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from kubernetes_asyncio import client as k8s

from gpud.kubernetes import node_api
from gpud.dra.claim_cdi import claim_specs_on_disk, spec_path
from gpud.dra.config import ConfigError, parse
from gpud.dra.kube import DraApi
from gpud.kubernetes.node_api import KubeError

NODE, DRIVER = "node-1", "gpu.nvidia.com"
FAR_TOO_DEEP = b"[" * 40_000 + b"]" * 40_000  # past Python's recursion limit: RecursionError in json.loads


def nested(levels: int) -> dict:
    document: dict = {}
    for _ in range(levels):
        document = {"a": document}
    return document


def slice_object(name: str, **extra) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name, "resourceVersion": "7", **extra},
            "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                                 "resourceSliceCount": 1}, "devices": []}}


class HostileServer:
    """Answers GET of the node with `node_answer` (status, bytes) and a slice watch with `watch_answer`
    (status, list of byte strings written one after another, `trickle_s` apart)."""

    def __init__(self):
        self.node_answer: tuple[int, bytes] = (200, b"{}")
        self.watch_answer: tuple[int, list[bytes]] = (200, [])
        self.trickle_s = 0.0

    async def node(self, request: web.Request) -> web.Response:
        status, body = self.node_answer
        return web.Response(status=status, body=body, content_type="application/json")

    async def slices(self, request: web.Request) -> web.StreamResponse:
        # a watch, as the API server reads the boolean (apimachinery/pkg/runtime/conversion.go
        # Convert_Slice_string_To_bool: only "0" and any case of "false" are false); kubernetes_asyncio sends "True"
        assert request.query.get("watch", "false").lower() not in ("0", "false")
        status, pieces = self.watch_answer
        response = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(self.trickle_s)  # fixed time: a trickling server's pace
        await response.write_eof()
        return response


@pytest.fixture
async def hostile():
    server = HostileServer()
    app = web.Application()
    app.router.add_get(f"/api/v1/nodes/{NODE}", server.node)
    app.router.add_get("/apis/resource.k8s.io/v1/resourceslices", server.slices)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = k8s.ApiClient(configuration)
    yield server, DraApi(client, NODE, DRIVER)
    await client.close()
    await runner.cleanup()


async def watched(api: DraApi) -> list[tuple[str, dict]]:
    return [event async for event in api.watch_slices("1")]


@pytest.mark.parametrize("body, why", [
    (FAR_TOO_DEEP, "nests lists or objects more than 64 deep"),
    (json.dumps(nested(100)).encode(), "nests lists or objects more than 64 deep"),
    (b"<html>not JSON</html>", "is not valid JSON"),
    (b"", "is not valid JSON"),
    (b"[1, 2]", "is a JSON list, not an object"),
    (b'{"a": "\xff"}', "not UTF-8"),
], ids=["40000-deep", "100-deep", "html", "empty", "list", "not-utf8"])
async def test_an_answer_that_is_no_bounded_json_object_is_a_kube_error(hostile, body, why):
    server, api = hostile
    server.node_answer = (200, body)
    with pytest.raises(KubeError, match=why) as raised:
        await api.read_node()
    assert raised.value.status == 200 and f"get node {NODE}" in str(raised.value)


async def test_a_refusal_is_told_by_its_status_message_or_its_first_bytes(hostile):
    server, api = hostile
    server.node_answer = (403, json.dumps({"kind": "Status", "code": 403, "message": "nodes is forbidden"}).encode())
    with pytest.raises(KubeError, match="HTTP 403: nodes is forbidden"):
        await api.read_node()
    server.node_answer = (500, FAR_TOO_DEEP)
    with pytest.raises(KubeError) as raised:
        await api.read_node()
    assert raised.value.status == 500 and raised.value.message == "[" * 200


async def test_a_watch_yields_well_formed_events(hostile):
    server, api = hostile
    bookmark = {"type": "BOOKMARK", "object": {"kind": "ResourceSlice", "metadata": {"resourceVersion": "9"}}}
    added = {"type": "ADDED", "object": slice_object("one")}
    lines = [json.dumps(added).encode() + b"\n", b"\n", json.dumps(bookmark).encode() + b"\n"]
    server.watch_answer = (200, lines)
    assert await watched(api) == [("ADDED", added["object"]), ("BOOKMARK", bookmark["object"])]
    # The same, a byte at a time: lines are found across writes.
    server.watch_answer = (200, [bytes([b]) for b in b"".join(lines)])
    assert await watched(api) == [("ADDED", added["object"]), ("BOOKMARK", bookmark["object"])]


@pytest.mark.parametrize("event, why", [
    (FAR_TOO_DEEP, "nests lists or objects more than 64 deep"),
    (json.dumps({"type": "ADDED", "object": slice_object("deep", labels=nested(100))}).encode(),
     "nests lists or objects more than 64 deep"),
    (b"{not json", "a watch event is not valid JSON"),
    (json.dumps({"type": "ADDED", "object": {}}).encode(), "no metadata.name"),
    (json.dumps({"type": "MODIFIED", "object": {"metadata": {"name": 7}}}).encode(), "no metadata.name"),
    (json.dumps({"type": "SURPRISE", "object": slice_object("one")}).encode(), "not a watch event"),
    (json.dumps({"type": "ADDED", "object": [1]}).encode(), "not a watch event"),
    (json.dumps({"type": "ADDED"}).encode(), "not a watch event"),
], ids=["40000-deep", "100-deep", "not-json", "no-metadata", "name-not-a-string", "unknown-type", "object-a-list",
        "no-object"])
async def test_a_watch_event_that_is_no_event_of_a_slice_is_a_kube_error(hostile, event, why):
    server, api = hostile
    server.watch_answer = (200, [json.dumps({"type": "ADDED", "object": slice_object("first")}).encode() + b"\n",
                                 event + b"\n"])
    events = []
    with pytest.raises(KubeError, match=why) as raised:
        async for item in api.watch_slices("1"):
            events.append(item)
    assert [name for _kind, obj in events for name in [obj["metadata"]["name"]]] == ["first"]
    assert raised.value.status is None  # the publisher backs off and lists again


async def test_a_watch_event_over_the_size_bound_is_not_read(hostile, monkeypatch):
    server, api = hostile
    monkeypatch.setattr(node_api, "MAX_ANSWER_BYTES", 64 << 10)
    big = json.dumps({"type": "ADDED", "object": slice_object("big", annotations={"x": "y" * (1 << 20)})}).encode()
    server.watch_answer = (200, [big[i:i + 8192] for i in range(0, len(big), 8192)] + [b"\n"])
    with pytest.raises(KubeError, match=f"a watch event is over {64 << 10} bytes: not read"):
        await watched(api)


async def test_a_watch_trickling_bytes_that_make_no_event_is_dropped(hostile, monkeypatch):
    server, api = hostile
    monkeypatch.setattr(node_api, "WATCH_IDLE_S", 0.5)
    first = json.dumps({"type": "ADDED", "object": slice_object("first")}).encode() + b"\n"
    server.watch_answer, server.trickle_s = (200, [first] + [b" "] * 400), 0.02  # 8 s of a byte each 20 ms
    events, started = [], time.monotonic()
    with pytest.raises(KubeError, match="no event nor bookmark in 0.5 s") as raised:
        async for item in api.watch_slices("1"):
            events.append(item)
    assert [obj["metadata"]["name"] for _kind, obj in events] == ["first"]
    assert raised.value.status is None and time.monotonic() - started < 4


async def test_a_watch_ends_with_the_servers_error_event_or_refusal(hostile):
    server, api = hostile
    expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                           "message": "too old resource version: 1 (5)"}}
    server.watch_answer = (200, [json.dumps(expired).encode() + b"\n"])
    with pytest.raises(KubeError, match="too old resource version") as raised:
        await watched(api)
    assert raised.value.status == 410
    refusal = {"kind": "Status", "code": 403, "message": "resourceslices.resource.k8s.io is forbidden"}
    server.watch_answer = (403, [json.dumps(refusal).encode()])
    with pytest.raises(KubeError, match="HTTP 403: resourceslices.resource.k8s.io is forbidden"):
        await watched(api)
    assert api.requests["watch"] == 2


@pytest.mark.parametrize("parameters", [FAR_TOO_DEEP.decode(), json.dumps(nested(100))], ids=["40000-deep", "100-deep"])
def test_opaque_parameters_nested_too_deep_are_a_config_error(parameters):
    with pytest.raises(ConfigError, match="parameters nests lists or objects more than 64 deep"):
        parse(parameters)


def test_claim_specs_on_disk_skip_deep_and_non_object_files(tmp_path):
    uids = {"deep": "0b1f0000-0000-4000-8000-00000000000d", "list": "0b1f0000-0000-4000-8000-00000000000e",
            "good": "0b1f0000-0000-4000-8000-00000000000f"}
    spec_path(tmp_path, DRIVER, uids["deep"]).write_bytes(FAR_TOO_DEEP)
    spec_path(tmp_path, DRIVER, uids["list"]).write_text("[]")
    good = {"cdiVersion": "0.6.0", "kind": "k8s.gpu.nvidia.com/claim", "devices": []}
    spec_path(tmp_path, DRIVER, uids["good"]).write_text(json.dumps(good))
    assert claim_specs_on_disk(tmp_path, DRIVER) == {uids["good"]: good}
