"""The CDI spec: what it holds for GPUs, MIG devices and replicas, that it follows every change within a
second and is never seen half-written, and that a real runtime (Debian's podman) runs containers with it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import referencing
from referencing.jsonschema import DRAFT7
from cdi_library import RUNTIME_SPEC_DIR, assert_cdi_library_accepts, cdi_library_verdict, gpud_on_the_runtimes_spec_dir
from helpers import (IN_CI, PODMAN_RUN, REPO, cli, mig_config, mig_settled, minimal_rootfs, need_podman_as_root,
                     podman, put_layout, sharing_config, stand_in_nodes, start_daemon, stop_daemon, until)
from openapi_check import assert_matches_openapi

from gpud.cdi.spec import CONTROL_NODES, parse_mig_minors
from gpud.client import Client, DaemonUnreachable
from gpud.cdi.version import minimum_version
from gpud.nvml.sim.driver_tree import BINARIES, LIBRARIES, library_dir
from gpud.nvml.sim.drivers import parse_driver
from gpud.nvml.sim.mig_minors import mig_minors_text

SCHEMA_DIR = REPO / "tests" / "fixtures" / "cdi"
CAPTURE = REPO / "tests" / "fixtures" / "hardware" / "h100-sxm5-580.159.04" / "capture.log"


def validate(spec: dict) -> None:
    """Every spec a test produces: valid by the CDI schema and loaded by the CDI library itself."""
    validate_by_schema(spec)
    assert_cdi_library_accepts(spec)


def validate_by_schema(spec: dict) -> None:
    resources = {name: DRAFT7.create_resource(json.loads((SCHEMA_DIR / name).read_text()))
                 for name in ("schema.json", "defs.json")}
    registry = referencing.Registry().with_resources(resources.items())
    jsonschema.Draft7Validator(resources["schema.json"].contents, registry=registry).validate(spec)


def cdi_config(tmp: Path, preset: str, dev_root: Path, **cdi):
    config = mig_config(tmp, preset).with_overrides(**{"cdi.dev_root": str(dev_root)})
    return config.with_overrides(**{f"cdi.{key}": value for key, value in cdi.items()})


async def cdi_until(node, wanted, timeout: float = 1.0) -> dict:
    """GET /v1/cdi until wanted(view) holds, at most `timeout` seconds: the promise is within a second."""
    deadline = time.monotonic() + timeout
    while True:
        _, view = await node.get("/v1/cdi")
        if wanted(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"/v1/cdi not as wanted within {timeout}s: {view['devices']} {view['error']}")
        await asyncio.sleep(0.02)


def edits(spec: dict, name: str) -> dict:
    (device,) = [d for d in spec["devices"] if d["name"] == name]
    return device["containerEdits"]


def node_paths(spec: dict, name: str) -> list[str]:
    return [node["path"] for node in edits(spec, name)["deviceNodes"]]


async def mig_devices(node) -> list[dict]:
    _, gpus = await node.get("/v1/gpus")
    return [{**device, "gpu": gpu["index"]} for gpu in gpus["gpus"] for device in gpu["mig"]["devices"]]


def test_the_schema_tells_its_own_good_examples_from_bad():
    for name in ("testdata_good_minimal.json", "testdata_good_spec-example.json"):
        validate_by_schema(json.loads((SCHEMA_DIR / name).read_text()))
    assert (SCHEMA_DIR / "testdata_bad_empty.json").read_text() == ""  # the schema's bad example: no document
    for bad in ({"kind": "gpud/gpu", "devices": []}, {"cdiVersion": "0.5.0", "kind": "gpud/gpu", "devices": [{"name": "0"}]},
                {"cdiVersion": "0.5.0", "kind": "gpud/gpu", "devices": [{"name": "0", "containerEdits": {
                    "deviceNodes": [{"hostPath": "/dev/nvidia0"}]}}]}):
        with pytest.raises(jsonschema.ValidationError):
            validate_by_schema(bad)


# -- the driver's MIG minors table -----------------------------------------------------------------


def test_the_simulated_mig_minors_table_is_the_drivers():
    text = mig_minors_text()
    # Our H100 capture printed the first 20 lines of the real file
    log = CAPTURE.read_text().splitlines()
    start = log.index("+ cat /proc/driver/nvidia-caps/mig-minors") + 2  # then "+ head -20"
    assert text.splitlines()[:20] == log[start:start + 20]
    minors = parse_mig_minors(text)
    # nv-caps.c: 2 + 32 GPUs × 15 GIs × (1 + 8 CIs) entries, numbered from 1 without gaps
    assert len(minors) == 2 + 32 * 15 * 9 and sorted(minors.values()) == list(range(1, 2 + 32 * 15 * 9 + 1))
    assert minors["gpu31/gi14/ci7/access"] == 4322 and minors["gpu1/gi0/access"] == 3 + 135


def test_mig_minors_lines_of_another_shape_are_skipped():
    text = ("config 1\ngarbage\n\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access x\nmonitor 2 3\n\xff\xfe 9\n"
            "gpu0/gi1/ci2/access 15\ngpu0/gi1/cix/access 16\n gpu0/gi2/access 21\nnotconfig 99\n")
    assert parse_mig_minors(text) == {"config": 1, "gpu0/gi1/access": 12, "gpu0/gi1/ci2/access": 15}


# -- cdiVersion: the least the CDI library accepts -------------------------------------------------

NODE = {"path": "/dev/nvidia0"}
VERSION_CASES = [  # (what a spec uses, its devices' edits, the version the CDI library wants)
    ("names starting with a letter, nothing else", {"name": "GPU-1", "containerEdits": {"deviceNodes": [NODE]}}, "0.3.0"),
    ("a name starting with a digit", {"name": "0", "containerEdits": {"deviceNodes": [NODE]}}, "0.5.0"),
    ("a hostPath", {"name": "a", "containerEdits": {"deviceNodes": [{**NODE, "hostPath": "/x/dev/nvidia0"}]}}, "0.5.0"),
    ("a mount type", {"name": "a", "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}}, "0.4.0"),
    ("device annotations", {"name": "a", "annotations": {"k": "v"}, "containerEdits": {"deviceNodes": [NODE]}}, "0.6.0"),
    ("additionalGids", {"name": "a", "containerEdits": {"deviceNodes": [NODE], "additionalGids": [44]}}, "0.7.0"),
    ("intelRdt", {"name": "a", "containerEdits": {"deviceNodes": [NODE], "intelRdt": {"closID": "c"}}}, "0.7.0"),
    ("intelRdt monitoring", {"name": "a", "containerEdits": {"deviceNodes": [NODE], "intelRdt": {"enableMonitoring": True}}}, "1.1.0"),
    ("netDevices", {"name": "a", "containerEdits": {"netDevices": [{"hostInterfaceName": "eth1", "name": "eth1"}]}}, "1.1.0"),
]
RELEASED = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]  # specs-go/version.go


@pytest.mark.parametrize("uses, device, wanted", VERSION_CASES, ids=[case[0] for case in VERSION_CASES])
def test_the_version_gpud_computes_is_the_least_the_cdi_library_accepts(uses, device, wanted):
    spec = {"cdiVersion": "", "kind": "gpud/gpu", "devices": [device]}
    assert minimum_version(spec) == wanted
    for version in RELEASED:
        devices, errors = cdi_library_verdict({**spec, "cdiVersion": version})
        if RELEASED.index(version) < RELEASED.index(wanted):
            assert f"the spec version must be at least v{wanted}" in errors and devices == [], (version, errors)
        else:
            assert not errors and devices == [f"gpud/gpu={device['name']}"], (version, errors)


def test_a_dot_in_the_kinds_class_and_spec_annotations_need_0_6_0():
    device = {"name": "a", "containerEdits": {"deviceNodes": [NODE]}}
    for spec in ({"kind": "gpud/gpu.mig", "devices": [device]},
                 {"kind": "gpud/gpu", "annotations": {"k": "v"}, "devices": [device]}):
        assert minimum_version(spec) == "0.6.0"
        _, errors = cdi_library_verdict({"cdiVersion": "0.5.0", **spec})
        assert "the spec version must be at least v0.6.0" in errors
        assert_cdi_library_accepts({"cdiVersion": "0.6.0", **spec})


# -- the spec --------------------------------------------------------------------------------------


async def test_gpus_mig_devices_and_time_sliced_replicas(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=2)
    sharing = ("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
               "    - name: nvidia.com/mig-1g.5gb\n      replicas: 3\n")
    config = sharing_config(short_tmp, "A100-SXM4-40GB:2", sharing).with_overrides(**{"cdi.dev_root": str(root)})
    node = await start_daemon(config)
    try:
        await mig_settled(node)
        assert (await put_layout(node, "all-balanced"))[0] == 200
        devices = await mig_devices(node)
        small = [d for d in devices if d["profile"] == "1g.5gb"]
        view = await cdi_until(node, lambda v: all(f"{d['uuid']}::2" in v["devices"] for d in small))
        assert_matches_openapi("GET", "/v1/cdi", 200, view)
        spec = view["spec"]
        validate(spec)
        assert json.loads((short_tmp / "state" / "cdi" / "gpud-gpu.json").read_text()) == spec
        assert (spec["kind"], view["kind"], view["path"]) == ("gpud/gpu", "gpud/gpu", str(short_tmp / "state/cdi/gpud-gpu.json"))
        assert spec["cdiVersion"] == "0.5.0"  # names starting with a digit, and hostPaths
        _, gpus = await node.get("/v1/gpus")
        expected = []
        for gpu in gpus["gpus"]:
            expected += [str(gpu["index"]), gpu["uuid"]]
            expected += [name for d in devices if d["gpu"] == gpu["index"]
                         for name in (f"{d['gpu']}:{d['index']}", d["uuid"])]
        expected += [f"{d['uuid']}::{n}" for d in small for n in range(3)] + ["all"]
        assert view["devices"] == expected and view["unavailable"] == []
        minors = parse_mig_minors(mig_minors_text())
        for device in devices:
            gpu, gi, ci = device["gpu"], device["gi_id"], device["ci_id"]
            gi_minor, ci_minor = minors[f"gpu{gpu}/gi{gi}/access"], minors[f"gpu{gpu}/gi{gi}/ci{ci}/access"]
            wanted = [f"/dev/nvidia{gpu}", f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                      f"/dev/nvidia-caps/nvidia-cap{ci_minor}"]
            assert node_paths(spec, device["uuid"]) == wanted == node_paths(spec, f"{gpu}:{device['index']}")
        for node_entry in edits(spec, devices[0]["uuid"])["deviceNodes"]:
            assert node_entry["hostPath"] == str(root) + node_entry["path"]
        assert node_paths(spec, f"{small[0]['uuid']}::1") == node_paths(spec, small[0]["uuid"])
        assert "env" not in edits(spec, f"{small[0]['uuid']}::1")  # time-slicing needs nothing more
        assert node_paths(spec, "0") == ["/dev/nvidia0"]
        assert set(node_paths(spec, "all")) == {p for d in devices for p in node_paths(spec, d["uuid"])}
        assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == \
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    finally:
        await stop_daemon(node)


async def test_device_nodes_only_where_they_exist(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=2, control=("nvidiactl",))
    (root / "dev" / "nvidia1").unlink()
    (root / "dev" / "nvidia-fake").write_text("a regular file is no device node")
    node = await start_daemon(cdi_config(short_tmp, "A100-SXM4-40GB:2", root))
    try:
        view = await cdi_until(node, lambda v: v["devices"])
        _, gpus = await node.get("/v1/gpus")
        gpu0, gpu1 = gpus["gpus"]
        assert view["devices"] == ["0", gpu0["uuid"], "all"]
        assert view["unavailable"] == [{"device": name, "reason": "no device node /dev/nvidia1 on the host"}
                                       for name in ("1", gpu1["uuid"])]
        assert [n["path"] for n in view["spec"]["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl"]
        validate(view["spec"])
        # a MIG device whose capability nodes are missing is left out, its GPU stays
        assert (await put_layout(node, "all-3g.20gb"))[0] == 200
        devices = await mig_devices(node)
        gone = [d for d in devices if d["gpu"] == 0][0]
        minor = parse_mig_minors(mig_minors_text())[f"gpu0/gi{gone['gi_id']}/ci{gone['ci_id']}/access"]
        (root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}").unlink()
        node.daemon.cdi.refresh("test: a node went")
        _, view = await node.get("/v1/cdi")
        validate(view["spec"])
        assert gone["uuid"] not in view["devices"] and "0" in view["devices"]
        assert {"device": gone["uuid"], "reason": f"no device node /dev/nvidia-caps/nvidia-cap{minor} on the host"} \
            in view["unavailable"]
    finally:
        await stop_daemon(node)


@pytest.mark.slow
async def test_a_mig_change_on_a_dgx_a100_shows_exactly_the_new_devices_within_a_second(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=8)
    node = await start_daemon(cdi_config(short_tmp, "dgx-a100", root))
    try:
        await mig_settled(node)
        assert (await put_layout(node, "all-balanced"))[0] == 200
        old = {d["uuid"] for d in await mig_devices(node)}
        await cdi_until(node, lambda v: old <= set(v["devices"]))
        status, _ = await put_layout(node, "all-1g.5gb")
        applied = time.monotonic()
        assert status == 200
        new = {d["uuid"] for d in await mig_devices(node)}
        assert len(new) == 8 * 7 and old - new

        def only_new(view):
            return {name for name in view["devices"] if name.startswith("MIG-")} == new
        view = await cdi_until(node, only_new, timeout=1.0 - (time.monotonic() - applied))
        assert not (old - new) & set(view["devices"])  # removed devices are gone
        on_disk = json.loads((short_tmp / "state" / "cdi" / "gpud-gpu.json").read_text())
        assert {d["name"] for d in on_disk["devices"] if d["name"].startswith("MIG-")} == new
        assert sum(":" in name and "::" not in name for name in view["devices"]) == 8 * 7
        validate(on_disk)
    finally:
        await stop_daemon(node)


@pytest.mark.usefixtures("mps_tmp")
async def test_mps_replicas_carry_the_client_environment_and_the_pipe_mount(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=1)
    sharing = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
    config = sharing_config(short_tmp, "t4", sharing).with_overrides(**{
        "cdi.dev_root": str(root), "mps.enabled": True, "mps.pipe_root": str(short_tmp / "mps"),
        "mps.log_root": str(short_tmp / "mpslog")})
    node = await start_daemon(config)
    try:
        _, gpu = await node.get("/v1/gpus/0")
        view = await cdi_until(node, lambda v: f"{gpu['uuid']}::1" in v["devices"], timeout=10)
        validate(view["spec"])
        pipe = str(short_tmp / "mps" / "gpu0" / "pipe")
        replica = edits(view["spec"], f"{gpu['uuid']}::0")
        assert replica["env"] == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                                  f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={gpu['memory_total_mib'] // 2}M",
                                  f"CUDA_MPS_PIPE_DIRECTORY={pipe}", f"CUDA_VISIBLE_DEVICES={gpu['uuid']}"]
        assert replica["mounts"] == [{"hostPath": pipe, "containerPath": pipe,
                                      "options": ["rw", "nosuid", "nodev", "bind"]}]
        _, client = await node.get("/v1/mps/gpu0/client-env")
        assert sorted(f"{k}={v}" for k, v in client["env"].items()) == replica["env"]
        assert node_paths(view["spec"], f"{gpu['uuid']}::0") == ["/dev/nvidia0"]
    finally:
        await stop_daemon(node)


async def test_mps_replicas_without_a_daemon_are_left_out(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=1)
    sharing = "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
    config = sharing_config(short_tmp, "t4", sharing).with_overrides(**{"cdi.dev_root": str(root)})
    node = await start_daemon(config)
    try:
        view = await cdi_until(node, lambda v: v["devices"])
        validate(view["spec"])
        _, gpu = await node.get("/v1/gpus/0")
        assert view["devices"] == ["0", gpu["uuid"], "all"]
        assert [u["device"] for u in view["unavailable"]] == [f"{gpu['uuid']}::0", f"{gpu['uuid']}::1"]
        assert all(u["reason"] == f"no MPS daemon serves {gpu['uuid']}" for u in view["unavailable"])
    finally:
        await stop_daemon(node)


@pytest.mark.slow
async def test_a_reader_never_sees_half_a_spec(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=8)
    node = await start_daemon(cdi_config(short_tmp, "dgx-a100", root))
    path = short_tmp / "state" / "cdi" / "gpud-gpu.json"
    seen, bad, stop = set(), [], threading.Event()

    def read_loop():
        while not stop.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                seen.add(len(json.loads(text)["devices"]))
            except ValueError:
                bad.append(text)
    try:
        await cdi_until(node, lambda v: v["devices"])
        reader = threading.Thread(target=read_loop)
        reader.start()
        gpu7 = root / "dev" / "nvidia7"
        for _ in range(40):  # GPU 7's node goes and comes back: each refresh rewrites the spec
            gpu7.unlink() if gpu7.exists() else os.mknod(gpu7, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            node.daemon.cdi.refresh("test")
            await asyncio.sleep(0.005)
        stop.set()
        reader.join(10)
        assert not reader.is_alive(), "the reader thread did not end"
        assert bad == [] and len(seen) == 2, (seen, bad[:1])
        validate(json.loads(path.read_text()))
        assert [p.name for p in path.parent.iterdir()] == ["gpud-gpu.json"]  # no temporary files left
    finally:
        stop.set()
        await stop_daemon(node)


async def test_an_unwritable_spec_dir_is_reported_and_gpud_keeps_serving(short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=1)
    blocker = short_tmp / "blocker"
    blocker.write_text("a file where the spec directory should be")
    node = await start_daemon(cdi_config(short_tmp, "A100-SXM4-40GB:1", root, spec_dir=str(blocker / "cdi")),
                              healthy=False)
    try:
        view = await cdi_until(node, lambda v: v["error"])
        assert view["error"].startswith(f"cannot write {blocker / 'cdi' / 'gpud-gpu.json'}") and view["spec"] is None
        _, health = await node.get("/healthz")
        assert view["error"] in health["problems"], health
        blocker.unlink()
        node.daemon.cdi.refresh("test: the directory can be made now")
        _, view = await node.get("/v1/cdi")
        assert view["error"] is None and (blocker / "cdi" / "gpud-gpu.json").exists()
        validate(json.loads((blocker / "cdi" / "gpud-gpu.json").read_text()))
        _, health = await node.get("/healthz")
        assert not any("gpud-gpu.json" in problem for problem in health.get("problems", [])), health
    finally:
        await stop_daemon(node)


async def test_turned_off_no_spec_and_the_old_one_is_removed(short_tmp):
    (short_tmp / "state").mkdir(mode=0o700)
    (short_tmp / "state" / "cdi").mkdir()
    (short_tmp / "state" / "cdi" / "gpud-gpu.json").write_text('{"cdiVersion": "0.3.0", "kind": "gpud/gpu", "devices": []}')
    node = await start_daemon(cdi_config(short_tmp, "A100-SXM4-40GB:1", short_tmp, enabled=False))
    try:
        status, view = await node.get("/v1/cdi")
        assert status == 200 and (view["enabled"], view["path"], view["devices"]) == (False, None, [])
        assert_matches_openapi("GET", "/v1/cdi", 200, view)
        assert not (short_tmp / "state" / "cdi" / "gpud-gpu.json").exists()
    finally:
        await stop_daemon(node)


async def test_no_device_node_no_spec_file(short_tmp):
    """A simulated node with the real /dev (no NVIDIA nodes here): nothing to hand out, and a spec without
    devices is one CDI readers refuse, so there is no file."""
    if Path("/dev/nvidia0").exists():
        pytest.skip("this host has NVIDIA device nodes")
    node = await start_daemon(cdi_config(short_tmp, "A100-SXM4-40GB:1", Path("/")))
    try:
        view = await cdi_until(node, lambda v: v["written_at"])
        assert view["devices"] == [] and len(view["unavailable"]) == 2
        assert not (short_tmp / "state" / "cdi" / "gpud-gpu.json").exists()
    finally:
        await stop_daemon(node)


# The production default, cdi.dev_root "/": gpud in a private mount namespace (unshare --mount) whose
# /dev is a tmpfs holding a few ordinary nodes and NVIDIA stand-ins (/dev/null's numbers, harmless).
PRIVATE_DEV = """set -e
mount -t tmpfs -o mode=755 gpud-test-dev /dev
mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/urandom c 1 9
for name in nvidia0 nvidia1 nvidiactl nvidia-uvm nvidia-uvm-tools; do mknod -m 666 /dev/$name c 1 3; done
exec "$@"
"""


def serve_behind(prefix: list[str], tmp: Path, *args: str) -> tuple[subprocess.Popen, Client]:
    """`gpud serve` on a simulated node, started through a command prefix (a namespace, another user)."""
    with (tmp / "gpud.log").open("w") as log:
        gpud = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gpud", "serve", "--sim-state", str(tmp / "sim.json"),
             "--socket", str(tmp / "gpud.sock"), "--state-dir", str(tmp / "state"), "--log-format", "json", *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return gpud, Client(tmp / "gpud.sock", timeout=10)


def spec_served(gpud: subprocess.Popen, client: Client, log: Path) -> dict:
    def written():
        assert gpud.poll() is None, log.read_text()
        try:
            return client.get("/v1/cdi")["spec"]
        except DaemonUnreachable:
            return None
    return until(written, 20, "the spec")


def stop_served(gpud: subprocess.Popen) -> None:
    gpud.terminate()
    assert gpud.wait(10) == 0


@pytest.mark.slow
def test_with_the_production_dev_root_the_cdi_library_takes_the_spec(short_tmp):
    """No hostPath at all, yet names such as "0" need cdiVersion 0.5.0: a 0.3.0 spec is refused whole."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        if IN_CI:
            pytest.fail("CI runs as root, with util-linux's unshare")
        pytest.skip("needs root for a private mount namespace")
    (short_tmp / "gpud.yaml").write_text(f"cdi:\n  dev_root: /\nmig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    gpud, client = serve_behind(["unshare", "--mount", "sh", "-c", PRIVATE_DEV, "sh"], short_tmp,
                                "--simulate", "A100-SXM4-40GB:2", "--config", str(short_tmp / "gpud.yaml"))
    try:
        spec = spec_served(gpud, client, short_tmp / "gpud.log")
        gpus = client.get("/v1/gpus")["gpus"]
        assert [d["name"] for d in spec["devices"]] == ["0", gpus[0]["uuid"], "1", gpus[1]["uuid"], "all"]
        assert not any("hostPath" in node for device in spec["devices"]
                       for node in device["containerEdits"]["deviceNodes"])
        assert spec["containerEdits"]["deviceNodes"] == [{"path": p} for p in CONTROL_NODES]
        assert spec["cdiVersion"] == "0.5.0"
        validate(spec)
        assert json.loads((short_tmp / "state" / "cdi" / "gpud-gpu.json").read_text()) == spec
        # what gpud wrote before: the CDI library refuses it whole, none of its devices can be had
        devices, errors = cdi_library_verdict({**spec, "cdiVersion": "0.3.0"})
        assert devices == [] and "the spec version must be at least v0.5.0" in errors
    finally:
        stop_served(gpud)


# -- a simulated node's device nodes ---------------------------------------------------------------


@pytest.mark.slow
def test_the_quick_start_as_an_ordinary_user_lists_every_gpu(short_tmp):
    """`gpud serve --simulate dgx-a100` without root: the simulator makes its device nodes (links to
    /dev/null, no mknod) and its driver's file tree, so `gpud cdi` lists every GPU, the spec carries the
    simulated driver version's libraries, binaries and firmware as on a real node, and the CDI library
    takes it."""
    as_user = []
    if os.geteuid() == 0:  # be an ordinary user, nobody, for gpud and for its client
        if shutil.which("setpriv") is None:
            pytest.fail("setpriv (util-linux) is missing")
        os.chown(short_tmp, 65534, 65534)
        as_user = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"]
    gpud, _ = serve_behind(as_user, short_tmp, "--simulate", "dgx-a100")

    def gpud_cdi(*args):
        return subprocess.run([*as_user, sys.executable, "-m", "gpud", "cdi", "--socket", str(short_tmp / "gpud.sock"),
                               *args], capture_output=True, text=True, timeout=60, cwd=REPO)

    def written():
        assert gpud.poll() is None, (short_tmp / "gpud.log").read_text()
        shown = gpud_cdi("--json")  # fails until gpud listens
        return shown.returncode == 0 and json.loads(shown.stdout)["written_at"] and json.loads(shown.stdout)
    try:
        view = until(written, 20, "the spec")
        spec, names = view["spec"], view["devices"]
        assert names[-1] == "all" and len(names) == 2 * 8 + 1 and view["unavailable"] == []
        assert names[:-1:2] == [str(index) for index in range(8)] and all(n.startswith("GPU-") for n in names[1:-1:2])
        validate(spec)
        shown = gpud_cdi()
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines() == [f"CDI spec: {short_tmp / 'state' / 'cdi' / 'gpud-gpu.json'}  kind: gpud/gpu  "
                                             f"devices: {len(names)}"] + [f"  gpud/gpu={name}" for name in names]
        dev = short_tmp / "sim.json.dev" / "dev"
        assert os.readlink(dev / "nvidia7") == "/dev/null" and (dev / "nvidia7").lstat().st_uid == os.stat(short_tmp).st_uid
        assert {path.name for path in dev.iterdir() if path.is_symlink()} == \
            {f"nvidia{minor}" for minor in range(8)} | {"nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"}
        # the driver's MIG capability nodes of these 8 GPUs, config and monitor: as the minors table says
        minors = parse_mig_minors(mig_minors_text())
        wanted = {f"nvidia-cap{m}" for cap, m in minors.items() if not cap.startswith("gpu") or int(cap[3:cap.index("/")]) < 8}
        assert {path.name for path in (dev / "nvidia-caps").iterdir()} == wanted
        for node in [n for device in spec["devices"] for n in device["containerEdits"]["deviceNodes"]]:
            assert node["hostPath"] == "/dev/null", node  # what the link resolves to: the CDI library lstats hostPath
        # the simulated driver's files, from its tree beside the state, made by the same ordinary user
        version, tree = parse_driver(None).version, short_tmp / "sim.json.driver"
        mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
        assert set(mounts) == {f"/{library_dir()}/{stem}.so.{version}" for stem in LIBRARIES} | \
            {f"/usr/bin/{name}" for name in BINARIES} | {f"/lib/firmware/nvidia/{version}/gsp_{family}.bin"
                                                         for family in ("ga10x", "tu10x")}
        assert all(host == f"{tree}{container}" for container, host in mounts.items())
        assert (tree / "etc" / "ld.so.cache").stat().st_uid == os.stat(short_tmp).st_uid
        assert f"libnvidia-ml.so.{version}::/{library_dir()}/libnvidia-ml.so.1" in \
            [arg for hook in spec["containerEdits"]["hooks"] for arg in hook["args"]]
    finally:
        stop_served(gpud)


@pytest.mark.parametrize("text, error", [
    ("cdi:\n  enabled: maybe\n", "cdi.enabled"), ("cdi:\n  spec_dir: 3\n", "cdi.spec_dir"),
    ("cdi: [1]\n", "cdi"), ("cdi:\n  dev_root: ''\n", "cdi.dev_root"), ("cdi:\n  colour: red\n", "cdi.colour")])
def test_bad_cdi_config_is_refused(text, error):
    from gpud.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as raised:
        parse_config(text)
    assert raised.value.key == error


# -- a real runtime --------------------------------------------------------------------------------


@pytest.mark.slow
def test_podman_runs_containers_with_mps_replicas_and_mig_devices(run_gpud, mps_tmp):
    need_podman_as_root()
    if shutil.which("busybox") is None:
        if IN_CI:
            pytest.fail("CI needs busybox-static (scripts/test-all installs it)")
        pytest.skip("busybox-static is not installed")
    tmp = mps_tmp
    root = stand_in_nodes(tmp / "root", gpus=1)
    rootfs = minimal_rootfs(tmp / "rootfs", "busybox")
    (tmp / "sharing.yaml").write_text("version: v1\nsharing:\n  mps:\n    resources:\n"
                                      "    - name: nvidia.com/gpu\n      replicas: 2\n")
    config = (
        f"cdi:\n  spec_dir: {RUNTIME_SPEC_DIR}\n  dev_root: {root}\n  driver_files: false\n"  # see run_in_container
        f"sharing:\n  file: {tmp / 'sharing.yaml'}\n"
        f"mps:\n  enabled: true\n  pipe_root: {tmp / 'mps'}\n  log_root: {tmp / 'mpslog'}\n"
        f"mig:\n  layouts_file: {tmp / 'absent.yaml'}\n")
    with gpud_on_the_runtimes_spec_dir(run_gpud, tmp, config, "--simulate", "A100-SXM4-40GB:1") as gpud:
        replica = f"{gpud.client.get('/v1/gpus/0')['uuid']}::0"
        gpud.wait_for(lambda: replica in gpud.client.get("/v1/cdi")["devices"], 20, "the MPS replicas")
        spec = gpud.client.get("/v1/cdi")["spec"]
        validate(spec)
        inside = run_in_container(rootfs, replica, "env; ls /dev; cat /proc/mounts")
        assert inside.returncode == 0, inside.stderr
        lines = inside.stdout.splitlines()
        assert edits(spec, replica)["env"] and all(variable in lines for variable in edits(spec, replica)["env"])
        pipe = str(tmp / "mps" / "gpu0" / "pipe")
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in lines and f" {pipe} " in inside.stdout
        assert {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} <= set(lines)

        assert cli("mig", "apply", "all-3g.20gb", socket=gpud.socket).returncode == 0
        old = [d["uuid"] for d in gpud.client.get("/v1/gpus/0")["mig"]["devices"]]
        gpud.wait_for(lambda: set(old) <= set(gpud.client.get("/v1/cdi")["devices"]), 5, "the MIG devices")
        assert_runs_with_its_nodes(gpud, rootfs, old[0])
        assert_unresolvable(rootfs, replica)  # the GPU's replicas went with its MIG mode

        assert cli("mig", "apply", "all-1g.5gb", socket=gpud.socket).returncode == 0
        new = [d["uuid"] for d in gpud.client.get("/v1/gpus/0")["mig"]["devices"]]
        gpud.wait_for(lambda: set(new) <= set(gpud.client.get("/v1/cdi")["devices"]), 5, "the new MIG devices")
        assert set(old) - set(new)
        for name in set(old) - set(new):
            assert_unresolvable(rootfs, name)
        assert_runs_with_its_nodes(gpud, rootfs, new[-1])


@pytest.mark.slow
def test_podman_takes_a_simulated_nodes_devices(run_gpud, short_tmp):
    """The simulator's device nodes as they are (links to /dev/null): podman runs a container with a GPU,
    whose nodes are the character devices the links resolve to."""
    need_podman_as_root()
    rootfs = minimal_rootfs(short_tmp / "rootfs", "busybox")
    config = (f"cdi:\n  spec_dir: {RUNTIME_SPEC_DIR}\n  driver_files: false\n"  # see run_in_container
              f"mig:\n  layouts_file: {short_tmp / 'absent.yaml'}\n")
    with gpud_on_the_runtimes_spec_dir(run_gpud, short_tmp, config, "--simulate", "A100-SXM4-40GB:2") as gpud:
        gpud.wait_for(lambda: "1" in gpud.client.get("/v1/cdi")["devices"], 10, "the spec")
        validate(gpud.client.get("/v1/cdi")["spec"])
        inside = run_in_container(rootfs, "1", "ls -l /dev")
        assert inside.returncode == 0, inside.stderr
        nodes = {line.split()[-1]: line for line in inside.stdout.splitlines() if " nvidia" in line}
        assert sorted(nodes) == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl"]
        assert all(line.startswith("c") and " 1,   3 " in line for line in nodes.values()), nodes


def assert_runs_with_its_nodes(gpud, rootfs: Path, device: str) -> None:
    """A container with the device has exactly the device nodes the spec gives it, the GPU's and its MIG caps."""
    inside = run_in_container(rootfs, device, "ls /dev /dev/nvidia-caps")
    assert inside.returncode == 0, inside.stderr
    spec = gpud.client.get("/v1/cdi")["spec"]
    validate(spec)
    wanted = node_paths(spec, device)
    caps = sorted(path.rsplit("/", 1)[1] for path in wanted if path.startswith("/dev/nvidia-caps/"))
    assert len(caps) == 2 and inside.stdout.split("/dev/nvidia-caps:")[1].split() == caps
    assert "nvidia0" in inside.stdout.split()


def assert_unresolvable(rootfs: Path, device: str) -> None:
    refused = run_in_container(rootfs, device, "true")
    assert refused.returncode != 0 and "unresolvable CDI devices" in refused.stderr, refused.stderr


def run_in_container(rootfs: Path, device: str, script: str):
    """The container's root is read-only: these tests are about device nodes, so their gpud leaves the
    driver's files out, whose hooks write links and the linker cache into it
    (test_cdi_driver.py runs containers with them)."""
    return podman(*PODMAN_RUN, "--rm", "--read-only", "--device", f"gpud/gpu={device}", "--rootfs", str(rootfs),
                  "/bin/busybox", "sh", "-c", script)



@pytest.mark.slow
def test_gpud_cdi_prints_the_names_a_runtime_takes(run_gpud, short_tmp):
    root = stand_in_nodes(short_tmp / "root", gpus=1)
    blocker = short_tmp / "blocker"
    (short_tmp / "gpud.yaml").write_text(f"cdi:\n  dev_root: {root}\nmig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(short_tmp / "gpud.yaml"))
    gpud.wait_healthy()
    uuid = gpud.client.get("/v1/gpus/0")["uuid"]
    gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["devices"], 5, "the spec")
    validate(gpud.client.get("/v1/cdi")["spec"])
    shown = cli("cdi", socket=gpud.socket)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"CDI spec: {short_tmp / 'state' / 'cdi' / 'gpud-gpu.json'}  kind: gpud/gpu  devices: 3",
                                         "  gpud/gpu=0", f"  gpud/gpu={uuid}", "  gpud/gpu=all"]
    as_json = cli("cdi", "--json", socket=gpud.socket)
    assert json.loads(as_json.stdout)["devices"] == ["0", uuid, "all"]
    assert gpud.stop() == 0
    blocker.write_text("not a directory")
    (short_tmp / "gpud.yaml").write_text(f"cdi:\n  dev_root: {root}\n  spec_dir: {blocker / 'cdi'}\n"
                                         f"mig:\n  layouts_file: {short_tmp / 'none.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(short_tmp / "sim.json"),
                    "--config", str(short_tmp / "gpud.yaml"))
    gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["error"], 10, "the write error")
    failed = cli("cdi", socket=gpud.socket)
    assert failed.returncode == 1 and f"error: cannot write {blocker / 'cdi' / 'gpud-gpu.json'}" in failed.stdout
    assert gpud.stop() == 0
