"""gpud's /metrics as a drop-in for dcgm-exporter: its default counters, units, types and labels, MIG
instance series and XID series, on simulated nodes (expected values come from the simulator's model data)."""

from __future__ import annotations

import asyncio
import math
import re
import socket
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pynvml
import pytest
from helpers import REPO, mig_config, mig_settled, put_layout, sim_config, start_daemon, stop_daemon

from gpud.health.catalog import load_catalog
from gpud.health.sources.gpu_checks import nvlink_mb_s
from gpud.nvml.health import Readings
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim._telemetry_calls import SAMPLE_PERIOD_US, telemetry
from gpud.nvml.sim.models import catalog
from gpud.nvml.sim.presets import parse_preset
from gpud.nvml.sim.scenarios import enable_mig, started

# dcgm-exporter's etc/default-counters.csv (4.8.x): the series it writes by default, with their types.
EXPORTER_DEFAULTS = {
    "DCGM_FI_DEV_SM_CLOCK": "gauge", "DCGM_FI_DEV_MEM_CLOCK": "gauge", "DCGM_FI_DEV_MEMORY_TEMP": "gauge",
    "DCGM_FI_DEV_GPU_TEMP": "gauge", "DCGM_FI_DEV_POWER_USAGE": "gauge",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge", "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge", "DCGM_FI_DEV_ENC_UTIL": "gauge",
    "DCGM_FI_DEV_DEC_UTIL": "gauge", "DCGM_FI_DEV_XID_ERRORS": "gauge", "DCGM_FI_DEV_FB_FREE": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge", "DCGM_FI_DEV_FB_RESERVED": "gauge", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "gauge",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "gauge", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter", "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gauge", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "gauge",
    "DCGM_FI_PROF_DRAM_ACTIVE": "gauge", "DCGM_FI_PROF_PCIE_TX_BYTES": "gauge", "DCGM_FI_PROF_PCIE_RX_BYTES": "gauge",
}
# What gpud cannot give without a vGPU host: docs/metrics.md says why. The DCGM_FI_PROF_* come from GPM
# (tests/test_gpm.py has their values).
NOT_FROM_NVML = {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}
GPU_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname", "DCGM_FI_DRIVER_VERSION"}
MIG_LABELS = GPU_LABELS | {"GPU_I_PROFILE", "GPU_I_ID"}
MIXED = "H100-SXM5-80GB:1,T4:1,RTX-2080-TI:1"
HALF_MIG = """version: v1
mig-configs:
  first-gpu-1g:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [1]
      mig-enabled: false
"""

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """The exposition text: each family's TYPE, and every sample (name, labels, value)."""
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            assert match, f"not an exposition line: {line!r}"
            name, labels, value = match.groups()
            parsed = {key: re.sub(r"\\(.)", r"\1", raw) for key, raw in _LABEL.findall(labels)}
            samples.append((name, parsed, float(value)))
    return types, samples


def series(samples, name: str, **labels) -> list[tuple[dict[str, str], float]]:
    return [(found, value) for metric, found, value in samples
            if metric == name and all(found.get(key) == str(want) for key, want in labels.items())]


def value(samples, name: str, **labels) -> float:
    (only,) = series(samples, name, **labels)
    return only[1]


async def scrape(node) -> tuple[dict[str, str], list]:
    await node.daemon.health.check_once()  # fresh readings, as the periodic loops take them
    await node.daemon.health.profiling.sample_once()
    async with node.http.get("http://localhost/metrics") as response:
        assert response.status == 200
        return parse(await response.text())


@pytest.fixture
async def h100_node(short_tmp):
    node = await start_daemon(sim_config(short_tmp, "hgx-h100"))
    yield node
    await stop_daemon(node)


async def test_every_default_counter_is_there_per_gpu_with_the_exporter_labels(h100_node):
    await h100_node.daemon.health.profiling.sample_once()  # GPM's metrics are between two samples
    types, samples = await scrape(h100_node)
    _, gpus = await h100_node.get("/v1/gpus")
    _, node = await h100_node.get("/v1/node")
    model = catalog().models["H100-SXM5-80GB"]
    idle = telemetry()["H100-SXM5-80GB"]
    for name, kind in EXPORTER_DEFAULTS.items():
        if name in NOT_FROM_NVML:
            assert name not in types
            continue
        assert types[name] == kind, name
        for gpu in gpus["gpus"]:
            (labels, _), = series(samples, name, gpu=gpu["index"])
            assert set(labels) - {"err_code", "err_msg"} == GPU_LABELS, name
            assert labels == {**labels, "UUID": gpu["uuid"], "pci_bus_id": gpu["pci_bus_id"],
                              "device": f"nvidia{gpu['index']}", "modelName": gpu["name"],
                              "hostname": socket.gethostname(), "DCGM_FI_DRIVER_VERSION": node["driver_version"]}
    for gpu in range(8):
        assert value(samples, "DCGM_FI_DEV_SM_CLOCK", gpu=gpu) == idle.idle_clocks_mhz["graphics"]
        assert value(samples, "DCGM_FI_DEV_MEM_CLOCK", gpu=gpu) == idle.idle_clocks_mhz["memory"]
        assert value(samples, "DCGM_FI_DEV_MEMORY_TEMP", gpu=gpu) == idle.memory_c
        assert value(samples, "DCGM_FI_DEV_GPU_TEMP", gpu=gpu) == model.idle_temperature_c
        assert value(samples, "DCGM_FI_DEV_POWER_USAGE", gpu=gpu) == model.idle_power_mw / 1000
        for idle_at_zero in ("GPU_UTIL", "MEM_COPY_UTIL", "ENC_UTIL", "DEC_UTIL", "NVLINK_BANDWIDTH_TOTAL"):
            assert value(samples, f"DCGM_FI_DEV_{idle_at_zero}", gpu=gpu) == 0
        fb = [value(samples, f"DCGM_FI_DEV_FB_{part}", gpu=gpu) for part in ("USED", "FREE", "RESERVED")]
        assert fb[2] == model.reserved_mib and sum(fb) == model.memory_mib
        # The energy counter: the idle draw since boot, give or take the rounding of the text format.
        assert value(samples, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu=gpu) > model.idle_power_mw


async def test_energy_counts_up_with_the_power_drawn_between_scrapes(h100_node):
    health = h100_node.daemon.health
    _, first = await scrape(h100_node)
    before = {uuid: readings.energy_mj for uuid, readings in health.readings.items()}
    started_at = next(iter(health.readings.values())).read_at
    await asyncio.sleep(0.3)  # fixed time: the energy drawn over it is what is measured, against the clock
    _, second = await scrape(h100_node)
    elapsed = next(iter(health.readings.values())).read_at - started_at
    watts = catalog().models["H100-SXM5-80GB"].idle_power_mw / 1000
    for uuid, readings in health.readings.items():
        grown_mj = readings.energy_mj - before[uuid]
        assert 0.5 * watts * elapsed * 1000 < grown_mj < 2 * watts * elapsed * 1000
    for gpu in range(8):
        assert value(second, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu=gpu) >= \
            value(first, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu=gpu)


async def test_boards_without_nvlink_hbm_sensor_or_energy_counter_have_no_such_sample(short_tmp):
    node = await start_daemon(sim_config(short_tmp, MIXED))
    try:
        types, samples = await scrape(node)
        models = parse_preset(MIXED)
        for gpu, model in enumerate(models):
            row = telemetry()[model.key]
            assert bool(series(samples, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu=gpu)) == (model.nvlinks > 0)
            assert bool(series(samples, "DCGM_FI_DEV_MEMORY_TEMP", gpu=gpu)) == (row.memory_c is not None)
            assert bool(series(samples, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu=gpu)) == row.energy_counter
            assert value(samples, "DCGM_FI_DEV_MEM_CLOCK", gpu=gpu) == row.idle_clocks_mhz["memory"]
            assert value(samples, "DCGM_FI_DEV_GPU_TEMP", gpu=gpu) == model.idle_temperature_c
        assert [m.key for m in models] == ["H100-SXM5-80GB", "T4", "RTX-2080-TI"]  # each case above is met
        assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" in types  # the family is there, without T4's sample
    finally:
        await stop_daemon(node)


async def test_mig_instances_get_their_own_framebuffer_series_and_no_utilisation(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "H100-SXM5-80GB:2", HALF_MIG))
    try:
        await mig_settled(node)
        assert (await put_layout(node, "first-gpu-1g"))[0] == 200
        _, samples = await scrape(node)
        _, gpu0 = await node.get("/v1/gpus/0")
        instances = {dev["gi_id"]: dev for dev in gpu0["mig"]["devices"]}
        assert len(instances) == 7
        totals = []
        for part in ("USED", "FREE", "RESERVED"):
            found = series(samples, f"DCGM_FI_DEV_FB_{part}", gpu=0, GPU_I_PROFILE="1g.10gb")
            assert {labels["GPU_I_ID"] for labels, _ in found} == {str(gi) for gi in instances}
            assert all(set(labels) == MIG_LABELS and labels["UUID"] == gpu0["uuid"] for labels, _ in found)
            totals.append({labels["GPU_I_ID"]: fb for labels, fb in found})
        for gi, dev in instances.items():  # each instance: its own memory, whole
            assert sum(part[str(gi)] for part in totals) == dev["memory_total_mib"]
        assert sum(sum(part.values()) for part in totals) <= gpu0["memory_total_mib"]
        assert not series(samples, "DCGM_FI_DEV_FB_USED", gpu=1, GPU_I_ID="0") and \
            not any("GPU_I_ID" in labels for labels, _ in series(samples, "DCGM_FI_DEV_FB_USED", gpu=1))
        # nvml.h: no utilisation rates for a GPU in MIG mode (nor does DCGM give them per instance)
        assert not series(samples, "DCGM_FI_DEV_GPU_UTIL", gpu=0)
        assert value(samples, "DCGM_FI_DEV_GPU_UTIL", gpu=1) == 0
        health = series(samples, "gpud_gpu_health", gpu=0, GPU_I_PROFILE="1g.10gb")
        assert len(health) == 7 and all(labels["mig_uuid"].startswith("MIG-") for labels, _ in health)
    finally:
        await stop_daemon(node)


async def test_xid_series_carry_err_code_and_err_msg_and_count_in_a_window(h100_node):
    name = load_catalog().info(79).name
    for expected in (1, 2):
        assert (await h100_node.post("/v1/sim/xid", {"gpu": 1, "xid": 79}))[0] == 200
        for _ in range(200):
            _, samples = await scrape(h100_node)
            if series(samples, "DCGM_EXP_XID_ERRORS_TOTAL", gpu=1, xid=79) and \
                    value(samples, "DCGM_EXP_XID_ERRORS_TOTAL", gpu=1, xid=79) == expected:
                break
            await asyncio.sleep(0.02)
        assert value(samples, "DCGM_FI_DEV_XID_ERRORS", gpu=1, err_code=79, err_msg=name) == 79
        assert value(samples, "DCGM_EXP_XID_ERRORS_COUNT", gpu=1, xid=79, window_size_in_ms=300000) == expected
        assert value(samples, "gpud_xid_errors_total", gpu=1, xid=79) == expected
    assert value(samples, "DCGM_FI_DEV_XID_ERRORS", gpu=0, err_code=0, err_msg="No Error") == 0
    ((labels, count),) = series(samples, "DCGM_EXP_XID_ERRORS_COUNT", gpu=0)
    assert count == 0 and "xid" not in labels and labels["window_size_in_ms"] == "300000"
    assert not series(samples, "DCGM_EXP_XID_ERRORS_TOTAL", gpu=0)


def test_nvlink_bandwidth_is_dcgms_rate_of_the_data_counters():
    first, later = Readings(nvlink_data_kib=10_000, read_at=100.0), Readings(nvlink_data_kib=2_010_000, read_at=102.0)
    assert nvlink_mb_s(later, first) == 1000  # 2,000,000 KiB in 2 s, divided by 1000 as DCGM does
    assert nvlink_mb_s(first, None) == 0  # the first reading: DCGM writes 0
    assert nvlink_mb_s(first, later) == 0  # counters went back (a driver reload), or time did not move on
    assert nvlink_mb_s(Readings(read_at=5.0), first) is None  # no NVLink: no sample


def test_docs_name_every_default_counter_and_why_some_are_absent():
    text = (Path(REPO) / "docs" / "metrics.md").read_text()
    for name in EXPORTER_DEFAULTS:
        assert f"`{name}`" in text, name
    assert "profiling" in text and "GPU_I_PROFILE" in text and "err_msg" in text


# --- the simulator's telemetry calls -------------------------------------------------------------


@pytest.fixture
def h100_sim(tmp_path):
    return started("H100-SXM5-80GB:2", tmp_path / "sim.json")


def test_clocks_boost_and_utilisation_follows_the_processes_sm_share(h100_sim):
    nvml, row = h100_sim, telemetry()["H100-SXM5-80GB"]
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) == row.idle_clocks_mhz["graphics"]
    nvml.sim_set_processes(0, [{"pid": 990001, "sm_percent": 60}, {"pid": 990002, "sm_percent": 70}])
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM) == row.busy_clocks_mhz["graphics"]
    assert nvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_GRAPHICS) == row.busy_clocks_mhz["graphics"]
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert (rates.gpu, rates.memory) == (100, 0)  # 60 + 70, at most 100
    assert nvml.nvmlDeviceGetEncoderUtilization(handle) == [0, SAMPLE_PERIOD_US]
    other = nvml.nvmlDeviceGetHandleByIndex(1)
    assert nvml.nvmlDeviceGetUtilizationRates(other).gpu == 0
    assert nvml.nvmlDeviceGetClockInfo(other, pynvml.NVML_CLOCK_VIDEO) == row.idle_clocks_mhz["video"]


def test_telemetry_calls_refuse_bad_input_and_mig(h100_sim):
    nvml = h100_sim
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetClockInfo(handle, 99)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetFieldValues(handle, [])
    with pytest.raises(TypeError):  # as pynvml's ctypes struct does for a field id that is no number
        nvml.nvmlDeviceGetFieldValues(handle, ["memory temperature"])
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetUtilizationRates("not a handle")
    fields = nvml.nvmlDeviceGetFieldValues(handle, [(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 18),
                                                    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 17),
                                                    pynvml.NVML_FI_DEV_ECC_CURRENT])
    assert [field.nvmlReturn for field in fields] == [pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_SUCCESS,
                                                      pynvml.NVML_ERROR_NOT_SUPPORTED]
    device = enable_mig(nvml, 0)
    profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(device, profile.id)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    for call in (lambda: nvml.nvmlDeviceGetUtilizationRates(device), lambda: nvml.nvmlDeviceGetClockInfo(mig, 1),
                 lambda: nvml.nvmlDeviceGetUtilizationRates(mig), lambda: nvml.nvmlDeviceGetFieldValues(mig, [82]),
                 lambda: nvml.nvmlDeviceGetDecoderUtilization(device)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    memory = nvml.nvmlDeviceGetMemoryInfo(mig, version=pynvml.nvmlMemory_v2)  # the MIG device's own memory
    assert memory.total >> 20 == profile.memorySizeMB and memory.reserved == 0


def test_every_model_has_telemetry_and_the_energy_counter_follows_the_draw(tmp_path):
    assert set(telemetry()) == set(catalog().models)
    nvml = SimulatedNvml("T4:1", tmp_path / "sim.json")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    first = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    with open("/proc/uptime") as uptime:
        booted_s = float(uptime.read().split()[0])
    assert math.isclose(first, catalog().models["T4"].idle_power_mw * booted_s, rel_tol=0.01)
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(handle) >= first


def test_the_simulated_h100_answers_as_the_captured_one(tmp_path):
    """tests/fixtures/hardware: the idle H100 of our capture, field by field."""
    xml = Path(REPO) / "tests" / "fixtures" / "hardware" / "h100-sxm5-580.159.04" / "nvidia-smi-q.xml"
    captured = ElementTree.parse(xml).getroot().find("gpu")

    def number(path: str) -> int:
        return int(captured.find(path).text.split()[0])

    nvml = started("H100-SXM5-80GB:1", tmp_path / "sim.json", driver="580.159.04")
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    clock = nvml.nvmlDeviceGetClockInfo
    assert clock(handle, pynvml.NVML_CLOCK_SM) == number("clocks/sm_clock")
    assert clock(handle, pynvml.NVML_CLOCK_GRAPHICS) == number("clocks/graphics_clock")
    assert clock(handle, pynvml.NVML_CLOCK_MEM) == number("clocks/mem_clock")
    assert clock(handle, pynvml.NVML_CLOCK_VIDEO) == number("clocks/video_clock")
    assert telemetry()["H100-SXM5-80GB"].busy_clocks_mhz == {
        "graphics": number("max_clocks/sm_clock"), "memory": number("max_clocks/mem_clock"),
        "video": number("max_clocks/video_clock")}
    (memory_temp,) = nvml.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert memory_temp.nvmlReturn == pynvml.NVML_SUCCESS
    assert memory_temp.value.uiVal == number("temperature/memory_temp")
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    assert (rates.gpu, rates.memory) == (number("utilization/gpu_util"), number("utilization/memory_util"))
    assert nvml.nvmlDeviceGetEncoderUtilization(handle)[0] == number("utilization/encoder_util")
    assert nvml.nvmlDeviceGetDecoderUtilization(handle)[0] == number("utilization/decoder_util")
    memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    assert memory.reserved >> 20 == number("fb_memory_usage/reserved")
