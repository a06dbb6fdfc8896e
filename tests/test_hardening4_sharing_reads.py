"""Issue 38, defect 3, what reading a sharing config costs beyond the thread it now runs on: the check of
a `devices` list was quadratic (20,000 indices: 7 s), every warning of a file was logged at each read
and served in every document (thousands for a file of unknown keys), a repeated selector was matched
against every device on each recomputation on the event loop, and PUT /v1/sharing/config read the
chosen file twice. The directory's listing is trusted only once its last change is older than the
listing, and a name past MAX_CONFIG_NAMES cannot be chosen."""

from __future__ import annotations

import os
import time

import pytest
import structlog
from helpers import start_daemon, stop_daemon
from test_sharing_configs import TIME_SLICED, configs_config, mount_configmap, put

import gpud.sharing.configs as configs_module
from gpud.base.errors import ErrorKind, GpudError
from gpud.model.inventory import Inventory, unknown_gpu
from gpud.sharing import config as config_module
from gpud.sharing.config import MAX_WARNINGS, ReplicatedResources, SharedResource, SharingConfig, check_sharing
from gpud.sharing.configs import MAX_CONFIG_NAMES, SharingConfigs
from gpud.sharing.resources import compute_sharing

AN_HOUR_AGO = time.time() - 3600


def test_a_long_devices_list_is_checked_in_linear_time(monkeypatch):
    # Each selector was counted in the whole list to find repeats: 20,000 distinct indices took 7 s.
    selectors = [str(n) for n in range(20_000)] + ["7"]
    document = {"version": "v1", "sharing": {"timeSlicing": {"resources": [
        {"name": "nvidia.com/gpu", "replicas": 2, "devices": selectors}]}}}
    monkeypatch.setattr(config_module, "load_yaml", lambda text, fail: document)  # the checks alone are timed
    started = time.perf_counter()
    config, warnings = check_sharing("(stubbed)")
    assert time.perf_counter() - started < 1.0
    assert warnings == ["sharing.timeSlicing.resources[0].devices: device 7 is repeated"]
    assert len(config.time_slicing.resources[0].devices) == 20_001


def test_thousands_of_warnings_are_kept_and_logged_to_a_bound(tmp_path):
    keys = 3 * MAX_WARNINGS
    text = TIME_SLICED.format(2) + "".join(f"      note{n}: x\n" for n in range(keys))
    config, warnings = check_sharing(text, "many.yaml")
    assert len(warnings) == MAX_WARNINGS + 1 and config.warnings == tuple(warnings)
    assert warnings[0].startswith("sharing.timeSlicing.resources[0].note0: unknown key")
    assert warnings[-1] == f"{keys - MAX_WARNINGS} more warnings not listed (at most {MAX_WARNINGS} are)"
    (tmp_path / "many.yaml").write_text(text)
    with structlog.testing.capture_logs() as logged:
        configs = SharingConfigs(str(tmp_path / "many.yaml"), None, None, tmp_path / "choice.json")
        configs.select(at_start=True)
    assert sum(entry["event"] == "sharing_file_warning" for entry in logged) == MAX_WARNINGS + 1


def test_a_repeated_selector_is_matched_once_when_the_document_is_recomputed():
    # compute_sharing runs on the event loop at each inventory and health change: 100,000 selectors (what
    # a file within the YAML reader's limits can hold) were each matched against every device.
    gpus = tuple(unknown_gpu(n, uuid=f"GPU-{n:08d}-0000-0000-0000-000000000000") for n in range(8))
    inventory = Inventory("550.90.07", "12.4", "12.550.90.07", gpus=gpus)
    selectors = tuple(str(n % 8) for n in range(100_000))
    config = SharingConfig(time_slicing=ReplicatedResources(False, False, (
        SharedResource("nvidia.com/gpu", None, selectors, 4),)))
    started = time.perf_counter()
    document = compute_sharing(config, inventory)
    assert time.perf_counter() - started < 0.1
    assert document["error"] is None and document["resources"][0]["count"] == 32


async def test_a_put_reads_the_chosen_file_once(short_tmp, monkeypatch):
    mount_configmap(short_tmp / "configs", {"two": TIME_SLICED.format(2), "six": TIME_SLICED.format(6)})
    node = await start_daemon(configs_config(short_tmp))
    reads = []
    real = configs_module.read_sharing_file

    def read(path, *args, **kwargs):
        reads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(configs_module, "read_sharing_file", read)
    try:
        status, answer = await put(node, "/v1/sharing/config", {"name": "six"})
        assert status == 200 and answer["config"]["name"] == "six", answer
        assert reads == [short_tmp / "configs" / "six"]
        _, view = await node.get("/v1/sharing")
        assert view["resources"][0]["count"] == 6
    finally:
        await stop_daemon(node)


def test_a_listing_made_within_the_racy_window_is_not_trusted_later(short_tmp):
    # A directory changed twice within one tick of its timestamp keeps the time of the first change: a
    # listing made between the two must not be trusted once the clock moves on (racy git's rule).
    directory = short_tmp / "configs"
    mount_configmap(directory, {"one": TIME_SLICED.format(2)})
    configs = SharingConfigs(str(short_tmp / "absent.yaml"), str(directory), "one", short_tmp / "choice.json")
    configs.select(at_start=True)  # listed at once after the mount: within the window
    stamp = os.stat(directory).st_mtime_ns
    os.symlink("..data/one", directory / "two")  # a second change ...
    os.utime(directory, ns=(stamp, stamp))  # ... within the same tick: the directory's time is as it was
    time.sleep(configs_module.RACY_S + 0.1)  # fixed time: the clock moves past the window
    assert configs.changed()
    configs.select(at_start=False)
    assert configs.available == ["one", "two"]


def test_a_name_past_the_cap_cannot_be_chosen(short_tmp):
    directory = short_tmp / "configs"
    directory.mkdir()
    names = [f"n{n:04}" for n in range(MAX_CONFIG_NAMES + 2)]
    for name in names:
        (directory / name).write_text(TIME_SLICED.format(2))
    os.utime(directory, (AN_HOUR_AGO, AN_HOUR_AGO))
    configs = SharingConfigs(str(short_tmp / "absent.yaml"), str(directory), None, short_tmp / "choice.json")
    configs.select(at_start=True)
    with pytest.raises(GpudError) as refused:
        configs.choose(names[-1], None)
    assert refused.value.kind is ErrorKind.REFUSED and refused.value.code == "sharing-config-past-limit"
    assert str(directory) in refused.value.message and str(MAX_CONFIG_NAMES) in refused.value.message
    assert configs.choice is None and not (short_tmp / "choice.json").exists()
    assert configs.choose(names[0], None).name == names[0]
