"""The Kubernetes agent's kubeconfig and watches (issue 38, defects 4, 5 and 11): a kubeconfig, a file it
names or its credential plugin that another user controls is refused, naming the file, its owner and
mode; a watch the server ends at once is retried with client-go's backoff, not in a loop; a watch that
trickles is dropped; an answer or a watch event is read bounded in size and nesting."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from helpers import need

from gpud.base.safefs import UnsafePath
from gpud.kubernetes import node_api
from gpud.kubernetes.agent import Agent
from gpud.kubernetes.node_api import KubeError, NodeApi, api_client, check_kubeconfig

REPO = Path(__file__).resolve().parent.parent
OTHER_UID = 60054
NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "resourceVersion": "7", "labels": {}},
        "status": {"conditions": []}}


def kubeconfig(directory: Path, server: str = "https://127.0.0.1:1", **user) -> Path:
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server, **user.pop("cluster", {})}}],
        "users": [{"name": "u", "user": user or {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    path.chmod(0o600)
    return path


@pytest.fixture
def home(tmp_path):
    directory = tmp_path / "kube"
    directory.mkdir(mode=0o700)
    return directory


def test_a_kubeconfig_gpud_controls_is_taken(home):
    (home / "ca.crt").write_text("x")
    check_kubeconfig(kubeconfig(home, cluster={"certificate-authority": "ca.crt"}))


def test_a_kubeconfig_another_user_owns_is_refused_naming_owner_and_mode(home):
    need(os.geteuid() == 0, "gives the file to another user")
    path = kubeconfig(home)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=rf"the kubeconfig {path} is owned by uid {OTHER_UID} \(mode 0600\)"):
        check_kubeconfig(path)


def test_a_kubeconfig_others_can_write_is_refused(home):
    path = kubeconfig(home)
    path.chmod(0o666)
    with pytest.raises(UnsafePath, match=r"is writable by users other than its owner .*\(mode 0666\)"):
        check_kubeconfig(path)


def test_a_directory_others_can_write_on_the_way_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone can put another kubeconfig in its place
    with pytest.raises(UnsafePath, match=str(shared)):
        check_kubeconfig(kubeconfig(shared))


@pytest.mark.parametrize("key", ["certificate-authority", "client-key", "tokenFile", "client-certificate"])
def test_a_file_the_kubeconfig_names_that_another_user_can_write_is_refused(home, key):
    named = home / "named"
    named.write_text("x")
    named.chmod(0o646)
    user = {key: "named"} if key != "certificate-authority" else {"token": "t", "cluster": {key: "named"}}
    with pytest.raises(UnsafePath, match=rf"the kubeconfig's {key} {named} is writable by users other than"):
        check_kubeconfig(kubeconfig(home, **user))


def test_an_exec_plugin_another_user_controls_is_refused_and_never_runs(home, tmp_path):
    need(os.geteuid() == 0, "gives the plugin to another user")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    marker = tmp_path / "ran"
    plugin = plugins / "get-token"
    plugin.write_text(f"#!/bin/sh\ntouch {marker}\necho '{{}}'\n")
    plugin.chmod(0o755)
    os.chown(plugin, OTHER_UID, OTHER_UID)
    path = kubeconfig(home, exec={"apiVersion": "client.authentication.k8s.io/v1", "command": "get-token",
                                  "env": [{"name": "PATH", "value": str(plugins)}]})
    with pytest.raises(UnsafePath, match=rf"exec credential plugin {plugin} is owned by uid {OTHER_UID}"):
        check_kubeconfig(path)
    agent = subprocess.run([sys.executable, "-m", "gpud", "k8s-agent", "--kubeconfig", str(path), "--node-name", "n1"],
                           capture_output=True, text=True, timeout=60, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert agent.returncode == 2, agent
    assert f"is owned by uid {OTHER_UID}" in agent.stdout + agent.stderr
    assert not marker.exists(), "the untrusted credential plugin ran"


# -- watches --------------------------------------------------------------------------------------------


class FakeApiServer:
    """An API server gone wrong for the Node watch only: GET answers the Node, a watch what `watch` does.
    Counts the watch requests."""

    def __init__(self, watch, node: bytes = json.dumps(NODE).encode()):
        self.watch, self.watches, self.node = watch, 0, node

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch", "").lower() in ("true", "1"):
            self.watches += 1
            return await self.watch(request)
        if request.method == "GET" and request.path == "/api/v1/nodes/n1":
            return web.Response(body=self.node, content_type="application/json")
        return web.json_response(NODE)  # the agent's writes: answered, not judged here

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


async def empty_200(request: web.Request) -> web.StreamResponse:
    return web.Response(status=200, content_type="application/json")


async def watches_in_6_s(watch, home: Path, gpud_socket: Path) -> tuple[int, Agent]:
    """How many watches the agent's Node follower makes in 6 s against a server whose watches do `watch`."""
    fake = FakeApiServer(watch)
    async with fake as url:
        client = await api_client(kubeconfig(home, server=url))
        agent = Agent(NodeApi(client, "n1"), gpud_socket)
        following = asyncio.create_task(agent._follow_node())
        await asyncio.sleep(6.0)  # fixed time: how many watches the agent makes in this time is the test
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await client.close()
    return fake.watches, agent


async def test_watches_ending_at_once_with_no_event_back_off_as_client_gos_reflector(home, tmp_path):
    watches, agent = await watches_in_6_s(empty_200, home, tmp_path / "no-gpud.sock")
    # backoff 1 s doubling, jittered to half to all of each step: at most 1 + (6 s: 0.5, 1, 2, ...) watches
    assert 2 <= watches <= 5, f"{watches} watches in 6 s"
    assert "very short watch" in json.dumps(agent.status["problems"])


async def test_a_trickling_watch_is_dropped_at_the_idle_deadline(home, monkeypatch):
    monkeypatch.setattr(node_api, "WATCH_IDLE_S", 1.0)

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for byte in b'{"type": "MODIFIED", "object": ' * 100:
            await response.write(bytes([byte]))
            await asyncio.sleep(0.2)
        return response

    async with FakeApiServer(trickle) as url:
        client = await api_client(kubeconfig(home, server=url))
        started = time.monotonic()
        with pytest.raises(KubeError, match="no event nor bookmark in 1 s"):
            async for _ in NodeApi(client, "n1").watch("7"):
                pass
        assert time.monotonic() - started < 5
        await client.close()


async def test_an_event_line_over_the_read_limit_is_an_error_not_a_hang(home, monkeypatch):
    monkeypatch.setattr(node_api, "MAX_ANSWER_BYTES", 1 << 20)

    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"type": "MODIFIED", "object": {"x": "' + b"a" * (4 << 20))
        await asyncio.sleep(30)  # fixed time: never ends the line
        return response

    async with FakeApiServer(huge) as url:
        client = await api_client(kubeconfig(home, server=url))
        started = time.monotonic()
        with pytest.raises(KubeError, match=f"a watch event is over {1 << 20} bytes: not read"):
            async for _ in NodeApi(client, "n1").watch("7"):
                pass
        assert time.monotonic() - started < 10
        await client.close()


async def test_a_node_over_aiohttps_line_limit_is_watched_and_read(home):
    """A Node may carry 256 KiB of annotations (k8s.io/apimachinery pkg/api/validation/objectmeta.go
    TotalAnnotationSizeLimitB): more than aiohttp's 128 KiB readline limit, which the agent's watch once
    met as "Line is too long", forever."""
    big = {**NODE, "metadata": {**NODE["metadata"], "annotations": {"example.com/big": "a" * (200 << 10)}}}

    async def one_big_event(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(json.dumps({"type": "MODIFIED", "object": big}).encode() + b"\n")
        return response

    async with FakeApiServer(one_big_event) as url:
        client = await api_client(kubeconfig(home, server=url))
        api = NodeApi(client, "n1")
        assert [(kind, obj) async for kind, obj in api.watch("7")] == [("MODIFIED", big)]
        await client.close()


@pytest.mark.parametrize("answer, why", [
    (b'{"metadata": ' * 100 + b"{}" + b"}" * 100, "nests lists or objects more than 64 deep"),
    (b"[" * 40_000 + b"]" * 40_000, "nests lists or objects more than 64 deep"),  # RecursionError in json.loads
    (b"[]", "is a JSON list, not an object"),
    (b'{"kind": "Node", "metadata": {"name": "n1", "x": "' + b"a" * (17 << 20) + b'"}}', "over 16777216 bytes"),
], ids=["nested-100", "nested-40000", "a-list", "17-MiB"])
async def test_an_answer_too_deep_too_large_or_no_object_is_a_kube_error(home, answer, why):
    async with FakeApiServer(empty_200, node=answer) as url:
        client = await api_client(kubeconfig(home, server=url))
        with pytest.raises(KubeError, match=why):
            await NodeApi(client, "n1").read_node()
        await client.close()


async def test_watches_ending_at_once_after_a_bookmark_back_off_too(home, tmp_path):
    async def bookmark_then_end(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        bookmark = {"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
                                                   "metadata": {"resourceVersion": "8"}}}
        await response.write(json.dumps(bookmark).encode() + b"\n")
        return response

    watches, _ = await watches_in_6_s(bookmark_then_end, home, tmp_path / "no-gpud.sock")
    assert 2 <= watches <= 5, f"{watches} watches in 6 s"


def test_a_gcp_cmd_path_another_user_owns_is_refused(home, tmp_path):
    need(os.geteuid() == 0, "gives the program to another user")
    program = tmp_path / "gcloud"
    program.write_text("#!/bin/sh\necho '{}'\n")
    program.chmod(0o755)
    os.chown(program, OTHER_UID, OTHER_UID)
    path = kubeconfig(home, **{"auth-provider": {"name": "gcp", "config": {"cmd-path": str(program)}}})
    with pytest.raises(UnsafePath, match=rf"auth-provider cmd-path {program} is owned by uid {OTHER_UID}"):
        check_kubeconfig(path)


def test_a_kubeconfig_list_is_checked_file_by_file_as_kubectl_reads_it(home, tmp_path):
    good = kubeconfig(home)
    others = tmp_path / "others"
    others.mkdir()
    bad = kubeconfig(others)
    bad.chmod(0o622)
    check_kubeconfig(f"{good}{os.pathsep}{tmp_path / 'missing'}")  # a missing listed file is skipped
    with pytest.raises(UnsafePath, match=str(bad)):
        check_kubeconfig(f"{good}{os.pathsep}{bad}")
