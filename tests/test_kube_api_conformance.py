"""The calls gpud's Kubernetes agent makes, and their failures, as the stand-in
(tests/kube_api_stand_in.py) answers them: statuses, reasons, merged results and messages as the real
kube-apiserver's source builds them (each cited in the stand-in). No real kube-apiserver can run here:
none is packaged for Debian 12 or on PyPI, and this machine reaches no Go module proxy to build one."""

from __future__ import annotations

import uuid

import pytest
from kube_api_stand_in import AGENT_USER, KubeApiStandIn
from kube_http import JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeHttp, node_path
from kube_manifests import agent_rbac_rules

AGENT_RULES = agent_rbac_rules()  # deploy/kubernetes/rbac.yaml


@pytest.fixture
def kube_api():
    with KubeApiStandIn() as stand_in:
        yield stand_in
        assert stand_in.unmodelled == []


@pytest.fixture
def node(kube_api) -> str:
    """A fresh node on the server."""
    name = f"n-{uuid.uuid4().hex[:8]}"
    kube_api.create_node(name)
    return name


def status_of(answer) -> tuple:
    return answer["code"], answer["reason"]


def test_the_agent_may_do_only_what_its_rules_allow(kube_api, node):
    agent = kube_api.http("agent")
    status, answer = agent.request("GET", node_path(node))
    assert (status, answer["reason"]) == (403, "Forbidden")
    assert answer["message"] == (f'nodes "{node}" is forbidden: User "{AGENT_USER}" cannot get resource "nodes" '
                                 'in API group "" at the cluster scope')
    kube_api.bind_agent_rbac(AGENT_RULES)
    assert agent.request("GET", node_path(node))[0] == 200
    assert agent.request("DELETE", node_path(node))[0] == 403  # authorization comes before the handler
    status, answer = agent.request("GET", "/api/v1/nodes")  # the manifest grants no list of every Node
    assert (status, answer["message"]) == (403, f'nodes is forbidden: User "{AGENT_USER}" cannot list resource '
                                                '"nodes" in API group "" at the cluster scope')


def test_a_bad_token_is_unauthorized(kube_api):
    status, answer = KubeHttp(kube_api.url, kube_api.ca_file, "not-a-token").request("GET", "/api/v1/nodes")
    assert (status, answer["reason"], answer["message"]) == (401, "Unauthorized", "Unauthorized")


def test_labels_merge_and_invalid_labels_are_refused(kube_api, node):
    admin = kube_api.http("admin")
    status, patched = admin.patch(node_path(node), {"metadata": {"labels": {"nvidia.com/gpu.healthy": "true"}}})
    assert status == 200 and patched["metadata"]["labels"]["nvidia.com/gpu.healthy"] == "true"
    assert patched["metadata"]["labels"]["kubernetes.io/hostname"] == node
    status, answer = admin.patch(node_path(node), {"metadata": {"labels": {"nvidia.com/gpu.healthy": "not ok!"}}})
    assert status_of(answer) == (422, "Invalid")
    assert {(c["reason"], c["field"]) for c in answer["details"]["causes"]} == {("FieldValueInvalid", "metadata.labels")}
    assert answer["message"].startswith(f'Node "{node}" is invalid: metadata.labels: Invalid value: "not ok!": ')


def test_a_no_op_patch_keeps_the_resource_version(kube_api, node):
    admin = kube_api.http("admin")
    version = admin.get(node_path(node))["metadata"]["resourceVersion"]
    status, same = admin.patch(node_path(node), {"metadata": {"labels": {"kubernetes.io/hostname": node}}})
    assert status == 200 and same["metadata"]["resourceVersion"] == version


def test_conditions_merge_by_type_on_the_status_subresource(kube_api, node):
    admin = kube_api.http("admin")
    condition = {"type": "GPUHealthy", "status": "False", "reason": "XidError", "message": "Xid 79",
                 "lastTransitionTime": "2026-01-02T03:04:05Z", "lastHeartbeatTime": "2026-01-02T03:04:05Z"}
    status, patched = admin.patch(node_path(node, "status"), {"status": {"conditions": [condition]}},
                                  STRATEGIC_MERGE_PATCH)
    assert status == 200
    conditions = {c["type"]: c for c in patched["status"]["conditions"]}
    assert conditions["GPUHealthy"] == condition and "Ready" in conditions
    _, patched = admin.patch(node_path(node, "status"), {"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}},
                             STRATEGIC_MERGE_PATCH)
    merged = {c["type"]: c for c in patched["status"]["conditions"]}["GPUHealthy"]
    assert merged == {**condition, "status": "True"}
    _, patched = admin.patch(node_path(node), {"status": {"conditions": []}}, MERGE_PATCH)
    assert {c["type"] for c in patched["status"]["conditions"]} >= {"Ready", "GPUHealthy"}  # nodes ignores status


def test_taints_are_replaced_with_a_resource_version_precondition(kube_api, node):
    admin = kube_api.http("admin")
    version = admin.get(node_path(node))["metadata"]["resourceVersion"]
    taints = [{"key": "nvidia.com/gpu-unhealthy", "value": "true", "effect": "NoSchedule"}]
    status, patched = admin.patch(node_path(node), {"metadata": {"resourceVersion": version}, "spec": {"taints": taints}},
                                  STRATEGIC_MERGE_PATCH)
    assert status == 200 and patched["spec"]["taints"] == taints
    status, answer = admin.patch(node_path(node), {"metadata": {"resourceVersion": version}, "spec": {"taints": []}},
                                 STRATEGIC_MERGE_PATCH)
    assert status_of(answer) == (409, "Conflict")
    assert answer["message"] == (f'Operation cannot be fulfilled on nodes "{node}": the object has been modified; '
                                 'please apply your changes to the latest version and try again')
    status, answer = admin.patch(node_path(node), {"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}},
                                 STRATEGIC_MERGE_PATCH)
    assert status_of(answer) == (422, "Invalid")
    assert {(c["reason"], c["field"]) for c in answer["details"]["causes"]} == \
        {("FieldValueNotSupported", "metadata.taints[0].effect")}


def test_patch_failures(kube_api, node):
    admin = kube_api.http("admin")
    status, answer = admin.request("PATCH", node_path(node), b"{}", "text/plain")
    assert status_of(answer) == (415, "UnsupportedMediaType")
    assert admin.request("PATCH", node_path(node), b"{not json", MERGE_PATCH)[0] == 400
    failing = [{"op": "test", "path": "/metadata/name", "value": "another"}]
    assert status_of(admin.patch(node_path(node), failing, JSON_PATCH)[1]) == (422, "Invalid")
    assert status_of(admin.patch(node_path("absent-node"), {"metadata": {}})[1]) == (404, "NotFound")
    status, answer = admin.patch(node_path(node), {"metadata": {"uid": str(uuid.uuid4())}})
    assert status_of(answer) == (422, "Invalid") and answer["details"]["causes"][0]["field"] == "metadata.uid"


def test_list_and_watch_as_the_agent_asks(kube_api, node):
    admin = kube_api.http("admin")
    listed = admin.get("/api/v1/nodes", fieldSelector=f"metadata.name={node}")
    assert [n["metadata"]["name"] for n in listed["items"]] == [node]
    version = listed["metadata"]["resourceVersion"]
    status, answer = admin.request("GET", "/api/v1/nodes", query={"fieldSelector": "status.phase=Running"})
    assert (status_of(answer), answer["message"]) == ((400, "BadRequest"), "field label not supported: status.phase")
    admin.patch(node_path(node), {"metadata": {"labels": {"watched": "yes"}}})
    events = list(admin.watch("/api/v1/nodes", fieldSelector=f"metadata.name={node}", resourceVersion=version,
                              allowWatchBookmarks="True", timeoutSeconds="1"))
    changes = [e for e in events if e["type"] != "BOOKMARK"]
    assert [(e["type"], e["object"]["metadata"]["labels"].get("watched")) for e in changes] == [("MODIFIED", "yes")]
    assert all(e["object"]["kind"] == "Node" for e in events)


def test_a_watch_from_a_compacted_version_is_expired(kube_api, node):
    admin = kube_api.http("admin")
    version = admin.get(node_path(node))["metadata"]["resourceVersion"]
    admin.patch(node_path(node), {"metadata": {"labels": {"a": "1"}}})
    kube_api.compact()
    [event] = list(admin.watch("/api/v1/nodes", resourceVersion=version, timeoutSeconds="5"))
    assert event["type"] == "ERROR" and status_of(event["object"]) == (410, "Expired")
    assert event["object"]["message"].startswith(f"too old resource version: {version} (")


def test_node_events(kube_api, node):
    admin = kube_api.http("admin")
    event = {"metadata": {"generateName": f"{node}."}, "involvedObject": {"kind": "Node", "name": node, "apiVersion": "v1"},
             "reason": "GPUUnhealthy", "message": "GPU 0: Xid 79", "type": "Warning", "count": 1,
             "firstTimestamp": "2026-01-02T03:04:05Z", "lastTimestamp": "2026-01-02T03:04:05Z",
             "source": {"component": "gpud"}}
    status, created = admin.request("POST", "/api/v1/namespaces/default/events", event)
    assert status == 201 and created["metadata"]["namespace"] == "default"
    assert created["involvedObject"]["name"] == node
    again = {**event, "metadata": {"name": created["metadata"]["name"]}}
    assert status_of(admin.request("POST", "/api/v1/namespaces/default/events", again)[1]) == (409, "AlreadyExists")
    status, answer = admin.request("POST", "/api/v1/namespaces/kube-public/events", again)
    assert status_of(answer) == (422, "Invalid")
    assert answer["details"]["causes"][0]["field"] == "involvedObject.namespace"
    names = [e["metadata"]["name"] for e in admin.get("/api/v1/namespaces/default/events")["items"]]
    assert created["metadata"]["name"] in names
