"""GET /v1/gpus/{id}/pods (issue 40): the pods holding a GPU, from the kubelet stand-in's PodResources List
(tests/kubelet_stand_in.py, the real proto), mapped to their GPU as /metrics' Kubernetes labels are
(gpud/pod_resources/holdings.py): MIG devices, shared replicas, gpu-memory units and gpud's DRA claims."""

from __future__ import annotations

from helpers import mig_config, mig_settled, put_layout, sharing_config, sim_config, start_daemon, stop_daemon, \
    until_async
from openapi_check import assert_matches_openapi
from test_dcgm_metrics import HALF_MIG
from test_pod_labels import SHARED, TWO_GPUS, allocate, hold, kubelet, published, reading  # noqa: F401 (fixture)
from kubelet_stand_in import PreparedDevice


async def pods(node, gpu, until=lambda status, body: status == 200 and body["pods"]) -> tuple[int, dict]:
    """The route's answer once `until` holds (the reader's next read of the kubelet)."""
    async def answered():
        status, body = await node.get(f"/v1/gpus/{gpu}/pods")
        return (status, body) if until(status, body) else None
    return await until_async(answered, timeout=8.0, what=f"GPU {gpu}'s pods")


async def test_a_pod_on_a_mig_device_and_one_on_its_replica_are_the_gpus(short_tmp, kubelet):  # noqa: F811
    node = await start_daemon(reading(mig_config(short_tmp, "H100-SXM5-80GB:2", HALF_MIG), kubelet))
    try:
        await mig_settled(node)
        assert (await put_layout(node, "first-gpu-1g"))[0] == 200
        _, gpus = await node.get("/v1/gpus")
        gpu0, gpu1 = gpus["gpus"]
        mig, other, claimed = gpu0["mig"]["devices"][:3]
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/mig-1g.10gb", [mig["uuid"]])
        allocate(kubelet, ("ml", "train", "sidecar"), "example.com/nic", [gpu1["uuid"]])  # not a GPU resource
        allocate(kubelet, ("ai", "shared", "main"), "nvidia.com/mig-1g.10gb", [f"{other['uuid']}::1"])
        allocate(kubelet, ("ml", "whole", "main"), "nvidia.com/gpu", [gpu1["uuid"]])
        await hold(node, "3333-cccc", "mig-claim", [claimed["uuid"]])
        kubelet.prepare_claim(("ml", "dra", "main"), "mig-claim",
                              [PreparedDevice("gpu.nvidia.com", "node-a", published(gpus, claimed["uuid"]))])
        status, body = await pods(node, 0, lambda status, body: status == 200 and len(body["pods"]) == 3)
        assert_matches_openapi("GET", "/v1/gpus/{id}/pods", 200, body)
        assert (body["gpu"], body["uuid"]) == (0, gpu0["uuid"]) and 0 <= body["answer_age_s"] < 4
        assert body["pods"] == [
            {"namespace": "ai", "name": "shared", "containers": ["main"], "devices": [f"{other['uuid']}::1"],
             "claims": []},
            {"namespace": "ml", "name": "dra", "containers": ["main"], "devices": [], "claims": ["ml/mig-claim"]},
            {"namespace": "ml", "name": "train", "containers": ["main"], "devices": [mig["uuid"]], "claims": []}]
        # a MIG device names its GPU, as a bus id or an index does
        assert (await node.get(f"/v1/gpus/{mig['uuid']}/pods"))[1]["pods"] == body["pods"]
        _, whole = await node.get(f"/v1/gpus/{gpu1['pci_bus_id']}/pods")
        assert [(p["namespace"], p["name"], p["containers"]) for p in whole["pods"]] == [("ml", "whole", ["main"])]
    finally:
        await stop_daemon(node)


async def test_shared_replicas_and_gpu_memory_units_are_their_gpus(short_tmp, kubelet):  # noqa: F811
    config = reading(sharing_config(short_tmp, TWO_GPUS, SHARED), kubelet).with_overrides(
        **{"gpu_memory.enabled": True, "gpu_memory.devices": ("1",)})
    node = await start_daemon(config)
    try:
        first, second = [gpu["uuid"] for gpu in (await node.get("/v1/gpus"))[1]["gpus"]]
        allocate(kubelet, ("ml", "a", "main"), "nvidia.com/gpu.shared", [f"{first}::0"])
        allocate(kubelet, ("ml", "a", "helper"), "nvidia.com/gpu.shared", [f"{first}::2", f"{first}::1"])
        allocate(kubelet, ("ml", "infer", "main"), "nvidia.com/gpu-memory", [f"{second}::{n}" for n in range(3)])
        _, body = await pods(node, 0)
        assert body["pods"] == [{"namespace": "ml", "name": "a", "containers": ["helper", "main"],
                                 "devices": [f"{first}::0", f"{first}::1", f"{first}::2"], "claims": []}]
        _, body = await pods(node, 1)
        assert [(p["name"], len(p["devices"])) for p in body["pods"]] == [("infer", 3)]
    finally:
        await stop_daemon(node)


async def test_without_a_fresh_answer_the_route_says_why(short_tmp):
    node = await start_daemon(sim_config(short_tmp, TWO_GPUS))  # a simulated node reads no kubelet unless told
    try:
        status, body = await node.get("/v1/gpus/0/pods")
        assert status == 503 and body["error"]["code"] == "pod-resources-unavailable", body
        assert "not configured" in body["error"]["message"]
        assert_matches_openapi("GET", "/v1/gpus/{id}/pods", 503, body)
        status, body = await node.get("/v1/gpus/9/pods")
        assert status == 404 and body["error"]["code"] == "gpu-not-found"
    finally:
        await stop_daemon(node)
    socket = short_tmp / "no-kubelet" / "kubelet.sock"
    node = await start_daemon(sim_config(short_tmp, TWO_GPUS).with_overrides(**{
        "metrics.pod_resources_socket": str(socket), "metrics.pod_resources_refresh_s": 1.0}))
    try:
        status, body = await pods(node, 0, lambda status, body: "no socket" in body.get("error", {}).get("message", ""))
        assert status == 503 and body["error"]["code"] == "pod-resources-unavailable"
        assert str(socket) in body["error"]["message"]
    finally:
        await stop_daemon(node)


async def test_a_stale_answer_is_not_served(short_tmp, kubelet):  # noqa: F811
    node = await start_daemon(reading(sim_config(short_tmp, TWO_GPUS), kubelet, pod_resources_timeout_s=1.0))
    try:
        first = (await node.get("/v1/gpus"))[1]["gpus"][0]["uuid"]
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/gpu", [first])
        await pods(node, 0)
        kubelet.list_delay_s = 60.0  # the kubelet stops answering: the last answer ages past 3 refreshes
        status, body = await pods(node, 0, lambda status, body: status == 503)
        assert body["error"]["code"] == "pod-resources-unavailable"
        message = body["error"]["message"]
        assert "s old (stale after 3 s)" in message and "the last read: GrpcCallError: no answer within 1 s" in message
    finally:
        kubelet.list_delay_s = 0.0
        await stop_daemon(node)
