"""Access control on the socket: group read access, admin-only changes (SO_PEERCRED), as real users."""

from __future__ import annotations

import json

from helpers import ADMINS, curl_as, gpud_for_users


def test_readers_read_admins_change_others_cannot_connect(run_gpud, short_tmp, users):
    gpud = gpud_for_users(run_gpud, short_tmp)
    mode = gpud.socket.stat()
    assert oct(mode.st_mode & 0o777) == "0o660" and mode.st_uid == 0

    assert curl_as("gpudt-reader", gpud.socket, "GET", "/v1/gpus")[0] == 200
    status, text = curl_as("gpudt-reader", gpud.socket, "PUT", "/v1/mig", {"layout": "all-balanced"})
    assert status == 403
    error = json.loads(text)["error"]
    assert error["code"] == "forbidden" and ADMINS in error["message"] and "uid" in error["message"]
    for method, path, body in (("POST", "/v1/reload", None), ("POST", "/v1/health/0/clear", {}),
                               ("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79}),
                               ("PUT", "/v1/sharing/config", {"name": "six"}),
                               ("PUT", "/v1/allocations", {"resource": "nvidia.com/gpu-memory", "read_at": 1,
                                                           "pods": []}),
                               ("PUT", "/v1/kubernetes/agent", {"node": "gpu-7"})):
        assert curl_as("gpudt-reader", gpud.socket, method, path, body)[0] == 403, path

    status, _ = curl_as("gpudt-admin", gpud.socket, "PUT", "/v1/mig", {"layout": "all-balanced", "dry_run": True})
    assert status == 200
    assert curl_as("gpudt-admin", gpud.socket, "POST", "/v1/reload")[0] == 200
    assert curl_as("gpudt-admin", gpud.socket, "PUT", "/v1/kubernetes/agent", {"node": "gpu-7"})[0] == 200
    # past the admin check: this gpud has no sharing.configs_dir to choose from
    assert curl_as("gpudt-admin", gpud.socket, "PUT", "/v1/sharing/config", {"name": "six"})[0] == 409
    # past the admin check: this gpud has no gpu_memory to report allocations of
    assert curl_as("gpudt-admin", gpud.socket, "PUT", "/v1/allocations",
                   {"resource": "nvidia.com/gpu-memory", "read_at": 1, "pods": []})[0] == 409
    assert curl_as("gpudt-reader", gpud.socket, "GET", "/v1/allocations")[0] == 200
    assert curl_as("gpudt-reader", gpud.socket, "GET", "/v1/kubernetes")[0] == 200

    assert curl_as("gpudt-other", gpud.socket, "GET", "/v1/gpus")[0] == 0  # the socket refuses the connection
    assert gpud.client.request("POST", "/v1/reload")[0] == 200  # root may
    assert gpud.stop() == 0
