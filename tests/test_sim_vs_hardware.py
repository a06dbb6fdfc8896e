"""The simulator against a real GPU: the same read-only probe, run on both, must give the same answers.

tests/fixtures/hardware/h100-sxm5-580.159.04 holds what a real H100 80GB HBM3 on driver 580.159.04
answered (captured with scripts/hw-capture; docs/hardware.md). Here scripts/hw-probe.py runs against a
simulated H100 on the same driver branch and every answer that is a property of the GPU model and the
driver (not of that one board, its VM or the moment) must match: values, error classes and codes.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

from gpud.nvml.sim import SimulatedNvml

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "hardware" / "h100-sxm5-580.159.04"

# Answers of that board, VM or moment, not of the model and driver: identity, live sensor readings,
# and NVLink (the VM exposes none of the SXM board's links, so every NVLink call answered NOT_SUPPORTED).
BOARD_SPECIFIC = ("uuid", "serial", "pci", "board_id", "vbios", "inforom_img", "temp", "power", "nvlink_",
                  "fabric_v", "multi_gpu_board", "persistence")


def _probe_module():
    spec = importlib.util.spec_from_file_location("hw_probe", ROOT / "scripts" / "hw-probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normal(answer: dict) -> dict:
    """The capture stored structs as their repr text; read them back into dicts."""
    value = answer.get("ok")
    if isinstance(value, str) and value.startswith("{"):
        return {"ok": ast.literal_eval(value)}
    if "nvml_error" in answer:
        return {"nvml_error": answer["nvml_error"], "class": answer["class"]}
    return answer


def _comparable(key: str) -> bool:
    field = key.split(".", 1)[-1]
    return key != "uid" and key != "pynvml_file" and not field.startswith(BOARD_SPECIFIC)


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    real = json.loads((CAPTURE / "probe-root.json").read_text())
    sim = SimulatedNvml("H100-SXM5-80GB:1", tmp_path_factory.mktemp("sim") / "state.json", driver="580.159.04")
    return real, _probe_module().probe(sim)


def test_the_probe_asks_the_simulator_everything_it_asked_the_real_gpu(answers):
    real, simulated = answers
    assert set(real) - {"pynvml_file"} <= set(simulated)


def test_every_model_and_driver_answer_matches_the_real_h100(answers):
    real, simulated = answers
    differences = {key: {"real": _normal(real[key]), "simulated": _normal(simulated[key])}
                   for key in real if _comparable(key) and _normal(real[key]) != _normal(simulated[key])}
    assert not differences, json.dumps(differences, indent=1)


def test_the_comparison_covers_the_mig_table_and_the_errors(answers):
    real, _ = answers
    compared = [key for key in real if _comparable(key)]
    # 18 profile constants twice (v1, v2), 7 placement lists, 7 capacities, the error cases: a check on
    # the comparison itself, so that a narrowed BOARD_SPECIFIC cannot quietly compare nothing.
    assert sum(".gip_v" in key for key in compared) == 36
    assert sum(".gipp[" in key for key in compared) == 7
    assert {"handle_out_of_range", "handle_bad_uuid", "shutdown_twice", "gpu0.mem_v2", "gpu0.mig_handle0"} <= \
        set(compared)
