"""The MIG tables gpud ships (for drivers that hide the table while MIG is off) against the driver.

gpud/mig/data/mig-profiles.yaml and the simulator's models.yaml are written from the same public
sources, separately: one is gpud's fallback knowledge, the other the model of what the driver
answers. Here gpud reads each simulated GPU's table with MIG on, as it would from a real driver,
and every row it would plan with must be the row it ships, so neither side drifts unnoticed.
"""

from __future__ import annotations

import pytest

from gpud.mig.capabilities import shipped_table
from gpud.nvml.reader import NodeReader
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.models import catalog
from gpud.nvml.sim.scenarios import enable_mig

MIG_MODELS = [key for key, model in catalog().models.items() if model.mig is not None]


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
