"""Who uses the GPUs: compute processes per GPU and MIG device, their GPU memory and SM use, and the
container or systemd unit each belongs to, through the simulator, the API and /metrics, with real
processes in real cgroups."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path

import pynvml
import pytest
from helpers import (IN_CI, PODMAN_RUN, curl_as, gpud_for_users, mig_config, minimal_rootfs, need, need_podman_as_root,
                     podman, put_layout, sim_config, start_daemon, stop_daemon, until)
from openapi_check import assert_matches_openapi

from gpud.nvml.processes import read_processes
from gpud.nvml.sim import SimError
from gpud.nvml.sim.scenarios import enable_mig, started
from gpud.processes.cgroup import CGROUPFS, UNKNOWN, Owner, owner_of
from gpud.processes.host import describe

MIB = 1 << 20
ID = "01f3c60cfaadbb51e4d5947dd2ef0480d53551cbcee8f3ada8c3723b2bf03bf4"
ID2 = "89e89703fbd1e88b72d279d951ce389d3742874205196d73f96e0dcbc0da0659"
POD = "0f0a4b3c-8d2e-4a55-9b1c-2d7e6f3a9c11"
POD_ = POD.replace("-", "_")
USER_1000 = Owner("systemd", systemd_unit="user@1000.service", systemd_slice="user-1000.slice")

# -- /proc/<pid>/cgroup as hosts write it --------------------------------------------------------
# Lines in the shapes public sources show (podman's, docker's, kubelet's and systemd's layouts, as
# quoted in the test fixtures of open-source tracers and exporters, and a CRI-O node's cgroup v1 file
# from an OpenShift 4.6 bug report), plus the lines this test host writes itself.

CGROUP_LINES = {
    "podman, systemd manager, rootful": (
        f"0::/machine.slice/libpod-{ID}.scope/container\n", Owner("container", "podman", ID)),
    "podman, cgroupfs manager, v2": (f"0::/libpod_parent/libpod-{ID}\n", Owner("container", "podman", ID)),
    "podman, cgroupfs manager, v1": (
        "".join(f"{n}:{c}:/libpod_parent/libpod-{ID}\n" for n, c in ((9, "name=systemd"), (4, "memory"), (1, "cpu")))
        + "0::/\n", Owner("container", "podman", ID)),
    "podman's conmon is not the container": (
        f"0::/machine.slice/libpod-conmon-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"libpod-conmon-{ID}.scope", systemd_slice="machine.slice")),
    "podman's conmon, cgroupfs": ("0::/libpod_parent/conmon\n", Owner("other")),
    "docker, systemd driver": (f"0::/system.slice/docker-{ID}.scope\n", Owner("container", "docker", ID)),
    "docker, cgroupfs driver, v1": (
        f"12:memory:/docker/{ID}\n11:cpu,cpuacct:/docker/{ID}\n1:name=systemd:/docker/{ID}\n",
        Owner("container", "docker", ID)),
    "containerd under Kubernetes, systemd driver": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod48d25824_cbe2_4fdc_9928_5bb49e05473d"
        f".slice/cri-containerd-{ID}.scope\n",
        Owner("container", "containerd", ID, "48d25824-cbe2-4fdc-9928-5bb49e05473d")),
    "containerd, guaranteed pod (no QoS slice)": (
        f"0::/kubepods.slice/kubepods-pod6553a60b_2b97_442a_b6da_a5704d81dd98.slice/cri-containerd-{ID}.scope\n",
        Owner("container", "containerd", ID, "6553a60b-2b97-442a-b6da-a5704d81dd98")),
    "containerd under Kubernetes, cgroupfs driver": (
        f"0::/kubepods/besteffort/pod13cb8437-00ed-40e4-99d8-e17193a58086/{ID}\n",
        Owner("container", "containerd", ID, "13cb8437-00ed-40e4-99d8-e17193a58086")),
    "containerd, cgroup v1 with the systemd driver's colon form": (
        "4:pids:/podruntime.slice/containerd.service/kubepods-burstable-pod29349498_197c_4919_b13f_9a928e7d001b"
        f".slice:cri-containerd:{ID}\n",
        Owner("container", "containerd", ID, "29349498-197c-4919-b13f-9a928e7d001b")),
    "CRI-O, cgroup v1 (OpenShift 4.6)": (
        "".join(f"{n}:{c}:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8ca306fa_3c03_47fa_97dd_"
                f"19979c345572.slice/crio-{ID}.scope\n"
                for n, c in ((12, "devices"), (11, "pids"), (1, "name=systemd"))),
        Owner("container", "cri-o", ID, "8ca306fa-3c03-47fa-97dd-19979c345572")),
    "CRI-O, static pod (its UID is a 32-digit hash)": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pode4e6004e827fdf45941cf777618f60ce.slice/"
        f"crio-{ID}.scope\n", Owner("container", "cri-o", ID, "e4e6004e827fdf45941cf777618f60ce")),
    "CRI-O's conmon is not the container": (
        f"0::/kubepods.slice/kubepods-besteffort.slice/crio-conmon-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"crio-conmon-{ID}.scope", systemd_slice="kubepods-besteffort.slice")),
    "a container inside a container (kind): the inner one": (
        f"0::/system.slice/docker-{ID2}.scope/kubepods/burstable/pod09a70ae9-ccc4-91e6-51e5-c773579b3490/{ID}\n",
        Owner("container", "containerd", ID, "09a70ae9-ccc4-91e6-51e5-c773579b3490")),
    "a system service": ("0::/system.slice/nvidia-persistenced.service\n",
                         Owner("systemd", systemd_unit="nvidia-persistenced.service", systemd_slice="system.slice")),
    "a login session": ("0::/user.slice/user-1000.slice/session-3.scope\n",
                        Owner("systemd", systemd_unit="session-3.scope", systemd_slice="user-1000.slice")),
    "a user's own service: the user's, as their service manager": (
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n", USER_1000),
    "rootless podman: the user's, as their service manager": (
        f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope/container\n", USER_1000),
    "podman, a pod's container": (
        f"0::/machine.slice/machine-libpod_pod_{ID2}.slice/libpod-{ID}.scope/container\n",
        Owner("container", "podman", ID)),
    "podman, cgroupfs manager, a pod's container": (
        f"0::/libpod_parent/{ID2}/libpod-{ID}\n", Owner("container", "podman", ID)),
    "docker under Kubernetes (dockershim), systemd driver": (
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/docker-{ID}.scope\n",
        Owner("container", "docker", ID, POD)),
    "CRI-O under Kubernetes, cgroupfs driver": (
        f"0::/kubepods/burstable/pod{POD}/crio-{ID}\n", Owner("container", "cri-o", ID, POD)),
    "containerd, guaranteed pod, cgroupfs driver": (
        f"0::/kubepods/pod{POD}/{ID}\n", Owner("container", "containerd", ID, POD)),
    "kind: a node's pod under kubelet's --cgroup-root=/kubelet, systemd driver, in a docker container": (
        f"0::/system.slice/docker-{ID2}.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{POD_}.slice/cri-containerd-{ID}.scope\n",
        Owner("container", "containerd", ID, POD)),
    "podman with the cgroupfs manager inside a rootful podman container": (
        f"0::/machine.slice/libpod-{ID2}.scope/container/libpod_parent/libpod-{ID}\n",
        Owner("container", "podman", ID)),
    "docker with the cgroupfs driver inside a docker container": (
        f"0::/docker/{ID2}/docker/{ID}\n", Owner("container", "docker", ID)),
    # Root made these, but not where the runtime puts containers: a unit, or nothing.
    "a docker-named scope inside a service": (
        f"0::/system.slice/gpu-job.service/docker-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"docker-{ID}.scope", systemd_slice="system.slice")),
    "a docker-named scope in machine.slice": (
        f"0::/machine.slice/docker-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"docker-{ID}.scope", systemd_slice="machine.slice")),
    "a libpod scope in system.slice": (
        f"0::/system.slice/libpod-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"libpod-{ID}.scope", systemd_slice="system.slice")),
    "a containerd scope in no pod": (
        f"0::/kubepods.slice/kubepods-besteffort.slice/cri-containerd-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"cri-containerd-{ID}.scope", systemd_slice="kubepods-besteffort.slice")),
    "a pod slice in the wrong QoS slice": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{POD_}.slice/crio-{ID}.scope\n",
        Owner("systemd", systemd_unit=f"crio-{ID}.scope", systemd_slice=f"kubepods-besteffort-pod{POD_}.slice")),
    "a bare ID in no pod": (f"0::/kubepods/besteffort/{ID}\n", Owner("other")),
    "a cgroupfs podman name outside libpod_parent": (f"0::/libpod-{ID}\n", Owner("other")),
    "a transient scope (systemd-run --scope)": (
        "0::/system.slice/run-r3c1d.scope\n", Owner("systemd", systemd_unit="run-r3c1d.scope",
                                                    systemd_slice="system.slice")),
    "PID 1": ("0::/init.scope\n", Owner("systemd", systemd_unit="init.scope")),
    "the root cgroup": ("0::/\n", Owner("other")),
    "cgroup v1 hybrid, systemd's hierarchy only": (
        "9:name=systemd:/system.slice/cron.service\n4:memory:/\n0::/\n",
        Owner("systemd", systemd_unit="cron.service", systemd_slice="system.slice")),
    "a cgroup that names nothing known": ("9:name=systemd:/\n4:memory:/process_api/4bbba5bf4d3e201b\n0::/\n",
                                          Owner("other")),
}


def cgroup_tree(root: Path, text: str) -> Path:
    """A cgroup filesystem as a hybrid host mounts it (v2 at "unified", v1 hierarchies at their
    controllers' names), with a root-made directory for each line of a /proc/<pid>/cgroup text."""
    for line in text.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        mount = "unified" if hierarchy == "0" else controllers.removeprefix("name=")
        (root / mount / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return root


@pytest.mark.parametrize("case", CGROUP_LINES)
def test_the_owner_is_read_from_real_world_cgroup_lines(case, tmp_path):
    need(os.geteuid() == 0, "the directories of a root-made cgroup tree are root's")
    text, expected = CGROUP_LINES[case]
    owner = owner_of(text, cgroup_tree(tmp_path, text))
    assert {**owner.as_dict(), "cgroup": None} == {**expected.as_dict(), "cgroup": None}
    assert owner.cgroup is not None and owner.cgroup in text


@pytest.mark.parametrize("garbage", ["", "\n", "garbage", "0::relative/path", "x:y:/z", "::::", "\x00\xff" * 50,
                                     "0::/" + "a/" * 5000, "1:memory\n"])
def test_garbage_is_an_unknown_or_plain_owner_never_an_error(garbage, tmp_path):
    owner = owner_of(garbage, tmp_path)
    assert owner.kind in ("unknown", "other") and owner.container_id is None


def test_a_container_id_is_64_hex_digits_exactly(tmp_path):
    need(os.geteuid() == 0, "the directories of a root-made cgroup tree are root's")
    for text, kind in ((f"0::/system.slice/docker-{ID[:12]}.scope\n", "systemd"), (f"0::/docker/{ID}0\n", "other"),
                       (f"0::/libpod_parent/libpod-{ID.upper()}\n", "other")):
        assert owner_of(text, cgroup_tree(tmp_path, text)).kind == kind


def test_a_process_that_exited_or_cannot_be_read_has_an_unknown_owner(tmp_path):
    child = subprocess.Popen(["true"])
    child.wait(10)
    gone = describe(child.pid)
    assert gone.comm is None and gone.owner == UNKNOWN
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "comm").write_text("python3\n")  # and no cgroup file
    assert describe(77, tmp_path).owner == UNKNOWN
    me = describe(os.getpid())
    assert me.uid == os.getuid() and me.comm == Path("/proc/self/comm").read_text().strip()
    assert me.owner.kind != "unknown" and me.owner.cgroup in Path("/proc/self/cgroup").read_text()


# -- cgroups a user made: delegated subtrees --------------------------------------------------------
# systemd hands a subtree to a user by chowning its top (user@<uid>.service always; a service with
# Delegate= and User=); below it the user names cgroups as they like. Each fake below is made by the
# real user gpudt-other in its delegated directory, as that user.

FAKES = {  # a cgroup the user names, below their delegated directory, and what it imitates
    "docker, systemd driver": f"system.slice/docker-{ID}.scope",
    "a bare docker-named scope": f"docker-{ID}.scope",
    "rootful podman": f"machine.slice/libpod-{ID}.scope/container",
    "podman, cgroupfs": f"libpod_parent/libpod-{ID}",
    "containerd in a pod, systemd driver": (
        f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/cri-containerd-{ID}.scope"),
    "containerd in a pod, cgroupfs driver": f"kubepods/besteffort/pod{POD}/{ID}",
    "a system unit": "system.slice/nvidia-persistenced.service",
}


def delegated_to(tree: Path, top: str, uid: int, gid: int) -> Path:
    """Root makes `top` in the v2 hierarchy and gives it to the user, as systemd's Delegate= does (the
    directory and its cgroup.procs, cgroup.threads and cgroup.subtree_control)."""
    delegated = tree / "unified" / top
    delegated.mkdir(parents=True)
    for path in (delegated, *(delegated / name for name in ("cgroup.procs", "cgroup.threads",
                                                            "cgroup.subtree_control"))):
        path.touch()
        os.chown(path, uid, gid)
    return delegated


def made_as(user: str, directory: Path) -> None:
    made = subprocess.run(["runuser", "-u", user, "--", "mkdir", "-p", str(directory)], capture_output=True,
                          text=True, cwd="/", timeout=30)
    assert made.returncode == 0, made.stderr


@pytest.mark.parametrize("fake", FAKES)
@pytest.mark.parametrize("top, expected", [
    ("user.slice/user-{uid}.slice/user@{uid}.service",
     lambda uid: Owner("systemd", systemd_unit=f"user@{uid}.service", systemd_slice=f"user-{uid}.slice")),
    ("system.slice/gpu-batch.service",  # a system service with Delegate=yes and User=
     lambda uid: Owner("systemd", systemd_unit="gpu-batch.service", systemd_slice="system.slice")),
], ids=["user manager", "delegated service"])
def test_a_cgroup_a_user_made_is_that_users_never_a_container(fake, top, expected, short_tmp, users):
    tmp_path = short_tmp
    tmp_path.chmod(0o755)  # the user reaches their directory as in /sys/fs/cgroup
    other = pwd.getpwnam("gpudt-other")
    top = top.format(uid=other.pw_uid)
    delegated = delegated_to(tmp_path, top, other.pw_uid, other.pw_gid)
    made_as("gpudt-other", delegated / FAKES[fake])
    text = f"0::/{top}/{FAKES[fake]}\n"
    assert owner_of(text, tmp_path) == Owner(**{**expected(other.pw_uid).as_dict(), "cgroup": f"/{top}/{FAKES[fake]}"})


def test_a_user_managers_subtree_is_the_users_even_where_root_made_it(tmp_path):
    need(os.geteuid() == 0, "the directories of a root-made cgroup tree are root's")
    text = f"0::/user.slice/user-1000.slice/user@1000.service/system.slice/docker-{ID}.scope\n"
    assert owner_of(text, cgroup_tree(tmp_path, text)) == Owner(
        "systemd", systemd_unit="user@1000.service", systemd_slice="user-1000.slice", cgroup=text[3:-1])


def test_a_cgroup_others_can_write_names_nothing_below_it(tmp_path):
    need(os.geteuid() == 0, "the directories of a root-made cgroup tree are root's")
    text = f"0::/system.slice/shared.service/kubepods/besteffort/pod{POD}/{ID}\n"
    cgroup_tree(tmp_path, text)
    (tmp_path / "unified/system.slice/shared.service").chmod(0o777)
    assert owner_of(text, tmp_path) == Owner("systemd", systemd_unit="shared.service", systemd_slice="system.slice",
                                             cgroup=text[3:-1])
    (tmp_path / "unified/system.slice/shared.service").chmod(0o755)
    assert owner_of(text, tmp_path).container_id == ID


def test_a_user_namespaced_container_is_itself_whatever_its_root_makes_inside(tmp_path):
    """crun gives a container run in a user namespace its cgroup (owned by the container's root, a
    subordinate uid): the container is the one root named, never one its root names inside."""
    need(os.geteuid() == 0, "the directories of a root-made cgroup tree are root's")
    outer = f"machine.slice/libpod-{ID2}.scope"
    text = f"0::/{outer}/container/system.slice/docker-{ID}.scope\n"
    cgroup_tree(tmp_path, text)
    for directory in (tmp_path / "unified" / outer, *(tmp_path / "unified" / outer).rglob("*")):
        os.chown(directory, 100000, 100000)
    owner = owner_of(text, tmp_path)
    assert (owner.kind, owner.container_runtime, owner.container_id) == ("container", "podman", ID2)


def test_a_cgroup_that_cannot_be_looked_at_names_no_container(tmp_path):
    """No tree: the process left (its cgroup with it), or the hierarchy is not mounted there."""
    assert owner_of(f"0::/system.slice/docker-{ID}.scope\n", tmp_path) == Owner(
        "other", cgroup=f"/system.slice/docker-{ID}.scope")


# -- the simulator's process table -----------------------------------------------------------------


@pytest.fixture
def sleeper():
    """A real host process, killed (and reaped) by the test or at the end."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait(10)


def test_each_process_has_its_own_memory_and_sm_use(tmp_path, sleeper):
    nvml = started("H100-SXM5-80GB:2", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 30_000, "sm_percent": 87}, 4242])
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    listed = {p.pid: p for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)}
    assert listed[sleeper.pid].usedGpuMemory == 30_000 * MIB and listed[4242].usedGpuMemory == 256 * MIB
    assert listed[4242].gpuInstanceId == listed[4242].computeInstanceId == 0xFFFFFFFF
    memory = nvml.nvmlDeviceGetMemoryInfo(device, version=pynvml.nvmlMemory_v2)
    assert memory.used == 30_256 * MIB and memory.free == memory.total - memory.reserved - memory.used
    since = (time.time_ns() // 1000) - 2_000_000
    samples = nvml.nvmlDeviceGetProcessUtilization(device, since)
    assert [(s.pid, s.smUtil) for s in samples] == [(sleeper.pid, 87)]  # 4242 used no SM: no sample
    assert samples[0].timeStamp > since
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last sample
        nvml.nvmlDeviceGetProcessUtilization(device, samples[0].timeStamp)
    with pytest.raises(pynvml.NVMLError_NotFound):  # no process on GPU 1
        nvml.nvmlDeviceGetProcessUtilization(nvml.nvmlDeviceGetHandleByIndex(1), 0)


def test_a_host_process_that_exits_is_no_longer_listed_and_its_memory_is_free(tmp_path, sleeper):
    nvml = started("H100-SXM5-80GB:1", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 1024}, 4242])
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    sleeper.kill()  # killed, not yet reaped: a zombie has exited too
    until(lambda: Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z"),
          what="the killed sleeper a zombie")
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [4242]
    sleeper.wait(10)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [4242]
    assert nvml.nvmlDeviceGetMemoryInfo(device, version=pynvml.nvmlMemory_v2).used == 256 * MIB


def test_the_process_table_survives_a_restart_and_reads_old_state_files(tmp_path, sleeper):
    state = tmp_path / "sim.json"
    nvml = started("H100-SXM5-80GB:1", state)
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 2048, "sm_percent": 10}])
    nvml.nvmlShutdown()
    again = started("H100-SXM5-80GB:1", state)
    (listed,) = again.nvmlDeviceGetComputeRunningProcesses(again.nvmlDeviceGetHandleByIndex(0))
    assert (listed.pid, listed.usedGpuMemory) == (sleeper.pid, 2048 * MIB)
    again.nvmlShutdown()
    document = json.loads(state.read_text())
    document["gpus"][0]["processes"] = [31337]  # as an older gpud wrote them: bare PIDs
    state.write_text(json.dumps(document))
    old = started("H100-SXM5-80GB:1", state)
    (listed,) = old.nvmlDeviceGetComputeRunningProcesses(old.nvmlDeviceGetHandleByIndex(0))
    assert (listed.pid, listed.usedGpuMemory) == (31337, 256 * MIB)


@pytest.mark.parametrize("processes", [[{"pid": 0}], [{"pid": 5, "used_memory_mib": 0}], [{"pid": 5, "colour": 1}],
                                       [{"pid": 5, "used_memory_mib": 81_560}], [{"pid": 5, "sm_percent": 101}],
                                       [{"pid": 5, "sm_percent": True}], [5, {"pid": 5}], ["5"], "5", [None]])
def test_bad_processes_are_refused_and_change_nothing(tmp_path, processes):
    nvml = started("H100-SXM5-80GB:1", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [77])
    with pytest.raises(SimError):
        nvml.sim_set_processes(0, processes)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0))] == [77]


def one_mig_device(nvml, device, slices_constant):
    """A GPU instance of the profile the constant names, with one compute instance taking all of it."""
    profile = nvml.nvmlDeviceGetGpuInstanceProfileInfo(device, slices_constant)
    gi = nvml.nvmlDeviceCreateGpuInstance(device, profile.id)
    ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, slices_constant, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)  # the same slice count
    return gi, nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)


def test_mig_devices_list_their_own_processes_and_give_no_utilisation(tmp_path):
    nvml = started("A100-SXM4-40GB:1", tmp_path / "sim.json")
    device = enable_mig(nvml, 0)
    gi = one_mig_device(nvml, device, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)[0]
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    nvml.sim_set_processes(nvml.nvmlDeviceGetUUID(mig), [{"pid": 99, "used_memory_mib": 5000, "sm_percent": 50}])
    (listed,) = nvml.nvmlDeviceGetComputeRunningProcesses(mig)
    assert (listed.pid, listed.usedGpuMemory, listed.gpuInstanceId) == (99, 5000 * MIB,
                                                                        nvml.nvmlGpuInstanceGetInfo(gi).id)
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(device)] == [99]  # the aggregate, for root
    assert nvml.nvmlDeviceGetMemoryInfo(mig).used == 5000 * MIB
    for handle in (mig, device):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    with pytest.raises(SimError):  # more than the MIG device's memory (a 3g.20gb)
        nvml.sim_set_processes(nvml.nvmlDeviceGetUUID(mig), [{"pid": 99, "used_memory_mib": 30_000}])


def test_the_reader_lists_each_device_and_says_why_one_cannot_be_read(tmp_path, sleeper):
    nvml = started("A100-SXM4-40GB:3", tmp_path / "sim.json")
    nvml.sim_set_processes(0, [{"pid": sleeper.pid, "used_memory_mib": 700, "sm_percent": 33}])
    device = enable_mig(nvml, 1)
    gi, ci = one_mig_device(nvml, device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    mig_uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0))
    nvml.sim_set_processes(mig_uuid, [4343])
    uuids = [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(3)]
    nvml.sim_set_gpu_lost(2)
    read = read_processes(nvml, uuids, time.time_ns() // 1000 - 2_000_000)
    whole, on_mig, lost = read
    assert [(p.pid, p.used_memory_bytes, p.sm_percent) for p in whole.processes] == [(sleeper.pid, 700 * MIB, 33)]
    assert whole.unavailable is None and whole.sm_unavailable is None and whole.gi_id is None
    assert (on_mig.uuid, on_mig.gpu_uuid, on_mig.gi_id, on_mig.ci_id) == \
        (mig_uuid, uuids[1], nvml.nvmlGpuInstanceGetInfo(gi).id, nvml.nvmlComputeInstanceGetInfo(ci).id)
    assert [p.pid for p in on_mig.processes] == [4343] and "MIG" in on_mig.sm_unavailable
    assert lost.uuid == uuids[2] and lost.processes == () and "lost" in lost.unavailable


# -- the daemon: API and metrics -------------------------------------------------------------------


def fast(config):
    return config.with_overrides(**{"health.check_interval_s": 0.5})


async def processes_until(node, ident: str, wanted, timeout: float = 5.0) -> dict:
    for _ in range(int(timeout / 0.05)):
        status, body = await node.get(f"/v1/gpus/{ident}/processes")
        if status == 200 and wanted(body):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"/v1/gpus/{ident}/processes never answered as wanted: {status} {body}")


def assert_promtool_accepts(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not IN_CI, "CI installs Debian's prometheus package (promtool)"
        return
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # Lint remarks (a counter's name, a help text) are promtool's taste; an unparsable exposition is an error.
    assert "error while linting" not in checked.stderr and "text format parsing error" not in checked.stderr, \
        checked.stderr


async def metrics(node) -> str:
    async with node.http.get("http://localhost/metrics") as response:
        return await response.text()


def listed(body: dict) -> dict[int, dict]:
    return {p["pid"]: p for device in body["devices"] for p in device["processes"]}


async def test_the_api_and_metrics_show_a_real_process_until_it_exits(short_tmp, sleeper):
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:2")))
    try:
        process = {"pid": sleeper.pid, "used_memory_mib": 4096, "sm_percent": 64}
        status, body = await node.post("/v1/sim/processes", {"gpu": 1, "processes": [process]})
        assert status == 200, body
        assert_matches_openapi("POST", "/v1/sim/processes", 200, body)
        gpu = (await node.get("/v1/gpus/1"))[1]
        body = await processes_until(node, "1", lambda b: sleeper.pid in listed(b))
        assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 200, body)
        assert (body["gpu"], body["uuid"], len(body["devices"])) == (1, gpu["uuid"], 1)
        assert body["read_at"] <= time.time()
        entry = listed(body)[sleeper.pid]
        assert (entry["comm"], entry["uid"], entry["used_memory_bytes"]) == ("sleep", os.getuid(), 4096 * MIB)
        assert entry["owner"]["kind"] != "unknown" and entry["owner"]["cgroup"] in \
            Path(f"/proc/{sleeper.pid}/cgroup").read_text()
        sm = await processes_until(node, gpu["pci_bus_id"], lambda b: listed(b)[sleeper.pid]["sm_utilization_percent"])
        assert listed(sm)[sleeper.pid]["sm_utilization_percent"] == 64
        assert set(listed((await node.get(f"/v1/gpus/{gpu['uuid']}/processes"))[1])) == {sleeper.pid}
        assert (await node.get("/v1/gpus/0/processes"))[1]["devices"][0]["processes"] == []

        text = await metrics(node)
        memory = [line for line in text.splitlines() if line.startswith("gpud_process_gpu_memory_used_bytes{")]
        assert len(memory) == 1 and f'pid="{sleeper.pid}"' in memory[0] and 'comm="sleep"' in memory[0]
        assert f'UUID="{gpu["uuid"]}"' in memory[0] and 'gpu="1"' in memory[0] and "GPU_I_ID" not in memory[0]
        assert memory[0].endswith(f" {4096 * MIB}")
        assert re.search(rf'gpud_process_sm_utilization_percent{{[^}}]*pid="{sleeper.pid}"[^}}]*}} 64$', text, re.M)
        assert re.search(r'gpud_device_compute_processes{[^}]*gpu="1"[^}]*} 1$', text, re.M)
        assert_promtool_accepts(text)

        sleeper.kill()
        sleeper.wait(10)
        body = await processes_until(node, "1", lambda b: not listed(b))
        assert body["devices"][0]["processes"] == []
        text = await metrics(node)
        assert f'pid="{sleeper.pid}"' not in text
        assert re.search(r'gpud_device_compute_processes{[^}]*gpu="1"[^}]*} 0$', text, re.M)
    finally:
        await stop_daemon(node)


async def test_mig_devices_have_their_own_entries_and_series(short_tmp):
    node = await start_daemon(fast(mig_config(short_tmp, "A100-SXM4-40GB:1")))
    try:
        status, body = await put_layout(node, "all-balanced")
        assert status == 200, body
        devices = (await node.get("/v1/gpus/0"))[1]["mig"]["devices"]
        first, second = devices[0], devices[1]
        for device, pid in ((first, 4242), (second, 4343)):
            status, body = await node.post("/v1/sim/processes", {
                "gpu": device["uuid"], "processes": [{"pid": pid, "used_memory_mib": 1000 + pid % 100}]})
            assert status == 200, body
        body = await processes_until(node, "0", lambda b: {4242, 4343} <= set(listed(b)))
        assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 200, body)
        assert len(body["devices"]) == len(devices)
        by_uuid = {d["uuid"]: d for d in body["devices"]}
        assert by_uuid[first["uuid"]]["mig"] == {"gi_id": first["gi_id"], "ci_id": first["ci_id"],
                                                 "profile": first["profile"]}
        assert by_uuid[first["uuid"]]["sm_utilization_unavailable"]
        assert listed({"devices": [by_uuid[first["uuid"]]]})[4242]["used_memory_bytes"] == 1042 * MIB
        status, only = await node.get(f"/v1/gpus/{second['uuid']}/processes")
        assert status == 200 and [d["uuid"] for d in only["devices"]] == [second["uuid"]]
        assert set(listed(only)) == {4343}

        text = await metrics(node)
        line = next(line for line in text.splitlines()
                    if line.startswith("gpud_process_gpu_memory_used_bytes{") and 'pid="4242"' in line)
        assert f'GPU_I_ID="{first["gi_id"]}"' in line and f'GPU_I_PROFILE="{first["profile"]}"' in line
        assert f'mig_uuid="{first["uuid"]}"' in line and line.endswith(f" {1042 * MIB}")
        # the device's labels are those of its health series, so a dashboard joins the two
        health = next(line for line in text.splitlines()
                      if line.startswith("gpud_gpu_health{") and f'mig_uuid="{first["uuid"]}"' in line)
        assert health[health.index("{"):health.index("}")] in line
        assert "gpud_process_sm_utilization_percent{" not in text
    finally:
        await stop_daemon(node)


BAD_IDS = ["9", "GPU-00000000-0000-0000-0000-000000000000", "MIG-nope", "0000:ff:00.0", "%00", "-1", "a" * 300]
BAD_BODIES = [{"gpu": 0}, {"gpu": 0, "pids": [1], "processes": []}, {"gpu": 0, "processes": [{"pid": "1"}]},
              {"gpu": 0, "processes": [{"pid": 1, "x": 1}]}, {"gpu": 0, "processes": [{"pid": 1, "sm_percent": -1}]},
              {"gpu": 0, "processes": [{"pid": 1, "used_memory_mib": 1.5}]}, {"gpu": 0, "processes": [7]},
              {"gpu": 0, "processes": {"pid": 1}}, {"gpu": 0, "pids": [True]}]


async def test_unknown_devices_are_404_and_bad_simulated_processes_400(short_tmp):
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:1")))
    try:
        await processes_until(node, "0", lambda b: True)
        for ident in BAD_IDS:
            status, body = await node.get(f"/v1/gpus/{ident}/processes")
            assert status == 404 and body["error"]["code"] == "gpu-not-found", (ident, body)
            assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 404, body)
        for bad in BAD_BODIES:
            status, answer = await node.post("/v1/sim/processes", bad)
            assert status == 400, (bad, answer)
        status, answer = await node.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": 5, "used_memory_mib": 100_000}]})  # more than the GPU's 80 GB
        assert status == 422 and "used_memory_mib" in answer["error"]["message"], answer

        assert (await node.post("/v1/sim/gpu-lost", {"gpu": 0}))[0] == 200
        body = await processes_until(node, "0", lambda b: b["devices"] and b["devices"][0]["unavailable"])
        assert "lost" in body["devices"][0]["unavailable"] and body["devices"][0]["processes"] == []
    finally:
        await stop_daemon(node)


@pytest.mark.slow
def test_a_reader_who_is_not_admin_sees_every_process(run_gpud, short_tmp, users, sleeper):
    gpud = gpud_for_users(run_gpud, short_tmp)
    gpud.client.request("POST", "/v1/sim/processes", {"gpu": 0, "pids": [sleeper.pid]})

    def seen():
        status, text = curl_as("gpudt-reader", gpud.socket, "GET", "/v1/gpus/0/processes")
        return status == 200 and sleeper.pid in listed(json.loads(text))
    gpud.wait_for(seen, timeout=15, what="the reader seeing the process")
    status, _ = curl_as("gpudt-reader", gpud.socket, "POST", "/v1/sim/processes", {"gpu": 0, "pids": []})
    assert status == 403


# -- real cgroups: a user's fake container scope and a root-made one ------------------------------


def writable_v2_hierarchy() -> Path:
    v2 = CGROUPFS if (CGROUPFS / "cgroup.controllers").exists() else CGROUPFS / "unified"
    need(os.geteuid() == 0 and (v2 / "cgroup.procs").exists(), "needs root and a cgroup v2 hierarchy")
    return v2


@pytest.fixture
def real_cgroups():
    """Makes cgroups in the host's real v2 hierarchy; at the end ends the processes put in them and
    removes them, deepest first (a shared parent stays while another test uses it)."""
    made: list[Path] = []
    processes: list[subprocess.Popen] = []

    def make(path: Path) -> Path:
        for directory in reversed([path, *path.parents]):
            if not directory.exists():
                directory.mkdir()
                made.append(directory)
        return path
    yield make, processes
    for process in processes:
        process.kill()
        process.wait(10)
    for top in sorted(made, key=lambda p: len(p.parts), reverse=True):
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            directory.rmdir()  # those the user made below
        top.rmdir()


@pytest.mark.slow
async def test_a_users_fake_docker_scope_is_reported_as_the_users_and_a_root_made_one_as_docker(
        short_tmp, users, real_cgroups):
    """The failure reported: a user with a delegated cgroup (rootless podman's user@UID.service) names
    a scope docker-<id>.scope, and gpud reported that user's GPU memory as that docker container's."""
    v2, (make, processes) = writable_v2_hierarchy(), real_cgroups
    other = pwd.getpwnam("gpudt-other")
    manager = make(v2 / f"user.slice/user-{other.pw_uid}.slice/user@{other.pw_uid}.service")
    for path in (manager, manager / "cgroup.procs", manager / "cgroup.threads", manager / "cgroup.subtree_control"):
        os.chown(path, other.pw_uid, other.pw_gid)  # as systemd delegates it (user@.service: Delegate=yes)
    fake = manager / f"docker-{ID}.scope"
    # Root puts the process in the user's manager cgroup, as systemd starts the user's manager; as the
    # user it makes the fake scope and moves itself there.
    processes.append(subprocess.Popen([
        "sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec setpriv --reuid="$2" --regid="$3" --clear-groups '
        'sh -c \'mkdir "$1" && echo $$ > "$1/cgroup.procs" && exec sleep 60\' sh "$4"',
        "sh", str(manager), str(other.pw_uid), str(other.pw_gid), str(fake)], cwd="/"))
    user_pid = processes[-1].pid
    until(lambda: f"/docker-{ID}.scope" in Path(f"/proc/{user_pid}/cgroup").read_text(), timeout=10,
          what="the user's process in its fake docker scope")
    assert fake.stat().st_uid == other.pw_uid
    # docker's own place, made by root, with a root process in it
    scope = make(v2 / f"system.slice/docker-{ID2}.scope")
    processes.append(subprocess.Popen(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec sleep 60', "sh", str(scope)]))
    root_pid = processes[-1].pid
    until(lambda: f"/docker-{ID2}.scope" in Path(f"/proc/{root_pid}/cgroup").read_text(), timeout=10,
          what="the root process in docker's scope")

    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:1")))
    try:
        status, body = await node.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": user_pid, "used_memory_mib": 4096}, {"pid": root_pid, "used_memory_mib": 1024}]})
        assert status == 200, body
        body = await processes_until(node, "0", lambda b: {user_pid, root_pid} <= set(listed(b)))
        assert_matches_openapi("GET", "/v1/gpus/{id}/processes", 200, body)
        users_entry, roots_entry = listed(body)[user_pid], listed(body)[root_pid]
        assert users_entry["uid"] == other.pw_uid
        assert {**users_entry["owner"], "cgroup": None} == {
            **Owner("systemd", systemd_unit=f"user@{other.pw_uid}.service",
                    systemd_slice=f"user-{other.pw_uid}.slice").as_dict(), "cgroup": None}, users_entry
        assert (roots_entry["owner"]["kind"], roots_entry["owner"]["container_runtime"],
                roots_entry["owner"]["container_id"]) == ("container", "docker", ID2), roots_entry
        text = await metrics(node)
        memory = {int(re.search(r'pid="(\d+)"', line).group(1)): line for line in text.splitlines()
                  if line.startswith("gpud_process_gpu_memory_used_bytes{")}
        assert ID not in memory[user_pid] and 'owner="systemd"' in memory[user_pid]
        assert f'systemd_unit="user@{other.pw_uid}.service"' in memory[user_pid]
        assert f'container_runtime="docker",container_id="{ID2}"' in memory[root_pid]
    finally:
        await stop_daemon(node)


# -- real containers -------------------------------------------------------------------------------


@pytest.fixture
def podman_container(short_tmp):
    need_podman_as_root()
    rootfs = minimal_rootfs(short_tmp / "rootfs", "sleep")
    name = f"gpud-test-{os.getpid()}-{time.monotonic_ns()}"
    started = podman(*PODMAN_RUN, "-d", "--name", name, "--read-only", "--rootfs", str(rootfs), "/bin/sleep", "300")
    if started.returncode != 0:
        if IN_CI:
            pytest.fail(f"podman could not run a container: {started.stderr}")
        pytest.skip(f"podman cannot run containers here: {started.stderr.strip()}")
    try:
        inspected = podman("inspect", "--format", "{{.Id}} {{.State.Pid}}", name)
        container_id, pid = inspected.stdout.split()
        yield container_id, int(pid)
    finally:
        podman("rm", "--force", "--time", "0", name)


@pytest.mark.slow
async def test_a_podman_container_owns_its_process(short_tmp, podman_container):
    container_id, pid = podman_container
    node = await start_daemon(fast(sim_config(short_tmp, "H100-SXM5-80GB:1")))
    try:
        status, body = await node.post("/v1/sim/processes", {"gpu": 0, "processes": [
            {"pid": pid, "used_memory_mib": 512}]})
        assert status == 200, body
        body = await processes_until(node, "0", lambda b: pid in listed(b))
        owner = listed(body)[pid]["owner"]
        assert (owner["kind"], owner["container_runtime"], owner["container_id"]) == \
            ("container", "podman", container_id), owner
        assert listed(body)[pid]["comm"] == "sleep"
        text = await metrics(node)
        assert re.search(rf'gpud_process_gpu_memory_used_bytes{{[^}}]*container_runtime="podman",'
                         rf'container_id="{container_id}"', text), text
        podman("rm", "--force", "--time", "0", container_id)
        await processes_until(node, "0", lambda b: pid not in listed(b))
        assert f'pid="{pid}"' not in await metrics(node)
    finally:
        await stop_daemon(node)
