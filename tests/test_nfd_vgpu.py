"""GFD's vGPU labels (nvidia.com/vgpu.present, vgpu.host-driver-version, vgpu.host-driver-branch) read
from PCI config space as NVIDIA's GPU feature discovery reads them: the parser on config spaces built
as the PCI specification lays them out (vGPU, bare metal, none, truncated, looping, garbage), the
reading of a sysfs tree (hostile ones included), the label file of a simulated bare-metal node and of a
simulated VM with vGPUs, and NVIDIA's real GFD binary on the same trees (its reading is
NVIDIA/k8s-device-plugin internal/vgpu and internal/lm/vgpu.go)."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest
import structlog
from helpers import sim_config, start_daemon, stop_daemon, until_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_nfd import NO_GPUS, NO_SYSFS, dmi_sysfs, nfd_labels
from test_nfd_gfd import (BARE_METAL_CAPABILITIES, MSI, POWER_MANAGEMENT, VENDOR_SPECIFIC, mock_nvml,  # noqa: F401
                          pci_config_space, pci_sysfs, run_gfd)

from gpud.nfd.labels import feature_file, node_labels, vgpu_labels
from gpud.nvml.sim.errors import SimError
from gpud.nvml.sim.simulator import SimulatedNvml
from gpud.nvml.vgpu import (HostDriver, VgpuReader, VgpuReading, _Unreadable, host_driver, is_vgpu, read_vgpus,
                            vendor_capability)

VGPU_LABELS = ("nvidia.com/vgpu.present", "nvidia.com/vgpu.host-driver-version", "nvidia.com/vgpu.host-driver-branch")


def vgpu_capability_data(version: bytes = b"550.54.16", branch: bytes = b"r550_40", before: bytes = b"",
                         record_length: int = 22) -> bytes:
    """The data of a vGPU's vendor-specific capability after its next pointer: its length, "VF", records
    (id, length, data) before the host driver record, then that record (id 0): version and branch, 10
    NUL-padded bytes each (internal/vgpu/vgpu.go GetInfo)."""
    records = before + bytes([0, record_length]) + version.ljust(10, b"\0") + branch.ljust(10, b"\0")
    return bytes([3 + 2 + len(records)]) + b"VF" + records


def vgpu_config(**record) -> bytes:
    """A VM's vGPU: the vGPU capability first in the chain, then MSI; conventional PCI, 256 bytes."""
    return pci_config_space(((0xD0, VENDOR_SPECIFIC, vgpu_capability_data(**record)), (0x68, MSI, b"\x80\x00")),
                            size=256)


# -- the parser ---------------------------------------------------------------------------------------


def test_a_vgpus_capability_gives_its_host_driver():
    capability = vendor_capability(vgpu_config())
    assert capability[:5] == bytes([VENDOR_SPECIFIC, 0x68, 27]) + b"VF" and len(capability) == 27
    assert is_vgpu(capability) and host_driver(capability) == HostDriver("550.54.16", "r550_40")


def test_a_bare_metal_gpu_has_a_vendor_capability_that_is_no_vgpus():
    capability = vendor_capability(pci_config_space())
    assert capability[:3] == bytes([VENDOR_SPECIFIC, 0, 0x14]) and not is_vgpu(capability)


@pytest.mark.parametrize("config", [
    pci_config_space(BARE_METAL_CAPABILITIES[:3]),  # no vendor-specific capability
    pci_config_space(capability_list=False),  # the status register says there is no list
    pci_config_space(pointer=0),  # an empty list
    pci_config_space(pointer=0xFF),  # off the bus: config space reads all ones; here one byte points there
    b"\xff" * 4096,  # a device off the bus: every read is all ones
    bytes(4096),
], ids=["no-vendor-capability", "no-list", "empty-list", "broken-pointer", "all-ones", "all-zeros"])
def test_no_vendor_capability(config):
    assert vendor_capability(config) is None


def test_only_the_first_vendor_capability_is_looked_at():
    """pciutil.go GetVendorSpecificCapability returns the first of id 0x09: a vGPU's after another
    vendor-specific capability is not seen (as GFD does not see it)."""
    config = pci_config_space(((0x60, VENDOR_SPECIFIC, b"\x08\x01"), (0xD0, VENDOR_SPECIFIC, vgpu_capability_data())))
    assert not is_vgpu(vendor_capability(config))


@pytest.mark.parametrize("pointers", [
    {0x60: 0x68, 0x68: 0x60},  # two capabilities pointing at each other
    {0x60: 0x60},  # one pointing at itself
    {0x40: 0x44, 0x44: 0x48, 0x48: 0x40},
], ids=["pair", "self", "three"])
def test_a_looping_capability_list_ends(pointers):
    config = bytearray(pci_config_space((), pointer=min(pointers)))
    for offset, following in pointers.items():
        config[offset:offset + 2] = bytes([POWER_MANAGEMENT, following])
    assert vendor_capability(bytes(config)) is None


def test_a_loop_after_the_vgpu_capability_does_not_matter():
    config = bytearray(vgpu_config())
    config[0x69] = 0xD0  # MSI points back at the vGPU capability
    assert host_driver(vendor_capability(bytes(config))) == HostDriver("550.54.16", "r550_40")


@pytest.mark.parametrize("size", [0, 64, 128, 255])
def test_config_space_gfd_would_refuse_is_unreadable(size):
    """pciutil.go: under 256 bytes is "entire PCI configuration is not read": the kernel gives users other
    than root only the first 64 (drivers/pci/pci-sysfs.c pci_read_config)."""
    with pytest.raises(_Unreadable, match="CAP_SYS_ADMIN"):
        vendor_capability(vgpu_config()[:size])


def test_a_capability_running_past_the_header_is_unreadable():
    """GFD slices Config[pos:pos+length] in bytes: past 255 it wraps below pos and panics."""
    config = bytearray(pci_config_space(((0xF0, VENDOR_SPECIFIC, b"\x20VF"),)))
    with pytest.raises(_Unreadable, match="0xf0"):
        vendor_capability(bytes(config))


@pytest.mark.parametrize("capability", [
    bytes([VENDOR_SPECIFIC, 0, 5]) + b"VF",  # the signature, no record
    bytes([VENDOR_SPECIFIC, 0, 10]) + b"VF" + bytes([0, 22, ord("5"), ord("5"), 0]),  # the record cut short
    bytes([VENDOR_SPECIFIC, 0, 9]) + b"VF" + bytes([1, 0, 0, 0]),  # a record of length 0: GFD loops for ever
    bytes([VENDOR_SPECIFIC, 0, 9]) + b"VF" + bytes([1, 0xFB, 0, 0]),  # a length that wraps back to the start
    bytes([VENDOR_SPECIFIC, 0, 9]) + b"VF" + bytes([1, 40, 0, 0]),  # a length past the end
    bytes([VENDOR_SPECIFIC, 0, 6]) + b"VF" + bytes([1]),  # a record id without its length
], ids=["no-record", "short-record", "zero-length", "wrapping", "past-the-end", "no-length"])
def test_a_vgpu_without_a_readable_host_driver_record(capability):
    assert is_vgpu(capability) and host_driver(capability) is None


def test_records_before_the_host_driver_record_are_skipped():
    data = vgpu_capability_data(before=bytes([7, 4, 0xAA, 0xBB]) + bytes([3, 2]))
    capability = vendor_capability(pci_config_space(((0xC0, VENDOR_SPECIFIC, data),), size=256))
    assert host_driver(capability) == HostDriver("550.54.16", "r550_40")


def test_the_host_driver_is_read_byte_by_byte_as_gfd_reads_it():
    """GetInfo appends string(byte): each byte is the code point of its value (Latin-1), and NULs are
    trimmed at both ends, not inside."""
    capability = vendor_capability(vgpu_config(version=b"\x00550.\xe9\x00x", branch=b"r550_40"))
    assert host_driver(capability) == HostDriver("550.\xe9\0x", "r550_40")
    assert host_driver(vendor_capability(vgpu_config(version=b"", branch=b""))) == HostDriver("", "")
    full = vendor_capability(vgpu_config(version=b"1234567890", branch=b"r123456789"))
    assert host_driver(full) == HostDriver("1234567890", "r123456789")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=4096))
def test_any_bytes_end_in_an_answer_or_unreadable(config):
    try:
        capability = vendor_capability(config)
    except _Unreadable:
        return
    if capability is not None and is_vgpu(capability):
        assert host_driver(capability) is None or isinstance(host_driver(capability), HostDriver)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=256, max_size=256), st.integers(0x40, 0xFF))
def test_any_capability_list_ends(config, pointer):
    config = bytearray(config)
    config[0x06], config[0x34] = 0x10, pointer
    try:
        vendor_capability(bytes(config))
    except _Unreadable:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=255))
def test_any_vgpu_capability_ends(records):
    host_driver(bytes([VENDOR_SPECIFIC, 0, min(255, 5 + len(records))]) + b"VF" + records)


# -- a node's sysfs -----------------------------------------------------------------------------------

GPU_ADDRESSES = ("0000:07:00.0", "0000:0f:00.0")


def gpu_tree(root: Path, config: bytes | None = None) -> Path:
    return pci_sysfs(root, {address: "0x030200" for address in GPU_ADDRESSES}, config)


def other_vendors_device(sysfs: Path) -> Path:
    """An Intel host bridge: its vendor is read, nothing else (GFD reads no more of another vendor's)."""
    device = sysfs / "bus" / "pci" / "devices" / "0000:00:00.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text("0x8086\n")
    return device


def test_bare_metal_gpus_are_no_vgpus(tmp_path):
    sysfs = gpu_tree(tmp_path / "sys")
    other_vendors_device(sysfs)
    assert read_vgpus(sysfs) == VgpuReading(False)


def test_vgpus_give_the_last_ones_host_driver(tmp_path):
    """lm/vgpu.go writes each vGPU's host driver in turn: the last in name order stays."""
    sysfs = gpu_tree(tmp_path / "sys", vgpu_config())
    (sysfs / "bus/pci/devices" / GPU_ADDRESSES[1] / "config").write_bytes(vgpu_config(version=b"550.90.05"))
    assert read_vgpus(sysfs) == VgpuReading(True, HostDriver("550.90.05", "r550_40"))


def test_a_vgpu_without_a_host_driver_record_is_present_and_said(tmp_path):
    """GFD fails as a whole there (GetInfo's error ends its labelling): gpud says vGPUs are present, leaves
    the host driver out and tells why."""
    capability = bytes([VENDOR_SPECIFIC, 0x68, 5]) + b"VF"
    sysfs = gpu_tree(tmp_path / "sys", pci_config_space(((0xD0, VENDOR_SPECIFIC, capability[2:]),), size=256))
    reading = read_vgpus(sysfs)
    assert (reading.present, reading.host_driver) == (True, None) and "host driver record" in reading.problem


def unreadable_config(device: Path, how: str) -> None:
    config = device / "config"
    config.unlink()
    if how == "missing":
        return
    if how == "directory":
        config.mkdir()
    elif how == "dangling-link":
        config.symlink_to(device / "nowhere")
    elif how == "link-loop":
        config.symlink_to(device / "config2")
        (device / "config2").symlink_to(config)
    elif how == "fifo":  # open would wait for a writer for ever without O_NONBLOCK
        os.mkfifo(config)
    elif how == "non-root-view":  # what the kernel gives a process without CAP_SYS_ADMIN
        config.write_bytes(pci_config_space()[:64])


@pytest.mark.parametrize("how, said", [("missing", "No such file"), ("directory", "directory"),
                                       ("dangling-link", "No such file"), ("link-loop", "symbolic links"),
                                       ("fifo", "a FIFO, not a regular file"), ("non-root-view", "CAP_SYS_ADMIN")])
def test_an_unreadable_config_space_gives_no_reading_and_says_why(tmp_path, how, said):
    """pciutil.go Devices: one NVIDIA device whose config cannot be read fails the reading (GFD labels
    nothing); gpud neither crashes nor hangs, and names the device."""
    sysfs = gpu_tree(tmp_path / "sys", vgpu_config())
    unreadable_config(sysfs / "bus/pci/devices" / GPU_ADDRESSES[1], how)
    reading = read_vgpus(sysfs)
    assert reading.present is None and GPU_ADDRESSES[1] in reading.problem and said in reading.problem


def test_hostile_trees_give_no_reading(tmp_path):
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    assert read_vgpus(tmp_path / "sys").present is None  # no PCI bus in sysfs at all
    devices.parent.mkdir(parents=True)
    devices.symlink_to(devices)  # the devices directory a link to itself
    assert "symbolic links" in read_vgpus(tmp_path / "sys").problem
    devices.unlink()
    devices.mkdir()
    (devices / "0000:07:00.0").symlink_to(devices / "0000:07:00.0")  # a device a link to itself
    assert "0000:07:00.0" in read_vgpus(tmp_path / "sys").problem
    (devices / "0000:07:00.0").unlink()
    (devices / "0000:07:00.0").write_text("not a directory")
    assert read_vgpus(tmp_path / "sys").present is None
    (devices / "0000:07:00.0").unlink()
    assert read_vgpus(tmp_path / "sys") == VgpuReading(False)  # an empty bus: no vGPU


def test_a_config_space_larger_than_pcies_is_read_only_so_far(tmp_path):
    """A config of 1 MiB of zeros: 4096 bytes read, no capability list, no vGPU. A link to /dev/zero
    (endless) is no config space at all: refused unread, as every host file that is not a regular file."""
    sysfs = gpu_tree(tmp_path / "sys")
    config = sysfs / "bus/pci/devices" / GPU_ADDRESSES[0] / "config"
    config.write_bytes(bytes(1 << 20))
    assert read_vgpus(sysfs) == VgpuReading(False)
    config.unlink()
    config.symlink_to("/dev/zero")
    reading = read_vgpus(sysfs)
    assert reading.present is None and "a character device, not a regular file" in reading.problem


def test_a_vendor_or_class_gfd_cannot_read_fails_the_reading(tmp_path):
    sysfs = gpu_tree(tmp_path / "sys", vgpu_config())
    (sysfs / "bus/pci/devices" / GPU_ADDRESSES[0] / "class").unlink()
    assert read_vgpus(sysfs).present is None
    other_vendors_device(tmp_path / "other" / "sys").joinpath("vendor").unlink()
    assert "vendor" in read_vgpus(tmp_path / "other" / "sys").problem


def test_the_reader_reads_once_per_inventory_snapshot_and_says_a_problem_once(tmp_path):
    sysfs = gpu_tree(tmp_path / "sys")
    reader, first, second, third = VgpuReader(sysfs), object(), object(), object()
    with structlog.testing.capture_logs() as logged:
        assert reader.reading(first) == VgpuReading(False)
        (sysfs / "bus/pci/devices" / GPU_ADDRESSES[0] / "config").write_bytes(vgpu_config())
        assert reader.reading(first) == VgpuReading(False)  # the same snapshot: not read again
        assert reader.reading(second) == VgpuReading(True, HostDriver("550.54.16", "r550_40"))
        unreadable_config(sysfs / "bus/pci/devices" / GPU_ADDRESSES[0], "non-root-view")
        assert reader.reading(third).present is None and reader.reading(object()).present is None
    problems = [entry for entry in logged if entry["event"] == "vgpu_unreadable"]
    assert len(problems) == 1 and problems[0]["log_level"] == "warning"
    assert GPU_ADDRESSES[0] in problems[0]["problem"] and "no nvidia.com/vgpu" in problems[0]["consequence"]
    assert [entry["present"] for entry in logged if entry["event"] == "vgpu_read"] == [False, True, None]


# -- the labels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reading, labels", [
    (VgpuReading(None, problem="unreadable"), {}),
    (VgpuReading(False), {"nvidia.com/vgpu.present": "false"}),
    (VgpuReading(True), {"nvidia.com/vgpu.present": "true"}),
    (VgpuReading(True, HostDriver("550.54.16", "r550_40")),
     {"nvidia.com/vgpu.present": "true", "nvidia.com/vgpu.host-driver-version": "550.54.16",
      "nvidia.com/vgpu.host-driver-branch": "r550_40"}),
])
def test_the_labels_of_a_reading(reading, labels):
    assert vgpu_labels(reading) == labels
    health = {"status": "healthy", "gpus": []}
    written = node_labels(NO_GPUS, NO_SYSFS, "unknown", None, {"layout": None, "state": "success"}, health, reading)
    assert {name: value for name, value in written.items() if name in VGPU_LABELS} == labels


def test_a_host_driver_kubernetes_would_refuse_is_left_out_and_said():
    labels = vgpu_labels(VgpuReading(True, HostDriver("550.\xe9", "r550 40")))
    text, dropped = feature_file(labels, 2e9)
    assert "nvidia.com/vgpu.present=true\n" in text and "host-driver" not in text
    assert {entry.label for entry in dropped} == {"nvidia.com/vgpu.host-driver-version",
                                                  "nvidia.com/vgpu.host-driver-branch"}


async def file_vgpu_labels(node, wanted) -> dict[str, str]:
    path = node.daemon.nfd.path

    async def current():
        if not path.exists():
            return None
        labels = nfd_labels(path)
        found = {name: value for name, value in labels.items() if name in VGPU_LABELS}
        return [found] if "nvidia.com/gpu.health" in labels and wanted(found) else None  # [{}]: none, found
    return (await until_async(current, timeout=10, what="the NFD file's vGPU labels"))[0]


async def test_a_simulated_bare_metal_node_and_then_a_vm_with_vgpus(short_tmp):
    """The simulator's sysfs (the default `sysfs` of a simulated node) holds its GPUs' config space:
    bare metal first, then (sim_set_vgpu) a VM's vGPUs, seen at the next inventory read."""
    node = await start_daemon(sim_config(short_tmp, "hgx-h100"))
    try:
        assert await file_vgpu_labels(node, bool) == {"nvidia.com/vgpu.present": "false"}
        node.daemon.session.nvml.sim_set_vgpu("550.54.16", "r550_40")
        await node.daemon.inventory.refresh("test")
        assert await file_vgpu_labels(node, lambda found: found.get("nvidia.com/vgpu.present") == "true") == {
            "nvidia.com/vgpu.present": "true", "nvidia.com/vgpu.host-driver-version": "550.54.16",
            "nvidia.com/vgpu.host-driver-branch": "r550_40"}
        _, view = await node.get("/v1/nfd")
        assert view["labels"]["nvidia.com/vgpu.host-driver-branch"] == "r550_40"
        node.daemon.session.nvml.sim_set_vgpu(None)
        await node.daemon.inventory.refresh("test")
        assert await file_vgpu_labels(node, lambda found: found.get("nvidia.com/vgpu.present") == "false") == {
            "nvidia.com/vgpu.present": "false"}
    finally:
        await stop_daemon(node)


async def test_a_hostile_sysfs_leaves_the_vgpu_labels_out_and_says_so(short_tmp):
    sysfs = gpu_tree(dmi_sysfs(short_tmp / "sys", b"VM\n"), vgpu_config())
    unreadable_config(sysfs / "bus/pci/devices" / GPU_ADDRESSES[0], "link-loop")
    with structlog.testing.capture_logs() as logged:
        node = await start_daemon(sim_config(short_tmp, "hgx-h100").with_overrides(sysfs=str(sysfs)))
        try:
            assert await file_vgpu_labels(node, lambda found: True) == {}
        finally:
            await stop_daemon(node)
    said = [entry for entry in logged if entry["event"] == "vgpu_unreadable"]
    assert len(said) == 1 and GPU_ADDRESSES[0] in said[0]["problem"] and str(sysfs) == said[0]["sysfs"]


# -- the simulator's VM ---------------------------------------------------------------------------------


def test_the_simulated_vgpu_guest(short_tmp):
    nvml = SimulatedNvml("a30", short_tmp / "sim.json")
    nvml.sim_set_vgpu("550.54.16", "r550_40")  # before init: the state file and the sysfs change
    assert read_vgpus(nvml.sysfs_root) == VgpuReading(True, HostDriver("550.54.16", "r550_40"))
    nvml.nvmlInit()
    try:
        device = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetVirtualizationMode(device) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_VGPU
        config = next((nvml.sysfs_root / "bus/pci/devices").iterdir()) / "config"
        assert len(config.read_bytes()) == 256  # conventional PCI in the VM: no extended space
        for bad in (("5" * 11, "r550"), ("550", "r550\n"), ("", "r550"), ("550", None), (550, "r550")):
            with pytest.raises(SimError):
                nvml.sim_set_vgpu(*bad)
        with pytest.raises(SimError, match="not both"):
            nvml.sim_set_passthrough(True)
        nvml.sim_set_vgpu(None)
        assert nvml.nvmlDeviceGetVirtualizationMode(device) == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
        assert len(config.read_bytes()) == 4096 and read_vgpus(nvml.sysfs_root) == VgpuReading(False)
        nvml.sim_set_passthrough(True)
        with pytest.raises(SimError, match="not both"):
            nvml.sim_set_vgpu("550.54.16", "r550_40")
    finally:
        nvml.nvmlShutdown()


# -- against NVIDIA's GFD -------------------------------------------------------------------------------


def gfd_vgpu_labels(tmp: Path, mock: Path, sysfs: Path) -> dict[str, str]:
    """GFD once on NVIDIA's mock NVML (an A100 node: its vGPU labeler reads only PCI devices), with
    `sysfs`'s PCI devices over /sys/bus/pci/devices; its vGPU labels."""
    labels = run_gfd(tmp, mock, "a100", 8, "none", sysfs)
    return {name: value for name, value in labels.items() if name in VGPU_LABELS}


def looping_list() -> bytes:
    config = bytearray(pci_config_space())
    config[0x79] = 0x60  # PCI Express points back at Power Management
    return bytes(config)


def loop_after_vgpu() -> bytes:
    config = bytearray(vgpu_config())
    config[0x69] = 0xD0  # MSI points back at the vGPU capability
    return bytes(config)


# Each case: the two GPUs' config spaces (None: no file) and the vgpu.present both must write (None: no
# vGPU label). Where GFD never returns (a record of length 0) or fails as a whole (a vGPU without a host
# driver record, a class shorter than 4 bytes) there is nothing to compare: the tests above hold gpud.
GFD_CASES = {
    "bare-metal": ((pci_config_space(),) * 2, "false"),
    "vgpu": ((vgpu_config(),) * 2, "true"),
    "vgpu-records-before": ((pci_config_space(((0xC0, VENDOR_SPECIFIC, vgpu_capability_data(
        before=bytes([7, 4, 0xAA, 0xBB]))),), size=256),) * 2, "true"),
    "vgpu-latin-1": ((vgpu_config(version=b"4\xe9\xff.16"),) * 2, "true"),
    "two-vgpus-the-last-wins": ((vgpu_config(), vgpu_config(version=b"550.90.05")), "true"),
    "vgpu-and-bare-metal": ((vgpu_config(), pci_config_space()), "true"),
    "no-list": ((pci_config_space(capability_list=False),) * 2, "false"),
    "looping-list": ((looping_list(),) * 2, "false"),
    "loop-after-vgpu": ((loop_after_vgpu(),) * 2, "true"),
    "first-vendor-capability-only": ((pci_config_space(((0x60, VENDOR_SPECIFIC, b"\x08\x01"),
                                                        (0xD0, VENDOR_SPECIFIC, vgpu_capability_data()))),) * 2,
                                     "false"),
    "non-root-view": ((pci_config_space()[:64],) * 2, None),
    "no-config": ((vgpu_config(), None), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(GFD_CASES))
def test_gpud_reads_the_config_space_as_gfd_does(short_tmp, mock_nvml, case):
    configs, present = GFD_CASES[case]
    sysfs = gpu_tree(short_tmp / "sys")
    for address, config in zip(GPU_ADDRESSES, configs):
        path = sysfs / "bus/pci/devices" / address / "config"
        path.unlink()
        if config is not None:
            path.write_bytes(config)
    other_vendors_device(sysfs)
    ours = vgpu_labels(read_vgpus(sysfs))
    assert ours == gfd_vgpu_labels(short_tmp, mock_nvml, sysfs)
    assert ours.get("nvidia.com/vgpu.present") == present


@pytest.mark.slow
@pytest.mark.parametrize("vgpu", [None, ("550.54.16", "r550_40")], ids=["bare-metal", "vgpu-guest"])
def test_gfd_reads_the_simulators_config_space_as_gpud_does(short_tmp, mock_nvml, vgpu):
    """The simulator's sysfs, read by GFD: the format of its config space is GFD's."""
    nvml = SimulatedNvml("hgx-h100", short_tmp / "sim.json")
    nvml.sim_set_vgpu(*(vgpu or (None,)))
    ours = vgpu_labels(read_vgpus(nvml.sysfs_root))
    assert ours == gfd_vgpu_labels(short_tmp, mock_nvml, nvml.sysfs_root)
    assert ours == ({"nvidia.com/vgpu.present": "true", "nvidia.com/vgpu.host-driver-version": vgpu[0],
                     "nvidia.com/vgpu.host-driver-branch": vgpu[1]} if vgpu else {"nvidia.com/vgpu.present": "false"})
