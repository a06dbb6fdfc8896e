"""The sharing config (k8s-device-plugin format) and the resources, replica IDs and labels gpud computes from it."""

from __future__ import annotations

import json
import textwrap

import pytest
from openapi_check import assert_matches_openapi

from gpud.model.inventory import Gpu, Inventory, MigDevice, MigInfo
from gpud.model.mig import Placement
from gpud.sharing.config import SharedResource, SharingConfig, SharingConfigError, load_sharing, parse_sharing
from gpud.sharing.resources import compute_sharing, mps_replicas

A100 = "NVIDIA A100-SXM4-40GB"


# -- building snapshots ----------------------------------------------------------------------------


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-4111-8111-111111111111"


def mig_uuid(gpu_index: int, index: int) -> str:
    return f"MIG-{gpu_index:08x}-2222-4222-8222-{index:012x}"


def mig(gpu_index: int, index: int, profile: str = "1g.5gb", memory_mib: int = 4864, gi_id: int | None = None
        ) -> MigDevice:
    return MigDevice(uuid=mig_uuid(gpu_index, index), index=index, profile=profile,
                     gi_id=index + 1 if gi_id is None else gi_id, ci_id=0, gi_profile_id=0, ci_profile_id=0,
                     placement=Placement(start=index, size=1), memory_total_mib=memory_mib, sm_count=14)


def gpu(index: int, name: str = A100, memory_mib: int = 40960, cc: str = "8.0",
        migs: tuple[MigDevice, ...] | None = None, lost: bool = False) -> Gpu:
    """A GPU with MIG off, or with MIG on and the given MIG devices (migs=() for MIG on, no devices)."""
    capable = name == A100
    mode = None if not capable else "disabled" if migs is None else "enabled"
    return Gpu(index=index, uuid=gpu_uuid(index), name=name, pci_bus_id=f"00000000:{index + 7:02x}:00.0",
               pci_device_id="0x20B010DE", memory_total_mib=memory_mib, compute_mode="default",
               architecture="ampere", cuda_compute_capability=cc, serial=None,
               mig=MigInfo(capable=capable, mode=mode, pending_mode=mode, devices=migs or ()), lost=lost)


def node(*gpus: Gpu) -> Inventory:
    return Inventory(driver_version="550.54.15", cuda_version="12.4", nvml_version="12.550.54.15", gpus=gpus)


def sevens(gpu_index: int) -> tuple[MigDevice, ...]:
    return tuple(mig(gpu_index, i) for i in range(7))


def config(text: str) -> SharingConfig:
    return parse_sharing(textwrap.dedent(text), "sharing.yaml")


def time_slicing(replicas: int, **extra: object) -> SharingConfig:
    entry = {"name": "nvidia.com/gpu", "replicas": replicas, **extra}
    return parse_sharing(json.dumps({"version": "v1", "sharing": {"timeSlicing": {"resources": [entry]}}}))


def resource(document: dict, name: str) -> dict:
    return next(r for r in document["resources"] if r["name"] == name)


def labels_of(labels: dict[str, str], name: str) -> dict[str, str]:
    """The labels GFD writes for one resource: <name>.count, <name>.product and so on."""
    return {key: value for key, value in labels.items() if key.rsplit(".", 1)[0] == name}


# -- the config file -------------------------------------------------------------------------------

PLUGIN_README_FILE = """\
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  mpsRoot: /run/nvidia/mps
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: [envvar, cdi-annotations]
    deviceIDStrategy: uuid
    sharedDevicesAllocationPolicy: packed
  gfd:
    oneshot: false
    noTimestamp: false
    sleepInterval: 60s
    outputFile: /etc/kubernetes/node-feature-discovery/features.d/gfd
resources:
  gpus:
  - pattern: "*"
    name: gpu
imex:
  channelIDs: [0]
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 10
  mps:
    resources:
    - name: gpu
      replicas: 10
"""


def test_a_file_as_the_plugin_readme_shows_loads():
    loaded = parse_sharing(PLUGIN_README_FILE, "sharing.yaml")
    assert loaded.mig_strategy == "none" and loaded.strategy == "mps"  # both given: MPS wins, as in the plugin
    assert loaded.time_slicing.rename_by_default and not loaded.time_slicing.fail_requests_greater_than_one
    assert loaded.time_slicing.resources == (SharedResource("nvidia.com/gpu", "nvidia.com/gpu.shared", "all", 10),)
    assert loaded.mps.fail_requests_greater_than_one  # the MPS default when unset
    assert loaded.mps.resources == (SharedResource("nvidia.com/gpu", None, "all", 10),)


def test_defaults_and_normalised_devices():
    loaded = config("""
        sharing:
          timeSlicing:
            interval: long
            resources:
            - {name: mig-1g.5gb, replicas: 2, devices: [0, "01", "1:02", "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763",
                                                        "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0"]}
            - {name: gpu, rename: gpu-small, replicas: 3, devices: 2}
        """)
    assert (loaded.mig_strategy, loaded.strategy, loaded.interval, loaded.mps) == ("none", "time-slicing", "long", None)
    assert not loaded.time_slicing.fail_requests_greater_than_one and not loaded.time_slicing.rename_by_default
    first, second = loaded.time_slicing.resources
    assert first == SharedResource("nvidia.com/mig-1g.5gb", None, ("0", "1", "1:2",
                                   "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763",
                                   "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0"), 2)
    assert second == SharedResource("nvidia.com/gpu", "nvidia.com/gpu-small", 2, 3)


@pytest.mark.parametrize("text", ["", "version: ''\n", "version: v1\nflags: {migStrategy: null}\nsharing:\n"])
def test_empty_files_and_sections_mean_no_sharing(text):
    assert parse_sharing(text) == SharingConfig()


SHARED = "sharing:\n  timeSlicing:\n    resources:\n"


@pytest.mark.parametrize(("text", "message"), [
    ("- v1\n", "expected a mapping of version, flags, resources, sharing, imex, got a list"),
    ("version: v2\n", "key 'version': unknown version 'v2', expected 'v1'"),
    # Unknown keys and an empty `devices` list load with warnings, as the plugin ignores them: tests/test_nvidia_files.py
    ("flags: {migStrategy: all}\n", "key 'flags.migStrategy': must be one of none, single, mixed, got 'all'"),
    ("flags: {plugin: {deviceIDStrategy: serial}}\n", "'flags.plugin.deviceIDStrategy': must be one of uuid, index"),
    ("flags: {plugin: {deviceListStrategy: [envvar, nfs]}}\n", "key 'flags.plugin.deviceListStrategy[1]'"),
    ("flags: {plugin: {sharedDevicesAllocationPolicy: spread}}\n", "sharedDevicesAllocationPolicy': must be one of"),
    ("flags: {failOnInitError: 'yes please'}\n", "key 'flags.failOnInitError': must be true or false, got a string"),
    ("flags: {gfd: {sleepInterval: soon}}\n", "key 'flags.gfd.sleepInterval': must be a duration"),
    ("resources: {gpus: [{name: gpu}]}\n", "key 'resources.gpus[0].pattern': missing"),
    ("imex: {channelIDs: [zero]}\n", "key 'imex.channelIDs[0]': must be an integer"),
    ("sharing: {timeSlicing: {}}\n", "key 'sharing.timeSlicing.resources': no resources specified"),
    ("sharing: {mps: {resources: []}}\n", "key 'sharing.mps.resources': no resources specified"),
    ("sharing: {timeSlicing: }\n", "key 'sharing.timeSlicing.resources': no resources specified"),
    ("sharing: {timeSlicing: {renameByDefault: 1, resources: [{name: gpu, replicas: 2}]}}\n",
     "key 'sharing.timeSlicing.renameByDefault': must be true or false, got an integer 1"),
    (SHARED + "    - {replicas: 2}\n", "key 'sharing.timeSlicing.resources[0].name': no resource name specified"),
    (SHARED + "    - {name: gpu}\n", "key 'sharing.timeSlicing.resources[0].replicas': no replicas specified"),
    (SHARED + "    - {name: gpu, replicas: 2}\n    - {name: gpu, replicas: 1}\n",
     "key 'sharing.timeSlicing.resources[1].replicas': number of replicas must be >= 2, got 1"),
    (SHARED + "    - {name: gpu, replicas: '4'}\n", "replicas': must be an integer, got a string '4'"),
    (SHARED + "    - {name: gpu, replicas: true}\n", "replicas': must be an integer, got a boolean True"),
    (SHARED + "    - {name: gpu, replicas: 4.0}\n", "replicas': must be an integer, got a number 4.0"),
    (SHARED + "    - {name: gpu, replica: 4}\n", "key 'sharing.timeSlicing.resources[0].replicas': no replicas specified"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: some}\n", "devices': devices set as 'some' but the only"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: 0}\n", "devices': a count of devices must be > 0, got 0"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: -3}\n", "devices': a count of devices must be > 0, got -3"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: {gpu: 0}}\n", "devices': must be 'all', a count of devices"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: true}\n", "devices': must be 'all', a count of devices"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: [0, -1]}\n", "devices[1]': -1 is not a GPU index"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: [true]}\n", "devices[0]': True is not a GPU index"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: [gpu0]}\n", "devices[0]': 'gpu0' is not a GPU index"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: ['0:x']}\n", "devices[0]': '0:x' is not a GPU index"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: [GPU-1234]}\n", "'GPU-1234' is not a GPU index"),
    (SHARED + "    - {name: gpu, replicas: 2, devices: ['MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3']}\n",
     "is not a GPU index"),
    (SHARED + "    - {name: " + "g" * 53 + ", replicas: 2}\n",
     "name': fully-qualified resource name must be 63 characters or less: nvidia.com/ggg"),
    (SHARED + "    - {name: Big_GPU, replicas: 2}\n", "name': incorrect format for resource name 'nvidia.com/Big_GPU'"),
    (SHARED + "    - {name: example.com/gpu, replicas: 2}\n", "resource name 'nvidia.com/example.com/gpu'"),
    (SHARED + "    - {name: gpu-, replicas: 2}\n", "incorrect format for resource name 'nvidia.com/gpu-'"),
    (SHARED + "    - {name: 4, replicas: 2}\n", "name': must be a string, got an integer 4"),
    (SHARED + "    - {name: gpu, rename: 'gpu shared', replicas: 2}\n",
     "key 'sharing.timeSlicing.resources[0].rename': incorrect format for resource name 'nvidia.com/gpu shared'"),
    (SHARED + "    - {name: gpu, rename: '', replicas: 2}\n", "rename': incorrect format for resource name"),
    ("sharing: {timeSlicing: {renameByDefault: true, resources: [{name: " + "g" * 50 + ", replicas: 2}]}}\n",
     "name': fully-qualified resource name must be 63 characters or less: nvidia.com/" + "g" * 50 + ".shared"),
    ("sharing: {timeSlicing: {interval: forever, resources: [{name: gpu, replicas: 2}]}}\n",
     "key 'sharing.timeSlicing.interval': must be one of default, short, medium, long, got 'forever'"),
    ("flags: {migStrategy: mixed}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n",
     "key 'flags.migStrategy': migStrategy mixed is not supported with MPS"),
    ("sharing: {mps: {resources: [{name: gpu, replicas: 48}, {name: mig-1g.5gb, replicas: 49}]}}\n",
     "key 'sharing.mps.resources[1].replicas': at most 48 MPS replicas per device, got 49"),
])
def test_what_the_plugin_rejects_is_rejected_naming_file_and_key(text, message):
    with pytest.raises(SharingConfigError) as caught:
        parse_sharing(text, "sharing.yaml")
    assert str(caught.value).startswith("sharing.yaml: ") and message in str(caught.value)


def test_a_yaml_syntax_error_names_the_line():
    with pytest.raises(SharingConfigError, match=r"^sharing.yaml: line 4: invalid YAML: mapping values are not"):
        parse_sharing("version: v1\nsharing:\n  timeSlicing:\n    resources: replicas: 2\n", "sharing.yaml")


def test_load_names_the_file_and_a_missing_file_propagates(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_sharing(tmp_path / "absent.yaml")
    path = tmp_path / "sharing.yaml"
    path.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n")
    with pytest.raises(SharingConfigError) as caught:
        load_sharing(path)
    assert str(caught.value).startswith(f"{path}: key 'sharing.timeSlicing.resources[0].replicas': ")
    path.write_text(PLUGIN_README_FILE)
    assert load_sharing(path).strategy == "mps"


# -- resources and labels --------------------------------------------------------------------------


def test_rtx_2080_ti_with_six_replicas():
    card = gpu(0, name="NVIDIA GeForce RTX 2080 Ti", memory_mib=11264, cc="7.5")
    document = compute_sharing(time_slicing(6), node(card))
    assert document["error"] is None and document["strategy"] == "time-slicing"
    [shared] = document["resources"]
    assert (shared["name"], shared["strategy"], shared["replicas"], shared["count"]) == \
        ("nvidia.com/gpu", "time-slicing", 6, 6)
    assert [d["id"] for d in shared["devices"]] == [f"{card.uuid}::{n}" for n in range(6)]
    assert all(d["parent"] == card.uuid and d["gpu_index"] == 0 and d["replicas"] == 6 and d["healthy"]
               for d in shared["devices"])
    assert document["labels"] == {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "11264",
        "nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-2080-Ti-SHARED", "nvidia.com/gpu.replicas": "6",
        "nvidia.com/gpu.sharing-strategy": "time-slicing", "nvidia.com/mig.capable": "false",
        "nvidia.com/mps.capable": "false"}  # no mig.strategy under none, as GFD
    assert list(document["labels"]) == sorted(document["labels"])


def test_no_config_advertises_every_gpu_once():
    document = compute_sharing(None, node(gpu(0), gpu(1, migs=sevens(1))))
    [plain] = document["resources"]
    assert (plain["name"], plain["strategy"], plain["replicas"], plain["count"]) == ("nvidia.com/gpu", "none", 1, 2)
    assert [d["id"] for d in plain["devices"]] == [gpu_uuid(0), gpu_uuid(1)]  # migStrategy none: MIG GPUs whole
    assert not plain["fail_requests_greater_than_one"]
    labels = document["labels"]
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.replicas"],
            labels["nvidia.com/gpu.sharing-strategy"], labels["nvidia.com/mig.capable"]) == \
        ("NVIDIA-A100-SXM4-40GB", "1", "none", "true")


def mixed_node() -> Inventory:
    """8× A100: GPUs 0-1 MIG off, 2-3 7×1g.5gb, 4 2×3g.20gb, 5 3g.20gb plus three 1c.3g.20gb compute
    instances sharing another GPU instance, 6 one 1g.5gb+me, 7 MIG on without devices."""
    return node(
        gpu(0), gpu(1), gpu(2, migs=sevens(2)), gpu(3, migs=sevens(3)),
        gpu(4, migs=(mig(4, 0, "3g.20gb", 20096), mig(4, 1, "3g.20gb", 20096))),
        gpu(5, migs=(mig(5, 0, "3g.20gb", 20096), *(mig(5, i, "1c.3g.20gb", 20096, gi_id=2) for i in (1, 2, 3)))),
        gpu(6, migs=(mig(6, 0, "1g.5gb+me"),)), gpu(7, migs=()))


MIXED = """
    flags: {migStrategy: mixed}
    sharing:
      timeSlicing:
        failRequestsGreaterThanOne: true
        resources:
        - {name: gpu, devices: [0], replicas: 4}
        - {name: mig-1g.5gb, devices: [2], rename: mig-small-shared, replicas: 2}
        - {name: mig-1g.5gb, devices: ["3:0", "MIG-00000003-2222-4222-8222-000000000001"], replicas: 3}
        - {name: mig-3g.20gb, replicas: 2}
    """


def test_mixed_layout_with_per_gpu_replicas_renames_and_plain_leftovers():
    document = compute_sharing(config(MIXED), mixed_node())
    assert document["error"] is None
    summary = {r["name"]: (r["strategy"], r["replicas"], r["count"]) for r in document["resources"]}
    assert summary == {
        "nvidia.com/gpu": ("time-slicing", None, 4 + 1),  # GPU 0 ×4, GPU 1 unshared
        "nvidia.com/mig-1g.5gb": ("time-slicing", None, 2 * 3 + 5),  # 3:0 and 3:1 ×3, the rest of GPU 3 unshared
        "nvidia.com/mig-1g.5gb.me": ("none", 1, 1),
        "nvidia.com/mig-3g.20gb": ("time-slicing", 2, 3 * 2),  # no resource for 1c.3g.20gb (C < G), nor GPU 7
        "nvidia.com/mig-small-shared": ("time-slicing", 2, 7 * 2),  # GPU index 2 selects its MIG devices
    }
    whole = resource(document, "nvidia.com/gpu")["devices"]
    assert [(d["id"], d["replicas"]) for d in whole] == \
        [(f"{gpu_uuid(0)}::{n}", 4) for n in range(4)] + [(gpu_uuid(1), 1)]
    small = resource(document, "nvidia.com/mig-1g.5gb")["devices"]
    assert [d["id"] for d in small[:6]] == [f"{mig_uuid(3, i)}::{n}" for i in (0, 1) for n in range(3)]
    assert [(d["id"], d["replicas"], d["parent"], d["gpu_index"]) for d in small[6:]] == \
        [(mig_uuid(3, i), 1, gpu_uuid(3), 3) for i in range(2, 7)]
    assert all(r["fail_requests_greater_than_one"] == (r["strategy"] != "none") for r in document["resources"])
    in_force = {"name": None, "chosen": None, "default": None, "why": "no configs_dir: sharing.file",
                "file": "/etc/gpud/sharing.yaml", "configs_dir": None, "available": [], "problem": None}
    assert_matches_openapi("GET", "/v1/sharing", 200, {"source": None, "warnings": [], "config": in_force, **document})


def test_mixed_layout_labels():
    labels = compute_sharing(config(MIXED), mixed_node())["labels"]
    assert labels_of(labels, "nvidia.com/gpu") == {
        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "40960",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-SHARED", "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "time-slicing"}
    assert labels_of(labels, "nvidia.com/mig-1g.5gb") == {
        "nvidia.com/mig-1g.5gb.count": "14", "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED",
        "nvidia.com/mig-1g.5gb.replicas": "3", "nvidia.com/mig-1g.5gb.sharing-strategy": "time-slicing",
        "nvidia.com/mig-1g.5gb.multiprocessors": "14"}
    assert labels["nvidia.com/mig-1g.5gb.me.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb.me"
    assert labels["nvidia.com/mig-1g.5gb.me.sharing-strategy"] == "none"
    assert (labels["nvidia.com/mig-3g.20gb.count"], labels["nvidia.com/mig-3g.20gb.replicas"]) == ("3", "2")
    assert not any("1c.3g" in key or "small-shared" in key for key in labels)
    assert (labels["nvidia.com/mig.strategy"], labels["nvidia.com/mig.capable"]) == ("mixed", "true")
    assert all(isinstance(value, str) for value in labels.values())


def test_rename_by_default_moves_replicas_to_the_shared_name_without_the_shared_product():
    loaded = config("sharing: {timeSlicing: {renameByDefault: true, resources: [{name: gpu, replicas: 2}]}}")
    document = compute_sharing(loaded, node(gpu(0), gpu(1)))
    assert [(r["name"], r["count"]) for r in document["resources"]] == [("nvidia.com/gpu.shared", 4)]
    assert document["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB"
    assert document["labels"]["nvidia.com/gpu.replicas"] == "2"


@pytest.mark.parametrize(("devices", "error"), [
    ("[5]", "nvidia.com/gpu: device '5' matches no nvidia.com/gpu device on this node"),
    (f"[{gpu_uuid(9)}]", f"nvidia.com/gpu: device '{gpu_uuid(9)}' matches no nvidia.com/gpu device on this node"),
    ("['0:0']", "nvidia.com/gpu: device '0:0' matches no nvidia.com/gpu device on this node"),
    ("3", "nvidia.com/gpu: devices asks for the first 3 devices, but this node has 2"),
])
def test_devices_that_select_nothing_are_refused(devices, error):
    document = compute_sharing(config(f"sharing: {{timeSlicing: {{resources: [{{name: gpu, replicas: 2, "
                                      f"devices: {devices}}}]}}}}"), node(gpu(0), gpu(1)))
    assert (document["resources"], document["error"]) == ([], error)


def test_a_device_selected_twice_is_refused():
    loaded = config("""
        sharing:
          timeSlicing:
            resources:
            - {name: gpu, devices: [0], replicas: 2}
            - {name: gpu, devices: all, rename: gpu-many, replicas: 8}
        """)
    assert compute_sharing(loaded, node(gpu(0), gpu(1)))["error"] == \
        f"nvidia.com/gpu: device {gpu_uuid(0)} is selected by more than one sharing entry"


@pytest.mark.parametrize("devices", ["all", "3", "['0:0']"])
def test_an_entry_for_a_resource_the_node_lacks_waits_for_it(devices):
    loaded = config(f"flags: {{migStrategy: mixed}}\nsharing: {{timeSlicing: {{resources: "
                    f"[{{name: mig-3g.20gb, replicas: 2, devices: {devices}}}]}}}}")
    document = compute_sharing(loaded, node(gpu(0, migs=sevens(0))))
    assert document["error"] is None
    assert [(r["name"], r["count"]) for r in document["resources"]] == [("nvidia.com/mig-1g.5gb", 7)]


SINGLE = "flags: {migStrategy: single}\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}"


def test_single_strategy_exposes_mig_devices_as_gpus():
    document = compute_sharing(config(SINGLE), node(gpu(0, migs=sevens(0)), gpu(1, migs=sevens(1))))
    [shared] = document["resources"]
    assert (shared["name"], shared["replicas"], shared["count"]) == ("nvidia.com/gpu", 2, 28)
    assert shared["devices"][0]["id"] == f"{mig_uuid(0, 0)}::0" and shared["devices"][0]["parent"] == gpu_uuid(0)
    labels = document["labels"]
    assert (labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.memory"]) == \
        ("14", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED", "4864")


def test_single_strategy_without_mig_is_whole_gpus():
    document = compute_sharing(config(SINGLE), node(gpu(0), gpu(1)))
    assert document["error"] is None and resource(document, "nvidia.com/gpu")["count"] == 4


@pytest.mark.parametrize(("gpus", "error"), [
    ((gpu(0, migs=sevens(0)), gpu(1)),
     "migStrategy single needs MIG enabled on every GPU, but it is disabled on GPU 1; use migStrategy mixed"),
    ((gpu(0, migs=sevens(0)), gpu(1, migs=())),
     "migStrategy single needs MIG devices on every GPU, but there are none on GPU 1"),
    ((gpu(0, migs=sevens(0)), gpu(1, migs=(mig(1, 0, "3g.20gb", 20096),))),
     "migStrategy single needs one MIG profile on the node, found 1g.5gb, 3g.20gb; use migStrategy mixed"),
])
def test_single_strategy_refusals(gpus, error):
    document = compute_sharing(config(SINGLE), node(*gpus))
    assert (document["resources"], document["error"]) == ([], error)
    assert labels_of(document["labels"], "nvidia.com/gpu") == {
        "nvidia.com/gpu.count": "0", "nvidia.com/gpu.memory": "0", "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-INVALID", "nvidia.com/gpu.sharing-strategy": "none"}


def test_a_lost_gpu_and_unhealthy_devices_mark_all_their_replicas():
    inventory = node(gpu(0, migs=(mig(0, 0), mig(0, 1))), gpu(1, migs=(mig(1, 0), mig(1, 1)), lost=True), gpu(2))
    loaded = config("flags: {migStrategy: mixed}\nsharing: {timeSlicing: {resources: "
                    "[{name: mig-1g.5gb, replicas: 3}, {name: gpu, replicas: 2}]}}")
    document = compute_sharing(loaded, inventory, unhealthy=frozenset({mig_uuid(0, 1), gpu_uuid(2)}))
    health = {d["id"]: d["healthy"] for r in document["resources"] for d in r["devices"]}
    assert len(health) == 4 * 3 + 2
    unhealthy_migs = (mig_uuid(0, 1), mig_uuid(1, 0), mig_uuid(1, 1))  # one named, two on the lost GPU
    assert {id_ for id_, healthy in health.items() if not healthy} == \
        {f"{uuid}::{n}" for uuid in unhealthy_migs for n in range(3)} | {f"{gpu_uuid(2)}::{n}" for n in range(2)}


BOTH = """
    sharing:
      timeSlicing: {resources: [{name: gpu, replicas: 10}]}
      mps: {resources: [{name: gpu, devices: [1], replicas: 4}]}
    """


def test_mps_wins_over_time_slicing():
    document = compute_sharing(config(BOTH), node(gpu(0), gpu(1)))
    [shared] = document["resources"]
    assert (shared["strategy"], shared["replicas"], shared["count"]) == ("mps", None, 1 + 4)
    assert shared["fail_requests_greater_than_one"]
    labels = document["labels"]
    assert (labels["nvidia.com/mps.capable"], labels["nvidia.com/gpu.sharing-strategy"],
            labels["nvidia.com/gpu.replicas"]) == ("true", "mps", "4")


def test_mps_replicas_maps_each_shared_device():
    inventory = node(gpu(0), gpu(1))
    assert mps_replicas(config(BOTH), inventory) == {gpu_uuid(1): 4}
    assert mps_replicas(time_slicing(4), inventory) == {}
    assert mps_replicas(None, inventory) == {}


def test_mps_inside_mig_devices_is_allowed():
    loaded = config("flags: {migStrategy: single}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}")
    inventory = node(gpu(0, migs=(mig(0, 0, "3g.20gb", 20096), mig(0, 1, "3g.20gb", 20096))))
    assert mps_replicas(loaded, inventory) == {mig_uuid(0, 0): 2, mig_uuid(0, 1): 2}
    assert compute_sharing(loaded, inventory)["resources"][0]["count"] == 4


def test_mps_above_16_replicas_needs_compute_capability_7_5():
    loaded = config("sharing: {mps: {resources: [{name: gpu, replicas: 20}]}}")
    volta = node(gpu(0, name="Tesla V100-SXM2-16GB", memory_mib=16384, cc="7.0"))
    document = compute_sharing(loaded, volta)
    assert document["resources"] == [] and document["error"] == (
        "nvidia.com/gpu: 20 MPS replicas on GPU 0 (Tesla V100-SXM2-16GB, compute capability 7.0); "
        "at most 16 below compute capability 7.5")
    assert mps_replicas(loaded, volta) == {}
    assert compute_sharing(loaded, node(gpu(0, cc="7.5")))["error"] is None


def test_an_all_mig_node_under_mixed_has_no_whole_gpu_resource_but_keeps_gpu_labels():
    document = compute_sharing(config("flags: {migStrategy: mixed}"), node(gpu(0, migs=sevens(0))))
    assert [(r["name"], r["count"]) for r in document["resources"]] == [("nvidia.com/mig-1g.5gb", 7)]
    assert document["labels"]["nvidia.com/gpu.count"] == "1"
    assert json.loads(json.dumps(document)) == document
