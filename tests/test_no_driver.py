"""The real NVML backend on a machine without an NVIDIA driver.

Debian 12's libnvidia-ml1 (non-free) loads here and answers nvmlInit with Driver Not Loaded, just
as on a GPU host whose kernel module is missing. .ci/run installs it; elsewhere the test is skipped.
"""

import pytest
from helpers import IN_CI, real_nvml_library_present


def test_gpud_serves_503_and_retries_while_the_driver_is_not_loaded(run_gpud, tmp_path):
    if not real_nvml_library_present():
        if IN_CI:
            pytest.fail("CI must have libnvidia-ml1 installed (.ci/run installs it)")
        pytest.skip("libnvidia-ml.so.1 is not installed (apt-get install libnvidia-ml1 from non-free)")
    config = tmp_path / "gpud.yaml"
    config.write_text("nvml:\n  init_retry_initial_s: 0.05\n  init_retry_max_s: 0.2\n")
    gpud = run_gpud("--config", str(config))

    def unavailable():
        status, body = gpud.client.request("GET", "/healthz", ok_statuses=(503,))
        return body if status == 503 and body["status"] == "unavailable" else None

    body = gpud.wait_for(unavailable, what="healthz 503 unavailable")
    assert "Driver Not Loaded" in body["reason"]
    assert "try gpud on a simulated node: gpud serve --simulate dgx-a100" in body["reason"]  # no GPU: what to try
    assert body["error"]["code"] == "nvml-unavailable"

    node = gpud.client.get("/v1/node")
    assert node["backend"] == "nvml" and node["driver_version"] is None and node["gpu_count"] is None
    status, gpus = gpud.client.request("GET", "/v1/gpus", ok_statuses=(503,))
    assert status == 503 and gpus["error"]["code"] == "nvml-unavailable"
    status, injected = gpud.client.request("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79}, ok_statuses=(404,))
    assert status == 404 and injected["error"]["code"] == "not-simulated"

    def retried():
        failures = [e for e in gpud.log_events() if e.get("event") == "nvml_init_failed"]
        return failures if len(failures) >= 2 else None

    failures = gpud.wait_for(retried, what="a second logged init attempt")
    assert "Driver Not Loaded" in failures[0]["error"] and failures[0]["level"] == "error"
    assert "gpud serve --simulate dgx-a100" in failures[0]["error"]
    assert failures[1]["attempt"] > failures[0]["attempt"]
    assert gpud.stop() == 0
