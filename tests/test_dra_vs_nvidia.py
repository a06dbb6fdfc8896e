"""`gpud dra-plugin` and NVIDIA's DRA kubelet plugin (../shared/nvidia-dra-driver, gpu-kubelet-plugin at
kubernetes-sigs/dra-driver-nvidia-gpu 22407113) side by side on the same mock node.

Both run on NVIDIA's mock NVML (../shared/nvidia-mock-nvml; its H100 and A100 configs, whole GPUs: the
mock's MIG calls are stubs): NVIDIA's plugin loads it from a driver root made by tests/dra_side_by_side.py
(the mock as the driver's libnvidia-ml, a stub libcuda, an ld.so.cache, stand-in /dev nodes), gpud serve
loads it through its real NVML backend with the same root as its CDI dev and driver root, and gpud's plugin
reads gpud. Each plugin publishes node1's pool of driver gpu.nvidia.com to its own API server stand-in, has
its own kubelet and CDI directories, and is called as the kubelet calls it (DRAPlugin v1 over its dra.sock,
45 s deadline), with the same claims.

The same: device names (gpu-<minor>), attribute names, types and values (`brand` too: go-nvlib
GetBrandAsString's "Nvidia" on the mock, which gpud's inventory reads; gpud leaves it out only where NVML does
not tell), capacity (memory), the slice's pool and owner; Prepare's answer (request, pool, device, CDI ID
`k8s.gpu.nvidia.com/claim=<uid>-gpu-0`), a spec the CDI library accepts with the same device node (path and
host path) for the device, the same control nodes, the same driver files mounted; a second Prepare of a claim
answers the same; a second claim on a prepared GPU is refused by both; Unprepare removes the spec, again is
success, an unknown claim too.

Documented differences (what gpud does otherwise, and why):
- attributes gpud adds (NVIDIA's has none; its issues #744, #1165 ask for them): `index`, `minor`,
  `nvlinkPeers` (where the GPU has NVLink peers), `numaNode` (where NVML gives one; the mock gives none)
  and `resource.kubernetes.io/pcieRoot` (where the bus id is a device in /sys; the mock's are not);
- the spec's file: NVIDIA writes YAML (`k8s.gpu.nvidia.com-claim_<uid>.yaml`), gpud JSON (`….json`);
  both are CDI's transient spec name for the claim, and runtimes read either;
- device nodes: NVIDIA's carry major, minor, fileMode and permissions (read from the host node); gpud's
  carry path and hostPath only: the runtime reads the rest from hostPath when it creates the container
  (CDI spec: "if not specified, read from the host path"), so the container gets the same node;
- env: NVIDIA's common edits add `NVIDIA_CTK_LIBCUDA_DIR=<libcuda's directory>` (read by its own
  nvidia-cdi-hook's enable-cuda-compat); both set `NVIDIA_VISIBLE_DEVICES=void`;
- hooks: NVIDIA's are its nvidia-cdi-hook (here /bin/true, --nvidia-cdi-hook-path) create-symlinks,
  enable-cuda-compat, update-ldcache and disable-device-node-modification; gpud's are its own hook program
  (gpud/cdi/hook.py) create-symlinks (the same links) and update-ldcache (the same folders). gpud has no
  enable-cuda-compat (CUDA forward-compatibility libraries in the image are not put ahead of the host's
  driver) and no disable-device-node-modification (NVML in the container may still make /dev nodes where
  the container may; gpud gives it no CAP_MKNOD either way);
- refusal text: NVIDIA "requested device gpu-0 is already allocated to different claim <uid>", gpud
  "device gpu-0 is held by claim <namespace>/<name> (<uid>); neither shares it".
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from cdi_library import assert_cdi_library_accepts
from dra_side_by_side import DRIVER, SideBySide, allocated_claim, mock_config, nvidia_missing
from helpers import mock_nvml_library, need

pytestmark = pytest.mark.slow

NODE = "node1"
GPUD_ONLY = {"index", "minor", "numaNode", "nvlinkPeers", "resource.kubernetes.io/pcieRoot"}
GPUS = {"h100": 8, "a100": 8}


@pytest.fixture(scope="module", params=sorted(GPUS))
def pair(request):
    why = nvidia_missing()
    need(why is None, why or "")
    need(shutil.which("gcc") is not None and shutil.which("ldconfig", path="/usr/sbin:/sbin") is not None,
         "gcc and ldconfig make the driver root's stub libcuda and its ld.so.cache")
    mock = mock_nvml_library()
    config = mock_config(request.param)
    need(config.exists(), f"{config} is absent")
    work = Path(tempfile.mkdtemp(prefix="gdv", dir="/tmp"))  # short: socket paths hold 108 bytes
    sides = SideBySide(work, mock, config, NODE)
    try:
        sides.wait_published(GPUS[request.param])
        yield sides
    finally:
        sides.stop()
        for kube in sides.kubes.values():
            assert kube.unmodelled == []
        shutil.rmtree(work, ignore_errors=True)


def _both(pair, name: str, device: str = "gpu-0") -> dict[str, tuple[str, str, str]]:
    return {side: allocated_claim(pair.kubes[side], name, device, NODE) for side in ("nvidia", "gpud")}


def _spec(plugin, uid: str) -> dict:
    (path,) = [p for p in plugin.cdi_dir.iterdir() if p.name.startswith(f"k8s.{DRIVER}-claim_{uid}.")]
    return yaml.safe_load(path.read_text())  # JSON is YAML


def _answer(response) -> list[tuple]:
    return [(tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids)) for d in response.devices]


def test_the_same_devices_attributes_and_capacity(pair):
    theirs, ours = pair.devices("nvidia"), pair.devices("gpud")
    assert sorted(ours) == sorted(theirs)
    gpus = {f"gpu-{g['minor_number']}": g for g in pair.gpud.client.get("/v1/gpus")["gpus"]}
    for name, nvidia in theirs.items():
        gpud = ours[name]
        expected = set(nvidia["attributes"])
        # the mock answers BRAND_NVIDIA (its configs' brand "nvidia"): gpud's inventory reads it, so both publish it
        assert gpus[name]["brand"] == "Nvidia" and "brand" in expected, name
        assert set(gpud["attributes"]) - GPUD_ONLY == expected, name
        for attribute in expected:  # the same type (string, version, int, bool) and value
            assert gpud["attributes"][attribute] == nvidia["attributes"][attribute], (name, attribute)
        assert gpud["attributes"]["index"] == {"int": gpus[name]["index"]}
        assert gpud["attributes"]["minor"] == {"int": gpus[name]["minor_number"]}
        assert gpud["capacity"] == nvidia["capacity"], name
        assert set(gpud) == set(nvidia) == {"name", "attributes", "capacity"}
    (their_slice,), (our_slice,) = (pair.kubes[s].resource_slices(NODE, DRIVER) for s in ("nvidia", "gpud"))
    for field in ("driver", "nodeName", "pool"):
        assert our_slice["spec"][field] == their_slice["spec"][field]
    for slice_ in (their_slice, our_slice):
        (owner,) = slice_["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("Node", NODE, True)


def test_prepare_gives_the_same_cdi_ids_and_device_nodes(pair):
    claims = _both(pair, "prepared")
    answers, specs = {}, {}
    for side, claim in claims.items():
        response = pair.plugins[side].prepare([claim])[claim[2]]
        assert not response.error, (side, response.error)
        answers[side] = _answer(response)
        assert answers[side] == [(("gpu",), NODE, "gpu-0", (f"k8s.gpu.nvidia.com/claim={claim[2]}-gpu-0",))]
        specs[side] = _spec(pair.plugins[side], claim[2])
        assert_cdi_library_accepts(specs[side])
        assert specs[side]["kind"] == "k8s.gpu.nvidia.com/claim"
        assert [d["name"] for d in specs[side]["devices"]] == [f"{claim[2]}-gpu-0"]
    theirs, ours = specs["nvidia"], specs["gpud"]

    def nodes(edits: dict) -> list[tuple[str, str]]:
        return sorted((n["path"], n.get("hostPath", n["path"])) for n in edits.get("deviceNodes") or [])

    assert nodes(ours["devices"][0]["containerEdits"]) == nodes(theirs["devices"][0]["containerEdits"]) == [
        ("/dev/nvidia0", str(pair.root / "dev" / "nvidia0"))]
    assert nodes(ours["containerEdits"]) == nodes(theirs["containerEdits"])  # nvidiactl, nvidia-uvm(-tools)
    assert sorted(m["containerPath"] for m in ours["containerEdits"]["mounts"]) == \
        sorted(m["containerPath"] for m in theirs["containerEdits"]["mounts"])
    # the documented differences, as they are: NVIDIA's extra env and hooks
    assert set(theirs["containerEdits"]["env"]) - set(ours["containerEdits"]["env"]) == {
        "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"}
    assert set(ours["containerEdits"]["env"]) == {"NVIDIA_VISIBLE_DEVICES=void"}

    def hooks(edits: dict) -> dict[str, list[str]]:  # subcommand: its arguments
        found = {}
        for hook in edits.get("hooks") or []:
            words = hook["args"]
            at = next(i for i, w in enumerate(words) if w in ("create-symlinks", "update-ldcache", "enable-cuda-compat",
                                                                "disable-device-node-modification"))
            found[words[at]] = [w for w in words[at + 1:] if not w.startswith("--ldconfig") and w != "/sbin/ldconfig"]
        return found

    their_hooks, our_hooks = hooks(theirs["containerEdits"]), hooks(ours["containerEdits"])
    assert set(their_hooks) - set(our_hooks) == {"enable-cuda-compat", "disable-device-node-modification"}
    assert our_hooks == {name: their_hooks[name] for name in ("create-symlinks", "update-ldcache")}
    for side, claim in claims.items():
        assert pair.plugins[side].unprepare([claim])[claim[2]].error == ""


def test_again_a_conflict_and_unprepare_have_the_same_outcome(pair):
    firsts, seconds = _both(pair, "first", "gpu-1"), _both(pair, "second", "gpu-1")
    for side, plugin in pair.plugins.items():
        first, second = firsts[side], seconds[side]
        answer = plugin.prepare([first])[first[2]]
        assert not answer.error, (side, answer.error)
        spec = _spec(plugin, first[2])
        # again: the same answer, the same spec
        again = plugin.prepare([first])[first[2]]
        assert (again.error, _answer(again)) == ("", _answer(answer)), side
        assert _spec(plugin, first[2]) == spec
        # another claim on the same GPU: refused, nothing written for it
        refused = plugin.prepare([second])[second[2]]
        assert refused.error and not refused.devices, side
        assert "gpu-1" in refused.error and first[2] in refused.error, (side, refused.error)
        assert not [p for p in plugin.cdi_dir.iterdir() if second[2] in p.name], side
        # Unprepare: the spec goes; again, and an unknown claim: success
        assert plugin.unprepare([first])[first[2]].error == ""
        assert not [p for p in plugin.cdi_dir.iterdir() if first[2] in p.name], side
        assert plugin.unprepare([first])[first[2]].error == ""
        unknown = ("default", "never", "0b0e4d7e-1111-2222-3333-444455556666")
        assert plugin.unprepare([unknown])[unknown[2]].error == ""
        # the GPU is free again: the second claim is prepared now
        assert not plugin.prepare([second])[second[2]].error, side
        assert plugin.unprepare([second])[second[2]].error == ""
        plugin.alive()
    for plugin in pair.plugins.values():
        assert list(plugin.cdi_dir.iterdir()) == []
