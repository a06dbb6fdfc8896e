"""Access control on the socket: group read access, admin-only changes (SO_PEERCRED), as real users."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import IN_CI

READERS, ADMINS = "gpudt-readers", "gpudt-admins"
USERS = {"gpudt-reader": [READERS], "gpudt-admin": [READERS, ADMINS], "gpudt-other": []}
SYSTEM_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root to create users and groups")
    for group in (READERS, ADMINS):
        subprocess.run([shutil.which("groupadd", path=SYSTEM_PATH), "-f", group], check=True)
    for user, groups in USERS.items():
        subprocess.run([shutil.which("useradd", path=SYSTEM_PATH), "-M", user], capture_output=True)
        subprocess.run([shutil.which("usermod", path=SYSTEM_PATH), "-G", ",".join(groups) or "", user], check=True)
    return USERS


def curl_as(user: str, socket_path, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    command = [shutil.which("runuser", path=SYSTEM_PATH), "-u", user, "--", "curl", "-s", "-o", "-", "-w",
               "\n%{http_code}", "--unix-socket", str(socket_path), "-X", method, f"http://localhost{path}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    text, _, code = result.stdout.rpartition("\n")
    return int(code or 0), text


def test_readers_read_admins_change_others_cannot_connect(run_gpud, short_tmp, users):
    short_tmp.chmod(0o755)  # let the test users reach the socket; the socket's own mode decides
    config = short_tmp / "gpud.yaml"
    config.write_text(f"api:\n  group: {READERS}\n  admin_group: {ADMINS}\n"
                      f"mig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(config))
    gpud.wait_healthy()
    mode = gpud.socket.stat()
    assert oct(mode.st_mode & 0o777) == "0o660" and mode.st_uid == 0

    assert curl_as("gpudt-reader", gpud.socket, "GET", "/v1/gpus")[0] == 200
    status, text = curl_as("gpudt-reader", gpud.socket, "PUT", "/v1/mig", {"layout": "all-balanced"})
    assert status == 403
    error = json.loads(text)["error"]
    assert error["code"] == "forbidden" and ADMINS in error["message"] and "uid" in error["message"]
    for method, path, body in (("POST", "/v1/reload", None), ("POST", "/v1/health/0/clear", {}),
                               ("POST", "/v1/sim/xid", {"gpu": 0, "xid": 79})):
        assert curl_as("gpudt-reader", gpud.socket, method, path, body)[0] == 403, path

    status, _ = curl_as("gpudt-admin", gpud.socket, "PUT", "/v1/mig", {"layout": "all-balanced", "dry_run": True})
    assert status == 200
    assert curl_as("gpudt-admin", gpud.socket, "POST", "/v1/reload")[0] == 200

    assert curl_as("gpudt-other", gpud.socket, "GET", "/v1/gpus")[0] == 0  # the socket refuses the connection
    assert gpud.client.request("POST", "/v1/reload")[0] == 200  # root may
    assert gpud.stop() == 0
