"""Each GPU's CPU affinity and NVLink counts, the two facts Slurm's NVML autodetection (SchedMD slurm,
src/plugins/gpu/nvml/gpu_nvml.c) writes as Cores= and Links= in gres.conf: read by gpud's reader on the
simulator and on NVIDIA's mock NVML, and served by GET /v1/gpus.

The simulated GPUs sit on this host: their CPUs are this host's (the CPUs of their NUMA node, all online
CPUs where the node is unknown or absent here). The expected values are read from /sys here, apart from
the simulator's own reading.
"""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest
from helpers import mock_nvml_config, run_on_mock_nvml, sim_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.model.inventory import format_cpulist
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.presets import DGX_A100_NUMA_NODES

HOST_SYSFS = Path("/sys")


def cpulist_cpus(text: str) -> tuple[int, ...]:
    """This test's own reading of a kernel cpulist ("0-3,8")."""
    cpus = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def host_cpus(node: int | None, sysfs: Path = HOST_SYSFS) -> tuple[int, ...]:
    """What the kernel gives as local_cpus of a PCI device on `node` (None: NUMA_NO_NODE) of this host."""
    node_list = sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    if node is not None and node_list.exists():
        return cpulist_cpus(node_list.read_text())
    return cpulist_cpus((sysfs / "devices" / "system" / "cpu" / "online").read_text())


def read_sim(tmp_path: Path, preset: str, host_sysfs: Path | None = None, prepare=lambda sim: None):
    sim = SimulatedNvml(preset, tmp_path / "sim.json")
    if host_sysfs is not None:
        sim.host_sysfs_root = host_sysfs
    sim.nvmlInit()
    try:
        prepare(sim)
        reader = NodeReader(sysfs=sim.sysfs_root)
        return reader.read(sim, {}), reader, sim
    finally:
        sim.nvmlShutdown()


# -- the cpulist format -----------------------------------------------------------------------------

def test_format_cpulist():
    assert format_cpulist(()) == ""
    assert format_cpulist((5,)) == "5"
    assert format_cpulist((0, 1, 2, 3)) == "0-3"
    assert format_cpulist((0, 1, 2, 3, 5, 7, 8, 56, 57, 58)) == "0-3,5,7-8,56-58"
    assert format_cpulist([9, 3, 4, 3, 1]) == "1,3-4,9"  # any order, repeats once
    assert cpulist_cpus(format_cpulist(tuple(range(0, 28)) + tuple(range(56, 84)))) == \
        tuple(range(0, 28)) + tuple(range(56, 84))


# -- NVLink counts on the simulator -----------------------------------------------------------------

@pytest.mark.parametrize("preset", ["dgx-a100", "hgx-h100", "hgx-h200"])
def test_nvswitch_boards_count_no_direct_links(tmp_path, preset):
    """Every link of an NVSwitch board ends at a switch: Slurm counts none (no Links=), though every
    GPU is every other's NVLink peer."""
    inventory, _, _ = read_sim(tmp_path, preset)
    for gpu in inventory.gpus:
        assert gpu.nvlink_counts == ()
        assert gpu.nvlink_peers == tuple(i for i in range(len(inventory.gpus)) if i != gpu.index)


def test_direct_links_are_counted_by_peer(tmp_path):
    """HGX A100 4-GPU: 12 NVLinks per GPU, GPU to GPU without NVSwitch, the simulator shares them out
    evenly (gpud/nvml/sim/topology.py): 4 to each of the 3 others."""
    inventory, _, sim = read_sim(tmp_path, "hgx-a100-4gpu")
    counts = {gpu.index: dict(gpu.nvlink_counts) for gpu in inventory.gpus}
    assert counts == {i: {j: 4 for j in range(4) if j != i} for i in range(4)}
    assert all(counts[i][j] == counts[j][i] for i in counts for j in counts[i])  # a link has two ends


def test_a_link_down_before_the_first_read_counts_nothing(tmp_path):
    inventory, _, _ = read_sim(tmp_path, "hgx-a100-4gpu", prepare=lambda sim: sim.sim_set_nvlink(0, 0, up=False))
    assert sum(links for _, links in inventory.gpus[0].nvlink_counts) == 11
    assert dict(inventory.gpus[1].nvlink_counts)[0] == 4  # the other end is not read from GPU 0


def test_pcie_boards_without_bridges_count_nothing(tmp_path):
    inventory, _, _ = read_sim(tmp_path, "a30")  # A30 NVLinks exist, inactive without a bridge
    assert all(gpu.nvlink_counts == () and gpu.nvlink_peers == () for gpu in inventory.gpus)


# -- CPU affinity on the simulator ------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["dgx-a100", "hgx-h100", "t4"])
def test_cpu_affinity_is_this_hosts_numa_node(tmp_path, preset):
    """dgx-a100 puts its GPUs on nodes 3, 1, 7, 5 (a real DGX's firmware): this host's CPUs of that node,
    or all online CPUs where this host lacks it; the others' node is unknown (-1): all online CPUs."""
    inventory, _, _ = read_sim(tmp_path, preset)
    for gpu in inventory.gpus:
        expected_node = DGX_A100_NUMA_NODES[gpu.index] if preset == "dgx-a100" else None
        assert gpu.numa_node == expected_node
        assert gpu.cpu_affinity == host_cpus(expected_node)
        assert gpu.cpu_affinity  # a host has CPUs


def fake_host(root: Path) -> Path:
    """A 2-node host of 8 CPUs: node0 has CPUs 0-3, node1 4-7."""
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (root / "devices" / "system" / "node" / node).mkdir(parents=True)
        (root / "devices" / "system" / "node" / node / "cpulist").write_text(cpus + "\n")
    (root / "devices" / "system" / "cpu").mkdir(parents=True)
    (root / "devices" / "system" / "cpu" / "online").write_text("0-7\n")
    return root


def test_cpu_affinity_on_a_fake_two_node_host(tmp_path):
    """DGX A100 GPUs 2 and 3 sit on node 1: CPUs 4-7; the others' nodes (3, 7, 5) are absent from this
    host: all online CPUs, as the kernel gives for a device whose node it does not have."""
    host = fake_host(tmp_path / "host-sys")
    inventory, _, _ = read_sim(tmp_path, "dgx-a100", host_sysfs=host)
    assert [gpu.cpu_affinity for gpu in inventory.gpus] == \
        [tuple(range(8))] * 2 + [(4, 5, 6, 7)] * 2 + [tuple(range(8))] * 4
    assert [gpu.cpu_affinity for gpu in inventory.gpus] == [host_cpus(node, host) for node in DGX_A100_NUMA_NODES]


def test_simulated_call_answers_words_of_the_mask(tmp_path):
    """pynvml's shape: cpuSetSize 64-bit words; 0 words is INVALID_ARGUMENT (nvml.h); a lost GPU's
    handle answers GPU_IS_LOST."""
    host = fake_host(tmp_path / "host-sys")
    sim = SimulatedNvml("dgx-a100", tmp_path / "sim.json")
    sim.host_sysfs_root = host
    sim.nvmlInit()
    try:
        handle = sim.nvmlDeviceGetHandleByIndex(2)
        assert list(sim.nvmlDeviceGetCpuAffinity(handle, 2)) == [0xF0, 0]
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            sim.nvmlDeviceGetCpuAffinity(handle, 0)
        sim.sim_set_gpu_lost(2)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            sim.nvmlDeviceGetCpuAffinity(handle, 2)
    finally:
        sim.nvmlShutdown()


# -- the reader: read once, tolerated failures, a lost GPU ------------------------------------------

class CountingNvml:
    """The simulator, counting nvmlDeviceGetCpuAffinity calls."""

    def __init__(self, sim):
        self._sim = sim
        self.affinity_calls = 0

    def __getattr__(self, name):
        if name == "nvmlDeviceGetCpuAffinity":
            self.affinity_calls += 1
        return getattr(self._sim, name)


def test_cpu_affinity_is_read_once_per_gpu(tmp_path):
    sim = SimulatedNvml("hgx-a100-4gpu", tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        counting, reader = CountingNvml(sim), NodeReader(sysfs=sim.sysfs_root)
        first = reader.read(counting, {})
        second = reader.read(counting, {})
        assert counting.affinity_calls == 4
        assert first.gpus == second.gpus
    finally:
        sim.nvmlShutdown()


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_UNKNOWN,
                                   pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NO_PERMISSION,
                                   pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_a_failing_affinity_call_leaves_it_empty_and_is_asked_again(tmp_path, error):
    """Only informative: whatever the call answers, the GPU is read (not lost, no error), its CPUs ()
    until a later read gets an answer. NO_PERMISSION is noted as the other optional fields are."""
    sim = SimulatedNvml("hgx-a100-4gpu", tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        reader = NodeReader(sysfs=sim.sysfs_root)
        sim.sim_fail_calls("nvmlDeviceGetCpuAffinity", error, 1)
        failed = reader.read(sim, {}).gpus[0]
        assert failed.cpu_affinity == () and not failed.lost and failed.error is None
        assert failed.unreadable == (("cpu_affinity: needs root (NVML NO_PERMISSION)",)
                                     if error == pynvml.NVML_ERROR_NO_PERMISSION else ())
        assert reader.read(sim, {}).gpus[0].cpu_affinity == host_cpus(None)
    finally:
        sim.nvmlShutdown()


def test_a_lost_gpu_keeps_its_affinity_and_has_no_counts(tmp_path):
    sim = SimulatedNvml("hgx-a100-4gpu", tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        reader = NodeReader(sysfs=sim.sysfs_root)
        known = {gpu.index: gpu for gpu in reader.read(sim, {}).gpus}
        sim.sim_set_gpu_lost(1)
        lost = reader.read(sim, known).gpus[1]
        # its slot's CPUs, as last read (gres.conf keeps a lost GPU's records); its links cannot be read
        assert lost.lost and lost.cpu_affinity == known[1].cpu_affinity == host_cpus(None)
        assert lost.nvlink_counts == ()
        sim.sim_recover_gpu(1)
        back = reader.read(sim, known).gpus[1]
        assert not back.lost and back.cpu_affinity == host_cpus(None) and dict(back.nvlink_counts) == {0: 4, 2: 4, 3: 4}
    finally:
        sim.nvmlShutdown()


# -- the API ----------------------------------------------------------------------------------------

async def test_gpu_views_show_cpu_affinity_and_nvlink_counts(short_tmp):
    running = await start_daemon(sim_config(short_tmp, "hgx-a100-4gpu"))
    try:
        status, body = await running.get("/v1/gpus")
        assert status == 200
        assert_matches_openapi("GET", "/v1/gpus", 200, body)
        online = format_cpulist(host_cpus(None))
        for gpu in body["gpus"]:
            assert gpu["cpu_affinity"] == online
            assert gpu["nvlink_counts"] == {str(i): 4 for i in range(4) if i != gpu["index"]}
        status, one = await running.get("/v1/gpus/2")
        assert status == 200 and one["nvlink_counts"] == {"0": 4, "1": 4, "3": 4}
    finally:
        await stop_daemon(running)


async def test_gpu_views_on_an_nvswitch_board(short_tmp):
    running = await start_daemon(sim_config(short_tmp, "dgx-a100"))
    try:
        status, body = await running.get("/v1/gpus")
        assert status == 200
        assert_matches_openapi("GET", "/v1/gpus", 200, body)
        assert {json.dumps(gpu["nvlink_counts"]) for gpu in body["gpus"]} == {"{}"}
        assert [gpu["cpu_affinity"] for gpu in body["gpus"]] == \
            [format_cpulist(host_cpus(node)) for node in DGX_A100_NUMA_NODES]
    finally:
        await stop_daemon(running)


# -- NVIDIA's mock NVML, a second opinion -----------------------------------------------------------

MOCK_READER = """
import json
import pynvml
from gpud.nvml.reader import NodeReader
pynvml.nvmlInit()
inventory = NodeReader().read(pynvml, {})
print(json.dumps([{"bus_id": g.pci_bus_id, "cpu_affinity": g.cpu_affinity, "nvlink_counts": g.nvlink_counts,
                   "nvlink_peers": g.nvlink_peers, "lost": g.lost, "error": g.error} for g in inventory.gpus]))
"""
MOCK_CORES_PER_NUMA = 64  # the mock's DefaultCoresPerNUMA (engine/topology.go), where a config sets none


def read_on_mock(config: dict, tmp_path: Path) -> list[dict]:
    """gpud's real reader with the real pynvml on the mock library."""
    return run_on_mock_nvml(MOCK_READER, config, tmp_path)


def mock_cpus_by_bus(config: dict) -> dict[str, tuple[int, ...]]:
    """The CPUs the mock gives each device, from its config's pcie_topology (engine/topology.go
    resolveAffinity): a root complex's cpu_affinity, else cores_per_numa CPUs from numa_node's first."""
    topology = config["pcie_topology"]
    cores = topology.get("cores_per_numa") or MOCK_CORES_PER_NUMA
    found = {}
    for complex_ in topology["root_complexes"]:
        node = complex_.get("numa_node", 0)
        cpus = cpulist_cpus(complex_["cpu_affinity"]) if complex_.get("cpu_affinity") else \
            tuple(range(node * cores, (node + 1) * cores))
        found.update({bus.lower(): cpus for bus in complex_["devices"]})
    return found


def short_bus(bus_id: str) -> str:
    return bus_id.lower()[-12:]  # "0000:07:00.0" from NVML's 8-digit-domain form


def test_mock_a100_affinity_from_its_topology_and_no_direct_links(tmp_path):
    """Where the mock and the simulator differ:
    * CPU affinity: the mock answers a made-up CPU set per NUMA node from its config (pcie_topology:
      64 CPUs per node from node * 64, or a root complex's cpu_affinity), whatever host it runs on; the
      simulator answers this host's real CPUs of the GPU's node, as the driver does (the kernel's
      local_cpus). Neither is the other's, so each is checked against its own model.
    * NVSwitch links: the mock gives their far end as the invalid bus id FFFFFFFF:FF:FF.0 with type
      SWITCH, the simulator a switch's bus id; both count nothing, as Slurm counts only GPU bus ids.
    """
    config = mock_nvml_config("a100")
    cpus = mock_cpus_by_bus(config)
    gpus = read_on_mock(config, tmp_path)
    assert len(gpus) == 8
    for index, gpu in enumerate(gpus):
        assert not gpu["lost"] and gpu["error"] is None
        assert tuple(gpu["cpu_affinity"]) == cpus[short_bus(gpu["bus_id"])]
        assert gpu["nvlink_counts"] == []
        assert gpu["nvlink_peers"] == [i for i in range(8) if i != index]


def test_mock_without_topology_answers_not_supported(tmp_path):
    """The mock answers nvmlDeviceGetCpuAffinity NOT_SUPPORTED for a config without pcie_topology
    (engine/device.go GetCpuAffinity): gpud shows no CPUs and reads the rest."""
    config = mock_nvml_config("a100")
    del config["pcie_topology"]
    gpus = read_on_mock(config, tmp_path)
    assert gpus and all(gpu["cpu_affinity"] == [] and gpu["error"] is None for gpu in gpus)


def test_mock_direct_links_are_counted(tmp_path):
    """A B200 board given direct GPU-to-GPU links (the mock's nvlink.device_links): GPU 0 has 3 links to
    GPU 1 and 2 to GPU 2, one inactive link to GPU 3; GPU 1 its 3 back to GPU 0."""
    config = mock_nvml_config("b200")
    buses = [device["pci"]["bus_id"] for device in config["devices"]]

    def link(number: int, peer: int, state: str = "active") -> dict:
        return {"link": number, "state": state, "remote_device_type": "gpu", "remote_pci_bus_id": buses[peer]}

    config["nvlink"]["device_links"] = [
        {"index": 0, "links": [link(0, 1), link(1, 1), link(2, 1), link(3, 2), link(4, 2), link(5, 3, "down")]},
        {"index": 1, "links": [link(0, 0), link(1, 0), link(2, 0)]},
    ]
    gpus = read_on_mock(config, tmp_path)
    assert gpus[0]["nvlink_counts"] == [[1, 3], [2, 2]]
    assert gpus[1]["nvlink_counts"] == [[0, 3]]
    assert all(gpu["nvlink_counts"] == [] for gpu in gpus[2:])
