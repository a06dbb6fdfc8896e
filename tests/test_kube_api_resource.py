"""The Kubernetes API server stand-in's resource.k8s.io/v1 (DRA): ResourceSlices and ResourceClaims, GET
/version, the dra user's RBAC and protobuf bodies, as tests/kube_api_stand_in.py models them from the real
kube-apiserver source (each behaviour cites its source there)."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
from helpers import until
from kube_api_stand_in import DRA_USER, PBDECODE, PROTOBUF, KubeApiStandIn
from kube_http import SLICES_PATH, claim_path, slice_path

MOCK_SLICE = json.loads((Path(__file__).resolve().parents[1].parent
                         / "shared/nvidia-dra-driver/resourceslice-h100-mock.json").read_text()) \
    if (Path(__file__).resolve().parents[1].parent / "shared/nvidia-dra-driver/resourceslice-h100-mock.json").exists() \
    else None
DRA_RULES = [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
              "verbs": ["get", "list", "watch", "create", "update", "delete", "deletecollection"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}]


def a_slice(node: str = "node1", driver: str = "gpu.example.com", devices: int = 1, **spec) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node}-{driver}-"},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{i}", "attributes": {"uuid": {"string": f"GPU-{i}"},
                                                                    "driverVersion": {"version": "550.163.1"}},
                                  "capacity": {"memory": {"value": "80Gi"}}} for i in range(devices)], **spec}}


def causes(answer: dict) -> list[tuple[str, str]]:
    return [(c["reason"], c["field"]) for c in answer["details"]["causes"]]


@pytest.fixture
def api():
    with KubeApiStandIn() as stand_in:
        yield stand_in
        assert stand_in.unmodelled == []


def test_version_for_everyone_and_by_constructor():
    for version, minor in (("1.34", "34"), ("1.35", "35"), ("1.36", "36")):
        with KubeApiStandIn(server_version=version) as api:
            status, answer = api.http(None).request("GET", "/version")  # system:public-info-viewer
            assert status == 200 and (answer["major"], answer["minor"], answer["gitVersion"]) == ("1", minor, f"v1.{minor}.0")
            assert answer == api.version
    with pytest.raises(ValueError):
        KubeApiStandIn(server_version="1.33")


def test_create_get_and_generated_names(api):
    admin = api.http("admin")
    status, created = admin.request("POST", SLICES_PATH, a_slice())
    assert status == 201, created
    meta = created["metadata"]
    assert meta["name"].startswith("node1-gpu.example.com-") and len(meta["name"]) == len("node1-gpu.example.com-") + 5
    assert set(meta["name"][-5:]) <= set("bcdfghjklmnpqrstvwxz2456789")
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert (created["kind"], created["apiVersion"]) == ("ResourceSlice", "resource.k8s.io/v1")
    assert admin.get(slice_path(meta["name"])) == created
    named = a_slice()
    named["metadata"] = {"name": "s1", "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "node1",
                                                            "uid": "11111111-2222-3333-4444-555555555555", "controller": True}]}
    status, answer = admin.request("POST", SLICES_PATH, named)
    assert status == 201 and answer["metadata"]["ownerReferences"][0]["controller"] is True
    status, answer = admin.request("POST", SLICES_PATH, named)
    assert (status, answer["reason"], answer["message"]) == (
        409, "AlreadyExists", 'resourceslices.resource.k8s.io "s1" already exists')
    status, answer = admin.request("GET", slice_path("nope"))
    assert (status, answer["message"], answer["details"]["group"]) == (
        404, 'resourceslices.resource.k8s.io "nope" not found', "resource.k8s.io")
    assert len(api.resource_slices("node1")) == 2 and api.resource_slices("node2") == []


@pytest.mark.skipif(MOCK_SLICE is None, reason="../shared/nvidia-dra-driver is not in this clone")
def test_the_slice_nvidia_s_plugin_posted_is_accepted(api):
    status, created = api.http("admin").request("POST", SLICES_PATH, MOCK_SLICE)
    assert status == 201, created
    assert created["spec"]["devices"] == MOCK_SLICE["spec"]["devices"]
    assert created["metadata"]["name"].startswith("00000-gpu.nvidia.com-node1-")


def test_field_selectors_list_and_delete_collection(api):
    admin = api.http("admin")
    for node, driver in (("n1", "a.example.com"), ("n1", "b.example.com"), ("n2", "a.example.com")):
        admin.request("POST", SLICES_PATH, a_slice(node, driver))
    listed = admin.get(SLICES_PATH, fieldSelector="spec.nodeName=n1,spec.driver=a.example.com")
    assert listed["kind"] == "ResourceSliceList" and len(listed["items"]) == 1
    assert "kind" not in listed["items"][0]
    assert len(admin.get(SLICES_PATH, fieldSelector="spec.driver!=a.example.com")["items"]) == 1
    name = listed["items"][0]["metadata"]["name"]
    assert [i["metadata"]["name"] for i in admin.get(SLICES_PATH, fieldSelector=f"metadata.name={name}")["items"]] == [name]
    status, answer = admin.request("GET", SLICES_PATH, query={"fieldSelector": "spec.pool.name=n1"})
    assert (status, answer["message"]) == (400, "field label not supported: spec.pool.name")
    assert len(admin.get(SLICES_PATH, limit="500", resourceVersion="0")["items"]) == 3
    wiped = api.wipe_resource_slices("n1", "a.example.com")
    assert [s["spec"]["driver"] for s in wiped] == ["a.example.com"]
    assert len(api.wipe_resource_slices("n1")) == 1 and len(api.resource_slices()) == 1
    assert [r["verb"] for r in api.requests if r["method"] == "DELETE"] == ["deletecollection"] * 2


def test_update_preconditions_generation_and_immutable_fields(api):
    admin = api.http("admin")
    _, created = admin.request("POST", SLICES_PATH, a_slice())
    path = slice_path(created["metadata"]["name"])
    same = copy.deepcopy(created)
    status, answer = admin.put(path, same)
    assert status == 200 and answer["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    changed = copy.deepcopy(created)
    changed["spec"]["pool"]["generation"] = 2
    status, updated = admin.put(path, changed)
    assert status == 200 and updated["metadata"]["generation"] == 2
    assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    status, answer = admin.put(path, changed)  # stale resourceVersion
    assert (status, answer["reason"]) == (409, "Conflict")
    assert answer["message"].startswith(f'Operation cannot be fulfilled on resourceslices.resource.k8s.io '
                                        f'"{created["metadata"]["name"]}": the object has been modified')
    moved = copy.deepcopy(updated)
    moved["spec"].update(driver="other.example.com", nodeName="node2")
    moved["spec"]["pool"]["name"] = "node2"
    status, answer = admin.put(path, moved)
    assert status == 422 and causes(answer) == [("FieldValueInvalid", "spec.pool.name"),
                                                ("FieldValueInvalid", "spec.driver"),
                                                ("FieldValueInvalid", "spec.nodeName")]
    assert 'spec.driver: Invalid value: "other.example.com": field is immutable' in answer["message"]
    assert answer["message"].startswith(f'ResourceSlice.resource.k8s.io "{created["metadata"]["name"]}" is invalid: [')
    status, answer = admin.put(slice_path("other"), updated)
    assert status == 400 and "does not match the name on the URL (other)" in answer["message"]
    unconditional = copy.deepcopy(updated)
    del unconditional["metadata"]["resourceVersion"]
    unconditional["spec"]["pool"]["generation"] = 3
    assert admin.put(path, unconditional)[1]["metadata"]["generation"] == 3


def test_delete_returns_the_object_and_checks_preconditions(api):
    admin = api.http("admin")
    _, created = admin.request("POST", SLICES_PATH, a_slice())
    path = slice_path(created["metadata"]["name"])
    status, answer = admin.delete(path, {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": "x"}})
    assert status == 409 and "Precondition failed: UID in precondition: x" in answer["message"]
    status, deleted = admin.delete(path)
    assert status == 200 and deleted == created
    assert admin.delete(path)[0] == 404


@pytest.mark.parametrize("change, reason, field, message", [
    (lambda s: s["metadata"].update(name="Bad_Name", generateName=None), "FieldValueInvalid", "metadata.name",
     "a lowercase RFC 1123 subdomain"),
    (lambda s: s["spec"].update(driver="x" * 64), "FieldValueTooLong", "spec.driver", "must have at most 63 bytes"),
    (lambda s: s["spec"].update(driver="bad_driver"), "FieldValueInvalid", "spec.driver", "RFC 1123 subdomain"),
    (lambda s: s["spec"]["pool"].update(name="a/B"), "FieldValueInvalid", "spec.pool.name", 'Invalid value: "B"'),
    (lambda s: s["spec"]["pool"].update(name="p" * 254), "FieldValueTooLong", "spec.pool.name", "at most 253 bytes"),
    (lambda s: s["spec"]["pool"].update(generation=-1), "FieldValueInvalid", "spec.pool.generation",
     "must be greater than or equal to zero"),
    (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "FieldValueInvalid", "spec.pool.resourceSliceCount",
     "must be greater than zero"),
    (lambda s: s["spec"].pop("nodeName"), "FieldValueRequired", "spec",
     "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"),
    (lambda s: s["spec"].update(allNodes=True), "FieldValueInvalid", "spec",
     'Invalid value: "{`nodeName`, `allNodes`}": exactly one of'),
    (lambda s: s["spec"].update(allNodes=False), "FieldValueInvalid", "spec.allNodes", "must be either unset or set to true"),
    (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "FieldValueInvalid", "spec.devices[0].name",
     "a lowercase RFC 1123 label"),
    (lambda s: s["spec"]["devices"].append(copy.deepcopy(s["spec"]["devices"][0])), "FieldValueDuplicate",
     "spec.devices[1]", 'Duplicate value: "gpu-0"'),
    (lambda s: s["spec"].update(devices=[{"name": f"d{i}"} for i in range(129)]), "FieldValueTooMany", "spec.devices",
     "Too many: 129: must have at most 128 items"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({f"a{i}": {"int": i} for i in range(31)}),
     "FieldValueInvalid", "spec.devices[0]", "the total number of attributes and capacities must not exceed 32"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"1bad": {"int": 1}}), "FieldValueTypeInvalid",
     "spec.devices[0].attributes[1bad]", "a valid C identifier must start with alphabetic character or '_'"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"a" * 33: {"int": 1}}), "FieldValueTooLong",
     "spec.devices[0].attributes[" + "a" * 33 + "]", "must have at most 32 bytes"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"Bad_Domain/x": {"int": 1}}), "FieldValueInvalid",
     "spec.devices[0].attributes[Bad_Domain/x]", "RFC 1123 subdomain"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"x": {"int": 1, "bool": True}}), "FieldValueInvalid",
     "spec.devices[0].attributes[x]", "exactly one value must be specified"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"x": {}}), "FieldValueInvalid",
     "spec.devices[0].attributes[x]", "exactly one value must be specified"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"x": {"string": "s" * 65}}), "FieldValueTooLong",
     "spec.devices[0].attributes[x].string", "must have at most 64 bytes"),
    (lambda s: s["spec"]["devices"][0]["attributes"].update({"x": {"version": "550.163.01"}}), "FieldValueInvalid",
     "spec.devices[0].attributes[x].version", "must be a string compatible with semver.org spec 2.0.0"),
    (lambda s: s["spec"]["devices"][0]["capacity"].update({"bad-name": {"value": "1"}}), "FieldValueTypeInvalid",
     "spec.devices[0].capacity[bad-name]", "C identifier"),
])
def test_slice_validation(api, change, reason, field, message):
    body = a_slice()
    change(body)
    status, answer = api.http("admin").request("POST", SLICES_PATH, body)
    assert status == 422, answer
    assert (reason, field) in causes(answer), answer
    assert message in answer["message"]


def test_decoding_errors_are_bad_requests(api):
    admin = api.http("admin")
    body = a_slice()
    body["spec"]["devices"][0]["capacity"]["memory"]["value"] = "80 GiB"
    status, answer = admin.request("POST", SLICES_PATH, body)
    assert status == 400 and "quantities must match the regular expression" in answer["message"]
    body = a_slice()
    body["spec"]["pool"]["generation"] = "1"
    assert admin.request("POST", SLICES_PATH, body)[0] == 400
    status, answer = admin.request("POST", SLICES_PATH, b"{}", "text/plain")
    assert (status, answer["reason"]) == (415, "UnsupportedMediaType")
    assert answer["message"].endswith("application/json, application/yaml" +
                                      (", application/vnd.kubernetes.protobuf" if PBDECODE.exists() else ""))


def tainted(effect: str, count: int = 1) -> dict:
    body = a_slice()
    body["spec"]["devices"][0]["taints"] = [{"key": f"gpu.example.com/t{i}", "value": "v", "effect": effect}
                                            for i in range(count)]
    return body


def test_taints_by_version_and_feature_gate():
    gate = {"DRADeviceTaints": True}
    with KubeApiStandIn() as api:  # 1.34: DRADeviceTaints alpha, off: taints are dropped
        status, created = api.http("admin").request("POST", SLICES_PATH, tainted("Bad"))
        assert status == 201 and "taints" not in created["spec"]["devices"][0]
    with KubeApiStandIn(server_version="1.34", feature_gates=gate) as api:
        admin = api.http("admin")
        status, created = admin.request("POST", SLICES_PATH, tainted("NoSchedule", 4))
        assert status == 201 and created["spec"]["devices"][0]["taints"][0]["timeAdded"].endswith("Z")
        status, answer = admin.request("POST", SLICES_PATH, tainted("None"))
        assert causes(answer) == [("FieldValueNotSupported", "spec.devices[0].taints[0].effect")]
        assert 'supported values: "NoExecute", "NoSchedule"' in answer["message"]
        status, answer = admin.request("POST", SLICES_PATH, tainted("NoSchedule", 5))
        assert causes(answer) == [("FieldValueTooMany", "spec.devices[0].taints")]
        bad = tainted("")
        bad["spec"]["devices"][0]["taints"][0]["key"] = "not a key"
        assert causes(admin.request("POST", SLICES_PATH, bad)[1]) == [
            ("FieldValueInvalid", "spec.devices[0].taints[0].key"), ("FieldValueRequired", "spec.devices[0].taints[0].effect")]
    with KubeApiStandIn(server_version="1.35", feature_gates=gate) as api:
        admin = api.http("admin")
        assert admin.request("POST", SLICES_PATH, tainted("None", 16))[0] == 201
        assert causes(admin.request("POST", SLICES_PATH, tainted("None", 17))[1]) == [
            ("FieldValueTooMany", "spec.devices[0].taints")]
        many = tainted("NoSchedule")
        many["spec"]["devices"] += [{"name": f"d{i}"} for i in range(64)]
        assert causes(admin.request("POST", SLICES_PATH, many)[1]) == [("FieldValueTooMany", "spec.devices")]
    with KubeApiStandIn(server_version="1.36") as api:  # beta, on by default
        assert api.http("admin").request("POST", SLICES_PATH, tainted("None"))[0] == 201


def counters_slice() -> dict:
    body = a_slice(devices=2)
    body["spec"]["sharedCounters"] = [{"name": "gpu-0-counter-set", "counters": {"memory": {"value": "80Gi"}}}]
    for device in body["spec"]["devices"]:
        device["consumesCounters"] = [{"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "40Gi"}}}]
    return body


def test_shared_counters_in_1_34_and_1_35():
    gate = {"DRAPartitionableDevices": True}
    with KubeApiStandIn() as api:  # gate off: dropped
        _, created = api.http("admin").request("POST", SLICES_PATH, counters_slice())
        assert "sharedCounters" not in created["spec"] and "consumesCounters" not in created["spec"]["devices"][0]
    with KubeApiStandIn(server_version="1.34", feature_gates=gate) as api:
        admin = api.http("admin")
        status, created = admin.request("POST", SLICES_PATH, counters_slice())
        assert status == 201 and created["spec"]["sharedCounters"][0]["name"] == "gpu-0-counter-set"
        wrong = counters_slice()
        wrong["spec"]["devices"][1]["consumesCounters"][0]["counterSet"] = "elsewhere"
        status, answer = admin.request("POST", SLICES_PATH, wrong)
        assert causes(answer) == [("FieldValueInvalid", "spec.devices[1].consumesCounters[0].counterSet")]
        assert "must reference a counterSet defined in the ResourceSlice sharedCounters" in answer["message"]
    with KubeApiStandIn(server_version="1.35", feature_gates=gate) as api:
        admin = api.http("admin")
        status, answer = admin.request("POST", SLICES_PATH, counters_slice())
        assert causes(answer) == [("FieldValueInvalid", "spec")]
        assert 'spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed' in answer["message"]
        counters = counters_slice()
        del counters["spec"]["devices"]
        devices = counters_slice()
        del devices["spec"]["sharedCounters"]
        assert admin.request("POST", SLICES_PATH, counters)[0] == 201  # a counter slice, then its devices
        assert admin.request("POST", SLICES_PATH, devices)[0] == 201
        status, answer = admin.request("POST", SLICES_PATH, {**counters, "spec": {**counters["spec"], "devices": []}})
        assert status == 422  # an empty list is set (non-nil in Go), not left out


def test_the_dra_user_by_its_rbac_rules(api):
    dra = api.http("dra")
    status, answer = dra.request("POST", SLICES_PATH, a_slice())
    assert status == 403 and answer["message"] == (
        f'resourceslices.resource.k8s.io is forbidden: User "{DRA_USER}" cannot create resource "resourceslices" '
        'in API group "resource.k8s.io" at the cluster scope')
    api.bind_rbac("dra", [{"apiGroups": [""], "resources": ["resourceslices"], "verbs": ["*"]}])
    assert dra.request("POST", SLICES_PATH, a_slice())[0] == 403  # the core group is not resource.k8s.io
    api.bind_rbac("dra", DRA_RULES)
    assert dra.request("POST", SLICES_PATH, a_slice())[0] == 201
    assert dra.request("DELETE", SLICES_PATH, query={"fieldSelector": "spec.nodeName=node1"})[0] == 200
    api.create_resource_claim("default", "c1", [{"name": "gpu", "deviceClassName": "gpu.example.com"}], None)
    assert dra.request("GET", claim_path("default", "c1"))[0] == 200
    status, answer = dra.request("GET", claim_path("default"))
    assert status == 403 and 'cannot list resource "resourceclaims" in API group "resource.k8s.io" in the ' \
        'namespace "default"' in answer["message"]
    api.bind_rbac("dra", [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
                           "verbs": ["delete"], "resourceNames": ["only-this"]}])
    assert dra.request("DELETE", SLICES_PATH)[0] == 403  # deletecollection is its own verb
    assert dra.request("DELETE", slice_path("only-this"))[0] == 404  # allowed, and absent
    assert dra.request("DELETE", slice_path("another"))[0] == 403
    api.bind_agent_rbac([])  # the agent's binding is its own
    assert dra.request("DELETE", slice_path("only-this"))[0] == 404


def test_claims_through_the_helpers(api):
    results = [{"request": "gpu", "driver": "gpu.example.com", "pool": "node1", "device": "gpu-0"}]
    config = [{"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.example.com",
                                                                 "parameters": {"kind": "GpuConfig"}}}]
    first = api.create_resource_claim("default", "c1", [{"name": "gpu", "deviceClassName": "gpu.example.com"}],
                                      results, config, reserved_for=[{"resource": "pods", "name": "p", "uid": "u"}],
                                      node="node1")
    admin = api.http("admin")
    claim = admin.get(claim_path("default", "c1"))
    assert claim == first and claim["kind"] == "ResourceClaim"
    assert claim["spec"]["devices"]["requests"][0] == {"name": "gpu", "exactly": {
        "deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 1}}
    allocation = claim["status"]["allocation"]
    assert allocation["devices"] == {"results": results, "config": config}
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["node1"]
    api.delete_resource_claim("default", "c1")
    status, answer = admin.request("GET", claim_path("default", "c1"))
    assert (status, answer["message"]) == (404, 'resourceclaims.resource.k8s.io "c1" not found')
    second = api.create_resource_claim("default", "c1", [{"name": "gpu", "exactly": {"deviceClassName": "x"}}], None)
    assert second["metadata"]["uid"] != first["metadata"]["uid"] and "allocation" not in second["status"]
    allocated = api.set_claim_allocation("default", "c1", results)
    assert allocated["status"]["allocation"]["devices"]["results"] == results
    assert [c["metadata"]["name"] for c in admin.get(claim_path("default"))["items"]] == ["c1"]
    assert admin.get("/apis/resource.k8s.io/v1/resourceclaims")["kind"] == "ResourceClaimList"


def test_slice_watches(api):
    admin = api.http("admin")
    _, first = admin.request("POST", SLICES_PATH, a_slice("n1"))
    version = first["metadata"]["resourceVersion"]
    admin.request("POST", SLICES_PATH, a_slice("n2"))
    events = list(admin.watch(SLICES_PATH, timeoutSeconds="1", fieldSelector="spec.nodeName=n1"))
    assert [(e["type"], e["object"]["spec"]["nodeName"]) for e in events] == [("ADDED", "n1")]
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(admin.watch(
        SLICES_PATH, timeout=20, resourceVersion=version, allowWatchBookmarks="true", timeoutSeconds="30",
        fieldSelector="spec.nodeName=n1")))
    reader.start()
    until(lambda: api._watches, what="the watch registered")
    changed = copy.deepcopy(first)
    changed["spec"]["pool"]["generation"] = 2
    admin.put(slice_path(first["metadata"]["name"]), changed)
    api.wipe_resource_slices("n1")
    until(lambda: len(seen) == 2, what="MODIFIED and DELETED")
    api.send_bookmarks()
    until(lambda: len(seen) == 3, what="the bookmark")
    api.end_watches()
    reader.join(10)
    assert [e["type"] for e in seen] == ["MODIFIED", "DELETED", "BOOKMARK"]
    assert int(seen[1]["object"]["metadata"]["resourceVersion"]) > int(seen[0]["object"]["metadata"]["resourceVersion"])
    assert seen[2]["object"]["kind"] == "ResourceSlice" and seen[2]["object"]["spec"]["devices"] is None
    listed = list(admin.watch(SLICES_PATH, timeoutSeconds="1", sendInitialEvents="true", allowWatchBookmarks="true",
                              resourceVersionMatch="NotOlderThan", resourceVersion=""))
    assert [e["type"] for e in listed] == ["ADDED", "BOOKMARK"]
    assert listed[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    api.compact()
    assert list(admin.watch(SLICES_PATH, resourceVersion=version))[0]["object"]["code"] == 410


def test_protobuf_accept_alone_is_unmodelled():
    with KubeApiStandIn() as api:
        status, _ = api.http("admin").request("GET", SLICES_PATH, accept=PROTOBUF)
        assert status == 501 and len(api.unmodelled) == 1
        assert api.http("admin").request("GET", SLICES_PATH, accept=f"{PROTOBUF}, application/json")[0] == 200


@pytest.mark.skipif(not PBDECODE.exists(), reason=f"no protobuf decoder at {PBDECODE} (../shared is not in this clone)")
def test_a_protobuf_body_is_decoded(api):
    body = (Path(__file__).parent / "data" / "resourceslice-h100-mock.pb")
    if not body.exists():
        pytest.skip(f"no protobuf body captured from NVIDIA's plugin at {body}")
    status, created = api.http("admin").request("POST", SLICES_PATH, body.read_bytes(), PROTOBUF)
    assert status == 201, created
    assert created["spec"]["driver"] == "gpu.nvidia.com" and len(created["spec"]["devices"]) == 8
    assert api.requests[-1]["content_type"] == PROTOBUF
    status, answer = api.http("admin").request("POST", SLICES_PATH, b"\x00garbage", PROTOBUF)
    assert status == 400
