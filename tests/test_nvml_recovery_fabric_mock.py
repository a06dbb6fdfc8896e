"""gpud's real reading code (gpud.nvml.health.read_readings with the real pynvml) on NVIDIA's mock
libnvidia-ml, GB200 config: the fabric reading and the recovery-action field.

The reader runs in a subprocess with LD_LIBRARY_PATH and MOCK_NVML_CONFIG set, as the other mock tests
do: the library is loaded once per process and reads its config at init.

Where the mock and gpud's simulator differ:
* Field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): the mock answers NOT_SUPPORTED (its field-value
  engine, engine/field_values.go, has no case for it), though its GB200 config claims a 570-branch
  driver. The simulator is right for a real driver: R565 added the field (NVML change log, v560 -> v565)
  and our H100/H200 captures on 580 print "GPU Recovery Action : None". The mock simply does not model
  it; read_readings must give None there, which this test checks.
* Fabric Manager down: the mock's "auto" state gives IN_PROGRESS while its readiness marker is absent
  (engine/fabric_readiness.go), as the simulator does for a GPU FM never registered (NVSentinel#889).
  The mock reverts to IN_PROGRESS as soon as the marker goes; the simulator keeps a registered GPU
  COMPLETED (NVSentinel: the state "doesn't revert when the daemon exits"): the simulator follows the
  field report.
* The mock's health summary and mask encoding agree with the simulator's (both from nvml.h).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pynvml
import yaml

from gpud.nvml.health import fabric_health_bits
from gpud.nvml.sim._fabric_calls import HEALTHY_MASK
from helpers import MOCK_NVML_CONFIGS, REPO, mock_nvml_library

GB200 = MOCK_NVML_CONFIGS / "mock-nvml-config-gb200.yaml"

READER = """
import json, sys
import pynvml
from gpud.nvml.health import read_readings
pynvml.nvmlInit()
uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
out = {}
for uuid, reading in read_readings(pynvml, uuids).items():
    fabric = reading.fabric
    out[uuid] = {"recovery_action": reading.recovery_action,
                 "fabric": None if fabric is None else vars(fabric)}
print(json.dumps(out))
"""


def read_on_mock(config, tmp_path, env=None) -> dict:
    library = mock_nvml_library()
    done = subprocess.run([sys.executable, "-c", READER], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "LD_LIBRARY_PATH": str(library), "MOCK_NVML_CONFIG": str(config),
                               "HOME": str(tmp_path), **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gb200_fabric_completed_and_recovery_action(tmp_path):
    readings = read_on_mock(GB200, tmp_path)
    assert len(readings) == len(yaml.safe_load(GB200.read_text())["devices"])
    for reading in readings.values():
        fabric = reading["fabric"]
        assert fabric["state"] == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        assert fabric["status"] == pynvml.NVML_SUCCESS
        assert fabric["cluster_uuid"] == "00000000-0000-0000-0000-000000000001"
        assert fabric["health_mask"] == HEALTHY_MASK  # the simulator's healthy mask is the mock's
        bits = fabric_health_bits(fabric["health_mask"])
        assert bits["degraded_bw"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
        assert bits["route_unhealthy"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_FALSE
        # The mock does not model field 230 (see the module docstring): NOT_SUPPORTED -> None.
        assert reading["recovery_action"] is None


def test_gb200_degraded_bandwidth(tmp_path):
    config = yaml.safe_load(GB200.read_text())
    config["device_defaults"]["fabric"]["health"] = {"degraded_bandwidth": True}
    path = tmp_path / "gb200-degraded.yaml"
    path.write_text(yaml.safe_dump(config))
    for reading in read_on_mock(path, tmp_path).values():
        bits = fabric_health_bits(reading["fabric"]["health_mask"])
        assert bits["degraded_bw"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
        assert bits["route_recovery"] == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_FALSE


def test_gb200_fabric_manager_not_ready_is_in_progress(tmp_path):
    """The mock couples its "auto" fabric state to a fake Fabric Manager's readiness marker; with the
    marker directory set and no marker, registration has not finished."""
    readings = read_on_mock(GB200, tmp_path, env={"MOCK_FABRICMANAGER_STATE_DIR": str(tmp_path)})
    assert {r["fabric"]["state"] for r in readings.values()} == {pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS}
    (tmp_path / "fabricmanager.ready").write_text("")
    readings = read_on_mock(GB200, tmp_path, env={"MOCK_FABRICMANAGER_STATE_DIR": str(tmp_path)})
    assert {r["fabric"]["state"] for r in readings.values()} == {pynvml.NVML_GPU_FABRIC_STATE_COMPLETED}


def test_a100_has_no_fabric(tmp_path):
    readings = read_on_mock(MOCK_NVML_CONFIGS / "mock-nvml-config-a100.yaml", tmp_path)
    assert readings and all(reading["fabric"] is None for reading in readings.values())
