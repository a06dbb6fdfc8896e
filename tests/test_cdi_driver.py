"""The driver's files in gpud's CDI spec: what it carries for a driver tree, next to what NVIDIA's
`nvidia-ctk cdi generate` carries for the same tree; gpud's own hook; and a real container (Debian's
podman) given only a gpud device loading the host's libnvidia-ml (Debian's libnvidia-ml1) through the
spec, with no NVIDIA tool anywhere."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from cdi_library import NVIDIA_CTK, RUNTIME_SPEC_DIR, assert_cdi_library_accepts, gpud_on_the_runtimes_spec_dir
from helpers import (MOCK_NVML_CONFIGS, PODMAN_RUN, minimal_rootfs, mock_nvml_library, need, need_podman_as_root, podman,
                     sim_config, stand_in_nodes, start_daemon, stop_daemon, until_async)

from gpud.cdi import hook
from gpud.cdi.driver_files import find_driver_files
from gpud.nvml.sim.driver_tree import BINARIES, LIBRARIES, firmware_names

VERSION = "550.163.01"  # the driver_version of NVIDIA's mock NVML config for a DGX A100
MOCK_NVML_CONFIG = MOCK_NVML_CONFIGS / "mock-nvml-config-a100.yaml"
# The driver's compute, utility and video libraries with their sonames, binaries and GSP firmware, as
# the driver's .run installs them (the simulator's driver tree cites the sources)
FIRMWARE = firmware_names(VERSION)
LIB_DIR = "usr/lib/x86_64-linux-gnu"
NODES = """set -e
mount -t tmpfs -o mode=755 gpud-test-dev /dev
mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/urandom c 1 9
for name in nvidia0 nvidia1 nvidia2 nvidia3 nvidia4 nvidia5 nvidia6 nvidia7 nvidiactl nvidia-uvm nvidia-uvm-tools; do
  mknod -m 666 /dev/$name c 195 0
done
exec "$@"
"""


def driver_tree(root: Path, nvml: Path | None = None) -> Path:
    """A driver install under root, as the nvidia-container-toolkit README in ../shared describes: small
    shared objects with the driver's file names and sonames (gcc; libnvidia-ml the library in nvml, if
    given: nvidia-ctk loads the tree's own), binaries, GSP firmware, persistenced's socket, ldconfig -r root."""
    need(shutil.which("gcc") is not None, "gcc is not installed")
    lib_dir = root / LIB_DIR
    lib_dir.mkdir(parents=True)
    (root / "stub.c").write_text("int gpud_test_stub;\n")
    for stem, soname in LIBRARIES.items():
        target = lib_dir / f"{stem}.so.{VERSION}"
        if stem == "libnvidia-ml" and nvml:
            shutil.copy(nvml / f"libnvidia-ml.so.{VERSION}", target)
            continue
        compiled = subprocess.run(["gcc", "-shared", f"-Wl,-soname,{soname}", "-o", target, root / "stub.c"],
                                  capture_output=True, text=True, timeout=120)
        assert compiled.returncode == 0, compiled.stderr
    for stem, soname in LIBRARIES.items():
        # the development links a real install has beside the libraries, each to the soname link (the real
        # H200's ld.so.cache: tests/fixtures/hardware/h200-580.159.04, nvidia-ctk-reference.yaml)
        if not (lib_dir / f"{stem}.so").exists():
            (lib_dir / f"{stem}.so").symlink_to(soname if soname != f"{stem}.so.{VERSION}" else f"{stem}.so.{VERSION}")
    (root / "usr" / "bin").mkdir()
    for name in BINARIES:
        (root / "usr" / "bin" / name).write_text("#!/bin/sh\n")
        (root / "usr" / "bin" / name).chmod(0o755)
    (root / "lib" / "firmware" / "nvidia" / VERSION).mkdir(parents=True)
    for name in FIRMWARE:
        (root / "lib" / "firmware" / "nvidia" / VERSION / name).write_bytes(b"firmware")
    (root / "run" / "nvidia-persistenced").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listening:  # the socket file stays after close
        listening.bind(str(root / "run" / "nvidia-persistenced" / "socket"))
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.conf").write_text(f"/{LIB_DIR}\n")
    cached = subprocess.run(["ldconfig", "-r", root], capture_output=True, text=True, timeout=120)
    assert cached.returncode == 0, cached.stderr
    return root


def nvidia_spec(tree: Path, out: Path) -> dict:
    """`nvidia-ctk cdi generate` for the tree, on NVIDIA's mock NVML, in a private mount namespace whose
    /dev holds the DGX A100's nodes."""
    need(NVIDIA_CTK.exists(), f"{NVIDIA_CTK} is absent")
    need(os.geteuid() == 0, "needs root for a private mount namespace")
    generated = subprocess.run(
        ["unshare", "--mount", "sh", "-c", NODES, "sh", NVIDIA_CTK, "cdi", "generate", "--driver-root", tree,
         "--dev-root", "/", "--format", "json", "--output", out],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "LD_LIBRARY_PATH": str(mock_nvml_library()), "MOCK_NVML_CONFIG": str(MOCK_NVML_CONFIG)})
    assert generated.returncode == 0, generated.stderr
    return json.loads(out.read_text())


def hook_args(edits: dict, command: str) -> list[str]:
    """The arguments after the command of every hook running it (nvidia-cdi-hook's or gpud's)."""
    found = []
    for entry in edits.get("hooks", []):
        if command in entry["args"]:
            found += entry["args"][entry["args"].index(command) + 1:]
    return found


def pairs(args: list[str], flag: str) -> set[str]:
    return {value for option, value in zip(args, args[1:]) if option == flag}


async def written(node) -> dict:
    """GET /v1/cdi once the spec is written (within a second of start)."""
    async def view():
        _, answer = await node.get("/v1/cdi")
        return answer["spec"] and answer
    return await until_async(view, 2, "the spec")


@pytest.mark.slow
async def test_gpuds_driver_files_are_nvidia_ctks(short_tmp):
    tree = driver_tree(short_tmp / "driver", mock_nvml_library())
    nvidia = nvidia_spec(tree, short_tmp / "nvidia.json")["containerEdits"]
    config = sim_config(short_tmp, "A100-SXM4-40GB:1").with_overrides(**{
        "sim_driver": VERSION, "cdi.driver_root": str(tree), "cdi.dev_root": str(stand_in_nodes(short_tmp / "dev", 1))})
    node = await start_daemon(config)
    try:
        spec = (await written(node))["spec"]
    finally:
        await stop_daemon(node)
    assert_cdi_library_accepts(spec)
    gpud = spec["containerEdits"]
    # the same files, at the same places, with the same options: libraries, binaries, firmware, socket
    mounts = lambda edits: sorted((m["hostPath"], m["containerPath"], tuple(m["options"])) for m in edits["mounts"])  # noqa: E731
    assert mounts(gpud) == mounts(nvidia)
    assert {m["containerPath"] for m in gpud["mounts"]} >= {f"/{LIB_DIR}/{stem}.so.{VERSION}" for stem in LIBRARIES} | \
        {f"/usr/bin/{name}" for name in BINARIES} | {f"/lib/firmware/nvidia/{VERSION}/{name}" for name in FIRMWARE} | \
        {"/run/nvidia-persistenced/socket"}
    # the same soname and development links, and the same folders for the linker cache
    gbm = f"../libnvidia-allocator.so.1::/{LIB_DIR}/gbm/nvidia-drm_gbm.so"  # NVIDIA's graphics (GBM) link: not compute
    assert pairs(hook_args(gpud, "create-symlinks"), "--link") == pairs(hook_args(nvidia, "create-symlinks"), "--link") - {gbm}
    assert f"libnvidia-ml.so.{VERSION}::/{LIB_DIR}/libnvidia-ml.so.1" in pairs(hook_args(gpud, "create-symlinks"), "--link")
    assert pairs(hook_args(gpud, "update-ldcache"), "--folder") == pairs(hook_args(nvidia, "update-ldcache"), "--folder")
    # gpud runs its own hook; what NVIDIA's hook does besides, gpud leaves out: CUDA forward compatibility
    # is the image's choice, and gpud neither changes the driver's device-node settings nor sets
    # application profiles; NVIDIA's environment is for its own hooks and runtime
    assert {entry["args"][3] for entry in gpud["hooks"]} == {"create-symlinks", "update-ldcache"}
    assert all(entry["path"] == sys.executable and entry["args"][2] == hook.__file__ for entry in gpud["hooks"])
    assert {entry["args"][1] for entry in nvidia["hooks"]} - {"create-symlinks", "update-ldcache"} == \
        {"enable-cuda-compat", "disable-device-node-modification", "update-application-profile"}
    assert "env" not in gpud and sorted(nvidia["env"]) == [f"NVIDIA_CTK_LIBCUDA_DIR=/{LIB_DIR}", "NVIDIA_VISIBLE_DEVICES=void"]


async def test_no_driver_files_when_turned_off_or_of_another_version(short_tmp):
    tree = driver_tree(short_tmp / "driver")
    dev_root = str(stand_in_nodes(short_tmp / "dev", 1))
    for overrides in ({"sim_driver": VERSION, "cdi.driver_files": False},  # left to something else
                      {"sim_driver": "550.90.07"}):  # the tree holds another driver's files
        config = sim_config(short_tmp, "A100-SXM4-40GB:1").with_overrides(**{
            "cdi.driver_root": str(tree), "cdi.dev_root": dev_root, **overrides})
        with structlog.testing.capture_logs() as logged:
            node = await start_daemon(config)
            try:
                view = await written(node)
                node.daemon.cdi.refresh("test: said once")
            finally:
                await stop_daemon(node)
        assert_cdi_library_accepts(view["spec"])
        assert list(view["spec"]["containerEdits"]) == ["deviceNodes"], overrides
        said = [(entry["log_level"], entry["driver_version"], entry["driver_root"]) for entry in logged
                if entry["event"] == "cdi_driver_files_not_found"]
        assert said == ([] if overrides.get("cdi.driver_files") is False else [("warning", "550.90.07", str(tree))])


def test_libraries_are_found_through_links_anywhere_in_the_tree(short_tmp):
    """Debian's layout: the cache names /lib/x86_64-linux-gnu/libnvidia-ml.so.1 (/lib a link to usr/lib),
    a link through /etc/alternatives to nvidia/current/libnvidia-ml.so.<version>."""
    root = short_tmp / "root"
    current = root / LIB_DIR / "nvidia" / "current"
    current.mkdir(parents=True)
    (root / "stub.c").write_text("int gpud_test_stub;\n")
    need(shutil.which("gcc") is not None, "gcc is not installed")
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libnvidia-ml.so.1", "-o", current / f"libnvidia-ml.so.{VERSION}",
                    root / "stub.c"], check=True, timeout=120)
    (current / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{VERSION}")
    (root / "etc" / "alternatives").mkdir(parents=True)
    (root / "etc" / "alternatives" / "nvidia--libnvidia-ml.so.1").symlink_to(f"/{LIB_DIR}/nvidia/current/libnvidia-ml.so.1")
    (root / LIB_DIR / "libnvidia-ml.so.1").symlink_to("/etc/alternatives/nvidia--libnvidia-ml.so.1")
    (root / "lib").symlink_to("usr/lib")
    # what Debian's ldconfig writes for it: the link in the cache, by the path ldconfig scanned
    (root / "etc" / "ld.so.conf").write_text("/lib/x86_64-linux-gnu\n")
    subprocess.run(["ldconfig", "-r", root], check=True, timeout=120, capture_output=True)
    found = find_driver_files(root, VERSION)
    lib = f"/{LIB_DIR}/nvidia/current/libnvidia-ml.so.{VERSION}"
    assert found.libraries == (lib,)
    assert found.links == ((f"libnvidia-ml.so.{VERSION}", f"/{LIB_DIR}/nvidia/current/libnvidia-ml.so.1"),)
    assert find_driver_files(root, "535.309.01").libraries == ()
    whole = (root / "etc" / "ld.so.cache").read_bytes()
    for bad in (b"not a cache", whole[:60], whole[:80]):  # not one, cut in its entry (48 + 24 bytes), in its strings
        (root / "etc" / "ld.so.cache").write_bytes(bad)
        assert find_driver_files(root, VERSION).libraries == (), bad[:60]  # nothing, and no error


# -- gpud's hook ------------------------------------------------------------------------------------


def run_hook(bundle: Path, *args: str, state: str | None = None) -> subprocess.CompletedProcess:
    state = json.dumps({"ociVersion": "1.0.2", "id": "c", "status": "creating", "bundle": str(bundle)}) \
        if state is None else state
    return subprocess.run([sys.executable, "-I", hook.__file__, *args], input=state, capture_output=True,
                          text=True, timeout=60)


def bundle_with_root(tmp: Path) -> tuple[Path, Path]:
    bundle, rootfs = tmp / "bundle", tmp / "bundle" / "rootfs"
    rootfs.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"}}))
    return bundle, rootfs


def test_the_hook_makes_links_inside_the_container_root_only(short_tmp):
    bundle, rootfs = bundle_with_root(short_tmp)
    outside = short_tmp / "host-lib"
    outside.mkdir()
    (rootfs / "usr").mkdir()
    (rootfs / "usr" / "lib").symlink_to(str(outside))  # an image's link out of its root
    done = run_hook(bundle, "create-symlinks", "--link", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so",
                    "--link", f"libcuda.so.{VERSION}::/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    assert done.returncode == 0, done.stderr
    assert list(outside.iterdir()) == []  # the host's directory is untouched
    made = rootfs / str(outside).lstrip("/") / "x86_64-linux-gnu"  # the link's target, taken inside the root
    assert os.readlink(made / "libcuda.so.1") == f"libcuda.so.{VERSION}" and os.readlink(made / "libcuda.so") == "libcuda.so.1"
    again = run_hook(bundle, "create-symlinks", "--link", f"libcuda.so.{VERSION}::/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    assert again.returncode == 0, again.stderr  # idempotent


@pytest.mark.parametrize("args, state, error", [
    (["create-symlinks", "--link", "no-separator"], None, "want TARGET::/container/path"),
    (["create-symlinks", "--link", "a::relative/link"], None, "want TARGET::/container/path"),
    (["create-symlinks"], "not json", "gpud-cdi-hook create-symlinks:"),
    (["create-symlinks"], "[]", "gpud-cdi-hook create-symlinks:"),
    (["create-symlinks"], '{"bundle": "/nonexistent-bundle"}', "No such file"),
    (["update-ldcache", "--ldconfig", "/nonexistent/ldconfig", "--folder", "/usr/lib"], None, "No such file"),
])
def test_the_hook_refuses_bad_input(short_tmp, args, state, error):
    bundle, _ = bundle_with_root(short_tmp)
    done = run_hook(bundle, *args, state=state)
    assert done.returncode == 1 and error in done.stderr, done.stderr


def test_the_hook_refuses_an_unknown_command(short_tmp):
    bundle, _ = bundle_with_root(short_tmp)
    done = run_hook(bundle, "enable-cuda-compat")
    assert done.returncode == 2 and "invalid choice" in done.stderr


# -- a real container -------------------------------------------------------------------------------

NVML_PROBE = r"""
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!nvml) { printf("dlopen: %s\n", dlerror()); return 2; }
    int (*init)(void) = (int (*)(void)) dlsym(nvml, "nvmlInit_v2");
    const char *(*error_string)(int) = (const char *(*)(int)) dlsym(nvml, "nvmlErrorString");
    Dl_info info;
    dladdr((void *) init, &info);
    int rc = init();
    printf("loaded %s\nnvmlInit_v2: %s\n", info.dli_fname, error_string(rc));
    return 0;
}
"""


def host_nvml() -> tuple[str, str]:
    """(the host's libnvidia-ml file, its driver version), from Debian's libnvidia-ml1."""
    found = [path for path in Path("/usr/lib/x86_64-linux-gnu").rglob("libnvidia-ml.so.*.*") if path.is_file()]
    need(bool(found), "Debian's libnvidia-ml1 (non-free) is not installed")
    return str(found[0]), found[0].name.removeprefix("libnvidia-ml.so.")


@pytest.mark.slow
def test_a_container_with_only_a_gpud_device_loads_the_hosts_nvml(run_gpud, short_tmp, monkeypatch):
    need_podman_as_root()
    library, version = host_nvml()
    need(shutil.which("gcc") is not None, "gcc is not installed")
    (short_tmp / "bin").mkdir()
    (short_tmp / "probe.c").write_text(NVML_PROBE)
    subprocess.run(["gcc", "-o", short_tmp / "bin" / "nvml-probe", short_tmp / "probe.c", "-ldl"], check=True,
                   timeout=120)
    monkeypatch.setenv("PATH", f"{short_tmp / 'bin'}:{os.environ['PATH']}")
    rootfs = minimal_rootfs(short_tmp / "rootfs", "nvml-probe")
    # the C library parts libnvidia-ml itself needs (libm, libpthread...): the image's, not the driver's
    ldd = subprocess.run(["ldd", library], capture_output=True, text=True, timeout=60).stdout
    for needed in [word for word in ldd.split() if word.startswith("/") and "nvidia" not in word]:
        target = rootfs / needed.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(needed).resolve(), target)
    # the host's driver files, not the simulator's own tree
    config = (f"cdi:\n  spec_dir: {RUNTIME_SPEC_DIR}\n  driver_root: /\n"
              f"mig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    with gpud_on_the_runtimes_spec_dir(run_gpud, short_tmp, config, "--simulate", "A100-SXM4-40GB:1",
                                       "--sim-driver", version) as gpud:
        spec = gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["spec"], 10, "the spec")
        assert_cdi_library_accepts(spec)
        assert library in [m["hostPath"] for m in spec["containerEdits"]["mounts"]]
        without = podman(*PODMAN_RUN, "--rm", "--rootfs", str(rootfs), "/bin/nvml-probe")
        assert without.returncode == 2 and "libnvidia-ml.so.1: cannot open shared object file" in without.stdout
        inside = podman(*PODMAN_RUN, "--rm", "--device", "gpud/gpu=0", "--rootfs", str(rootfs), "/bin/nvml-probe")
        assert inside.returncode == 0, inside.stdout + inside.stderr
        # the host's library, by its soname through the container's linker cache; no driver: NVML says so
        assert inside.stdout.splitlines() == [f"loaded {os.path.dirname(library)}/libnvidia-ml.so.1",
                                              "nvmlInit_v2: Driver Not Loaded"], inside.stdout


STAND_IN_PROBE = r"""
#define _GNU_SOURCE /* dlinfo */
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { printf("dlopen: %s\n", dlerror()); return 2; }
    struct link_map *map;
    dlinfo(cuda, RTLD_DI_LINKMAP, &map);
    printf("loaded %s\ncuInit: %s\n", map->l_name, dlsym(cuda, "cuInit") ? "found" : "absent");
    return 0;
}
"""


@pytest.mark.slow
def test_a_container_given_a_simulated_gpu_loads_the_simulated_drivers_stand_in(run_gpud, short_tmp, monkeypatch):
    """The simulator's driver tree through the spec: the container's linker finds libcuda.so.1 by its
    soname (the hooks' links and linker cache), and it is the stand-in, exporting no CUDA call."""
    need_podman_as_root()
    need(shutil.which("gcc") is not None, "gcc is not installed")
    (short_tmp / "bin").mkdir()
    (short_tmp / "probe.c").write_text(STAND_IN_PROBE)
    subprocess.run(["gcc", "-o", short_tmp / "bin" / "cuda-probe", short_tmp / "probe.c", "-ldl"], check=True, timeout=120)
    monkeypatch.setenv("PATH", f"{short_tmp / 'bin'}:{os.environ['PATH']}")
    rootfs = minimal_rootfs(short_tmp / "rootfs", "cuda-probe")
    config = (f"cdi:\n  spec_dir: {RUNTIME_SPEC_DIR}\nmig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    with gpud_on_the_runtimes_spec_dir(run_gpud, short_tmp, config, "--simulate", "A100-SXM4-40GB:1") as gpud:
        assert_cdi_library_accepts(gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["spec"], 10, "the spec"))
        inside = podman(*PODMAN_RUN, "--rm", "--device", "gpud/gpu=0", "--rootfs", str(rootfs), "/bin/cuda-probe")
        assert inside.returncode == 0, inside.stdout + inside.stderr
        assert inside.stdout.splitlines() == [f"loaded /{LIB_DIR}/libcuda.so.1", "cuInit: absent"], inside.stdout
