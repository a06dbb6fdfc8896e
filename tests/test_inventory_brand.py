"""Each GPU's brand (nvmlDeviceGetBrand) in go-nvlib's words (pkg/nvlib/device/device.go GetBrandAsString),
what NVIDIA's DRA driver publishes as `brand`: answered by the simulator per model, read by gpud's reader
on the simulator and on NVIDIA's mock NVML, kept for a lost GPU, and served by GET /v1/gpus."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest
import structlog
from helpers import mock_nvml_config, run_on_mock_nvml, sim_config, start_daemon, stop_daemon
from openapi_check import assert_matches_openapi

from gpud.base.logs import configure_log_level
from gpud.inventory import _identities, _load_known
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.models import catalog

# What each simulated model answers (models.yaml `brand`, with its sources there).
SIMULATED = {"A100-SXM4-40GB": "NVIDIA", "A100-SXM4-80GB": "NVIDIA", "A100-PCIE-80GB": "NVIDIA", "A30": "NVIDIA",
             "H100-SXM5-80GB": "NVIDIA", "H100-NVL-94GB": "NVIDIA", "H200-SXM5-141GB": "NVIDIA", "B200": "NVIDIA",
             "T4": "NVIDIA", "RTX-2080-TI": "GEFORCE"}
# go-nvlib GetBrandAsString, by pynvml constant: the words NVIDIA's DRA driver publishes.
GO_NVLIB = {"NVML_BRAND_UNKNOWN": "Unknown", "NVML_BRAND_QUADRO": "Quadro", "NVML_BRAND_TESLA": "Tesla",
            "NVML_BRAND_NVS": "NVS", "NVML_BRAND_GRID": "Grid", "NVML_BRAND_GEFORCE": "GeForce",
            "NVML_BRAND_TITAN": "Titan", "NVML_BRAND_NVIDIA_VAPPS": "NvidiaVApps", "NVML_BRAND_NVIDIA_VPC": "NvidiaVPC",
            "NVML_BRAND_NVIDIA_VCS": "NvidiaVCS", "NVML_BRAND_NVIDIA_VWS": "NvidiaVWS",
            "NVML_BRAND_NVIDIA_CLOUD_GAMING": "NvidiaCloudGaming", "NVML_BRAND_NVIDIA_VGAMING": "NvidiaCloudGaming",
            "NVML_BRAND_QUADRO_RTX": "QuadroRTX", "NVML_BRAND_NVIDIA_RTX": "NvidiaRTX", "NVML_BRAND_NVIDIA": "Nvidia",
            "NVML_BRAND_GEFORCE_RTX": "GeForceRTX", "NVML_BRAND_TITAN_RTX": "TitanRTX"}


class BrandNvml(SimulatedNvml):
    """The simulator answering one NVML_BRAND_* value for every GPU."""

    brand = pynvml.NVML_BRAND_NVIDIA

    def nvmlDeviceGetBrand(self, device):
        super().nvmlDeviceGetBrand(device)  # a bad or lost handle fails as before
        return self.brand


def read(tmp_path: Path, preset: str, nvml_class=SimulatedNvml, prepare=lambda sim: None):
    sim = nvml_class(preset, tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        prepare(sim)
        return NodeReader(sysfs=sim.sysfs_root).read(sim, {})
    finally:
        sim.nvmlShutdown()


# -- the simulator ----------------------------------------------------------------------------------

def test_every_model_answers_its_brand(tmp_path):
    assert set(catalog().models) == set(SIMULATED), "a model without an expected brand here"
    for model, brand in SIMULATED.items():
        sim = SimulatedNvml(f"{model}:1", tmp_path / f"{model}.json")
        sim.nvmlInit()
        try:
            assert sim.nvmlDeviceGetBrand(sim.nvmlDeviceGetHandleByIndex(0)) == getattr(pynvml, f"NVML_BRAND_{brand}")
        finally:
            sim.nvmlShutdown()


def test_a_lost_gpu_answers_no_brand(tmp_path):
    sim = SimulatedNvml("A100-SXM4-40GB:2", tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        handle = sim.nvmlDeviceGetHandleByIndex(1)
        sim.sim_set_gpu_lost(1, how="is-lost")
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            sim.nvmlDeviceGetBrand(handle)
    finally:
        sim.nvmlShutdown()


# -- the reader on the simulator --------------------------------------------------------------------

@pytest.mark.parametrize(("preset", "brand"), [("dgx-a100", "Nvidia"), ("hgx-h100", "Nvidia"), ("hgx-h200", "Nvidia"),
                                                ("t4", "Nvidia"), ("rtx-2080ti", "GeForce")])
def test_the_inventory_carries_the_brand(tmp_path, preset, brand):
    gpus = read(tmp_path, preset).gpus
    assert gpus and {gpu.brand for gpu in gpus} == {brand}
    assert all(gpu.unreadable == () and gpu.error is None for gpu in gpus)


@pytest.mark.parametrize("constant", sorted(GO_NVLIB))
def test_each_brand_in_go_nvlibs_words(tmp_path, constant):
    sim_class = type("Sim", (BrandNvml,), {"brand": getattr(pynvml, constant)})
    assert read(tmp_path, "A100-SXM4-40GB:1", sim_class).gpus[0].brand == GO_NVLIB[constant]


@pytest.mark.parametrize("value", [pynvml.NVML_BRAND_NVIDIA_DLA, pynvml.NVML_BRAND_NVIDIA_VGAMEDEV,
                                   pynvml.NVML_BRAND_NVIDIA_NPU, 99])
def test_a_brand_go_nvlib_has_no_word_for_is_none_and_logged_at_debug(tmp_path, value):
    sim_class = type("Sim", (BrandNvml,), {"brand": value})
    level = structlog.get_config()["wrapper_class"]
    with structlog.testing.capture_logs() as logged:
        configure_log_level("debug")
        try:
            gpu = read(tmp_path, "A100-SXM4-40GB:1", sim_class).gpus[0]
        finally:
            structlog.configure(wrapper_class=level)
    assert gpu.brand is None and gpu.error is None and not gpu.lost and gpu.unreadable == ()
    (entry,) = [e for e in logged if e["event"] == "brand_unknown"]
    assert entry["log_level"] == "debug" and entry["value"] == value and entry["gpu"] == gpu.uuid


@pytest.mark.parametrize("error", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION,
                                   pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_a_refused_brand_is_left_out_as_other_optional_fields_are(tmp_path, error):
    """NOT_SUPPORTED or a driver without the call: no brand; NO_PERMISSION: no brand, noted in `unreadable`.
    The GPU is read either way."""
    fail = lambda sim: sim.sim_fail_calls("nvmlDeviceGetBrand", error, 1)  # noqa: E731
    gpu = read(tmp_path, "A100-SXM4-40GB:1", prepare=fail).gpus[0]
    assert gpu.brand is None and gpu.error is None and not gpu.lost
    assert gpu.unreadable == (("brand: needs root (NVML NO_PERMISSION)",)
                              if error == pynvml.NVML_ERROR_NO_PERMISSION else ())


def test_a_lost_gpu_keeps_its_brand(tmp_path):
    sim = SimulatedNvml("rtx-2080ti", tmp_path / "sim.json")
    sim.nvmlInit()
    try:
        reader = NodeReader(sysfs=sim.sysfs_root)
        known = {gpu.index: gpu for gpu in reader.read(sim, {}).gpus}
        sim.sim_set_gpu_lost(0)
        lost = reader.read(sim, known).gpus[0]
        assert lost.lost and lost.brand == known[0].brand == "GeForce"
    finally:
        sim.nvmlShutdown()


def test_the_brand_is_kept_on_disk_with_the_rest_of_the_identity(tmp_path):
    """A GPU lost while gpud is down still has its brand when gpud comes back; a file written before gpud
    kept brands gives none."""
    gpu = read(tmp_path, "t4").gpus[0]
    path = tmp_path / "known.json"
    path.write_text(json.dumps(_identities({0: gpu})))
    assert _load_known(path)[0].brand == "Nvidia"
    path.write_text(json.dumps({"0": {k: v for k, v in _identities({0: gpu})["0"].items() if k != "brand"}}))
    assert _load_known(path)[0].brand is None
    assert _load_known(path)[0].uuid == gpu.uuid


# -- the API ----------------------------------------------------------------------------------------

async def test_gpu_views_show_the_brand(short_tmp):
    running = await start_daemon(sim_config(short_tmp, "rtx-2080ti"))
    try:
        status, body = await running.get("/v1/gpus")
        assert status == 200
        assert_matches_openapi("GET", "/v1/gpus", 200, body)
        assert [gpu["brand"] for gpu in body["gpus"]] == ["GeForce"]
        status, one = await running.get("/v1/gpus/0")
        assert status == 200 and one["brand"] == "GeForce"
        assert_matches_openapi("GET", "/v1/gpus/{id}", 200, one)
        assert_matches_openapi("GET", "/v1/gpus/{id}", 200, {**one, "brand": None})
    finally:
        await stop_daemon(running)


def test_the_openapi_document_lists_go_nvlibs_words():
    from gpud.api.server import load_openapi
    schema = load_openapi()["components"]["schemas"]["Gpu"]["properties"]["brand"]
    assert set(schema["enum"]) == set(GO_NVLIB.values()) | {None}


# -- NVIDIA's mock NVML, a second opinion -----------------------------------------------------------

MOCK_READER = """
import json
import pynvml
from gpud.nvml.reader import NodeReader
pynvml.nvmlInit()
inventory = NodeReader().read(pynvml, {})
print(json.dumps([{"brand": g.brand, "lost": g.lost, "error": g.error, "unreadable": g.unreadable}
                  for g in inventory.gpus]))
"""


def read_on_mock(config: dict, tmp_path: Path) -> list[dict]:
    """gpud's real reader with the real pynvml on the mock library."""
    return run_on_mock_nvml(MOCK_READER, config, tmp_path)


@pytest.mark.parametrize("name", ["a100", "h100"])
def test_mock_data_center_gpus_read_nvidia(tmp_path, name):
    """The mock's configs say `brand: "nvidia"`, which it answers as BRAND_NVIDIA (engine/device.go
    parseBrand): go-nvlib's "Nvidia", as the simulator's A100 and H100 answer."""
    gpus = read_on_mock(mock_nvml_config(name), tmp_path)
    assert len(gpus) == 8
    assert all(gpu["brand"] == "Nvidia" and gpu["error"] is None and not gpu["lost"] and gpu["unreadable"] == []
               for gpu in gpus)


def test_mock_other_brands(tmp_path):
    """The other brands the mock's parseBrand knows, each on one device (device_defaults overridden per
    device); a word it does not know it answers BRAND_UNKNOWN, go-nvlib's "Unknown"."""
    config = mock_nvml_config("a100")
    words = {"geforce": "GeForce", "tesla": "Tesla", "quadro": "Quadro", "titan": "Titan", "nvidia_rtx": "NvidiaRTX",
             "no-such-brand": "Unknown"}
    for device, word in zip(config["devices"], words):
        device["brand"] = word
    gpus = read_on_mock(config, tmp_path)
    assert [gpu["brand"] for gpu in gpus] == list(words.values()) + ["Nvidia"] * (len(gpus) - len(words))

