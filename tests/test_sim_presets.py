"""Preset names, custom specs and the identities they produce."""

import re

import pytest

from gpud.nvml.sim import PRESETS, PresetError, SimulatedNvml, parse_preset
from gpud.nvml.sim.scenarios import started

GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
DGX_A100_BUS_IDS = [f"00000000:{bus}:00.0" for bus in ("07", "0F", "47", "4E", "87", "90", "B7", "BD")]


@pytest.mark.parametrize(
    ("preset", "count", "name"),
    [
        ("dgx-a100", 8, "NVIDIA A100-SXM4-40GB"),
        ("dgx-a100-80gb", 8, "NVIDIA A100-SXM4-80GB"),
        ("hgx-h100", 8, "NVIDIA H100 80GB HBM3"),
        ("hgx-h200", 8, "NVIDIA H200"),
        ("a30", 4, "NVIDIA A30"),
        ("t4", 1, "Tesla T4"),
        ("rtx-2080ti", 1, "NVIDIA GeForce RTX 2080 Ti"),
    ],
)
def test_named_presets(preset, count, name):
    models = parse_preset(preset)
    assert [model.name for model in models] == [name] * count
    assert PRESETS[preset].description


def test_custom_spec_is_case_insensitive_and_ordered():
    models = parse_preset(" a100-sxm4-40gb:2 , T4:1")
    assert [model.key for model in models] == ["A100-SXM4-40GB", "A100-SXM4-40GB", "T4"]


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "   ",
        "dgx",
        "A100-SXM4-40GB",
        "A100-SXM4-40GB:0",
        "T4:-1",
        "T4:1.5",
        "T4:two",
        "T4:1,",
        "V100:1",
        "T4:65",
    ],
)
def test_bad_specs_are_rejected_with_a_helpful_message(spec):
    with pytest.raises(PresetError) as caught:
        parse_preset(spec)
    message = str(caught.value)
    assert all(name in message for name in PRESETS)
    assert all(key in message for key in ("A100-SXM4-40GB", "A30", "H100-SXM5-80GB", "T4", "RTX-2080-TI"))


def test_bad_preset_fails_at_construction_without_touching_disk(tmp_path):
    with pytest.raises(PresetError):
        SimulatedNvml("T4:0", tmp_path / "state.json")
    assert not (tmp_path / "state.json").exists()


def test_pci_bus_ids_use_the_dgx_layout_for_eight_gpus(tmp_path):
    nvml = started("hgx-h100", tmp_path / "state.json")
    bus_ids = [nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(i)).busId for i in range(8)]
    assert bus_ids == DGX_A100_BUS_IDS


def test_pci_bus_ids_are_sequential_otherwise(tmp_path):
    nvml = started("A100-SXM4-40GB:2,T4:1", tmp_path / "state.json")
    infos = [nvml.nvmlDeviceGetPciInfo(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    assert [info.busId for info in infos] == ["00000000:01:00.0", "00000000:02:00.0", "00000000:03:00.0"]
    assert [info.busIdLegacy for info in infos] == ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]


def test_gpu_uuids_are_deterministic_per_preset(tmp_path):
    def uuids(preset, name):
        nvml = started(preset, tmp_path / name)
        return [
            nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
            for i in range(nvml.nvmlDeviceGetCount())
        ]

    first = uuids("dgx-a100", "one.json")
    assert first == uuids("DGX-A100", "two.json")
    assert len(set(first)) == 8
    assert all(GPU_UUID.fullmatch(uuid) for uuid in first)
    assert set(first).isdisjoint(uuids("A100-SXM4-40GB:8", "three.json"))
