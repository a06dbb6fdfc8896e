"""Named sharing configs (sharing.configs_dir, laid out as the kubelet mounts a ConfigMap), the one in
force chosen live with PUT /v1/sharing/config, and the Kubernetes agent's settings and status
(GET /v1/kubernetes, PUT /v1/kubernetes/agent)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import (Running, answer_until, cli, mig_config, start_daemon, stop_daemon, until_async)
from openapi_check import assert_matches_openapi

TIME_SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {}\n"
FIRST_STAMP = "..2026_11_26_00_00_00.123"


def mount_configmap(directory: Path, files: dict[str, str], stamp: str = FIRST_STAMP) -> None:
    """Writes `files` as the kubelet's atomic writer does: a new ..<timestamp> directory, ..data swapped
    to it by a rename, NAME -> ..data/NAME links; the old timestamped directory and links of keys gone
    are removed."""
    directory.mkdir(exist_ok=True)
    (directory / stamp).mkdir()
    for name, text in files.items():
        (directory / stamp / name).write_text(text)
    old = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.symlink(stamp, directory / "..data_tmp")
    os.rename(directory / "..data_tmp", directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            os.symlink(f"..data/{name}", directory / name)
    for entry in os.listdir(directory):
        if not entry.startswith("..") and entry not in files:
            (directory / entry).unlink()
    if old:
        shutil.rmtree(directory / old)


def configs_config(tmp: Path, default: str | None = "two", preset: str = "t4"):
    settings = {"sharing.configs_dir": str(tmp / "configs"), "sharing.file": str(tmp / "absent.yaml")}
    if default:
        settings["sharing.default_config"] = default
    return mig_config(tmp, preset).with_overrides(**settings)


async def put(node: Running, path: str, body) -> tuple[int, dict]:
    async with node.http.put(f"http://localhost{path}", json=body) as response:
        return response.status, await response.json()


def gpu_count(view: dict) -> int | None:
    return next((r["count"] for r in view["resources"] if r["name"] == "nvidia.com/gpu"), None)


async def test_a_chosen_config_is_in_force_says_why_and_is_advertised(short_tmp):
    mount_configmap(short_tmp / "configs", {"two": TIME_SLICED.format(2), "six": TIME_SLICED.format(6)})
    node = await start_daemon(configs_config(short_tmp))
    try:
        _, view = await answer_until(node, "/v1/sharing", lambda _, body: body["resources"])
        assert_matches_openapi("GET", "/v1/sharing", 200, view)
        assert view["config"] == {"name": "two", "chosen": None, "default": "two",
                                  "why": "the default, sharing.default_config",
                                  "file": str(short_tmp / "configs" / "two"), "configs_dir": str(short_tmp / "configs"),
                                  "available": ["six", "two"], "problem": None}
        assert gpu_count(view) == 2 and view["source"] == str(short_tmp / "configs" / "two")
        before = node.daemon.bus.sequence

        status, answer = await put(node, "/v1/sharing/config", {"name": "six", "reason": "inference pool"})
        assert status == 200, answer
        assert_matches_openapi("PUT", "/v1/sharing/config", 200, answer)
        assert answer["config"]["name"] == "six"
        assert answer["config"]["why"] == "chosen through PUT /v1/sharing/config: inference pool"
        assert answer["config"]["chosen"]["name"] == "six" and answer["config"]["chosen"]["reason"] == "inference pool"
        _, view = await node.get("/v1/sharing")
        (resource,) = view["resources"]
        assert resource["count"] == 6 and {d["replicas"] for d in resource["devices"]} == {6}
        assert view["config"]["name"] == "six" and view["labels"]["nvidia.com/gpu.replicas"] == "6"
        events, _ = node.daemon.bus.backlog_after(before)
        sharing = [json.loads(event.line)["data"] for event in events if event.type == "sharing"]
        assert sharing and sharing[-1]["config"] == "six" and sharing[-1]["resources"] == {"nvidia.com/gpu": 6}
        _, nfd = await answer_until(node, "/v1/nfd", lambda _, body: body["labels"].get("nvidia.com/gpu.replicas") == "6")
        assert nfd["labels"]["nvidia.com/gpu.product"].endswith("-SHARED")
        saved = json.loads((short_tmp / "state" / "sharing-choice.json").read_text())
        assert saved["name"] == "six" and saved["reason"] == "inference pool" and saved["chosen_at"] > 0

        status, answer = await put(node, "/v1/sharing/config", {"name": None})
        assert status == 200 and answer["config"]["name"] == "two" and answer["config"]["chosen"] is None
        assert answer["config"]["why"] == "the default, sharing.default_config"
        assert gpu_count((await node.get("/v1/sharing"))[1]) == 2
    finally:
        await stop_daemon(node)


async def test_without_a_default_the_sharing_file_is_in_force(short_tmp):
    mount_configmap(short_tmp / "configs", {"six": TIME_SLICED.format(6)})
    (short_tmp / "absent.yaml").write_text(TIME_SLICED.format(3))
    node = await start_daemon(configs_config(short_tmp, default=None))
    try:
        _, view = await answer_until(node, "/v1/sharing", lambda _, body: body["resources"])
        assert gpu_count(view) == 3 and view["config"]["name"] is None
        assert view["config"]["why"] == "no chosen config nor sharing.default_config in configs_dir: sharing.file"
        assert view["config"]["file"] == str(short_tmp / "absent.yaml") and view["config"]["available"] == ["six"]
    finally:
        await stop_daemon(node)


HOSTILE_NAMES = ["../x", "..data", FIRST_STAMP, "..", ".", "a/b", "x" * 300, "", "six\n", "caf\u00e9"]


async def test_refused_choices_change_nothing(short_tmp):
    configs = short_tmp / "configs"
    outside = short_tmp / "outside.yaml"
    outside.write_text(TIME_SLICED.format(8))  # valid: only where it lies refuses it
    mount_configmap(configs, {"two": TIME_SLICED.format(2), "six": TIME_SLICED.format(6),
                              "broken": "version: v1\nsharing: [oops\n"})
    os.symlink(outside, configs / "escape")
    os.symlink("..data/../../outside.yaml", configs / "climb")
    (configs / "folder").mkdir()
    node = await start_daemon(configs_config(short_tmp))
    try:
        _, before = await answer_until(node, "/v1/sharing", lambda _, body: body["resources"])
        assert before["config"]["available"] == ["broken", "six", "two"]

        status, answer = await put(node, "/v1/sharing/config", {"name": "absent"})
        assert status == 404 and answer["error"]["code"] == "sharing-config-not-found"
        assert answer["error"]["available"] == ["broken", "six", "two"]
        for name in HOSTILE_NAMES:
            status, answer = await put(node, "/v1/sharing/config", {"name": name})
            assert status == 422 and answer["error"]["code"] == "sharing-config-name-invalid", (name, answer)
        for body in ({"name": 6}, {"name": ["six"]}, {"nam": "six"}, {"name": "six", "reason": 1}):
            status, answer = await put(node, "/v1/sharing/config", body)
            assert status == 400, (body, answer)
            assert_matches_openapi("PUT", "/v1/sharing/config", 400, answer)
        status, answer = await put(node, "/v1/sharing/config", {"name": "six", "reason": "r" * 1025})
        assert status == 422 and answer["error"]["code"] == "sharing-config-reason-too-long"
        status, answer = await put(node, "/v1/sharing/config", {"name": "broken"})
        assert status == 422 and answer["error"]["code"] == "sharing-config-invalid"
        assert "broken: line 3" in answer["error"]["message"] and "invalid YAML" in answer["error"]["message"]
        for name in ("escape", "climb"):
            status, answer = await put(node, "/v1/sharing/config", {"name": name})
            assert status == 422 and answer["error"]["code"] == "sharing-config-invalid", answer
            assert f"outside {configs}" in answer["error"]["message"]
        status, answer = await put(node, "/v1/sharing/config", {"name": "folder"})
        assert status == 422 and "not a regular file" in answer["error"]["message"]

        _, after = await node.get("/v1/sharing")
        assert after == before
        assert not (short_tmp / "state" / "sharing-choice.json").exists()
    finally:
        await stop_daemon(node)


async def test_without_configs_dir_a_choice_is_refused(short_tmp):
    (short_tmp / "sharing.yaml").write_text(TIME_SLICED.format(3))
    config = mig_config(short_tmp, "t4").with_overrides(**{"sharing.file": str(short_tmp / "sharing.yaml")})
    node = await start_daemon(config)
    try:
        _, view = await answer_until(node, "/v1/sharing", lambda _, body: body["resources"])
        assert view["config"]["why"] == "no configs_dir: sharing.file" and view["config"]["available"] == []
        status, answer = await put(node, "/v1/sharing/config", {"name": "six"})
        assert status == 409 and answer["error"]["code"] == "sharing-configs-dir-unset"
        assert gpu_count((await node.get("/v1/sharing"))[1]) == 3
    finally:
        await stop_daemon(node)


async def test_a_configmap_update_is_applied_without_a_reload_and_an_invalid_one_is_reported(short_tmp):
    configs = short_tmp / "configs"
    mount_configmap(configs, {"two": TIME_SLICED.format(2), "pool": TIME_SLICED.format(3)})
    node = await start_daemon(configs_config(short_tmp))
    try:
        assert (await put(node, "/v1/sharing/config", {"name": "pool"}))[0] == 200
        mount_configmap(configs, {"two": TIME_SLICED.format(2), "pool": TIME_SLICED.format(5)},
                        stamp="..2026_11_26_00_05_00.456")
        await until_async(lambda: _count_is(node, 5), timeout=15, what="the updated ConfigMap in force")

        mount_configmap(configs, {"two": TIME_SLICED.format(2), "pool": "version: v1\nsharing: [oops\n"},
                        stamp="..2026_11_26_00_10_00.789")
        _, view = await answer_until(node, "/v1/sharing", lambda _, body: body["config"]["problem"], timeout=15)
        assert "invalid YAML" in view["config"]["problem"] and "stays in force" in view["config"]["problem"]
        assert gpu_count(view) == 5 and view["config"]["name"] == "pool"  # the last good config

        mount_configmap(configs, {"two": TIME_SLICED.format(2)}, stamp="..2026_11_26_00_15_00.000")
        _, view = await answer_until(node, "/v1/sharing", lambda _, body: body["config"]["name"] == "two", timeout=15)
        assert gpu_count(view) == 2 and "the chosen config 'pool' is not in" in view["config"]["problem"]
        assert view["config"]["chosen"]["name"] == "pool"  # kept: it is in force again once the key is back
    finally:
        await stop_daemon(node)


async def _count_is(node: Running, count: int) -> bool:
    return gpu_count((await node.get("/v1/sharing"))[1]) == count


def serve_simulated_t4(run_gpud, tmp: Path, config: Path):
    gpud = run_gpud("--simulate", "t4", "--sim-state", str(tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    return gpud


def test_a_choice_survives_a_restart_and_kubernetes_settings_follow_a_reload(run_gpud, short_tmp):
    mount_configmap(short_tmp / "configs", {"two": TIME_SLICED.format(2), "six": TIME_SLICED.format(6)})
    config = short_tmp / "gpud.yaml"
    config.write_text(yaml.safe_dump({"sharing": {"configs_dir": str(short_tmp / "configs"), "default_config": "two",
                                                  "file": str(short_tmp / "none.yaml")},
                                      "mig": {"layouts_file": str(short_tmp / "none.yaml")}}))
    gpud = serve_simulated_t4(run_gpud, short_tmp, config)
    used = cli("sharing", "use", "six", "--reason", "burst", socket=gpud.socket)
    assert used.returncode == 0, used.stderr
    assert "six" in used.stdout and "burst" in used.stdout
    shown = cli("sharing", socket=gpud.socket)
    assert "config: six (chosen through PUT /v1/sharing/config: burst)" in shown.stdout, shown.stdout
    assert cli("sharing", "use", "absent", socket=gpud.socket).returncode != 0
    assert gpud.stop() == 0

    gpud = serve_simulated_t4(run_gpud, short_tmp, config)
    view = gpud.wait_for(lambda: gpud.client.get("/v1/sharing")["resources"] and gpud.client.get("/v1/sharing"),
                         what="the sharing document")
    assert view["config"]["name"] == "six" and view["resources"][0]["count"] == 6
    assert any(e.get("event") == "sharing_config_in_force" and e.get("name") == "six" for e in gpud.log_events())
    back = cli("sharing", "use", "--default", socket=gpud.socket)
    assert back.returncode == 0 and gpud.client.get("/v1/sharing")["config"]["name"] == "two"

    assert gpud.client.get("/v1/kubernetes")["settings"] == {"taint_unhealthy": False, "mig_busy_timeout_s": 3600.0}
    config.write_text(config.read_text() + "kubernetes:\n  taint_unhealthy: true\n  mig_busy_timeout_s: 600\n")
    assert gpud.client.request("POST", "/v1/reload")[0] == 200
    settings = {"taint_unhealthy": True, "mig_busy_timeout_s": 600.0}
    assert gpud.client.get("/v1/kubernetes")["settings"] == settings
    # the stream replays this run's events, after a `gap` line: sequence numbers go on across restarts
    event = next(e for e in gpud.client.stream("/v1/watch?since=0&types=kubernetes") if e["type"] != "gap")
    assert event["type"] == "kubernetes" and event["data"] == settings
    assert gpud.stop() == 0


async def test_the_agent_reports_its_status(short_tmp):
    node = await start_daemon(mig_config(short_tmp, "t4"))
    try:
        status, view = await node.get("/v1/kubernetes")
        assert status == 200 and view == {"settings": {"taint_unhealthy": False, "mig_busy_timeout_s": 3600.0},
                                          "agent": None, "agent_reported_at": None}
        report = {"node": "gpu-7", "mig": {"label": "all-1g.5gb", "state": "success"}, "errors": []}
        status, answer = await put(node, "/v1/kubernetes/agent", report)
        assert status == 200 and answer["agent"] == report
        status, view = await node.get("/v1/kubernetes")
        assert_matches_openapi("GET", "/v1/kubernetes", 200, view)
        assert view["agent"] == report and view["agent_reported_at"] > 0
        for body in (["not", "an", "object"], "text", None):
            status, answer = await put(node, "/v1/kubernetes/agent", body)
            assert status == 400 and answer["error"]["code"] == "invalid-body", answer
        for raw in (b'{"load": NaN}', b'{"load": -Infinity}', b'{"load": 1e999}', b'{"load": '):
            async with node.http.put("http://localhost/v1/kubernetes/agent", data=raw) as response:
                answer = await response.json()  # served back, it would not be JSON
                assert response.status == 400 and answer["error"]["code"] == "invalid-json", (raw, answer)
        status, answer = await put(node, "/v1/kubernetes/agent", {"padding": "x" * (64 << 10)})
        assert status == 413 and answer["error"]["code"] == "body-too-large"
        assert (await node.get("/v1/kubernetes"))[1]["agent"] == report  # refusals keep the last report
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("text, why", [
    ("sharing:\n  default_config: ../two\n", "ConfigMap key"),
    ("sharing:\n  default_config: ..data\n", "ConfigMap's own entries"),
    ("kubernetes:\n  mig_busy_timeout_s: 604801\n", "between 0 and 604800"),
    ("kubernetes:\n  taint_unhealthy: sometimes\n", "true or false"),
])
def test_bad_settings_are_refused(text, why):
    from gpud.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=why):
        parse_config(text)
