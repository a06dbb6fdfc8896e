"""The MIG tables gpud ships (for drivers that hide the table while MIG is off) against the driver.

gpud/nvml/data/mig-profiles.yaml and the simulator's models.yaml are written from the same public
sources, separately: one is gpud's fallback knowledge, the other the model of what the driver
answers. Here gpud reads each simulated GPU's table with MIG on, as it would from a real driver,
and every row it would plan with must be the row it ships, so neither side drifts unnoticed.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gpud.nvml.mig_tables import shipped_table
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.models import catalog
from gpud.nvml.sim.scenarios import enable_mig

MIG_MODELS = [key for key, model in catalog().models.items() if model.mig is not None]
# What real GPUs answered (scripts/hw-capture; docs/hardware.md).
HARDWARE_PROBES = sorted((Path(__file__).resolve().parent / "fixtures" / "hardware").glob("*/probe-root.json"))


def _row(profile, counts: bool) -> tuple:
    return (profile.id, profile.constant, profile.slices, profile.memory_mib,
            profile.instance_count if counts else None, profile.placements)


@pytest.mark.parametrize("model", MIG_MODELS)
def test_the_shipped_table_is_what_the_driver_answers(tmp_path, model):
    sim = SimulatedNvml(f"{model}:1", tmp_path / "sim.json", driver="580.65.06")
    sim.nvmlInit()
    enable_mig(sim, 0)
    gpu = NodeReader().read(sim, {}).gpus[0]
    assert gpu.mig.profiles_source == "nvml"
    shipped = shipped_table(gpu.pci_device_id)
    assert shipped is not None, f"{model} ({gpu.pci_device_id}) has no shipped MIG table"
    # Where NVML misreports instance counts (A30) gpud already corrected them with the shipped ones.
    read = {p.name: _row(p, True) for p in gpu.mig.capabilities.gi_profiles}
    ships = {p.name: _row(p, True) for p in shipped.capabilities.gi_profiles}
    assert read == ships
    assert gpu.mig.capabilities.memory_slices == shipped.capabilities.memory_slices


def test_every_simulated_mig_model_is_covered():
    assert {"A100-SXM4-40GB", "A30", "H100-SXM5-80GB", "H200-SXM5-141GB", "B200"} <= set(MIG_MODELS)


def _answer(answer: dict):
    """A probe answer's value; the H100 capture stored structs as their repr text."""
    value = answer["ok"]
    return ast.literal_eval(value) if isinstance(value, str) and value.startswith(("{", "[")) else value


@pytest.mark.parametrize("probe", HARDWARE_PROBES, ids=lambda path: path.parent.name)
def test_the_shipped_table_is_what_a_real_gpu_answered(probe):
    real = json.loads(probe.read_text())
    shipped = shipped_table(hex(_answer(real["gpu0.pci"])["pciDeviceId"]))
    assert shipped is not None
    # Every profile constant the real driver answered, with its placements (-lgipp) from the same capture.
    answered = {}
    for key, answer in real.items():
        if key.startswith("gpu0.gip_v2[") and "ok" in answer:
            info = _answer(answer)
            placements = tuple((start, size) for start, size in _answer(real[f"gpu0.gipp[{info['id']}]"]))
            answered[info["name"].removeprefix("MIG ")] = (
                info["id"], int(key[len("gpu0.gip_v2["):-1]), info["sliceCount"], info["memorySizeMB"],
                info["instanceCount"], placements)
    ships = {p.name: (p.id, p.constant, p.slices, p.memory_mib, p.instance_count,
                      tuple((placement.start, placement.size) for placement in p.placements))
             for p in shipped.capabilities.gi_profiles}
    assert answered and answered == ships
