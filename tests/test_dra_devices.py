"""What the DRA plugin publishes of a simulated node (gpud in-process, its real answers), and the taints and
health it derives from gpud's health: names, attribute formats and capacities as NVIDIA's driver writes them
(gpud/dra/devices.py cites each), checked against what NVIDIA's plugin published on NVIDIA's mock NVML
(../shared/nvidia-dra-driver/resourceslice-h100-mock.json) where that tells."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
from helpers import SHARED, mig_config, put_layout, start_daemon, stop_daemon

from gpud.dra.devices import binary_quantity, mig_device_name, node_devices, pci_bus_id, pcie_root, semver
from gpud.dra.health import TaintPolicy, device_taints, reasons_by_uuid, states_by_uuid, unmonitored_taint

NVIDIA_SLICE = SHARED / "nvidia-dra-driver" / "resourceslice-h100-mock.json"
QUALIFIED_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z_][A-Za-z0-9_]{0,31}")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")


async def _documents(tmp, layout=None):
    node = await start_daemon(mig_config(tmp, "hgx-a100-4gpu"))
    try:
        if layout is not None:
            status, answer = await put_layout(node, layout)
            assert status == 200, answer
        answers = [await node.get(path) for path in ("/v1/gpus", "/v1/node", "/v1/health")]
        return [body for _, body in answers]
    finally:
        await stop_daemon(node)


def test_formats_are_nvidias():
    # NVIDIA's plugin published driver 550.163.01 as 550.163.1, CUDA 12.4 as 12.4.0, H100's 9.0 as 9.0.0,
    # 80 GiB as 80Gi, NVML's 00000000:CA:00.0 as 0000:ca:00.0 (resourceslice-h100-mock.json, README.md)
    assert (semver("550.163.01"), semver("12.4"), semver("9.0")) == ("550.163.1", "12.4.0", "9.0.0")
    assert binary_quantity(80 << 30) == "80Gi" and binary_quantity(19968 << 20) == "19968Mi"
    assert binary_quantity(1) == "1" and binary_quantity(1536) == "1536" and binary_quantity(0) == "0"
    assert pci_bus_id("00000000:CA:00.0") == "0000:ca:00.0"
    assert mig_device_name(2, "1g.24gb", 19, 0) == "gpu-2-mig-1g24gb-19-0"  # dra.md §7's example
    assert mig_device_name(0, "1g.10gb+me", 20, 6) == "gpu-0-mig-1g10gb-me-20-6"


@pytest.mark.skipif(not NVIDIA_SLICE.exists(), reason=f"{NVIDIA_SLICE} is absent (a clone without ../shared)")
async def test_whole_gpus_carry_nvidias_attributes_and_gpuds_own(short_tmp):
    gpus, node, _ = await _documents(short_tmp)
    devices, left_out = node_devices(gpus, node)
    assert left_out == [] and [d.name for d in devices] == [f"gpu-{g['minor_number']}" for g in gpus["gpus"]]
    theirs = json.loads(NVIDIA_SLICE.read_text())["spec"]["devices"][0]
    for device, gpu in zip(devices, gpus["gpus"]):
        entry = device.slice_entry()
        # every attribute NVIDIA's has, of the same type (brand where gpud's inventory has one), plus gpud's own
        for name, value in theirs["attributes"].items():
            if name == "brand" and not gpu.get("brand"):
                continue
            assert set(entry["attributes"][name]) == set(value), name
        assert set(entry["attributes"]) - set(theirs["attributes"]) <= {"index", "minor", "numaNode", "nvlinkPeers",
                                                                           "resource.kubernetes.io/pcieRoot"}
        assert set(entry["capacity"]) == set(theirs["capacity"]) == {"memory"}
        assert entry["attributes"]["uuid"] == {"string": gpu["uuid"]}
        assert entry["attributes"]["type"] == {"string": "gpu"}
        assert entry["attributes"]["architecture"] == {"string": "Ampere"}
        assert entry["attributes"]["driverVersion"] == {"version": semver(node["driver_version"])}
        assert entry["attributes"]["index"] == {"int": gpu["index"]}
        assert entry["attributes"]["nvlinkPeers"] == {"string": ",".join(map(str, gpu["nvlink_peers"]))}
        assert entry["capacity"]["memory"] == {"value": "40Gi"}
        for name, value in entry["attributes"].items():
            assert QUALIFIED_NAME.fullmatch(name), name
            (kind, text), = value.items()
            assert kind in ("string", "int", "version", "bool")
            if kind == "version":
                assert SEMVER.fullmatch(text), (name, text)
            if kind == "string":
                assert len(text) <= 64, (name, text)
        assert len(entry["attributes"]) + len(entry["capacity"]) <= 32


async def test_mig_devices_named_and_counted_as_nvidias(short_tmp):
    gpus, node, _ = await _documents(short_tmp, "all-balanced")
    devices, left_out = node_devices(gpus, node)
    migs = [(g, m) for g in gpus["gpus"] for m in g["mig"]["devices"]]
    assert left_out == [] and len(devices) == len(migs) == 16
    for device, (gpu, mig) in zip(devices, migs):
        assert DNS_LABEL.fullmatch(device.name) and device.name == (
            f"gpu-{gpu['minor_number']}-mig-{mig['profile'].replace('.', '')}-{mig['gi_profile_id']}-"
            f"{mig['placement']['start']}")
        entry = device.slice_entry()
        assert entry["attributes"]["parentUUID"] == {"string": gpu["uuid"]}
        assert entry["attributes"]["profile"] == {"string": mig["profile"]}
        assert entry["attributes"]["uuid"] == {"string": mig["uuid"]}
        slices = [k for k in entry["capacity"] if k.startswith("memorySlice")]
        start, size = mig["placement"]["start"], mig["placement"]["size"]
        assert sorted(slices) == sorted(f"memorySlice{i}" for i in range(start, start + size))
        assert entry["capacity"]["multiprocessors"] == {"value": str(mig["sm_count"])}
        assert entry["capacity"]["memory"] == {"value": binary_quantity(mig["memory_total_mib"] << 20)}
        assert device.gpu_uuid == gpu["uuid"] and device.uuid == mig["uuid"]
    assert len({d.name for d in devices}) == len(devices)  # unique in the pool


def test_a_lost_gpu_is_left_out_and_says_why():
    gpus = {"gpus": [{"index": 0, "uuid": "GPU-a", "lost": True}, {"index": 1, "uuid": "GPU-b", "minor_number": None}]}
    devices, left_out = node_devices(gpus, {"driver_version": "580.65.06", "cuda_version": "13.0"})
    assert devices == [] and [x["reason"] for x in left_out] == [
        "the GPU is lost", "NVML gives no minor number (no /dev/nvidia<minor>)"]


def test_pcie_root_is_read_as_the_standard_attribute_reads_it(tmp_path):
    # deviceattribute/pci_linux.go resolvePCIeRoot: the first directory under /sys/devices
    (tmp_path / "devices/pci0000:40/0000:40:01.1/0000:41:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:40/0000:40:01.1/0000:41:00.0", tmp_path / "bus/pci/devices/0000:41:00.0")
    os.symlink("../../../devices/pci0000:40/0000:40:01.1", tmp_path / "bus/pci/devices/0000:42:00.0")
    assert pcie_root(tmp_path, "0000:41:00.0") == "pci0000:40"
    assert pcie_root(tmp_path, "0000:42:00.0") is None  # leads to another device
    assert pcie_root(tmp_path, "0000:43:00.0") is None  # absent
    assert pcie_root(tmp_path, "../../etc") is None  # not a bus id


async def test_taints_follow_what_each_reason_asks(short_tmp):
    async def health_after_xids():
        node = await start_daemon(mig_config(short_tmp, "hgx-a100-4gpu"))
        try:
            for gpu, xid in ((0, 79), (1, 13)):
                status, _ = await node.post("/v1/sim/xid", {"gpu": gpu, "xid": xid})
                assert status == 200
            for _ in range(200):
                _, health = await node.get("/v1/health")
                if health["gpus"][0]["reasons"]:
                    return health
                await asyncio.sleep(0.02)
            raise AssertionError(health)
        finally:
            await stop_daemon(node)

    health = await health_after_xids()
    reasons = reasons_by_uuid(health)
    fatal, benign = reasons[health["gpus"][0]["uuid"]], reasons[health["gpus"][1]["uuid"]]
    taint, = device_taints("gpu.nvidia.com", fatal, TaintPolicy(server_minor=34))
    assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.nvidia.com/xid", "79", "NoSchedule")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", taint["timeAdded"])
    assert device_taints("gpu.nvidia.com", fatal, TaintPolicy(no_execute=True))[0]["effect"] == "NoExecute"
    # XID 13 is an application's error: gpud keeps no reason for it (NVIDIA's driver ignores it too)
    assert benign == [] and device_taints("gpu.nvidia.com", benign, TaintPolicy()) == []
    # a reason that asks nothing of an operator (a degraded fabric, a P2P drain in progress: action none)
    # only informs: effect None, which a 1.34 API server does not have
    informs = [{"kind": "fabric", "code": "bandwidth-degraded", "action": "none", "first_seen": 1.0}]
    assert device_taints("gpu.nvidia.com", informs, TaintPolicy(server_minor=34)) == []
    taint, = device_taints("gpu.nvidia.com", informs, TaintPolicy(server_minor=35))
    assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.nvidia.com/fabric", "bandwidth-degraded", "None")
    assert device_taints("example.com", reasons[health["gpus"][2]["uuid"]], TaintPolicy()) == []
    states = states_by_uuid(health)
    assert states[health["gpus"][0]["uuid"]].healthy is False
    assert "XID 79" in states[health["gpus"][0]["uuid"]].message and "reboot" in states[health["gpus"][0]["uuid"]].message
    assert states[health["gpus"][2]["uuid"]].healthy is True
    assert unmonitored_taint("gpu.nvidia.com", TaintPolicy(server_minor=34)) == []
    assert unmonitored_taint("gpu.nvidia.com", TaintPolicy(server_minor=36)) == [
        {"key": "gpu.nvidia.com/unmonitored", "effect": "None"}]


def test_taints_per_device_stay_within_the_servers_limit():
    reasons = [{"kind": f"k{i}", "code": str(i), "action": "reboot"} for i in range(20)]
    assert len(device_taints("gpu.nvidia.com", reasons, TaintPolicy(server_minor=34))) == 4
    assert len(device_taints("gpu.nvidia.com", reasons, TaintPolicy(server_minor=35))) == 16
    same = [{"kind": "xid", "code": "79", "action": "reboot"}, {"kind": "xid", "code": "48", "action": "reset-gpu"}]
    assert len(device_taints("gpu.nvidia.com", same, TaintPolicy())) == 1  # one per key and effect
    hostile = [{"kind": "x" * 300 + "/../$(id)", "code": "a b\nc" * 40, "action": "reboot"}]
    taint, = device_taints("gpu.nvidia.com", hostile, TaintPolicy())
    assert re.fullmatch(r"gpu\.nvidia\.com/[a-z0-9._-]{1,63}", taint["key"]) and len(taint["value"]) <= 63
