"""Profiling metrics from NVML's GPM: the simulator's GPM calls as nvml.h describes them, gpud's sampler on
the simulator and on NVIDIA's mock NVML, the DCGM_FI_PROF_* series per GPU and GPU instance, and their
configuration."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pynvml
import pytest
import structlog
from helpers import IN_CI, mig_config, mig_settled, mock_nvml_config, put_layout, run_on_mock_nvml, sim_config, \
    start_daemon, stop_daemon

from gpud.config import ConfigError, parse_config
from gpud.health.collectors.profiling import PROFILING_FIELDS
from gpud.nvml.gpm import INSTANCE_METRICS, MIB, GpmSampler, GpmTarget, Profile
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim._gpm_calls import gpm_model
from gpud.nvml.sim.scenarios import enable_mig
from test_dcgm_metrics import GPU_LABELS, HALF_MIG, MIG_LABELS, parse, series, value
from test_prometheus import lint_problems_that_are_ours

GR, TENSOR, PCIE_TX, NVLINK_RX = (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
                                  pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
                                  pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC)
BUSY_PID = 4_000_001  # a process of the simulated world only


class nvml_raises:
    def __init__(self, code: int):
        self.code = code

    def __enter__(self):
        return self

    def __exit__(self, kind, error, _):
        assert isinstance(error, pynvml.NVMLError), f"expected NVML error {self.code}, got {error!r}"
        assert error.value == self.code
        return True


@pytest.fixture
def sim(tmp_path):
    nvml = SimulatedNvml("H100-SXM5-80GB:2,A100-SXM4-40GB:1", tmp_path / "sim.json")
    nvml.nvmlInit()
    yield nvml
    nvml.nvmlShutdown()


def metrics_get(nvml, first, second, ids, version=pynvml.NVML_GPM_METRICS_GET_VERSION):
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics, request.sample1, request.sample2 = version, len(ids), first, second
    for slot, metric in zip(request.metrics, ids):
        slot.metricId = metric
    nvml.nvmlGpmMetricsGet(request)
    return [(slot.nvmlReturn, slot.value) for slot in request.metrics[:len(ids)]]


def one_instance(nvml, index: int, profile_constant: int):
    """MIG on, and one GPU instance of the profile with one compute instance spanning it: (GI id, MIG device)."""
    gpu = enable_mig(nvml, index)
    profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, profile_constant)
    gpu_instance = nvml.nvmlDeviceCreateGpuInstance(gpu, profile.id)
    whole = {1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE}
    compute = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gpu_instance, whole[profile.sliceCount], pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, compute.id)
    return nvml.nvmlGpuInstanceGetInfo(gpu_instance).id, nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)


def two_samples(nvml, take, pause_s=0.15):
    first, second = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    take(first)
    time.sleep(pause_s)  # fixed time: nvml.h wants more than 100 ms between two samples
    take(second)
    return first, second


# --- the simulator -------------------------------------------------------------------------------


def test_metrics_between_two_samples_follow_the_processes_activity(sim):
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    assert sim.nvmlGpmQueryDeviceSupport(gpu).isSupportedDevice == 1
    sim.sim_set_processes(0, [{"pid": BUSY_PID, "sm_percent": 80}])
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmSampleGet(gpu, sample))
    (gr_ok, gr), (tensor_ok, tensor), (pcie_ok, pcie), (nvlink_ok, nvlink) = metrics_get(
        sim, first, second, [GR, TENSOR, PCIE_TX, NVLINK_RX])
    model = gpm_model()
    assert (gr_ok, tensor_ok, pcie_ok, nvlink_ok) == (pynvml.NVML_SUCCESS,) * 4
    assert gr == pytest.approx(80 * model.shares[GR]) and tensor == pytest.approx(80 * model.shares[TENSOR])
    assert pcie == pytest.approx(0.8 * model.full_activity_mib_per_s[PCIE_TX])
    assert nvlink == 0  # the simulated processes exchange no peer-to-peer data
    # an idle GPU: all 0; the order of the samples does not matter
    idle = sim.nvmlDeviceGetHandleByIndex(1)
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmSampleGet(idle, sample), 0.01)
    assert metrics_get(sim, second, first, [GR]) == [(pynvml.NVML_SUCCESS, 0.0)]


def test_metrics_get_checks_its_version_count_and_samples(sim):
    gpu, other = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmSampleGet(gpu, sample), 0.01)
    with nvml_raises(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
        metrics_get(sim, first, second, [GR], version=2)
    with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):
        metrics_get(sim, first, second, [])  # numMetrics 0
    untaken = sim.nvmlGpmSampleAlloc()
    with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):
        metrics_get(sim, first, untaken, [GR])
    elsewhere = sim.nvmlGpmSampleGet(other, untaken)
    with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):  # samples of two GPUs
        metrics_get(sim, first, elsewhere, [GR])
    # each metric its own nvmlReturn: one the simulator does not give, and an id nvml.h does not have
    assert [code for code, _ in metrics_get(sim, first, second, [GR, pynvml.NVML_GPM_METRIC_NVDEC_0_UTIL, 0])] == \
        [pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NOT_SUPPORTED]
    sim.nvmlGpmSampleFree(second)
    for freed in (lambda: sim.nvmlGpmSampleFree(second), lambda: sim.nvmlGpmSampleGet(gpu, second),
                  lambda: metrics_get(sim, first, second, [GR]), lambda: sim.nvmlGpmSampleGet(gpu, None),
                  lambda: sim.nvmlGpmSampleFree(gpu)):  # freed, never a sample, a device handle
        with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):
            freed()


def test_no_gpm_before_hopper(sim):
    a100 = sim.nvmlDeviceGetHandleByIndex(2)
    support = sim.nvmlGpmQueryDeviceSupport(a100)
    assert (support.version, support.isSupportedDevice) == (pynvml.NVML_GPM_SUPPORT_VERSION, 0)
    sample = sim.nvmlGpmSampleAlloc()  # a buffer is process memory: allocating one needs no GPU
    for call in (lambda: sim.nvmlGpmSampleGet(a100, sample), lambda: sim.nvmlGpmMigSampleGet(a100, 1, sample),
                 lambda: sim.nvmlGpmQueryIfStreamingEnabled(a100)):
        with nvml_raises(pynvml.NVML_ERROR_NOT_SUPPORTED):
            call()
    assert sim.nvmlGpmQueryIfStreamingEnabled(sim.nvmlDeviceGetHandleByIndex(0)) == pynvml.NVML_FEATURE_DISABLED


def test_a_lost_gpu_and_shutdown(sim):
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    sample = sim.nvmlGpmSampleAlloc()
    sim.sim_set_gpu_lost(0)
    with nvml_raises(pynvml.NVML_ERROR_GPU_IS_LOST):
        sim.nvmlGpmSampleGet(gpu, sample)
    sim.nvmlShutdown()
    with nvml_raises(pynvml.NVML_ERROR_UNINITIALIZED):
        sim.nvmlGpmSampleAlloc()
    sim.nvmlInit()
    with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):  # the buffers went with the last shutdown
        sim.nvmlGpmSampleFree(sample)


def test_mig_samples_by_gpu_instance_and_by_mig_device(sim):
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    sample = sim.nvmlGpmSampleAlloc()
    with nvml_raises(pynvml.NVML_ERROR_NOT_SUPPORTED):  # MIG mode off (nvmlDeviceGetGpuInstanceById's answer)
        sim.nvmlGpmMigSampleGet(gpu, 1, sample)
    gi_id, mig_device = one_instance(sim, 0, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    sim.sim_set_processes(sim.nvmlDeviceGetUUID(mig_device), [{"pid": BUSY_PID, "sm_percent": 70}])
    with nvml_raises(pynvml.NVML_ERROR_NOT_FOUND):  # no GPU instance with this id
        sim.nvmlGpmMigSampleGet(gpu, gi_id + 1, sample)
    with nvml_raises(pynvml.NVML_ERROR_INVALID_ARGUMENT):  # the GPU's handle, not a MIG device's
        sim.nvmlGpmMigSampleGet(mig_device, gi_id, sample)
    model = gpm_model()
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmMigSampleGet(gpu, gi_id, sample))
    (gr_ok, gr), (pcie_ok, _) = metrics_get(sim, first, second, [GR, PCIE_TX])
    assert gr_ok == pynvml.NVML_SUCCESS and gr == pytest.approx(70 * model.shares[GR])
    assert pcie_ok == pynvml.NVML_ERROR_NOT_SUPPORTED  # PCIe is the whole GPU's (DCGM: entity level GPU)
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmSampleGet(mig_device, sample))  # "MIG device handle"
    assert metrics_get(sim, first, second, [GR])[0][1] == pytest.approx(70)
    first, second = two_samples(sim, lambda sample: sim.nvmlGpmSampleGet(gpu, sample))  # the whole GPU: 3 of 7
    assert metrics_get(sim, first, second, [GR])[0][1] == pytest.approx(70 * 3 / 7)


# --- gpud's sampler --------------------------------------------------------------------------------


def test_sampler_gives_dcgm_units_from_the_second_pass_and_says_no_gpm_once(sim):
    uuids = [sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(index)) for index in range(3)]
    targets = [GpmTarget(uuid, uuid) for uuid in uuids]
    sim.sim_set_processes(0, [{"pid": BUSY_PID, "sm_percent": 50}])
    sampler = GpmSampler()
    with structlog.testing.capture_logs() as logged:
        assert sampler.sample(sim, targets) == {}  # one sample each: nothing to compare yet
        time.sleep(0.15)  # fixed time: nvml.h wants more than 100 ms between two samples
        profiles = sampler.sample(sim, targets)
        sampler.sample(sim, targets)
    model = gpm_model()
    busy = profiles[uuids[0]]
    assert busy.gr_engine_active == pytest.approx(0.5 * model.shares[GR])  # percent -> ratio, as DCGM
    assert busy.pipe_tensor_active == pytest.approx(0.5 * model.shares[TENSOR])
    assert busy.pcie_tx_bytes == pytest.approx(0.5 * model.full_activity_mib_per_s[PCIE_TX] * MIB)  # MiB/s -> B/s
    assert busy.nvlink_rx_bytes == 0
    assert profiles[uuids[1]] == Profile(**dict.fromkeys(vars(busy), 0.0))
    assert uuids[2] not in profiles  # the A100: no GPM
    said = [entry for entry in logged if entry["event"] == "gpm_not_supported"]
    assert len(said) == 1 and list(said[0]["gpus"]) == [uuids[2]]
    # one sample kept per device, freed when the device is gone and all at once at the end
    assert len(sim._gpm_samples) == 2
    sampler.sample(sim, targets[:1])
    assert len(sim._gpm_samples) == 1
    sampler.free_all(sim)
    assert not sim._gpm_samples


def test_sampler_instances_get_no_pcie_or_nvlink(sim):
    gi_id, _ = one_instance(sim, 0, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    uuid = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(0))
    targets = [GpmTarget(uuid, uuid), GpmTarget("MIG-x", uuid, gi_id),
               GpmTarget("MIG-gone", uuid, gi_id + 1)]
    sampler = GpmSampler()
    with structlog.testing.capture_logs() as logged:
        for _ in range(3):
            profiles = sampler.sample(sim, targets)
    instance = profiles["MIG-x"]
    assert {name for name, found in vars(instance).items() if found is not None} == set(INSTANCE_METRICS)
    assert profiles[uuid].pcie_rx_bytes == 0 and "MIG-gone" not in profiles
    failed = [entry for entry in logged if entry["event"] == "gpm_failed"]
    assert len(failed) == 1 and failed[0]["gi"] == gi_id + 1  # NOT_FOUND, said once however many passes


# --- the series ------------------------------------------------------------------------------------


async def profiled(node) -> tuple[dict, list]:
    """Two GPM passes (a period's metrics) and a scrape."""
    for _ in range(2):
        await node.daemon.health.profiling.sample_once()
    async with node.http.get("http://localhost/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return text, parse(text)


async def test_hgx_h100_with_mig_instances_writes_every_profiling_series(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "H100-SXM5-80GB:2", HALF_MIG))
    try:
        await mig_settled(node)
        assert (await put_layout(node, "first-gpu-1g"))[0] == 200
        _, gpu0 = await node.get("/v1/gpus/0")
        busy = min(gpu0["mig"]["devices"], key=lambda dev: dev["gi_id"])
        node.daemon.session.nvml.sim_set_processes(busy["uuid"], [{"pid": BUSY_PID, "sm_percent": 60}])
        node.daemon.session.nvml.sim_set_processes(1, [{"pid": BUSY_PID + 1, "sm_percent": 40}])
        text, (types, samples) = await profiled(node)
        for name, _, attribute in PROFILING_FIELDS:
            assert types[name] == "gauge"
            for gpu in (0, 1):
                (labels, _), = [(found, got) for found, got in series(samples, name, gpu=gpu)
                                if "GPU_I_ID" not in found]
                assert set(labels) == GPU_LABELS
            instances = [labels for labels, _ in series(samples, name, gpu=0) if "GPU_I_ID" in labels]
            if attribute in INSTANCE_METRICS:
                assert len(instances) == 7 and all(set(labels) == MIG_LABELS and labels["GPU_I_PROFILE"] == "1g.10gb"
                                                   for labels in instances)
            else:  # PCIe and NVLink: whole GPUs only, as DCGM
                assert not instances
        model = gpm_model()
        assert value(samples, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu=0, GPU_I_ID=busy["gi_id"]) == \
            pytest.approx(0.6 * model.shares[GR], rel=1e-3)
        assert value(samples, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu=0, GPU_I_ID=busy["gi_id"] + 1) == 0
        whole_gpu0 = [got for labels, got in series(samples, "DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu=0)
                      if "GPU_I_ID" not in labels]
        assert whole_gpu0[0] == pytest.approx(0.6 * model.shares[GR] / 7, rel=1e-3)  # one 1g instance of 7
        tensor1 = [got for labels, got in series(samples, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu=1)]
        assert tensor1 == [pytest.approx(0.4 * model.shares[TENSOR], rel=1e-3)]
        assert [got for _, got in series(samples, "DCGM_FI_PROF_PCIE_RX_BYTES", gpu=1)] == \
            [pytest.approx(0.4 * gpm_model().full_activity_mib_per_s[pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC] * MIB,
                           rel=1e-3)]
        promtool_checks(text)
    finally:
        await stop_daemon(node)


def promtool_checks(text: str) -> None:
    """promtool parses the profiling families, and lints nothing in them but what dcgm-exporter's names and
    labels draw (tests/test_prometheus.py)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not IN_CI, "CI installs Debian's prometheus package (promtool)"
        pytest.skip("promtool is not installed: the exposition was not checked by Prometheus's own parser")
    profiling = "\n".join(line for line in text.splitlines() if "DCGM_FI_PROF_" in line) + "\n"
    checked = subprocess.run([promtool, "check", "metrics"], input=profiling, capture_output=True, text=True,
                             timeout=60)
    output = checked.stdout + checked.stderr
    assert checked.returncode in (0, 3) and "error while linting" not in output, output  # 3: lint remarks
    assert lint_problems_that_are_ours(profiling, output) == []


async def test_a100_node_has_no_profiling_series_and_says_so_once(short_tmp):
    node = await start_daemon(sim_config(short_tmp, "dgx-a100"))
    try:
        with structlog.testing.capture_logs() as logged:
            text, _ = await profiled(node)
            await node.daemon.health.profiling.sample_once()
        assert "DCGM_FI_PROF_" not in text
        said = [entry for entry in logged if entry["event"] == "gpm_not_supported"]
        # the daemon's own first pass may have said it before the capture began: never twice
        assert len(said) <= 1 and len(node.daemon.health.profiling.sampler.unsupported) == 8
    finally:
        await stop_daemon(node)


async def test_profiling_off_takes_no_samples_and_a_reset_frees_them(short_tmp):
    config = sim_config(short_tmp, "H100-SXM5-80GB:2")
    node = await start_daemon(config.with_overrides(**{"health.profiling": False}))
    try:
        await asyncio.sleep(0.1)  # fixed time: a pass that would sample has its chance; none must come
        assert not node.daemon.session.nvml._gpm_samples
        async with node.http.get("http://localhost/metrics") as response:
            assert "DCGM_FI_PROF_" not in await response.text()
    finally:
        await stop_daemon(node)
    node = await start_daemon(sim_config(short_tmp, "H100-SXM5-80GB:2"))
    try:
        await profiled(node)
        nvml = node.daemon.session.nvml
        assert len(nvml._gpm_samples) == 2
        async with node.daemon.session.released("test"):
            assert not nvml._gpm_samples  # freed before NVML shut down
        assert node.daemon.health.profiling.profiles == {}
        await profiled(node)  # and sampled again after
        assert len(node.daemon.health.profiling.profiles) == 2
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("text, key", [
    ("health:\n  profiling_interval_s: fast\n", "health.profiling_interval_s"),
    ("health:\n  profiling_interval_s: 0.5\n", "health.profiling_interval_s"),
    ("health:\n  profiling_interval_s: [10]\n", "health.profiling_interval_s"),
    ("health:\n  profiling: 'yes'\n", "health.profiling"),
    ("health:\n  profiling: 1\n", "health.profiling"),
])
def test_profiling_settings_refuse_what_is_not_one(text, key):
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert refused.value.key == key
    assert parse_config("health:\n  profiling: false\n  profiling_interval_s: 30\n").health.profiling_interval_s == 30


# --- NVIDIA's mock NVML ----------------------------------------------------------------------------

ON_MOCK = """
import json, time
import pynvml
from gpud.nvml.gpm import GpmSampler, GpmTarget
pynvml.nvmlInit()
uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
sampler = GpmSampler()
targets = [GpmTarget(uuid, uuid) for uuid in uuids]
first = sampler.sample(pynvml, targets)
time.sleep(0.3)
second = sampler.sample(pynvml, targets)
sampler.free_all(pynvml)
print(json.dumps({"first": len(first), "profiles": {u: vars(p) for u, p in second.items()},
                  "unsupported": sorted(sampler.unsupported), "gpus": len(uuids)}))
"""


def test_gpuds_sampler_on_nvidias_mock_nvml(tmp_path):
    """The real pynvml path on NVIDIA's mock libnvidia-ml (its engine/gpm.go models GPM from the same
    utilisation its nvmlDeviceGetUtilizationRates answers). Its nvmlGpmMigSampleGet is a stub and it makes no
    MIG instances (bridge/stubs_generated.go), so MIG sampling is checked on gpud's simulator only."""
    h100 = run_on_mock_nvml(ON_MOCK, mock_nvml_config("h100"), tmp_path)
    assert h100["first"] == 0 and not h100["unsupported"] and len(h100["profiles"]) == h100["gpus"] > 0
    for profile in h100["profiles"].values():
        for name in ("gr_engine_active", "sm_active", "sm_occupancy", "pipe_tensor_active", "dram_active",
                     "pipe_fp64_active", "pipe_fp32_active", "pipe_fp16_active"):
            assert 0 <= profile[name] <= 1, (name, profile)
        assert profile["pcie_tx_bytes"] >= 0 and profile["nvlink_rx_bytes"] >= 0
    a100 = run_on_mock_nvml(ON_MOCK, mock_nvml_config("a100"), tmp_path)
    assert a100["profiles"] == {} and len(a100["unsupported"]) == a100["gpus"] > 0
