"""Slurm's gres.conf from gpud: the records of whole GPUs, MIG devices, shards and MPS on simulated nodes,
Slurm's core indexes from a sysfs tree, the file kept written (rename, 0644, rewritten on a MIG change and
after an edit behind gpud's back, refused in a directory another user controls), `scontrol reconfigure`
after a write, the CLI; and every gres.conf made here parsed by Slurm's own slurmd -G."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from helpers import (cli, mig_config, mig_settled, put_layout, sharing_config, start_daemon, stop_daemon,
                     until_async)
from openapi_check import assert_matches_openapi

from gpud.cdi.spec import parse_mig_minors
from gpud.kept_writer import RECHECK_S
from gpud.model.inventory import Inventory, MigInfo, format_cpulist
from gpud.slurm.cores import CoreIndex, read_core_indexes
from gpud.slurm.gres import HEADER, build_gres

OTHER = "gpudt-other"
SLURMD = shutil.which("slurmd", path="/usr/sbin:/usr/bin:" + os.environ.get("PATH", ""))
A100 = "nvidia_a100-sxm4-40gb"
TIME_SLICING = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def no_cores(cpus):
    return None


def gpu_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


# -- Slurm's own parser ---------------------------------------------------------------------------


def assert_slurm_accepts(gres, tmp: Path) -> None:
    """slurmd -G (Slurm 22.05) parses the file standalone, as slurmd does at start, against a slurm.conf whose
    node line is gpud's Gres=. Two things are adapted to this machine, not Slurm's rules: the device files
    become character devices under tmp (slurmd stats each, and this machine has no /dev/nvidia*), and Cores=
    are dropped (slurmd maps them onto this machine's own cores, which the simulated host's outnumber)."""
    if SLURMD is None:
        pytest.skip("no slurmd here (Debian's slurmd package)")
    root = tmp / "slurmd"
    root.mkdir(exist_ok=True)
    text = re.sub(r" Cores=\S+", "", gres.text)
    for path in sorted(set(re.findall(r"/dev/[\w/-]+", text))):
        device = root / path.lstrip("/")
        device.parent.mkdir(parents=True, exist_ok=True)
        if not device.exists():
            device.symlink_to("/dev/null")  # a character device by stat(), as slurmd checks
    (root / "gres.conf").write_text(text.replace("/dev/", f"{root}/dev/"))
    gres_types = ",".join(dict.fromkeys(part.split(":")[0] for part in gres.node_gres.split(",") if part)) or "gpu"
    (root / "slurm.conf").write_text(
        f"ClusterName=gpudtest\nSlurmctldHost=localhost\nGresTypes={gres_types}\nSelectType=select/cons_tres\n"
        f"NodeName=gpudnode CPUs=1 Gres={gres.node_gres} State=UNKNOWN\nPartitionName=p Nodes=gpudnode\n"
        f"SlurmdSpoolDir={root}/spool\nStateSaveLocation={root}/state\nSlurmdPidFile={root}/slurmd.pid\n")
    done = subprocess.run([SLURMD, "-G", "-f", str(root / "slurm.conf"), "-N", "gpudnode"], capture_output=True,
                          text=True, timeout=30)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and not re.search(r"error:|fatal:|WARNING", said), said
    parsed = re.findall(r"Gres Name=gpu Type=(\S+) Count=1 ", said)
    for part in gres.node_gres.split(","):
        if part.startswith("gpu:"):
            _, gpu_type, count = part.split(":")
            assert gpu_type in parsed, said


# -- simulated nodes ------------------------------------------------------------------------------


async def node_state(config, layout: str | None = None):
    """(inventory, sharing document, MIG minors table, GET /v1/slurm/gres) of a simulated node."""
    node = await start_daemon(config)
    try:
        if layout:
            await mig_settled(node)
            assert (await put_layout(node, layout))[0] == 200
        daemon = node.daemon
        inventory = daemon.inventory.current
        minors = parse_mig_minors(config.mig_minors_path.read_text()) if config.mig_minors_path.exists() else {}
        # the writer rebuilds a debounce after the last change: the served text catches up with this snapshot
        expected = build_gres(inventory, daemon.sharing.document, minors, no_cores).text
        view = await until_async(lambda: gres_view(node, lambda v: v["text"] == expected), timeout=5,
                                 what="gres.conf built from the current inventory")
        return inventory, daemon.sharing.document, minors, view
    finally:
        await stop_daemon(node)


async def gres_view(node, wanted):
    _, view = await node.get("/v1/slurm/gres")
    return view if wanted(view) else None


async def test_whole_gpus_of_a_dgx_a100(short_tmp):
    inventory, sharing, minors, view = await node_state(mig_config(short_tmp, "dgx-a100"))
    assert_matches_openapi("GET", "/v1/slurm/gres", 200, view)
    gres = build_gres(inventory, sharing, minors, no_cores)
    assert (view["text"], view["node_gres"], view["path"]) == (gres.text, gres.node_gres, None)
    assert gres.text.startswith(HEADER) and gres.unavailable == []
    # NVSwitch links count nothing in Links= (gpu_nvml.c): nothing to say on a DGX A100
    assert gpu_lines(gres.text) == [f"Name=gpu Type={A100} File=/dev/nvidia{gpu.minor_number}"
                                    for gpu in inventory.gpus]
    assert gres.node_gres == f"gpu:{A100}:8"
    assert [r["device"] for r in gres.records] == [str(n) for n in range(8)]
    assert_slurm_accepts(gres, short_tmp)


async def test_cores_and_direct_nvlinks_on_an_hgx_a100(short_tmp):
    inventory, sharing, minors, _ = await node_state(mig_config(short_tmp, "hgx-a100-4gpu"))
    # The inventory's NVML affinity and NVLink counts (another branch fills them): GPUs 0-1 on socket 0,
    # 2-3 on socket 1; each pair joined by 4 NVLinks, GPU 0 also 2 to GPU 2; GPU 3 knows no affinity.
    affinity = {0: (0, 1, 2, 3), 1: (0, 1, 2, 3), 2: (4, 5, 6, 7), 3: ()}
    links = {0: ((1, 4), (2, 2)), 1: ((0, 4),), 2: ((3, 4), (0, 2)), 3: ((2, 4),)}
    gpus = tuple(dataclasses.replace(gpu, cpu_affinity=affinity[gpu.index], nvlink_counts=links[gpu.index])
                 for gpu in inventory.gpus)
    inventory = dataclasses.replace(inventory, gpus=gpus)

    def cores(cpus):
        return format_cpulist([cpu // 2 for cpu in cpus]) or None  # two CPUs a core, as the fake CoreIndex
    gres = build_gres(inventory, sharing, minors, cores)
    assert [(r.get("cores"), r.get("links")) for r in gres.records] == [
        ("0-1", "-1,4,2,0"), ("0-1", "4,-1,0,0"), ("2-3", "2,0,-1,4"), (None, "0,0,4,-1")]
    assert gpu_lines(gres.text)[0] == f"Name=gpu Type={A100} File=/dev/nvidia{gpus[0].minor_number} Cores=0-1 Links=-1,4,2,0"
    assert "Cores=" not in gpu_lines(gres.text)[3]
    assert_slurm_accepts(gres, short_tmp)


async def test_all_1g5gb_mig_devices_with_the_drivers_cap_minors(short_tmp):
    inventory, sharing, minors, view = await node_state(mig_config(short_tmp, "dgx-a100"), "all-1g.5gb")
    gres = build_gres(inventory, sharing, minors, no_cores)
    assert view["text"] == gres.text
    assert len(gres.records) == 56 and gres.node_gres == "gpu:1g.5gb:56" and gres.unavailable == []
    for gpu in inventory.gpus:
        records = [r for r in gres.records if r["device"].startswith(f"{gpu.index}:")]
        assert [r["device"] for r in records] == [f"{gpu.index}:{d.index}" for d in gpu.mig.devices]
        assert len(records) == 7
        for record, device in zip(records, gpu.mig.devices):
            gi = minors[f"gpu{gpu.minor_number}/gi{device.gi_id}/access"]
            ci = minors[f"gpu{gpu.minor_number}/gi{device.gi_id}/ci{device.ci_id}/access"]
            assert record == {"name": "gpu", "type": "1g.5gb", "device": record["device"], "uuid": device.uuid,
                              "multiple_files": f"/dev/nvidia{gpu.minor_number},/dev/nvidia-caps/nvidia-cap{gi},"
                                                f"/dev/nvidia-caps/nvidia-cap{ci}", "cores": None}
    assert gpu_lines(gres.text)[0].startswith("Name=gpu Type=1g.5gb MultipleFiles=/dev/nvidia")
    assert_slurm_accepts(gres, short_tmp)


async def test_mixed_whole_gpus_and_mig_devices_and_unusable_gpus(short_tmp):
    inventory, sharing, minors, _ = await node_state(mig_config(short_tmp, "A100-SXM4-40GB:4"), "all-balanced")
    gpus = list(inventory.gpus)
    gpus[1] = dataclasses.replace(gpus[1], mig=MigInfo(capable=True, mode="disabled", pending_mode="disabled"))
    gpus[2] = dataclasses.replace(gpus[2], lost=True)
    gpus[3] = dataclasses.replace(gpus[3], mig=dataclasses.replace(gpus[3].mig, devices=()))
    gres = build_gres(dataclasses.replace(inventory, gpus=tuple(gpus)), sharing, minors, no_cores)
    # a lost GPU keeps the records it was last seen with: Slurm's count stays, gpud slurm health drains
    assert [r["type"] for r in gres.records] == ([d.profile for d in gpus[0].mig.devices] + [A100] +
                                                 [d.profile for d in gpus[2].mig.devices])
    assert "\n# GPU 2 is lost" in gres.text
    assert [u["device"] for u in gres.unavailable] == ["3"] and "no MIG devices" in gres.unavailable[0]["reason"]
    assert gres.node_gres == f"gpu:1g.5gb:4,gpu:2g.10gb:2,gpu:3g.20gb:2,gpu:{A100}:1"
    assert_slurm_accepts(gres, short_tmp)


async def test_time_slicing_shards_and_shared_mig_devices_left_out(short_tmp):
    inventory, sharing, minors, _ = await node_state(sharing_config(short_tmp, "A100-SXM4-40GB:2", TIME_SLICING))
    gres = build_gres(inventory, sharing, minors, no_cores)
    assert gpu_lines(gres.text)[2:] == [f"Name=shard Count=4 File=/dev/nvidia{gpu.minor_number}"
                                        for gpu in inventory.gpus]
    assert gres.node_gres == f"gpu:{A100}:2,shard:8"
    assert_slurm_accepts(gres, short_tmp)

    mixed = ("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
             "    - name: nvidia.com/mig-1g.5gb\n      replicas: 3\n")
    (short_tmp / "m").mkdir()
    inventory, sharing, minors, _ = await node_state(sharing_config(short_tmp / "m", "A100-SXM4-40GB:1", mixed),
                                                     "all-1g.5gb")
    gres = build_gres(inventory, sharing, minors, no_cores)
    assert "shard" not in gres.text and gres.node_gres == "gpu:1g.5gb:7"
    assert len(gres.unavailable) == 7 and all("MIG device" in u["reason"] for u in gres.unavailable)


async def test_mps_sharing_is_100_per_gpu(short_tmp):
    mps = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    inventory, sharing, minors, _ = await node_state(sharing_config(short_tmp, "t4", mps))
    gres = build_gres(inventory, sharing, minors, no_cores)
    assert gpu_lines(gres.text) == [f"Name=gpu Type=tesla_t4 File=/dev/nvidia{inventory.gpus[0].minor_number}",
                                    f"Name=mps Count=100 File=/dev/nvidia{inventory.gpus[0].minor_number}"]
    assert gres.node_gres == "gpu:tesla_t4:1,mps:100"
    assert_slurm_accepts(gres, short_tmp)


def test_a_gpu_without_a_minor_number_or_with_an_error_is_left_out(short_tmp):
    from gpud.model.inventory import unknown_gpu

    gpus = (unknown_gpu(0, name="NVIDIA A100-SXM4-40GB"),
            dataclasses.replace(unknown_gpu(1, minor_number=1), error="NVML: unknown error"))
    gres = build_gres(Inventory("550.90.07", "12.4", "12.550", gpus), None, {}, no_cores)
    assert gres.records == [] and gres.node_gres == "" and gres.text == HEADER
    assert [u["device"] for u in gres.unavailable] == ["0", "1"]


# -- Slurm's core indexes -------------------------------------------------------------------------


def fake_cpus(sysfs: Path, sockets: int = 2, cores_per_socket: int = 4, offline=()) -> None:
    """cpu N and N+8 share a core (hyperthreads); cores_per_socket cores a socket; core ids not dense."""
    threads = sockets * cores_per_socket
    for cpu in range(2 * threads):
        if cpu in offline:
            (sysfs / "devices/system/cpu" / f"cpu{cpu}").mkdir(parents=True)  # no topology: offline
            continue
        core = cpu % threads
        topology = sysfs / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{core // cores_per_socket}\n")
        (topology / "core_id").write_text(f"{(core % cores_per_socket) * 2}\n")


def test_core_indexes_socket_by_socket_with_hyperthreads(tmp_path):
    fake_cpus(tmp_path)
    (tmp_path / "devices/system/cpu/cpufreq").mkdir()  # not a CPU
    assert read_core_indexes(tmp_path) == {cpu: cpu % 8 for cpu in range(16)}
    index = CoreIndex(tmp_path)
    assert index((0, 1, 2, 3, 8, 9, 10, 11)) == "0-3"
    assert index((12, 5)) == "4-5"
    assert index(tuple(range(16))) is None  # every core: nothing to say
    assert index(()) is None and index((99,)) is None  # unknown


def test_core_indexes_order_sockets_by_package_id_then_lowest_cpu(tmp_path):
    # Package 1's CPUs enumerated first (cpu0-3) and package 0's after: core 0 is still on package 0.
    for cpu, (package, core) in enumerate([(1, 0), (1, 1), (0, 5), (0, 3), (1, 0), (1, 1), (0, 5), (0, 3)]):
        topology = tmp_path / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(str(package))
        (topology / "core_id").write_text(str(core))
    assert read_core_indexes(tmp_path) == {2: 0, 6: 0, 3: 1, 7: 1, 0: 2, 4: 2, 1: 3, 5: 3}
    assert CoreIndex(tmp_path)((0, 1)) == "2-3"


def test_offline_cpus_count_nothing(tmp_path):
    fake_cpus(tmp_path, offline=(15,))
    assert 15 not in read_core_indexes(tmp_path) and len(set(read_core_indexes(tmp_path).values())) == 8


# -- the file -------------------------------------------------------------------------------------


def slurm_config(tmp: Path, preset: str = "A100-SXM4-40GB:2", **slurm):
    config = mig_config(tmp, preset).with_overrides(**{"slurm.gres_file": str(tmp / "slurm" / "gres.conf")})
    return config.with_overrides(**{f"slurm.{key}": value for key, value in slurm.items()})


def recording_scontrol(tmp: Path, exit_code: int = 0) -> Path:
    """A stand-in for scontrol's argument handling only: it records its argv and exits exit_code."""
    script = tmp / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp / 'argv'}\necho 'scontrol says hi'\nexit {exit_code}\n")
    script.chmod(0o755)
    return script


async def test_the_file_is_written_0644_and_follows_a_mig_change(short_tmp):
    config = slurm_config(short_tmp, reconfigure=True, scontrol=str(recording_scontrol(short_tmp)))
    node = await start_daemon(config)
    path = short_tmp / "slurm" / "gres.conf"
    try:
        view = await until_async(lambda: gres_view(node, lambda v: v["written_at"]), timeout=5, what="written")
        assert_matches_openapi("GET", "/v1/slurm/gres", 200, view)
        assert path.read_text() == view["text"] and stat.S_IMODE(path.stat().st_mode) == 0o644
        assert view["path"] == str(path) and view["node_gres"] == f"gpu:{A100}:2"
        view = await until_async(lambda: gres_view(node, lambda v: v["reconfigure"]["last"]), timeout=5,
                                 what="scontrol ran")
        assert view["reconfigure"] == {"enabled": True, "last": {
            "at": view["reconfigure"]["last"]["at"], "argv": [config.slurm.scontrol, "reconfigure"],
            "returncode": 0, "output": "scontrol says hi\n"}}
        assert (short_tmp / "argv").read_text() == "reconfigure\n"
        inode = path.stat().st_ino

        await mig_settled(node)
        assert (await put_layout(node, "all-1g.5gb"))[0] == 200
        view = await until_async(lambda: gres_view(node, lambda v: v["node_gres"] == "gpu:1g.5gb:14"), timeout=5,
                                 what="the MIG layout in gres.conf")
        assert path.read_text() == view["text"] and path.stat().st_ino != inode  # a new file, renamed over
        await until_async(lambda: (short_tmp / "argv").read_text().count("reconfigure") >= 2, timeout=5,
                          what="scontrol after the MIG change")
        assert_slurm_accepts(node.daemon.slurm_gres.gres, short_tmp)
        assert (await asyncio.to_thread(cli, "slurm", "gres", socket=config.socket_path)).stdout == view["text"]
        line = await asyncio.to_thread(cli, "slurm", "gres", "--node-line", socket=config.socket_path)
        assert (line.returncode, line.stdout) == (0, "Gres=gpu:1g.5gb:14\n")
        as_json = await asyncio.to_thread(cli, "slurm", "gres", "--json", socket=config.socket_path)
        assert json.loads(as_json.stdout)["node_gres"] == "gpu:1g.5gb:14"
    finally:
        await stop_daemon(node)


async def test_a_failing_scontrol_is_reported_not_fatal(short_tmp):
    config = slurm_config(short_tmp, reconfigure=True, scontrol=str(recording_scontrol(short_tmp, exit_code=1)))
    node = await start_daemon(config)
    try:
        view = await until_async(lambda: gres_view(node, lambda v: v["reconfigure"]["last"]), timeout=5,
                                 what="scontrol ran")
        assert view["reconfigure"]["last"]["returncode"] == 1 and view["error"] is None
        assert (short_tmp / "slurm" / "gres.conf").read_text() == view["text"]
        node.daemon.slurm_gres._scontrol = str(short_tmp / "absent")
        last = await node.daemon.slurm_gres.reconfigure()  # no such program: reported the same way
        assert last["returncode"] is None and "cannot run" in last["output"]
        _, health = await node.get("/healthz")
        assert health["status"] == "ok"
    finally:
        await stop_daemon(node)


async def test_a_file_edited_behind_gpuds_back_is_rewritten(short_tmp):
    node = await start_daemon(slurm_config(short_tmp))
    path = short_tmp / "slurm" / "gres.conf"
    try:
        view = await until_async(lambda: gres_view(node, lambda v: v["written_at"]), timeout=5, what="written")
        path.write_text("Name=gpu File=/dev/nvidia7\n")
        view = await until_async(lambda: gres_view(node, lambda v: v["changed_behind_gpud"]["count"]),
                                 timeout=RECHECK_S + 3, what="the edit noticed")
        await until_async(lambda: path.read_text() == view["text"], timeout=3, what="rewritten")
    finally:
        await stop_daemon(node)


async def test_a_directory_another_user_owns_is_refused_and_the_old_file_kept(short_tmp, users):
    directory = short_tmp / "slurm"
    directory.mkdir()
    (directory / "gres.conf").write_text("# the old one\n")
    os.chown(directory, pwd.getpwnam(OTHER).pw_uid, -1)
    node = await start_daemon(slurm_config(short_tmp), healthy=False)
    try:
        view = await until_async(lambda: gres_view(node, lambda v: v["error"]), timeout=5, what="refused")
        assert str(directory) in view["error"] and OTHER in view["error"] and "slurm.gres_file" in view["error"]
        assert view["text"] and view["written_at"] is None
        _, health = await node.get("/healthz")
        assert view["error"] in health.get("problems", [])
        assert (directory / "gres.conf").read_text() == "# the old one\n"
        os.chown(directory, 0, -1)  # the operator fixes it: written at the next recheck
        view = await until_async(lambda: gres_view(node, lambda v: v["written_at"]), timeout=RECHECK_S + 3,
                                 what="written once fixed")
        assert (directory / "gres.conf").read_text() == view["text"] and view["error"] is None
    finally:
        await stop_daemon(node)
