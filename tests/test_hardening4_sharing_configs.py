"""Sharing configs read off the event loop, a directory of many names capped and not read again while
unchanged (issue 38, defect 3): one valid 198 KB file held every client for 3.3 s; 30,000 files in
sharing.configs_dir put /healthz p99 at 918 ms and cost a core's tenth idle."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from helpers import start_daemon, stop_daemon
from test_sharing_configs import TIME_SLICED, configs_config, mount_configmap, put

from gpud.client import ApiFailure, Client, DaemonUnreachable
from gpud.sharing import configs as configs_module
from gpud.sharing.configs import MAX_CONFIG_NAMES, SharingConfigs


def large_config(channels: int = 20_500) -> str:
    """A valid config of some 198 KB: GPUs time-sliced, and a long list of IMEX channels."""
    return TIME_SLICED.format(2) + "imex:\n  channelIDs:\n" + "".join(f"  - {index}\n" for index in range(channels))


def healthz_while_read(socket_path, reading: threading.Event, release: threading.Event) -> bool:
    """Whether gpud answers /healthz, as another client from a thread of its own, while a config read
    is under way; the read goes on once it has answered or given up. Were the read on gpud's event
    loop, the loop would wait in it, and this request with it, until the timeout."""
    try:
        assert reading.wait(10), "no config read began"
        Client(socket_path, timeout=3).get("/healthz")  # any answer is one: a degraded 503 as well
        return True
    except ApiFailure:
        return True
    except DaemonUnreachable:  # the deadline passed
        return False
    finally:
        release.set()


async def test_choosing_a_198_kb_config_does_not_hold_other_clients(short_tmp, monkeypatch):
    """The read and parse of a chosen config run off the event loop: other clients are answered while
    it is under way. How long a 198 KB read holds them is bench/sharing_configs.py's figure."""
    text = large_config()
    assert 190_000 < len(text) < 210_000
    mount_configmap(short_tmp / "configs", {"two": TIME_SLICED.format(2), "big": text})
    node = await start_daemon(configs_config(short_tmp, preset="dgx-a100"))
    reading, release = threading.Event(), threading.Event()

    def read_once_answered(*args, **kwargs):
        reading.set()
        release.wait(10)  # the prober's answer (or its timeout) lets the read go on
        return real_read(*args, **kwargs)
    real_read = configs_module.read_sharing_file
    monkeypatch.setattr(configs_module, "read_sharing_file", read_once_answered)
    try:
        prober = asyncio.ensure_future(asyncio.to_thread(healthz_while_read, node.daemon.config.api.socket,
                                                         reading, release))
        status, body = await put(node, "/v1/sharing/config", {"name": "big"})
        assert await prober, "/healthz went unanswered while the chosen config was read"
        assert status == 200 and body["config"]["name"] == "big", body
    finally:
        release.set()
        await stop_daemon(node)


def test_a_directory_of_30000_names_is_capped_and_said(tmp_path):
    directory = tmp_path / "configs"
    directory.mkdir()
    for index in range(30_000):
        (directory / f"c{index:05d}").write_text(TIME_SLICED.format(2))
    configs = SharingConfigs(str(tmp_path / "absent.yaml"), str(directory), "c00000", tmp_path / "choice.json")
    configs.load()
    configs.select(at_start=True)
    assert len(configs.available) == MAX_CONFIG_NAMES and configs.available[-1] == f"c{MAX_CONFIG_NAMES - 1:05d}"
    assert f"holds 30000 config names, over the {MAX_CONFIG_NAMES} gpud reads" in configs.problem
    assert configs.view()["available"] == configs.available


def test_an_unchanged_directory_is_not_listed_again(tmp_path, monkeypatch):
    directory = tmp_path / "configs"
    mount_configmap(directory, {f"c{index}": TIME_SLICED.format(2) for index in range(50)})
    old = time.time() - 10
    os.utime(directory, (old, old))  # not changed within its timestamp's tick
    configs = SharingConfigs(str(tmp_path / "absent.yaml"), str(directory), "c0", tmp_path / "choice.json")
    configs.load()
    configs.select(at_start=True)
    listings = []
    real_listdir = os.listdir
    monkeypatch.setattr(configs_module.os, "listdir", lambda path: listings.append(path) or real_listdir(path))
    for _ in range(20):
        assert not configs.changed()
    assert listings == []
    mount_configmap(directory, {"c0": TIME_SLICED.format(3), "new": TIME_SLICED.format(4)}, stamp="..2026_11_27")
    listings.clear()
    assert configs.changed() and len(listings) == 1  # a ConfigMap update changes the directory: listed again
    configs.select(at_start=False)
    assert configs.available == ["c0", "new"]
