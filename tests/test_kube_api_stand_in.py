"""The Kubernetes API server stand-in's own behaviour: what it copies of kube-apiserver (each case names
its source in tests/kube_api_stand_in.py) and its fault injection. What both it and a real server must
answer alike is in test_kube_api_conformance.py."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import threading
import time

import pytest
from helpers import until
from kube_api_stand_in import AGENT_USER, KubeApiStandIn
from kube_http import JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeHttp, node_path
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio import watch as kwatch

NODE_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]}]


@pytest.fixture
def api():
    with KubeApiStandIn() as stand_in:
        stand_in.create_node("n1")
        yield stand_in


def test_tokens_anonymous_and_forbidden_messages(api):
    status, answer = KubeHttp(api.url, api.ca_file, "not-a-token").request("GET", node_path("n1"))
    assert (status, answer["reason"], answer["message"]) == (401, "Unauthorized", "Unauthorized")
    status, answer = api.http(None).request("GET", node_path("n1"))  # --anonymous-auth=true: system:anonymous
    assert status == 403 and 'User "system:anonymous" cannot get resource "nodes"' in answer["message"]
    agent = api.http("agent")
    status, answer = agent.request("GET", "/api/v1/nodes", query={"fieldSelector": "metadata.name=n1", "watch": "True"})
    assert status == 403
    assert answer["message"] == (f'nodes "n1" is forbidden: User "{AGENT_USER}" cannot watch resource "nodes" '
                                 'in API group "" at the cluster scope')
    status, answer = agent.request("GET", "/api/v1/nodes")
    assert answer["message"].startswith('nodes is forbidden: User') and "cannot list" in answer["message"]
    status, answer = agent.patch(node_path("n1", "status"), {"status": {}}, STRATEGIC_MERGE_PATCH)
    assert 'cannot patch resource "nodes/status" in API group "" at the cluster scope' in answer["message"]
    status, answer = agent.request("POST", "/api/v1/namespaces/default/events", {"metadata": {"name": "e"}})
    assert answer["message"] == (f'events is forbidden: User "{AGENT_USER}" cannot create resource "events" '
                                 'in API group "" in the namespace "default"')
    assert [r["verb"] for r in api.requests] == ["get", "get", "watch", "list", "patch", "create"]
    with KubeApiStandIn(anonymous_auth=False) as strict:
        assert strict.http(None).request("GET", node_path("n1"))[0] == 401


def test_rbac_rules_as_rbac_matches_them(api):
    api.create_node("n2")
    agent = api.http("agent")
    api.bind_agent_rbac([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"], "resourceNames": ["n1"]},
                         {"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]}])
    assert agent.request("GET", node_path("n1"))[0] == 200
    assert agent.request("GET", node_path("n2"))[0] == 403
    assert agent.patch(node_path("n1", "status"), {"status": {}}, STRATEGIC_MERGE_PATCH)[0] == 200
    assert agent.patch(node_path("n1"), {"metadata": {}})[0] == 403  # nodes/status does not grant nodes


def test_resource_versions_and_the_no_op_patch(api):
    admin = api.http("admin")
    before = api.node("n1")["metadata"]["resourceVersion"]
    status, same = admin.patch(node_path("n1"), {"metadata": {"labels": {"kubernetes.io/os": "linux"}}})
    assert status == 200 and same["metadata"]["resourceVersion"] == before
    changed = api.label("n1", "a", "b")
    assert int(changed["metadata"]["resourceVersion"]) > int(before)
    events = list(admin.watch("/api/v1/nodes", timeoutSeconds="1", resourceVersion=before))
    assert [(e["type"], e["object"]["metadata"]["labels"].get("a")) for e in events] == [("MODIFIED", "b")]
    api.label("n1", "a", None)
    assert "a" not in api.node("n1")["metadata"]["labels"]


def test_preconditions(api):
    admin = api.http("admin")
    stale = api.node("n1")["metadata"]["resourceVersion"]
    api.label("n1", "x", "1")
    status, answer = admin.patch(node_path("n1"), {"metadata": {"resourceVersion": stale}, "spec": {"taints": []}})
    assert (status, answer["reason"]) == (409, "Conflict")
    assert answer["message"] == ('Operation cannot be fulfilled on nodes "n1": the object has been modified; '
                                 'please apply your changes to the latest version and try again')
    status, answer = admin.patch(node_path("n1"), {"metadata": {"uid": "someone-else"}})
    assert (status, answer["details"]["causes"][0]["field"]) == (422, "metadata.uid")
    assert admin.patch(node_path("n9"), {"metadata": {}})[1]["message"] == 'nodes "n9" not found'


def test_patch_types_and_strategies(api):
    admin = api.http("admin")
    taints = [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "value": "1", "effect": "NoExecute"}]
    assert admin.patch(node_path("n1"), {"spec": {"taints": taints}}, STRATEGIC_MERGE_PATCH)[0] == 200
    _, node = admin.patch(node_path("n1"), {"spec": {"taints": [{"key": "c", "effect": "NoSchedule"}]}},
                          STRATEGIC_MERGE_PATCH)
    assert node["spec"]["taints"] == [{"key": "c", "effect": "NoSchedule"}]  # no merge key: atomic
    condition = {"type": "GPUHealthy", "status": "False", "lastTransitionTime": "2026-01-02T03:04:05.678+01:00"}
    _, node = admin.patch(node_path("n1", "status"), {"status": {"conditions": [condition]}}, STRATEGIC_MERGE_PATCH)
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready", "GPUHealthy"]
    assert node["status"]["conditions"][1]["lastTransitionTime"] == "2026-01-02T02:04:05Z"  # metav1.Time
    _, node = admin.patch(node_path("n1", "status"),
                          {"status": {"conditions": [{"type": "GPUHealthy", "$patch": "delete"}]}}, STRATEGIC_MERGE_PATCH)
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready"]
    _, node = admin.patch(node_path("n1"), {"status": {"capacity": {"cpu": "1"}}, "metadata": {"labels": {"l": "v"}}})
    assert node["status"]["capacity"]["cpu"] == "8" and node["metadata"]["labels"]["l"] == "v"  # status kept
    _, node = admin.patch(node_path("n1", "status"), {"spec": {"unschedulable": True}})
    assert "unschedulable" not in node["spec"]  # spec kept
    operations = [{"op": "test", "path": "/metadata/labels/l", "value": "v"},
                  {"op": "replace", "path": "/metadata/labels/l", "value": "w"}]
    assert admin.patch(node_path("n1"), operations, JSON_PATCH)[1]["metadata"]["labels"]["l"] == "w"
    status, answer = admin.patch(node_path("n1"), operations, JSON_PATCH)
    assert (status, answer["reason"]) == (422, "Invalid")


def test_bad_requests(api):
    admin = api.http("admin")
    status, answer = admin.request("PATCH", node_path("n1"), b"{}", "text/plain")
    assert (status, answer["reason"]) == (415, "UnsupportedMediaType")
    assert answer["message"].endswith("application/json-patch+json, application/merge-patch+json, "
                                      "application/strategic-merge-patch+json, application/apply-patch+yaml")
    assert admin.request("PATCH", node_path("n1"), b"{not json", MERGE_PATCH)[0] == 400
    status, answer = admin.request("PATCH", node_path("n1"), b" " * (3 * 1024 * 1024 + 1), MERGE_PATCH)
    assert (status, answer["reason"]) == (413, "RequestEntityTooLarge")
    assert admin.request("GET", "/api/v1/nodes", query={"fieldSelector": "status.phase=x"})[1]["message"] == \
        "field label not supported: status.phase"
    assert api.unmodelled == []
    assert admin.request("PATCH", node_path("n1"), b"{}", "application/apply-patch+yaml")[0] == 501
    assert admin.request("DELETE", node_path("n1"))[0] == 501
    assert len(api.unmodelled) == 2


def test_validation(api):
    admin = api.http("admin")
    status, answer = admin.patch(node_path("n1"), {"metadata": {"labels": {"example.com/ok": "not ok!"}}})
    assert status == 422 and answer["message"].startswith('Node "n1" is invalid: metadata.labels: Invalid value: "not ok!"')
    status, answer = admin.patch(node_path("n1"), {"spec": {"taints": [
        {"key": "k", "effect": "Bad"}, {"key": "k", "effect": "NoSchedule"}, {"key": "k", "effect": "NoSchedule"}]}})
    causes = [(c["reason"], c["field"]) for c in answer["details"]["causes"]]
    assert causes == [("FieldValueNotSupported", "metadata.taints[0].effect"),
                      ("FieldValueDuplicate", "metadata.taints[2]")]
    assert 'Unsupported value: "Bad": supported values: "NoSchedule", "PreferNoSchedule", "NoExecute"' in answer["message"]
    big = {"metadata": {"annotations": {"a": "x" * (256 * 1024)}}}
    assert admin.patch(node_path("n1"), big)[1]["details"]["causes"][0]["reason"] == "FieldValueTooLong"


def test_events(api):
    admin = api.http("admin")
    event = {"metadata": {"generateName": "n1."}, "involvedObject": {"kind": "Node", "name": "n1"},
             "reason": "GPUUnhealthy", "message": "m", "type": "Warning", "firstTimestamp": "2026-01-01T00:00:00Z"}
    status, created = admin.request("POST", "/api/v1/namespaces/default/events", event)
    assert status == 201 and created["metadata"]["name"].startswith("n1.") and created["metadata"]["namespace"] == "default"
    named = {**event, "metadata": {"name": "e1"}}
    assert admin.request("POST", "/api/v1/namespaces/default/events", named)[0] == 201
    assert admin.request("POST", "/api/v1/namespaces/default/events", named)[1]["reason"] == "AlreadyExists"
    status, answer = admin.request("POST", "/api/v1/namespaces/kube-public/events", named)
    assert (status, answer["details"]["causes"][0]["field"]) == (422, "involvedObject.namespace")
    assert admin.request("POST", "/api/v1/namespaces/nope/events", named)[1]["message"] == 'namespaces "nope" not found'
    assert len(api.events()) == 2 == len(admin.get("/api/v1/namespaces/default/events")["items"])


def test_watches_bookmarks_timeouts_and_compaction(api):
    admin = api.http("admin")
    started = time.monotonic()
    assert [e["type"] for e in admin.watch("/api/v1/nodes", timeoutSeconds="1")] == ["ADDED"]
    assert 0.9 < time.monotonic() - started < 5
    version = api.node("n1")["metadata"]["resourceVersion"]
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(admin.watch(
        "/api/v1/nodes", timeout=20, resourceVersion=version, allowWatchBookmarks="True", timeoutSeconds="30")))
    reader.start()
    until(lambda: api._watches, what="the watch registered")
    api.label("n1", "k", "v")
    until(lambda: seen, what="the MODIFIED event")
    api.send_bookmarks()
    until(lambda: len(seen) == 2, what="the bookmark")
    api.end_watches()
    reader.join(10)
    assert [e["type"] for e in seen] == ["MODIFIED", "BOOKMARK"]
    assert seen[1]["object"]["metadata"] == {"resourceVersion": seen[0]["object"]["metadata"]["resourceVersion"]}
    api.compact()
    assert list(admin.watch("/api/v1/nodes", resourceVersion=version)) == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: {version} ({api.node('n1')['metadata']['resourceVersion']})",
        "reason": "Expired", "code": 410}}]


def test_periodic_bookmarks_only_when_asked():
    with KubeApiStandIn(bookmark_period_s=0.2) as api:
        api.create_node("n1")
        admin = api.http("admin")
        asked = list(admin.watch("/api/v1/nodes", timeoutSeconds="3", allowWatchBookmarks="true"))
        assert asked[0]["type"] == "ADDED" and {e["type"] for e in asked[1:]} == {"BOOKMARK"} and len(asked) >= 3
        assert [e["type"] for e in admin.watch("/api/v1/nodes", timeoutSeconds="1", allowWatchBookmarks="0")] == ["ADDED"]


def test_faults(api):
    admin = api.http("admin")
    api.fail_next(500, count=2, match=lambda method, path: method == "PATCH")
    assert admin.request("GET", node_path("n1"))[0] == 200
    answers = [admin.patch(node_path("n1"), {}) for _ in range(3)]
    assert [status for status, _ in answers] == [500, 500, 200] and answers[0][1]["reason"] == "InternalError"
    api.fail_next(429)
    status, answer = admin.request("GET", node_path("n1"))
    assert (status, answer["details"]["retryAfterSeconds"]) == (429, 1)
    api.delay(0.5)
    started = time.monotonic()
    admin.get(node_path("n1"))
    assert time.monotonic() - started >= 0.5
    api.delay(0)
    # a watch broken by down() ends without the chunked stream's last chunk (http.client would read
    # that cut as a clean end, so the raw stream is read here)
    raw = ssl.create_default_context(cafile=str(api.ca_file)).wrap_socket(
        socket.create_connection(("127.0.0.1", api.port), timeout=10), server_hostname="127.0.0.1")
    raw.sendall(f"GET /api/v1/nodes?watch=1 HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {api.tokens['admin']}\r\n\r\n".encode())
    received = b""
    while b'"ADDED"' not in received:
        received += raw.recv(65536)
    api.down()
    while chunk := raw.recv(65536):
        received += chunk
    raw.close()
    assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"0\r\n\r\n")
    with pytest.raises(ConnectionRefusedError):
        admin.request("GET", node_path("n1"))
    api.up()
    assert admin.request("GET", node_path("n1"))[0] == 200


async def test_kubernetes_asyncio_through_the_kubeconfig(api):
    api.bind_agent_rbac(NODE_RULES)
    configuration = kclient.Configuration()
    await kconfig.load_kube_config(config_file=str(api.kubeconfig("agent")), client_configuration=configuration)
    async with kclient.ApiClient(configuration) as api_client:
        core = kclient.CoreV1Api(api_client)
        node = await core.read_node("n1")
        assert node.status.capacity["cpu"] == "8"
        version = node.metadata.resource_version
        api.label("n1", "seen", "yes")
        types = []
        async with kwatch.Watch().stream(core.list_node, field_selector="metadata.name=n1", resource_version=version,
                                         allow_watch_bookmarks=True, timeout_seconds=30) as stream:
            async for event in stream:
                types.append(event["type"])
                if len(types) == 1:
                    api.send_bookmarks()
                else:
                    break
        assert types == ["MODIFIED", "BOOKMARK"]
        api.compact()
        with pytest.raises(kclient.ApiException) as expired:
            async with kwatch.Watch().stream(core.list_node, resource_version=version, timeout_seconds=5) as stream:
                await asyncio.wait_for(stream.__anext__(), 10)
        assert expired.value.status == 410
    assert {r["user"] for r in api.requests} == {AGENT_USER}
    assert api.unmodelled == []


def test_the_server_certificate_is_checked(api):
    other = ssl.create_default_context()  # the system's CAs do not know the stand-in's
    connection = http.client.HTTPSConnection("127.0.0.1", api.port, context=other, timeout=5)
    with pytest.raises(ssl.SSLCertVerificationError):
        connection.request("GET", "/api/v1/nodes")
    connection.close()
