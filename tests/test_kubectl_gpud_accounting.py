"""kubectl gpud's accounting as a pure function (the scheduler's pod requests, DRA results, hostile objects),
its start-up imports, and what the API stand-in serves kubectl (discovery in both forms, pods, label
selectors) as kube-apiserver does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kube_api_discovery import AGGREGATED_CONTENT_TYPE
from kube_api_stand_in import KubeApiStandIn, labels_match, parse_label_selector

from gpud.kubectl_plugin.accounting import cluster_totals, inspect, pod_requests

ACCEPT_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"


def pod(containers, init=(), node="n1", phase="Running"):
    return {"metadata": {"namespace": "default", "name": "p"}, "spec": {
        "nodeName": node, "containers": [{"resources": {"requests": r}} for r in containers],
        "initContainers": [{"resources": {"requests": r}, **({"restartPolicy": "Always"} if sidecar else {})}
                           for r, sidecar in init]}, "status": {"phase": phase}}


def test_a_pods_request_is_the_containers_sum_or_an_init_containers_if_larger_with_sidecars_added():
    """component-helpers resource/helpers.go PodRequests (the scheduler's NodeResourcesFit)."""
    assert pod_requests(pod([{"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "2"}])) == {"nvidia.com/gpu": 3}
    assert pod_requests(pod([{"nvidia.com/gpu": "1"}], [({"nvidia.com/gpu": "4"}, False)])) == {"nvidia.com/gpu": 4}
    # a sidecar (restartPolicy Always) runs beside the containers and the init containers after it
    assert pod_requests(pod([{"nvidia.com/gpu": "1"}], [({"nvidia.com/gpu": "1"}, True),
                                                       ({"nvidia.com/gpu": "2"}, False)])) == {"nvidia.com/gpu": 3}


@pytest.mark.parametrize("hostile", [
    {"metadata": "x"}, {"metadata": {"name": 5}}, {"status": {"capacity": ["nvidia.com/gpu"]}},
    {"metadata": {"name": "n1", "labels": {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "-1"}},
     "status": {"capacity": {"nvidia.com/gpu": "1.5", "nvidia.com/mig-1g.10gb": "lots"}}},
])
def test_malformed_objects_are_passed_over_not_a_crash(hostile):
    pods = [pod([{"nvidia.com/gpu": "x"}]), {"spec": []}, {"spec": {"nodeName": "n1", "containers": [None, 3]}}]
    slices = [{"spec": {"driver": "gpu.nvidia.com", "nodeName": "n1", "pool": {"name": "n1"},
                        "devices": [None, {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}},
                                           "capacity": {"memory": {"value": "eighty"}}}]}}, {"spec": "x"}]
    claims = [{"status": {"allocation": {"devices": {"results": [None, {"driver": "gpu.nvidia.com", "pool": "n1",
                                                                        "device": "gpu-0", "consumedCapacity": 7}]}}}}]
    views = inspect([hostile, {"metadata": {"name": "n1"}}], pods, slices, claims, "gpu.nvidia.com", include_all=True)
    assert views[-1].name == "n1" and views[-1].gpus.allocated == 1 and views[-1].gpus.total == 1
    json.dumps(cluster_totals(views))


def test_a_shared_dra_gpu_counts_each_claims_consumed_memory_and_the_device_once():
    device = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-0"}},
              "capacity": {"memory": {"value": "80Gi"}}, "allowMultipleAllocations": True}
    slices = [{"spec": {"driver": "gpu.nvidia.com", "nodeName": "n1", "pool": {"name": "n1"}, "devices": [device]}}]
    claims = [{"metadata": {"namespace": "default", "name": f"share-{n}"}, "status": {"allocation": {"devices": {
        "results": [{"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0",
                     "consumedCapacity": {"memory": "10Gi"}}]}}}} for n in range(3)]
    [view] = inspect([{"metadata": {"name": "n1"}}], [], slices, claims, "gpu.nvidia.com")
    assert (view.gpus.allocated, view.gpus.total, view.memory_allocated_mib, view.memory_total_mib) == \
        (1, 1, 30 * 1024, 80 * 1024)
    assert view.claims == ["default/share-0", "default/share-1", "default/share-2"]
    # another driver's devices and claims are not gpud's
    assert inspect([{"metadata": {"name": "n1"}}], [], slices, claims, "other.example.com") == []


def test_the_plugin_starts_without_the_daemons_libraries():
    """Only what `kubectl gpud inspect` needs: no YAML, logging, HTTP server or gpud config."""
    code = "import json, sys, gpud.kubectl_plugin.main; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                           check=True).stdout))
    heavy = {"yaml", "structlog", "aiohttp", "gpud.config", "gpud.client", "kubernetes_asyncio", "grpc", "http.client"}
    assert loaded & heavy == set()


# -- the stand-in ----------------------------------------------------------------------------------


def test_discovery_is_aggregated_when_asked_unaggregated_otherwise_and_not_for_anonymous():
    with KubeApiStandIn() as api:
        http = api.http("agent")  # any authenticated user reads discovery (system:discovery)
        status, answer = http.request("GET", "/apis", accept=ACCEPT_V2)
        assert status == 200 and answer["kind"] == "APIGroupDiscoveryList"
        groups = {item["metadata"]["name"]: item for item in answer["items"]}
        assert set(groups) == {"resource.k8s.io", "policy", "coordination.k8s.io"}
        group = groups["resource.k8s.io"]
        assert {r["resource"]: r["scope"] for r in group["versions"][0]["resources"]} == {
            "resourceslices": "Cluster", "resourceclaims": "Namespaced"}
        status, answer = http.request("GET", "/api")
        assert status == 200 and answer["kind"] == "APIVersions" and answer["versions"] == ["v1"]
        status, answer = http.request("GET", "/api/v1")
        assert status == 200 and {"nodes", "nodes/status", "pods", "events"} <= {r["name"] for r in answer["resources"]}
        status, answer = api.http(None).request("GET", "/api")
        assert status == 403 and answer["message"] == 'forbidden: User "system:anonymous" cannot get path "/api"'
    with KubeApiStandIn(resource_api=False) as api:
        status, answer = api.http("admin").request("GET", "/apis")
        assert status == 200 and [group["name"] for group in answer["groups"]] == ["policy", "coordination.k8s.io"]
        status, _ = api.http("admin").request("GET", "/apis/resource.k8s.io/v1/resourceslices")
        assert status == 404


def test_the_aggregated_answer_says_so_in_its_content_type():
    import http.client
    import ssl

    with KubeApiStandIn() as api:
        context = ssl.create_default_context(cafile=str(api.ca_file))
        connection = http.client.HTTPSConnection("127.0.0.1", api.port, context=context, timeout=10)
        connection.request("GET", "/api",
                           headers={"Accept": ACCEPT_V2, "Authorization": f"Bearer {api.tokens['admin']}"})
        response = connection.getresponse()
        assert response.getheader("Content-Type") == AGGREGATED_CONTENT_TYPE
        assert [item["metadata"]["name"] for item in json.loads(response.read())["items"]] == [""]
        connection.close()


def test_pod_lists_take_the_real_field_labels_and_refuse_others():
    with KubeApiStandIn() as api:
        api.create_node("n1")
        api.create_pod("default", "a", "n1", [{"name": "c", "limits": {"nvidia.com/gpu": "1"}}])
        api.create_pod("kube-system", "b", None, [{"name": "c"}], phase="Pending")
        http = api.http("admin")
        running = http.get("/api/v1/pods", fieldSelector="status.phase=Running,spec.nodeName=n1")
        [item] = running["items"]
        assert item["metadata"]["name"] == "a" and item["spec"]["containers"][0]["resources"]["requests"] == {
            "nvidia.com/gpu": "1"}  # SetDefaults_Pod: the limit as the request
        assert [p["metadata"]["name"] for p in http.get("/api/v1/namespaces/kube-system/pods")["items"]] == ["b"]
        status, answer = http.request("GET", "/api/v1/pods", query={"fieldSelector": "spec.nodename=n1"})
        assert status == 400 and answer["message"] == "field label not supported: spec.nodename"
        assert api.unmodelled == []


def test_label_selectors_as_apimachinery_parses_them():
    labels = {"a": "1", "b": "2"}
    for selector, expected in (("a=1", True), ("a==1,b=3", False), ("a!=2", True), ("c!=1", True),
                               ("a in (1, 3)", True), ("b notin (2)", False), ("a", True), ("!a", False), ("!c", True)):
        assert labels_match(parse_label_selector(selector), labels) is expected, selector
    for bad in ("a=(1)", "!a=1", "=x"):
        with pytest.raises(Exception, match="unable to parse requirement"):
            parse_label_selector(bad)
