"""gpud's NFD labels measured against the real things: NVIDIA's GPU feature discovery (GFD) on NVIDIA's
mock NVML for names and values, and Kubernetes' own label rules for every label of every simulated
preset and every mock node.

GFD (../shared/nvidia-device-plugin/bin/gpu-feature-discovery) and gpud's real NVML backend both run on
the mock (../shared/nvidia-mock-nvml), so they read the same node; every label gpud writes under one of
GFD's names must carry GFD's value, and every GFD label gpud leaves out is one GFD_LABELS_NOT_WRITTEN
names with its reason (docs/kubernetes.md lists the same)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from helpers import (IN_CI, MOCK_NVML_CONFIGS, REPO, SHARED, GpudProcess, mig_settled, mock_nvml_library, put_layout,
                     sharing_config, stand_in_nodes, start_daemon, stop_daemon, until_async)
from test_nfd import dmi_sysfs, nfd_labels, parse_feature_text
from test_sharing import gpu, node

from gpud.model.inventory import normal_bus_id
from gpud.nfd.labels import OWN_LABELS, gfd_node_labels, gpu_mode
from gpud.nvml.sim.presets import PRESETS
from gpud.sharing.resources import compute_sharing

GFD = SHARED / "nvidia-device-plugin" / "bin" / "gpu-feature-discovery"
MOCK_SOURCE = SHARED / "nvidia-mock-nvml"
MOCK_CONFIGS = MOCK_NVML_CONFIGS

# GFD's labels gpud does not write, and why (docs/kubernetes.md "GFD labels gpud does not write").
GFD_LABELS_NOT_WRITTEN = {
    "nvidia.com/gpu.clique": "the NVLink fabric clique (nvmlDeviceGetGpuFabricInfo): gpud does not read fabric info",
    "nvidia.com/gfd.timestamp": "GFD's own liveness mark; gpud's labels expire instead (# +expiry-time)",
}


# -- Kubernetes' rules for a label, as nfd-master applies them ----------------------------------------
# kubernetes-sigs/node-feature-discovery pkg/apis/nfd/nodefeaturerule/validate/validate.go Label():
# k8svalidation.IsQualifiedName(key), a non-empty namespace outside kubernetes.io, and
# IsValidLabelValue(value); k8s.io/apimachinery pkg/util/validation/validation.go gives the formats.

QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")  # qualifiedNameFmt
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # labelValueFmt


def kubernetes_refuses(key: str, value: str) -> str | None:
    parts = key.split("/")
    if len(parts) != 2:
        return "no namespace (NFD's validate.Label: unprefixed keys are not allowed)" if len(parts) == 1 \
            else "more than one '/'"
    namespace, name = parts
    if not namespace or len(namespace) > 253 or not DNS1123_SUBDOMAIN.fullmatch(namespace):
        return f"namespace {namespace!r} is not a DNS-1123 subdomain of at most 253 characters"
    if namespace == "kubernetes.io" or namespace.endswith(".kubernetes.io"):
        return "a kubernetes.io namespace"
    if not name or len(name) > 63 or not QUALIFIED_NAME.fullmatch(name):
        return f"name {name!r} is not a qualified name of at most 63 characters"
    if len(value) > 63 or not LABEL_VALUE.fullmatch(value):
        return f"value {value!r} is not a label value of at most 63 characters"
    return None


def invalid_labels(labels: dict[str, str]) -> dict[str, str]:
    return {f"{key}={value}": problem for key, value in labels.items() if (problem := kubernetes_refuses(key, value))}


@pytest.mark.parametrize("key, value", [
    ("gpu.count", "8"), ("nvidia.com/a/b", "1"), ("NVIDIA.com/gpu.count", "8"), ("kubernetes.io/arch", "x"),
    ("nvidia.com/" + "n" * 64, "1"), ("nvidia.com/-gpu", "1"), ("nvidia.com/gpu.count", "v" * 64),
    ("nvidia.com/gpu.product", "NVIDIA A100"), ("nvidia.com/gpu.product", "x-"), ("nvidia.com/x", "a+b"),
])
def test_the_rules_here_refuse_what_kubernetes_refuses(key, value):
    assert kubernetes_refuses(key, value)


def test_the_rules_here_accept_what_kubernetes_accepts():
    for key, value in {"nvidia.com/gpu.count": "8", "nvidia.com/cuda.driver.rev": "",
                       "nvidia.com/mig-1g.5gb.me.engines.ofa": "1", "nvidia.com/" + "n" * 63: "v" * 63,
                       "nvidia.com/gpu.machine": "DGXA100-920-23687-2530-000-rev.-1"}.items():
        assert kubernetes_refuses(key, value) is None, key


# -- GFD's node labels from an inventory, bad input included -------------------------------------------


def test_the_driver_and_cuda_versions_are_split_as_gfd_splits_them():
    labels = gfd_node_labels(node(gpu(0)), "m", "compute")
    assert {key: value for key, value in labels.items() if key.startswith("nvidia.com/cuda.")} == {
        "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "54", "nvidia.com/cuda.driver.rev": "15",
        "nvidia.com/cuda.driver-version.major": "550", "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15", "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/cuda.runtime-version.major": "12", "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4"}
    two_part = gfd_node_labels(replace(node(gpu(0)), driver_version="550.120"), "m", "compute")
    assert (two_part["nvidia.com/cuda.driver.rev"], two_part["nvidia.com/cuda.driver-version.revision"]) == ("", "")


@pytest.mark.parametrize("driver, cuda", [("550", "12.4"), ("1.2.3.4", "12.4"), ("", "12.4"),
                                          ("550.54.15", "unknown"), ("550.54.15", "12"), ("550.54.15", "12.x")])
def test_versions_gfd_could_not_read_give_no_labels(driver, cuda):
    """GFD refuses a driver version that is not X.Y[.Z] (nvml.go newVersionLabeler): no driver labels
    then, nor CUDA labels for a CUDA version that is not major.minor; the rest stays."""
    labels = gfd_node_labels(replace(node(gpu(0)), driver_version=driver, cuda_version=cuda), "m", "compute")
    assert labels["nvidia.com/gpu.family"] == "ampere" and invalid_labels(labels) == {}
    assert ("nvidia.com/cuda.driver.major" in labels) == (driver == "550.54.15")
    assert ("nvidia.com/cuda.runtime.major" in labels) == (cuda == "12.4")


@pytest.mark.parametrize("capability, family", [
    ("3.7", "kepler"), ("6.0", "pascal"), ("7.0", "volta"), ("7.5", "turing"), ("8.0", "ampere"), ("8.6", "ampere"),
    ("8.9", "ada-lovelace"), ("9.0", "hopper"), ("10.0", "blackwell"), ("12.0", "blackwell"), ("11.0", "undefined"),
])
def test_the_family_is_gfds_name_for_the_compute_capability(capability, family):
    labels = gfd_node_labels(node(gpu(0, cc=capability)), "m", "compute")
    major, minor = capability.split(".")
    assert (labels["nvidia.com/gpu.family"], labels["nvidia.com/gpu.compute.major"],
            labels["nvidia.com/gpu.compute.minor"]) == (family, major, minor)


@pytest.mark.parametrize("capability", ["0.0", "unknown", "", "8", "a.b"])
def test_an_unknown_compute_capability_gives_no_architecture_labels(capability):
    labels = gfd_node_labels(node(gpu(0, cc=capability)), "m", "compute")
    assert not {"nvidia.com/gpu.family", "nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor"} & set(labels)
    assert labels["nvidia.com/gpu.machine"] == "m"


def test_a_lost_gpu_is_not_the_one_described_and_no_gpus_give_no_labels():
    assert gfd_node_labels(node(gpu(0, cc="7.0", lost=True), gpu(1, cc="9.0")), "m", "compute")["nvidia.com/gpu.family"] == "hopper"
    assert gfd_node_labels(node(), "m", "compute") == {}  # GFD labels nothing on a node without GPUs
    assert gfd_node_labels(node(gpu(0, lost=True)), "m", "compute") == {}


# -- PCI config space, as the PCI Local Bus Specification 3.0 (6.1, 6.7) lays it out ------------------
# A type 0 header: vendor and device ids at 0x00, command and status at 0x04 (status bit 4: "Capabilities
# List"), class code at 0x09, subsystem ids at 0x2c, the capabilities pointer at 0x34; each capability is
# its id, the offset of the next (0: the last) and its own data.

POWER_MANAGEMENT, MSI, PCI_EXPRESS, VENDOR_SPECIFIC = 0x01, 0x05, 0x10, 0x09
# NVIDIA's GPUs on bare metal or passed through (lspci -v: "Capabilities: [60] Power Management version 3,
# [68] MSI, [78] Express Endpoint, [b4] Vendor Specific Information: Len=14"): the vendor-specific one is
# not a vGPU's (no "VF")
BARE_METAL_CAPABILITIES = ((0x60, POWER_MANAGEMENT, b"\x03\x00\x08\x00"), (0x68, MSI, b"\x80\x00"),
                           (0x78, PCI_EXPRESS, b"\x02\x00"), (0xB4, VENDOR_SPECIFIC, b"\x14\x01"))


def pci_config_space(capabilities=BARE_METAL_CAPABILITIES, *, size: int = 4096, capability_list: bool = True,
                     pointer: int | None = None) -> bytes:
    """An NVIDIA 3D controller's config space with these capabilities, (offset, id, data after the next
    pointer), chained in the order given (pointer: another capabilities pointer than the first's)."""
    config = bytearray(max(size, 256))
    config[0x00:0x04] = (0x10DE).to_bytes(2, "little") + (0x2330).to_bytes(2, "little")
    config[0x04:0x08] = (0x0006).to_bytes(2, "little") + (0x0010 if capability_list else 0).to_bytes(2, "little")
    config[0x08:0x0C] = bytes([0xA1, 0x00, 0x02, 0x03])  # revision, then class 0x030200
    config[0x2C:0x30] = (0x10DE).to_bytes(2, "little") + (0x16C1).to_bytes(2, "little")
    config[0x34] = capabilities[0][0] if pointer is None else pointer
    for number, (offset, identifier, data) in enumerate(capabilities):
        following = capabilities[number + 1][0] if number + 1 < len(capabilities) else 0
        config[offset:offset + 2 + len(data)] = bytes([identifier, following]) + data
    return bytes(config[:size])


def pci_sysfs(root: Path, classes: dict[str, str], config: bytes | None = None) -> Path:
    """A sysfs tree with a PCI device per bus id (sysfs's 4-digit domain), holding what go-nvlib's nvpci
    reads of it (vendor, class, device, numa_node, resource) and what GFD's vGPU labeler reads (config,
    as root reads it: a bare-metal GPU's unless given): enough for GFD and for gpud."""
    for address, pci_class in classes.items():
        device = root / "bus" / "pci" / "devices" / address
        device.mkdir(parents=True)
        for name, value in (("vendor", "0x10de"), ("class", pci_class), ("device", "0x20b0"), ("numa_node", "0"),
                            ("resource", "0x0000000000000000 0x0000000000000000 0x0000000000000000")):
            (device / name).write_text(value + "\n")
        (device / "config").write_bytes(pci_config_space() if config is None else config)
    return root


@pytest.mark.parametrize("classes, mode", [
    (["0x030200", "0x030200"], "compute"),  # 3D controller: a data-centre GPU
    (["0x030000"], "graphics"),  # VGA controller: a GPU with its display engine on
    (["0x030200", "0x030000"], "unknown"),  # GFD: not all GPUs of one class
    (["0x068000"], "unknown"),  # another class
    (["3D controller"], "unknown"),  # not a number
    ([None], "unknown"),  # the device is not in sysfs
])
def test_the_gpu_mode_is_the_pci_class_as_gfd_reads_it(tmp_path, classes, mode):
    bus_ids = tuple(f"00000000:{index + 7:02x}:00.0" for index in range(len(classes)))
    sysfs = pci_sysfs(tmp_path / "sys", {bus_id[4:]: pci_class for bus_id, pci_class in zip(bus_ids, classes)
                                          if pci_class is not None})
    assert gpu_mode(sysfs, bus_ids) == mode
    assert gpu_mode(sysfs, ("not a bus id",)) == "unknown"


def test_the_product_is_sanitised_as_gfd_sanitises_it():
    labels = compute_sharing(None, node(gpu(0, name="NVIDIA  RTX (beta) 6000+")))["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-RTX-beta-6000" and invalid_labels(labels) == {}


# -- every simulated preset ---------------------------------------------------------------------------

MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"
SINGLE = "version: v1\nflags:\n  migStrategy: single\n"


async def file_labels(node, layout: str | None = None, timeout: float = 5.0) -> dict[str, str]:
    """The labels of gpud's NFD file once it holds the MIG layout applied (if any) and no write is
    pending (the writer's view matches the file)."""
    path = node.daemon.nfd.path

    async def current():
        if not path.exists():
            return None
        _, view = await node.get("/v1/nfd")
        labels = nfd_labels(path)
        applied = layout is None or (labels.get("nvidia.com/mig.config"), labels.get("nvidia.com/mig.config.state")) \
            == (layout, "success")
        return labels if applied and view["labels"] == labels and view["error"] is None else None
    return await until_async(current, timeout=timeout, what=f"the NFD file with layout {layout}")


@pytest.mark.parametrize("preset", sorted(PRESETS))
async def test_every_label_of_every_preset_is_valid_for_kubernetes(short_tmp, preset):
    """MIG off, then (on MIG-capable GPUs) a layout of several profiles under the mixed strategy: every
    label, the per-profile ones included, passes Kubernetes' rules, and none is left out as invalid."""
    sysfs = dmi_sysfs(short_tmp / "sys", b"ProLiant DL380a Gen11 (P57871-B21)\n")
    node = await start_daemon(sharing_config(short_tmp, preset, MIXED).with_overrides(**{"sysfs": str(sysfs)}))
    try:
        await mig_settled(node)
        seen = [await file_labels(node)]
        if seen[0]["nvidia.com/mig.capable"] == "true":
            status, result = await put_layout(node, "all-balanced")
            assert status == 200 and result["state"] == "success", result
            seen.append(await file_labels(node, "all-balanced"))
            assert any(name.endswith(".engines.copy") and name.startswith("nvidia.com/mig-") for name in seen[1])
        for labels in seen:
            assert labels["nvidia.com/gpu.machine"] == "ProLiant-DL380a-Gen11-P57871-B21"
            assert invalid_labels(labels) == {}
        _, view = await node.get("/v1/nfd")
        assert view["dropped"] == []
    finally:
        await stop_daemon(node)


# NVIDIA's MIG user guide, "Supported MIG Profiles", A100-SXM4-40GB: SMs, copy engines, NVDECs, NVJPG, OFA
# per GPU instance (https://docs.nvidia.com/datacenter/tesla/mig-user-guide/).
A100_40GB_PROFILES = {"1g.5gb": (14, 1, 0, 0, 0), "2g.10gb": (28, 2, 1, 0, 0), "3g.20gb": (42, 3, 2, 0, 0),
                      "7g.40gb": (98, 7, 5, 1, 1)}


def attribute_labels(resource: str, profile: str) -> dict[str, str]:
    sms, copy, decoders, jpeg, ofa = A100_40GB_PROFILES[profile]
    slices = profile.split("g.")[0]
    return {f"{resource}.multiprocessors": str(sms), f"{resource}.slices.gi": slices,
            f"{resource}.slices.ci": slices, f"{resource}.engines.copy": str(copy),
            f"{resource}.engines.decoder": str(decoders), f"{resource}.engines.encoder": "0",
            f"{resource}.engines.jpeg": str(jpeg), f"{resource}.engines.ofa": str(ofa)}


async def test_mixed_strategy_labels_each_mig_profile_as_gfd_does(short_tmp):
    """mig-strategy.go newMigStrategyMixedLabeler: one resource per profile, each with its count, product,
    memory and the MIG device's attributes; the GPUs, all MIG-enabled, keep their own labels with
    replicas 0 (labelled without sharing)."""
    node = await start_daemon(sharing_config(short_tmp, "dgx-a100", MIXED))
    try:
        await mig_settled(node)
        status, _ = await put_layout(node, "all-balanced")
        assert status == 200
        labels = await file_labels(node, "all-balanced")
        for profile, count, memory in (("1g.5gb", 16, 4864), ("2g.10gb", 8, 9856), ("3g.20gb", 8, 19968)):
            resource = f"nvidia.com/mig-{profile}"
            assert {key: value for key, value in labels.items() if key.startswith(resource + ".")} == {
                f"{resource}.count": str(count), f"{resource}.memory": str(memory),
                f"{resource}.product": f"NVIDIA-A100-SXM4-40GB-MIG-{profile}", f"{resource}.replicas": "1",
                f"{resource}.sharing-strategy": "none", **attribute_labels(resource, profile)}
        assert (labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.family"]) \
            == ("8", "0", "ampere")
        assert "nvidia.com/gpu.multiprocessors" not in labels  # GFD gives whole GPUs no attributes
    finally:
        await stop_daemon(node)


async def test_single_strategy_labels_the_mig_devices_as_the_gpus(short_tmp):
    """mig-strategy.go newMigStrategySingleLabeler: one profile on every GPU is nvidia.com/gpu, with the
    MIG device's product, memory and attributes; the architecture labels stay the GPUs'."""
    node = await start_daemon(sharing_config(short_tmp, "dgx-a100", SINGLE))
    try:
        await mig_settled(node)
        status, _ = await put_layout(node, "all-1g.5gb")
        assert status == 200
        labels = await file_labels(node, "all-1g.5gb")
        assert {key: value for key, value in labels.items() if key.startswith("nvidia.com/gpu.")
                and key not in OWN_LABELS} == {
            "nvidia.com/gpu.count": "56", "nvidia.com/gpu.memory": "4864", "nvidia.com/gpu.replicas": "1",
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "nvidia.com/gpu.sharing-strategy": "none",
            "nvidia.com/gpu.family": "ampere", "nvidia.com/gpu.compute.major": "8",
            "nvidia.com/gpu.compute.minor": "0", "nvidia.com/gpu.machine": labels["nvidia.com/gpu.machine"],
            "nvidia.com/gpu.mode": "compute",  # the simulator's GPUs are 3D controllers in its sysfs
            **attribute_labels("nvidia.com/gpu", "1g.5gb")}
        assert not any(key.startswith("nvidia.com/mig-") for key in labels)

        status, _ = await put_layout(node, "all-balanced")  # several profiles: GFD's MIG-INVALID labels
        assert status == 200
        labels = await file_labels(node, "all-balanced")
        assert {key: labels[key] for key in ("nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.replicas",
                                             "nvidia.com/gpu.memory", "nvidia.com/gpu.sharing-strategy")} == {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-INVALID", "nvidia.com/gpu.count": "0",
            "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.memory": "0", "nvidia.com/gpu.sharing-strategy": "none"}
        assert "nvidia.com/gpu.multiprocessors" not in labels and invalid_labels(labels) == {}
    finally:
        await stop_daemon(node)


# -- against GFD on NVIDIA's mock NVML -----------------------------------------------------------------


def need_the_reference() -> None:
    """GFD, the mock's source, root (device nodes, a mount namespace) and unshare; CI has them all."""
    missing = [str(path) for path in (GFD, MOCK_SOURCE / "build") if not path.exists()]
    if os.geteuid() != 0:
        missing.append("root (mknod, mount namespaces)")
    if shutil.which("unshare") is None:
        missing.append("unshare (util-linux)")
    if missing:
        if IN_CI:
            pytest.fail(f"CI has ../shared and runs as root, but here is no {', '.join(missing)}")
        pytest.skip(f"needs {', '.join(missing)}")


@pytest.fixture(scope="module")
def mock_nvml() -> Path:
    need_the_reference()
    return mock_nvml_library()


def mock_env(mock: Path, config: str) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(mock), "MOCK_NVML_CONFIG": str(MOCK_CONFIGS / f"mock-nvml-config-{config}.yaml")}


def run_gfd(tmp: Path, mock: Path, config: str, gpus: int, strategy: str, sysfs: Path) -> dict[str, str]:
    """GFD once, on the mock, in a private mount namespace: stand-in device nodes over /dev and the test's
    PCI devices over /sys/bus/pci/devices; the machine type from the test's DMI file."""
    dev = stand_in_nodes(tmp / "gfd-root", gpus) / "dev"
    os.mknod(dev / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    output = tmp / "gfd-labels"
    mounts = 'mount --bind "$0" /dev && mount --bind "$1" /sys/bus/pci/devices && shift && exec "$@"'
    command = ["unshare", "--mount", "sh", "-c", mounts, str(dev), str(sysfs / "bus" / "pci" / "devices"), str(GFD),
               "--oneshot", "--use-node-feature-api=false", "--no-timestamp", f"--mig-strategy={strategy}",
               f"--machine-type-file={sysfs / 'class' / 'dmi' / 'id' / 'product_name'}", f"--output-file={output}"]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **mock_env(mock, config)})
    assert ran.returncode == 0, ran.stderr[-3000:]
    return parse_feature_text(output.read_text())


def run_gpud(tmp: Path, mock: Path, config: str, strategy: str, sysfs: Path) -> tuple[dict[str, str], list[dict]]:
    """gpud's real NVML backend on the mock: the labels of its NFD file, and its GPUs."""
    path = tmp / "features.d" / "gpud"
    (tmp / "sharing.yaml").write_text(f"version: v1\nflags:\n  migStrategy: {strategy}\n")
    (tmp / "gpud.yaml").write_text(f"sharing:\n  file: {tmp / 'sharing.yaml'}\n"
                                   f"nfd:\n  features_file: {path}\nsysfs: {sysfs}\n"
                                   f"cdi:\n  spec_dir: {tmp / 'cdi'}\n")  # not the host's /var/run/cdi
    gpud = GpudProcess(tmp, "--config", str(tmp / "gpud.yaml"), env=mock_env(mock, config))
    try:
        labels = gpud.wait_for(lambda: path.exists() and "nvidia.com/gpu.health" in (found := nfd_labels(path))
                               and found, what="gpud's NFD file")
        gpus = gpud.client.get("/v1/gpus")["gpus"]
    finally:
        assert gpud.stop() == 0, gpud.log_text()[-3000:]
    return labels, gpus


@pytest.fixture(scope="module")
def mock_bus_ids(mock_nvml, tmp_path_factory):
    """Each mock node's GPU bus ids, as gpud reads them, for a PCI tree in sysfs (once per node)."""
    found: dict[str, list[str]] = {}

    def bus_ids(config: str) -> list[str]:
        if config not in found:
            workdir = tmp_path_factory.mktemp(f"bus-{config}")
            _, gpus = run_gpud(workdir, mock_nvml, config, "none", workdir / "no-sys")
            found[config] = [gpu["pci_bus_id"] for gpu in gpus]
        return found[config]
    return bus_ids


MOCK_NODES = sorted(path.name.removeprefix("mock-nvml-config-").removesuffix(".yaml")
                    for path in MOCK_CONFIGS.glob("mock-nvml-config-*.yaml")) or ["a100"]


@pytest.mark.slow
@pytest.mark.parametrize("config", MOCK_NODES)
@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_gpud_and_gfd_agree_on_the_same_node(short_tmp, mock_nvml, mock_bus_ids, config, strategy):
    """One sysfs for both: a DMI product name, and the GPUs as bare-metal 3D controllers (their bus ids
    as NVML gives them; sysfs names them in lower case with a 4-digit domain)."""
    sysfs = dmi_sysfs(short_tmp / "sys", b"NVIDIA DGX H100 (rev. 2)\n")
    pci_sysfs(sysfs, {normal_bus_id(bus_id)[4:]: "0x030200" for bus_id in mock_bus_ids(config)})
    ours, gpus = run_gpud(short_tmp, mock_nvml, config, strategy, sysfs)
    gfd = run_gfd(short_tmp, mock_nvml, config, len(gpus), strategy, sysfs)

    assert gfd["nvidia.com/gpu.count"] == str(len(gpus))  # GFD read the same node
    shared = set(ours) & set(gfd)
    assert {name: ours[name] for name in shared} == {name: gfd[name] for name in shared}
    assert set(ours) - set(gfd) <= set(OWN_LABELS), "labels gpud writes under names GFD does not use"
    assert set(gfd) - set(ours) <= set(GFD_LABELS_NOT_WRITTEN), "GFD labels gpud leaves out without a reason"
    assert invalid_labels(ours) == {}
    # what gpud must write wherever GFD does, on every node
    assert {"nvidia.com/gpu.machine", "nvidia.com/gpu.mode", "nvidia.com/gpu.family", "nvidia.com/gpu.compute.major",
            "nvidia.com/cuda.driver-version.full", "nvidia.com/cuda.runtime-version.full",
            "nvidia.com/gpu.product", "nvidia.com/mig.capable", "nvidia.com/vgpu.present"} <= shared
    assert ours["nvidia.com/gpu.mode"] == "compute" and ours["nvidia.com/vgpu.present"] == "false"


# Real nodes on which scripts/hw-check ran GFD and gpud side by side (docs/hardware.md)
REAL_NODES = sorted(path.parent for path in (REPO / "tests" / "fixtures" / "hardware").glob("*/gfd-labels"))


@pytest.mark.parametrize("capture", REAL_NODES, ids=lambda path: path.name)
def test_gpud_and_gfd_agreed_on_a_real_gpu(capture):
    """The labels both wrote on the same real node; gpud's file read as nfd-master read it when gpud
    wrote it (its expiry has passed since)."""
    written = next(json.loads(line)["timestamp"] for line in (capture / "gpud-serve.log").read_text().splitlines()
                   if json.loads(line)["event"] == "nfd_file_written")
    ours = parse_feature_text((capture / "nfd" / "gpud").read_text(), now=datetime.fromisoformat(written))
    gfd = parse_feature_text((capture / "gfd-labels").read_text())
    shared = set(ours) & set(gfd)
    assert shared and {name: ours[name] for name in shared} == {name: gfd[name] for name in shared}
    assert set(ours) - set(gfd) <= set(OWN_LABELS), "labels gpud writes under names GFD does not use"
    # GFD ran with --mig-strategy=single; gpud labels a MIG strategy only when its sharing file sets one
    strategy = json.loads((capture / "api_v1_sharing.json").read_text())["mig_strategy"]
    left_out = set(GFD_LABELS_NOT_WRITTEN) | ({"nvidia.com/mig.strategy"} if strategy == "none" else set())
    # gpud wrote no vGPU label when these were captured (before issue 37); GFD saw a GPU passed through,
    # not a vGPU, which gpud now reads as GFD does (tests/test_nfd_vgpu.py)
    left_out.add("nvidia.com/vgpu.present")
    assert gfd["nvidia.com/vgpu.present"] == "false"
    assert set(gfd) - set(ours) <= left_out, "GFD labels gpud leaves out without a reason"


def test_the_docs_list_the_gfd_labels_gpud_does_not_write():
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    for name in GFD_LABELS_NOT_WRITTEN:
        assert f"`{name}`" in docs, name
