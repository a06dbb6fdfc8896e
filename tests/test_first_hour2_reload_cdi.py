"""A reload's answer means the CDI spec follows it: `gpud reload` then `gpud cdi` (the README's order, typed
in a second now that a command starts fast) showed the spec from before the new sharing config, which its
writer rewrites a moment later (issue 39)."""

from __future__ import annotations

from helpers import GpudProcess


def test_the_cdi_spec_names_the_new_replicas_when_the_reload_answers(short_tmp):
    sharing = short_tmp / "sharing.yaml"
    sharing.write_text("version: v1\n")
    config = short_tmp / "gpud.yaml"
    config.write_text(f"sharing:\n  file: {sharing}\n")
    gpud = GpudProcess(short_tmp, "--simulate", "A100-SXM4-40GB:2", "--sim-state", str(short_tmp / "sim.json"),
                       "--config", str(config))
    try:
        gpud.wait_healthy()
        gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["written_at"], what="the first CDI spec")
        gpus = [g["uuid"] for g in gpud.client.get("/v1/gpus")["gpus"]]
        sharing.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                           "      - name: nvidia.com/gpu\n        replicas: 3\n")
        gpud.client.request("POST", "/v1/reload", {})
        devices = set(gpud.client.get("/v1/cdi")["devices"])  # asked at once, as a command typed next
        assert {f"{uuid}::{n}" for uuid in gpus for n in range(3)} <= devices, sorted(devices)
    finally:
        gpud.stop()
