"""The simulator against real GPUs: the same read-only probe, run on both, must give the same answers.

tests/fixtures/hardware/<board>/probe-root.json holds what a real GPU answered (captured with
scripts/hw-capture; docs/hardware.md): an H100 80GB HBM3 and an H200, both on driver 580.159.04. Here
scripts/hw-probe.py runs against the simulated model of each board on the driver the board ran, and every
answer that is a property of the GPU model and the driver (not of that one board, its VM or the moment)
must match: values, error classes and codes.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.nvml.sim import SimulatedNvml

ROOT = Path(__file__).resolve().parent.parent
HARDWARE = ROOT / "tests" / "fixtures" / "hardware"


@dataclass(frozen=True)
class Board:
    capture: str  # folder under tests/fixtures/hardware
    model: str  # the simulator's model of that board (gpud/nvml/sim/models.yaml)
    # A check on the comparison itself, so that a narrowed BOARD_SPECIFIC cannot quietly compare
    # nothing: the GI profile answers (each profile constant the driver knows, v1 and v2) and the
    # placement lists (one per profile) the capture holds.
    profile_info_keys: int
    placement_keys: int


BOARDS = [
    # 18 profile constants twice (v1, v2) and 7 placement lists on both R580 Hopper boards.
    Board("h100-sxm5-580.159.04", "H100-SXM5-80GB", profile_info_keys=36, placement_keys=7),
    Board("h200-580.159.04", "H200-SXM5-141GB", profile_info_keys=36, placement_keys=7),
]

# Answers of that board, VM or moment, not of the model and driver: identity, live sensor readings,
# and NVLink (neither VM exposes the SXM board's links, so every NVLink call answered NOT_SUPPORTED).
BOARD_SPECIFIC = ("uuid", "serial", "pci", "board_id", "vbios", "inforom_img", "temp", "power", "nvlink_",
                  "fabric_v", "multi_gpu_board", "persistence")


def _probe_module():
    spec = importlib.util.spec_from_file_location("hw_probe", ROOT / "scripts" / "hw-probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normal(answer: dict) -> dict:
    """The H100 capture stored structs as their repr text; read them back into dicts."""
    value = answer.get("ok")
    if isinstance(value, str) and value.startswith("{"):
        return {"ok": ast.literal_eval(value)}
    if "nvml_error" in answer:
        return {"nvml_error": answer["nvml_error"], "class": answer["class"]}
    return answer


def _comparable(key: str) -> bool:
    field = key.split(".", 1)[-1]
    return key != "uid" and key != "pynvml_file" and not field.startswith(BOARD_SPECIFIC)


@pytest.fixture(scope="module", params=BOARDS, ids=lambda board: board.capture)
def board(request):
    return request.param


@pytest.fixture(scope="module")
def answers(board, tmp_path_factory):
    real = json.loads((HARDWARE / board.capture / "probe-root.json").read_text())
    # The simulated board runs the driver the real one ran.
    sim = SimulatedNvml(f"{board.model}:1", tmp_path_factory.mktemp("sim") / "state.json",
                        driver=real["driver"]["ok"])
    return real, _probe_module().probe(sim)


def test_every_captured_board_is_compared():
    assert {board.capture for board in BOARDS} == {path.parent.name for path in HARDWARE.glob("*/probe-root.json")}


def test_the_probe_asks_the_simulator_everything_it_asked_the_real_gpu(answers):
    real, simulated = answers
    assert set(real) - {"pynvml_file"} <= set(simulated)


def test_every_model_and_driver_answer_matches_the_real_gpu(answers):
    real, simulated = answers
    differences = {key: {"real": _normal(real[key]), "simulated": _normal(simulated[key])}
                   for key in real if _comparable(key) and _normal(real[key]) != _normal(simulated[key])}
    assert not differences, json.dumps(differences, indent=1)


def test_the_comparison_covers_the_mig_table_and_the_errors(board, answers):
    real, _ = answers
    compared = [key for key in real if _comparable(key)]
    assert sum(".gip_v" in key for key in compared) == board.profile_info_keys
    assert sum(".gipp[" in key for key in compared) == board.placement_keys
    assert {"handle_out_of_range", "handle_bad_uuid", "shutdown_twice", "gpu0.mem_v2", "gpu0.mig_handle0"} <= \
        set(compared)
