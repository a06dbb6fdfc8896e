"""Kubernetes labels on gpud's GPU and MIG series (issue 37): read from the kubelet stand-in's PodResources
List (tests/kubelet_stand_in.py, the real proto), applied as dcgm-exporter applies them
(gpud/pod_resources/labels.py cites where), on a simulated node."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers import mig_config, mig_settled, put_layout, sharing_config, sim_config, start_daemon, stop_daemon, \
    until_async
from kubelet_stand_in import Kubelet, PreparedDevice
from test_dcgm_metrics import HALF_MIG, parse, series
from test_prometheus import free_port, scrape as scrape_tcp

from gpud.dra.devices import node_devices

TWO_GPUS = "A100-SXM4-40GB:2"
POD = {"pod": "train", "namespace": "ml", "container": "main"}
DRA_LABELS = ("dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name")


@pytest.fixture
def kubelet(short_tmp):
    directory = short_tmp / "kubelet" / "device-plugins"
    directory.mkdir(parents=True)
    stand_in = Kubelet(directory)
    yield stand_in
    stand_in.stop()


def reading(config, kubelet: Kubelet, **metrics):
    return config.with_overrides(**{"metrics.pod_resources_socket": str(kubelet.pod_resources_socket),
                                    "metrics.pod_resources_refresh_s": 1.0,
                                    **{f"metrics.{key}": value for key, value in metrics.items()}})


def allocate(kubelet: Kubelet, container: tuple[str, str, str], resource: str, ids: list[str]) -> None:
    """What the kubelet records once a device plugin answered Allocate (devicemanager podDevices.insert)."""
    namespace, pod, name = container
    with kubelet._changed:
        kubelet.pod_devices.setdefault((namespace, pod), {}).setdefault(name, {})[resource] = list(ids)


async def samples(node) -> list:
    async with node.http.get("http://localhost/metrics") as response:
        assert response.status == 200
        return parse(await response.text())[1]


async def labelled(node, name: str, timeout: float = 8.0, **labels) -> list:
    """The samples once a series of `name` with these labels is there (the reader's next read)."""
    async def found():
        got = await samples(node)
        return got if series(got, name, **labels) else None
    return await until_async(found, timeout=timeout, what=f"{name} with {labels}")


def pods_of(found) -> list[tuple[str, str, str] | None]:
    return sorted(((labels["namespace"], labels["pod"], labels["container"]) if "pod" in labels else None
                   for labels, _ in found), key=str)


async def uuids(node) -> list[str]:
    _, body = await node.get("/v1/gpus")
    return [gpu["uuid"] for gpu in body["gpus"]]


async def test_a_whole_gpu_carries_its_containers_labels_and_an_unallocated_one_none(short_tmp, kubelet):
    node = await start_daemon(reading(sim_config(short_tmp, TWO_GPUS), kubelet))
    try:
        first, second = await uuids(node)
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/gpu", [first])
        allocate(kubelet, ("ml", "train", "sidecar"), "example.com/nic", [second])  # not a GPU resource
        got = await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=first, **POD)
        for family in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "gpud_gpu_health"):
            assert pods_of(series(got, family, UUID=first)) == [("ml", "train", "main")], family
            assert pods_of(series(got, family, UUID=second)) == [None], family  # no label at all, not ""
        labels = series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=first)[0][0]
        assert list(labels)[-3:] == ["pod", "namespace", "container"] and not any(k.startswith("dra_") for k in labels)
        # series of no GPU are left alone
        assert all("pod" not in labels for labels, _ in series(got, "gpud_pod_resources_reads_total"))
    finally:
        await stop_daemon(node)


SHARED = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


async def test_shared_replicas_give_one_series_per_container(short_tmp, kubelet):
    config = reading(sharing_config(short_tmp, TWO_GPUS, SHARED), kubelet)
    node = await start_daemon(config)
    try:
        first, second = await uuids(node)
        _, sharing = await node.get("/v1/sharing")
        assert [r["name"] for r in sharing["resources"]] == ["nvidia.com/gpu.shared"]  # gpud's own resource
        allocate(kubelet, ("ml", "a", "main"), "nvidia.com/gpu.shared", [f"{first}::0"])
        allocate(kubelet, ("ml", "b", "main"), "nvidia.com/gpu.shared", [f"{first}::1", f"{first}::2"])
        allocate(kubelet, ("ml", "c", "main"), "nvidia.com/gpu.shared", [f"{second}::3"])
        got = await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=second, pod="c")
        for family in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"):
            assert pods_of(series(got, family, UUID=first)) == [("ml", "a", "main"), ("ml", "b", "main")]
            assert pods_of(series(got, family, UUID=second)) == [("ml", "c", "main")]
        # the copies are the same reading
        assert len({value for _, value in series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=first)}) == 1
    finally:
        await stop_daemon(node)


async def test_gpu_memory_units_label_the_gpu_they_are_on(short_tmp, kubelet):
    config = reading(sim_config(short_tmp, TWO_GPUS), kubelet).with_overrides(
        **{"gpu_memory.enabled": True, "gpu_memory.devices": ("0",)})
    node = await start_daemon(config)
    try:
        first, second = await uuids(node)
        _, sharing = await node.get("/v1/sharing")
        assert "nvidia.com/gpu-memory" in [r["name"] for r in sharing["resources"]]
        allocate(kubelet, ("ml", "infer", "main"), "nvidia.com/gpu-memory", [f"{first}::{n}" for n in range(5)])
        got = await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=first, pod="infer")
        assert pods_of(series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=first)) == [("ml", "infer", "main")]
        assert pods_of(series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=second)) == [None]
    finally:
        await stop_daemon(node)


async def mig_node(short_tmp, kubelet):
    node = await start_daemon(reading(mig_config(short_tmp, "H100-SXM5-80GB:2", HALF_MIG), kubelet))
    await mig_settled(node)
    assert (await put_layout(node, "first-gpu-1g"))[0] == 200
    _, gpus = await node.get("/v1/gpus")
    return node, gpus


async def test_a_mig_device_labels_its_instances_series_only(short_tmp, kubelet):
    node, gpus = await mig_node(short_tmp, kubelet)
    try:
        gpu0 = gpus["gpus"][0]
        mig, other = gpu0["mig"]["devices"][:2]
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/mig-1g.10gb", [mig["uuid"]])
        allocate(kubelet, ("ml", "shared", "main"), "nvidia.com/mig-1g.10gb", [f"{other['uuid']}::1"])
        gi = str(mig["gi_id"])
        got = await labelled(node, "DCGM_FI_DEV_FB_USED", UUID=gpu0["uuid"], GPU_I_ID=gi, **POD)
        assert pods_of(series(got, "DCGM_FI_DEV_FB_USED", GPU_I_ID=gi, UUID=gpu0["uuid"])) == [("ml", "train", "main")]
        assert pods_of(series(got, "gpud_gpu_health", GPU_I_ID=gi, UUID=gpu0["uuid"])) == [("ml", "train", "main")]
        assert pods_of(series(got, "DCGM_FI_DEV_FB_USED", GPU_I_ID=str(other["gi_id"]))) == [("ml", "shared", "main")]
        # the parent's whole-GPU series stay as they are (kubernetes.go keys a MIG device by its instance)
        whole = [labels for labels, _ in series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=gpu0["uuid"])]
        assert len(whole) == 1 and "pod" not in whole[0]
        unheld = [labels for labels, _ in series(got, "DCGM_FI_DEV_FB_USED", UUID=gpu0["uuid"])
                  if labels.get("GPU_I_ID") not in (gi, str(other["gi_id"]))]
        assert len(unheld) == 6 and not any("pod" in labels for labels in unheld)  # the GPU's own and 5 instances
    finally:
        await stop_daemon(node)


def published(gpus: dict, uuid: str) -> str:
    """The name gpud's DRA plugin publishes the device under (gpud/dra/devices.py)."""
    devices, _ = node_devices(gpus, {"driver_version": "580.65.06", "cuda_version": "13.0", "hostname": "node-a"})
    return next(device.name for device in devices if device.uuid == uuid)


async def hold(node, uid: str, name: str, devices: list[str], driver: str = "gpu.nvidia.com") -> None:
    """The claim as gpud's DRA plugin holds it (PUT /v1/claims/{uid})."""
    body = {"namespace": "ml", "name": name, "driver": driver, "devices": devices}
    async with node.http.put(f"http://localhost/v1/claims/{uid}", json=body) as response:
        assert response.status == 200, await response.text()


async def test_a_dra_claim_on_a_whole_gpu_carries_the_dra_labels(short_tmp, kubelet):
    node = await start_daemon(reading(sim_config(short_tmp, TWO_GPUS), kubelet))
    try:
        first, second = await uuids(node)
        _, gpus = await node.get("/v1/gpus")
        await hold(node, "1111-aaaa", "train-gpu", [first])
        name = published(gpus, first)
        kubelet.prepare_claim(("ml", "train", "main"), "train-gpu",
                              [PreparedDevice("gpu.nvidia.com", "node-a", name, ("gpud/gpu=0",))])
        # a claim gpud's ledger does not hold (another driver's) labels nothing
        kubelet.prepare_claim(("ml", "other", "main"), "not-gpuds", [PreparedDevice("gpu.nvidia.com", "node-a", "gpu-1")])
        got = await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=first, dra_claim_name="train-gpu")
        (labels, _), = series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=first)
        assert {k: labels[k] for k in (*POD, *DRA_LABELS)} == {
            **POD, "dra_claim_name": "train-gpu", "dra_claim_namespace": "ml", "dra_driver_name": "gpu.nvidia.com",
            "dra_pool_name": "node-a", "dra_device_name": name}
        assert "dra_mig_profile" not in labels
        assert pods_of(series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=second)) == [None]
    finally:
        await stop_daemon(node)


async def test_a_dra_claim_on_a_mig_device_labels_the_instance_and_its_gpu(short_tmp, kubelet):
    node, gpus = await mig_node(short_tmp, kubelet)
    try:
        gpu0 = gpus["gpus"][0]
        mig = gpu0["mig"]["devices"][3]
        await hold(node, "2222-bbbb", "mig-claim", [mig["uuid"]])
        name = published(gpus, mig["uuid"])
        assert name.startswith(f"gpu-{gpu0['minor_number']}-mig-1g10gb-")
        kubelet.prepare_claim(("ml", "train", "main"), "mig-claim", [PreparedDevice("gpu.nvidia.com", "node-a", name)])
        gi = str(mig["gi_id"])
        got = await labelled(node, "DCGM_FI_DEV_FB_USED", GPU_I_ID=gi, dra_mig_device_uuid=mig["uuid"])
        expected = {**POD, "dra_claim_name": "mig-claim", "dra_claim_namespace": "ml",
                    "dra_driver_name": "gpu.nvidia.com", "dra_pool_name": "node-a", "dra_device_name": name,
                    "dra_mig_profile": mig["profile"], "dra_mig_device_uuid": mig["uuid"]}
        for found in (series(got, "DCGM_FI_DEV_FB_USED", GPU_I_ID=gi, UUID=gpu0["uuid"]),
                      series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=gpu0["uuid"])):  # dra.go: keyed by parentUUID
            (labels, _), = found
            assert {k: labels.get(k) for k in expected} == expected
    finally:
        await stop_daemon(node)


async def test_a_hanging_kubelet_slows_no_scrape_and_its_answer_expires(short_tmp, kubelet):
    config = reading(sim_config(short_tmp, TWO_GPUS), kubelet, pod_resources_timeout_s=2.0)
    node = await start_daemon(config)
    try:
        first, _ = await uuids(node)
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/gpu", [first])
        await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=first, **POD)
        kubelet.list_delay_s = 60.0
        slowest = 0.0
        deadline = time.monotonic() + 3 * 1.0 + 3.0  # past the stale bound (3 refreshes) and a read's deadline
        while time.monotonic() < deadline:
            for path in ("/metrics", "/healthz"):
                started = time.monotonic()
                async with node.http.get(f"http://localhost{path}") as response:
                    assert response.status == 200
                    await response.read()
                slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.05)
        assert slowest < 0.5, slowest  # measured: a few ms; the reads hang 2 s each in their thread
        got = await samples(node)
        assert pods_of(series(got, "DCGM_FI_DEV_GPU_TEMP", UUID=first)) == [None]  # expired
        assert series(got, "gpud_pod_resources_fresh")[0][1] == 0
        assert series(got, "gpud_pod_resources_reads_total", result="failed")[0][1] >= 1
        kubelet.list_delay_s = 0.0
        await labelled(node, "DCGM_FI_DEV_GPU_TEMP", timeout=10, UUID=first, **POD)  # back once it answers
    finally:
        kubelet.list_delay_s = 0.0
        await stop_daemon(node)


async def test_an_absent_kubelet_gives_no_labels_and_says_so(short_tmp):
    config = sim_config(short_tmp, TWO_GPUS).with_overrides(**{
        "metrics.pod_resources_socket": str(short_tmp / "no-kubelet" / "kubelet.sock"),
        "metrics.pod_resources_refresh_s": 1.0})
    node = await start_daemon(config)
    try:
        got = await until_async(lambda: _counted(node, "no_socket"), timeout=5, what="a read without a socket")
        assert not any("pod" in labels for _, labels, _ in got)
        assert series(got, "gpud_pod_resources_reads_total", result="failed")[0][1] == 0
        assert (await node.get("/healthz"))[0] == 200
    finally:
        await stop_daemon(node)


async def _counted(node, result: str):
    got = await samples(node)
    found = series(got, "gpud_pod_resources_reads_total", result=result)
    return got if found and found[0][1] >= 1 else None


async def test_garbage_from_the_socket_is_a_failed_read(short_tmp):
    path = short_tmp / "garbage.sock"
    served = asyncio.Event()

    async def garbage(reader, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(range(256)) * 4)
        await writer.drain()
        writer.close()
        served.set()
    server = await asyncio.start_unix_server(garbage, path=str(path))
    config = sim_config(short_tmp, TWO_GPUS).with_overrides(**{
        "metrics.pod_resources_socket": str(path), "metrics.pod_resources_refresh_s": 1.0})
    node = await start_daemon(config)
    try:
        got = await until_async(lambda: _counted(node, "failed"), timeout=5, what="a failed read")
        assert not any("pod" in labels for _, labels, _ in got)
        assert series(got, "gpud_pod_resources_fresh")[0][1] == 0
    finally:
        await stop_daemon(node)
        server.close()


async def test_off_when_set_empty_and_by_default_on_a_simulated_node(short_tmp):
    config = sim_config(short_tmp, TWO_GPUS)
    assert config.pod_resources_socket_path is None
    assert config.with_overrides(simulate="").pod_resources_socket_path == \
        Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    node = await start_daemon(config.with_overrides(**{"metrics.pod_resources_socket": ""}))
    try:
        assert node.daemon.config.pod_resources_socket_path is None
        assert not series(await samples(node), "gpud_pod_resources_reads_total")
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("shown", [False, True])
async def test_the_labels_stay_off_tcp_unless_turned_on(short_tmp, kubelet, shown):
    address = f"127.0.0.1:{free_port()}"
    config = reading(sim_config(short_tmp, TWO_GPUS), kubelet, listen=address, listen_pod_labels=shown)
    node = await start_daemon(config)
    try:
        first, _ = await uuids(node)
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/gpu", [first])
        await labelled(node, "DCGM_FI_DEV_GPU_TEMP", UUID=first, **POD)
        _, _, text = await scrape_tcp(address)
        assert ('pod="train"' in text) is shown
        assert pods_of(series(parse(text)[1], "DCGM_FI_DEV_GPU_TEMP", UUID=first)) == \
            ([("ml", "train", "main")] if shown else [None])
    finally:
        await stop_daemon(node)


def test_the_kubelets_refusal_is_read_as_grpc_says_it(kubelet):
    """The real gRPC server's error (the stand-in's rate limit, ratelimit.go) through gpud's own client."""
    from gpud.pod_resources.grpc_unary import GrpcCallError, call
    errors = set()
    for _ in range(20):
        try:
            call(kubelet.pod_resources_socket, "/v1.PodResourcesLister/List", b"", 5.0, 1 << 20)
        except GrpcCallError as exc:
            errors.add(str(exc))
    assert errors == {"gRPC status 8: rejected by rate limit"}
