"""Files written for NVIDIA's tools (mig-parted, the k8s device plugin) load unchanged, with warnings
for what the tools accept but cannot do what was meant; what the tools refuse, gpud refuses.

What each tool accepts is read from its source: mig-parted api/spec/v1/spec.go (strict keys,
`devices` "all" or []int), helpers.go and pkg/types/device.go (a device-filter it cannot parse never
matches); the device plugin api/config/v1/config.go (non-strict sigs.k8s.io/yaml: unknown keys are
ignored) and replicas.go (an empty `devices` list is accepted).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import structlog

from gpud.config import ConfigError, parse_config
from gpud.mig.layouts import LayoutError, LayoutsFile, NodeGpu, check_layouts, check_layouts_file, load_layouts
from gpud.sharing.config import SharingConfigError, check_sharing, check_sharing_file, load_sharing
from tests.helpers import cli, mig_config, mig_settled, put_layout, sharing_config, start_daemon, stop_daemon
from tests.mig_parted import mig_parted_verdict

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia"
A100_40GB, H100_80GB = "0x20B010DE", "0x233010DE"


def _warnings(text: str) -> list[str]:
    return check_layouts(text, "custom.yaml")[1]


def _entry_file(entry: str) -> str:
    return f"version: v1\nmig-configs:\n  l:\n    - {entry}\n"


# -- mig-parted files ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["operator-mig-config.yaml", "mig-parted-custom.yaml"])
def test_files_as_operators_write_them_load_without_warnings(name):
    layouts, warnings = check_layouts_file(FIXTURES / name)
    assert warnings == []
    assert layouts == load_layouts(FIXTURES / name)


def test_the_operator_config_selects_gpus_by_pci_id_lists():
    layouts, _ = check_layouts_file(FIXTURES / "operator-mig-config.yaml")
    balanced = layouts["all-balanced"]
    a100 = balanced.for_gpu(0, A100_40GB, mig_capable=True)
    h100 = balanced.for_gpu(0, H100_80GB, mig_capable=True)
    a30 = balanced.for_gpu(0, "0x20B710DE", mig_capable=True)  # its filter is a plain string
    assert (a100.mig_devices, h100.mig_devices, a30.mig_devices) == (
        {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
        {"1g.6gb": 2, "2g.12gb": 1})
    assert balanced.for_gpu(0, "0x1FB010DE", mig_capable=False) is None  # a GPU without MIG is left alone
    assert layouts["all-enabled"].for_gpu(3, H100_80GB, mig_capable=True).mig_devices == {}


def test_a_display_gpu_filter_keeps_mig_off_on_it():
    layouts, _ = check_layouts_file(FIXTURES / "mig-parted-custom.yaml")
    station = layouts["station-balanced"]
    gpus = [NodeGpu(0, "0x20B210DE", True), NodeGpu(1, "0x1FB010DE", False)]
    assert station.selected(gpus) == [gpus[0]]  # `devices: all` is all MIG-capable GPUs
    assert layouts["custom-config"].for_gpu(1, A100_40GB, mig_capable=True).mig_enabled is False


def test_what_mig_parted_accepts_but_cannot_do_is_warned_about():
    layouts, warnings = check_layouts_file(FIXTURES / "mig-parted-suspicious.yaml")
    assert warnings == [
        "mig-configs.typos[0].devices: index -1 is negative: it selects no GPU",
        "mig-configs.typos[0].devices: index 1 is repeated",
        "mig-configs.typos[0].device-filter: '0x20B0' is read as 0x000020b0, whose vendor 0x20b0 is not "
        "NVIDIA's (0x10de): it never matches",
        "mig-configs.typos[0].device-filter: '20B010DE' is not a PCI id of the form 0xDDDDVVVV or "
        "0xDDDDVVVV:0xSSSSssss (device, vendor, then optionally subsystem device and vendor): it never matches",
        "mig-configs.typos[1].mig-devices.1g.5gb: no GPU its device-filter names offers this profile",
        "mig-configs.typos[2].devices: an empty list selects no GPU",
        "mig-configs.typos[2].mig-enabled: null is read as false",
        "mig-configs.typos[2].device-filter: '0x20B01002' is read as 0x20b01002, whose vendor 0x1002 is not "
        "NVIDIA's (0x10de): it never matches",
        "mig-configs.typos[2].mig-devices: null is read as {} (no MIG devices)",
        "mig-configs.unknown[0].device-filter: 0x7fff10de is the PCI id of no MIG-capable GPU gpud knows",
        "mig-configs.unknown[0].mig-devices.1g.9gb: no GPU model gpud knows offers this profile",
    ]
    typos = layouts["typos"]
    # The one good filter still selects; the malformed ones match nothing, as in mig-parted.
    assert typos.for_gpu(1, A100_40GB, mig_capable=True).mig_devices == {"1g.5gb": 2}
    assert typos.for_gpu(2, A100_40GB, mig_capable=True) is None
    assert layouts["unknown"].selected([NodeGpu(0, A100_40GB, True), NodeGpu(1, H100_80GB, True)]) == []


@pytest.mark.parametrize("written, normalised", [
    ("0x20b010de", "0x20b010de"), ("0X20B010DE", "0x20b010de"), ("548409566", "0x20b010de"),
    ("0x20B0_10DE", "0x20b010de"), ("0x20B210DE:0x145f10DE", "0x20b210de:0x145f10de"),
])
def test_a_device_filter_is_read_as_mig_parted_parses_numbers(written, normalised):
    """pkg/types/device.go: each part through strconv.ParseInt(s, 0, 32), so any base prefix works."""
    layouts, warnings = check_layouts(_entry_file(f"{{devices: all, mig-enabled: false, device-filter: '{written}'}}"))
    assert layouts["l"].entries[0].device_filter == (normalised,)
    expected = [] if written.lower() == normalised else \
        [f"mig-configs.l[0].device-filter: '{written}' is read as {normalised}: each part is a number, "
         "0xDDDDVVVV with 8 hex digits is meant"]
    assert warnings == expected


@pytest.mark.parametrize("value", ["''", "null", "[]"])
def test_an_empty_device_filter_matches_every_gpu(value):
    layouts, warnings = check_layouts(_entry_file(f"{{devices: all, mig-enabled: false, device-filter: {value}}}"))
    assert warnings == [] and layouts["l"].for_gpu(0, H100_80GB, mig_capable=True) is not None


def test_a_profile_the_named_gpu_lacks_is_warned_but_one_it_has_is_not():
    entry = "{{devices: all, device-filter: ['{pci}'], mig-enabled: true, mig-devices: {{'{profile}': 1}}}}"
    assert _warnings(_entry_file(entry.format(pci=H100_80GB, profile="1c.3g.40gb"))) == []
    assert _warnings(_entry_file(entry.format(pci=H100_80GB, profile="3g.20gb"))) == [
        "mig-configs.l[0].mig-devices.3g.20gb: no GPU its device-filter names offers this profile"]
    # A100 40GB or H100: 3g.20gb is offered by one of them.
    both = entry.format(pci=H100_80GB, profile="3g.20gb").replace("]", f", '{A100_40GB}']", 1)
    assert _warnings(_entry_file(both)) == []


def test_a_filter_for_a_gpu_without_mig_is_not_warned_about():
    assert _warnings(_entry_file("{devices: all, mig-enabled: false, device-filter: '0x1FB010DE'}")) == []


@pytest.mark.parametrize("text, message", [
    # mig-parted refuses these too (api/spec/v1/spec.go).
    (_entry_file("{devices: all, mig-enabled: false, mig-device: {}}"), "key 'mig-device': unexpected key"),
    ("version: v1\nkind: MigConfig\nmig-configs:\n  l: [{devices: all, mig-enabled: false}]\n",
     "key 'kind': not a MIG layout file"),
    ("mig-configs:\n  l: [{devices: all, mig-enabled: false}]\n", "key 'version': missing"),
    ("version: v2\nmig-configs:\n  l: [{devices: all, mig-enabled: false}]\n", "unknown version 'v2'"),
    (_entry_file("{devices: some, mig-enabled: false}"), "must be 'all' or a list of GPU indices, got 'some'"),
    (_entry_file("{devices: null, mig-enabled: false}"), "must be 'all' or a list of GPU indices, got None"),
    (_entry_file("{devices: ['0'], mig-enabled: false}"), "GPU index must be an integer, got '0'"),
    (_entry_file("{devices: all, mig-enabled: 'yes'}"), "must be true or false, got 'yes'"),
    (_entry_file("{devices: all, mig-enabled: true}"), "required when mig-enabled is true"),
    (_entry_file("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}"), "count must be an integer >= 0"),
    (_entry_file("{devices: all, mig-enabled: false, device-filter: [0x20B010DE]}"),
     "548409566 is not a PCI id string"),  # YAML reads an unquoted hex number as an integer
    ("version: v1\nmig-configs:\n  l: []\n", "must be a non-empty list of entries"),
    # Not YAML at all, and the wrong types.
    ("version: v1\nmig-configs:\n  l:\n    - {devices: all\n", "line 5: invalid YAML"),
    ("version: v1\nmig-configs: [a, b]\n", "must map at least one layout name"),
    ("just text\n", "not a MIG layout file"),
])
def test_what_mig_parted_refuses_is_refused(text, message):
    with pytest.raises(LayoutError) as error:
        check_layouts(text, "custom.yaml")
    assert str(error.value).startswith("custom.yaml: ") and message in str(error.value)


# Well-formed names no GPU can offer: mig-parted checks a name's form only (pkg/types/mig_profile.go
# AssertValidMigProfileFormat through go-nvlib's parseMigProfileFields), so the file loads there.
IMPOSSIBLE_PROFILES = [
    ("0g.5gb", "slice counts and memory size must be at least 1"),
    ("0c.1g.5gb", "slice counts and memory size must be at least 1"),
    ("1g.0gb", "slice counts and memory size must be at least 1"),
    ("2c.1g.5gb", "a compute instance (2c) cannot be larger than its GPU instance (1g)"),
    ("4c.3g.20gb", "a compute instance (4c) cannot be larger than its GPU instance (3g)"),
]

BLOCK_NULL_MIG_DEVICES = "version: v1\nmig-configs:\n  l:\n    - devices: all\n      mig-enabled: {}\n      mig-devices:\n"


@pytest.mark.parametrize("text, loads", [
    *((_entry_file(f"{{devices: all, mig-enabled: true, mig-devices: {{{profile}: 1}}}}"), True)
      for profile, _ in IMPOSSIBLE_PROFILES),
    # A null mig-devices is a nil map in mig-parted: missing when mig-enabled is true (api/spec/v1/spec.go).
    (BLOCK_NULL_MIG_DEVICES.format("true"), False),
    (_entry_file("{devices: all, mig-enabled: true, mig-devices: null}"), False),
    (BLOCK_NULL_MIG_DEVICES.format("false"), True),
    (_entry_file("{devices: all, mig-enabled: true, mig-devices: {}}"), True),
    (_entry_file("{devices: all, mig-enabled: true}"), False),
    (_entry_file("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}"), False),
], ids=[*(f"profile-{profile}" for profile, _ in IMPOSSIBLE_PROFILES), "block-null-mig-on", "flow-null-mig-on",
        "block-null-mig-off", "empty-mig-on", "missing-mig-on", "negative-count"])
def test_the_loader_takes_or_refuses_a_file_as_mig_parted_does(text, loads):
    mig_parted_loads, printed = mig_parted_verdict(text, "l")
    assert mig_parted_loads is loads, printed
    try:
        check_layouts(text, "custom.yaml")
    except LayoutError:
        assert not loads
    else:
        assert loads


@pytest.mark.parametrize("profile, reason", IMPOSSIBLE_PROFILES)
def test_an_impossible_profile_loads_with_a_warning_and_the_other_layouts_stay(profile, reason):
    text = (f"version: v1\nmig-configs:\n  all-1g.5gb:\n    - {{devices: all, mig-enabled: true, mig-devices: {{1g.5gb: 7}}}}\n"
            f"  impossible:\n    - {{devices: all, mig-enabled: true, mig-devices: {{1g.5gb: 1, {profile}: 1}}}}\n")
    layouts, warnings = check_layouts(text, "custom.yaml")
    assert warnings == [f"mig-configs.impossible[0].mig-devices.{profile}: no GPU offers profile {profile}: "
                        f"{reason}; applying this layout is refused"]
    assert layouts["all-1g.5gb"].entries[0].mig_devices == {"1g.5gb": 7}
    # Kept as written: 2c.1g.5gb must not turn into the possible 1g.5gb.
    assert layouts["impossible"].entries[0].mig_devices == {"1g.5gb": 1, profile: 1}


@pytest.mark.parametrize("text", [BLOCK_NULL_MIG_DEVICES.format("true"),
                                  _entry_file("{devices: all, mig-enabled: true, mig-devices: null}")],
                         ids=["block", "flow"])
def test_a_null_mig_devices_with_mig_on_is_refused_naming_file_layout_entry_and_key(text):
    with pytest.raises(LayoutError) as error:
        check_layouts(text, "custom.yaml")
    assert str(error.value) == ("custom.yaml: layout 'l', entry 1, key 'mig-devices': null counts as missing; "
                                "required when mig-enabled is true ({} for no MIG devices)")


def test_a_null_mig_devices_with_mig_off_is_no_mig_devices():
    layouts, warnings = check_layouts(BLOCK_NULL_MIG_DEVICES.format("false"), "custom.yaml")
    assert layouts["l"].entries[0].mig_devices == {}
    assert warnings == ["mig-configs.l[0].mig-devices: null is read as {} (no MIG devices)"]


def test_the_layouts_file_logs_its_warnings_once_per_change(tmp_path):
    path = tmp_path / "layouts.yaml"
    shutil.copy(FIXTURES / "mig-parted-suspicious.yaml", path)
    layouts_file = LayoutsFile(path)
    with structlog.testing.capture_logs() as logged:
        layouts_file.layouts()
        layouts_file.layouts()
    events = [e for e in logged if e["event"] == "mig_layouts_file_warning"]
    assert len(events) == len(layouts_file.warnings()) == 11
    assert events[0] == {"event": "mig_layouts_file_warning", "log_level": "warning", "component": "mig",
                         "path": str(path), "key": "mig-configs.typos[0].devices",
                         "warning": "index -1 is negative: it selects no GPU"}


# -- device plugin files -------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy", [("plugin-time-slicing.yaml", "time-slicing"), ("plugin-mps.yaml", "mps")])
def test_plugin_files_from_its_docs_load_without_warnings(name, strategy):
    config, warnings = check_sharing_file(FIXTURES / name)
    assert warnings == [] and config.warnings == ()
    assert config.strategy == strategy


def test_plugin_flags_are_read_as_the_plugin_reads_them():
    time_slicing = load_sharing(FIXTURES / "plugin-time-slicing.yaml").time_slicing
    assert time_slicing.rename_by_default and not time_slicing.fail_requests_greater_than_one
    assert time_slicing.resources[0].rename == "nvidia.com/gpu.shared"
    mps = load_sharing(FIXTURES / "plugin-mps.yaml").mps
    assert mps.fail_requests_greater_than_one  # the plugin's MPS default when unset
    assert mps.resources[0].replicas == 10 and mps.resources[0].devices == "all"


def test_keys_the_plugin_ignores_and_lists_it_accepts_load_with_warnings():
    config, warnings = check_sharing_file(FIXTURES / "plugin-with-extras.yaml")
    assert [w.split(": ")[0] for w in warnings] == [
        "kind", "flags.plugin.deviceIdStrategy", "sharing.timeSlicing.strategy",
        "sharing.timeSlicing.resources[0].comment", "sharing.timeSlicing.resources[0].devices",
        "sharing.timeSlicing.resources[1].devices"]
    assert all("unknown key, ignored as the device plugin ignores it" in w for w in warnings[:4])
    assert warnings[4:] == [
        "sharing.timeSlicing.resources[0].devices: device 0 is repeated",
        "sharing.timeSlicing.resources[1].devices: an empty list shares no device (list at least one, or use 'all')"]
    assert config.warnings == tuple(warnings)
    first, second = config.time_slicing.resources
    assert (first.devices, second.devices) == (("0", "0", "1"), ())
    assert config.time_slicing.fail_requests_greater_than_one


def test_resource_patterns_the_plugin_drops_are_warned_about():
    config, warnings = check_sharing("version: v1\nresources:\n  gpus:\n  - {pattern: 'A100*', name: a100}\n")
    assert warnings == ["resources: renaming by pattern is ignored, as the device plugin ignores it"]
    assert config.strategy == "none"


@pytest.mark.parametrize("text, message", [
    ("version: v2\n", "unknown version 'v2'"),
    ("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n", "number of replicas must be >= 2"),
    ("sharing: {timeSlicing: {resources: [{name: gpu, replica: 4}]}}\n", "no replicas specified"),
    ("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: some}]}}\n", "the only valid string"),
    ("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: [-1]}]}}\n", "-1 is not a GPU index"),
    ("sharing: {timeSlicing: {failRequestsGreaterThanOne: 'no', resources: [{name: gpu, replicas: 2}]}}\n",
     "failRequestsGreaterThanOne': must be true or false"),
    ("flags: {migStrategy: mixed}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n",
     "not supported with MPS"),
    ("flags: {plugin: {deviceIDStrategy: serial}}\n", "must be one of uuid, index"),
    ("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}\n", "line 2: invalid YAML"),
    ("sharing: [timeSlicing]\n", "key 'sharing': must be a mapping, got a list"),
])
def test_what_the_plugin_refuses_is_refused(text, message):
    with pytest.raises(SharingConfigError) as error:
        check_sharing(text, "sharing.yaml")
    assert str(error.value).startswith("sharing.yaml: ") and message in str(error.value)


def test_an_absent_sharing_file_propagates_as_from_load_sharing(tmp_path):
    with pytest.raises(FileNotFoundError):
        check_sharing_file(tmp_path / "absent.yaml")


# -- gpud's own config: mps.devices --------------------------------------------------------------


@pytest.mark.parametrize("text, devices", [
    ("mps:\n  devices: all\n", ("all",)), ("mps:\n  devices: [all]\n", ("all",)),
    ("mps:\n  devices: [0, GPU-b1028956-cfa2-0990-bf4a-5da9abb51763]\n",
     (0, "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763")),
])
def test_mps_devices_all_is_accepted_as_a_word_as_in_nvidias_files(text, devices):
    assert parse_config(text).mps.devices == devices


@pytest.mark.parametrize("text", ["mps:\n  devices: some\n", "mps:\n  devices: 3\n", "mps:\n  devices: {a: 1}\n"])
def test_mps_devices_other_words_are_still_refused(text):
    with pytest.raises(ConfigError, match="mps.devices"):
        parse_config(text)


# -- in the daemon -------------------------------------------------------------------------------

NODE = "A100-SXM4-40GB:2"
NODE_LAYOUTS = """\
version: v1
mig-configs:
  all-3g.20gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.20gb": 2}
  h100-only:
    - device-filter: ["0x233010DE", "0x233110DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  gpu-one-twice:
    - devices: [1, 1]
      mig-enabled: true
      mig-devices: {"7g.80gb": 1, "1g.5gb": 0}
"""


async def test_layouts_show_warnings_matching_gpus_and_refuse_a_layout_matching_no_gpu(short_tmp):
    node = await start_daemon(mig_config(short_tmp, NODE, NODE_LAYOUTS))
    try:
        before = await mig_settled(node)
        status, view = await node.get("/v1/mig/layouts")
        assert status == 200
        file_warning = "mig-configs.gpu-one-twice[0].devices: index 1 is repeated"
        node_warning = ("mig-configs.gpu-one-twice[0].mig-devices.7g.80gb: none of the GPUs of this node "
                        "that the entry selects offers profile 7g.80gb")
        assert view["warnings"] == [file_warning, node_warning]
        layouts = {layout["name"]: layout for layout in view["layouts"]}
        assert {name: (v["fits"], v["matching_gpus"]) for name, v in layouts.items()} == {
            "all-3g.20gb": (True, 2), "h100-only": (False, 0), "gpu-one-twice": (False, 1)}
        assert layouts["gpu-one-twice"]["warnings"] == [file_warning, node_warning]
        assert layouts["all-3g.20gb"]["warnings"] == [] and layouts["h100-only"]["warnings"] == []
        assert layouts["h100-only"]["reason"] == (
            "layout 'h100-only' matches no GPU of this node: entry 1 (devices all (MIG-capable GPUs), device-filter "
            "0x233010de, 0x233110de) selects none of GPU 0 (0x20b010de), GPU 1 (0x20b010de)")

        status, refused = await put_layout(node, "h100-only")
        assert status == 422 and refused["error"]["code"] == "layout-matches-no-gpu"
        assert "matches no GPU of this node" in refused["error"]["message"]
        status, dry = await put_layout(node, "h100-only", dry_run=True)
        assert status == 422 and dry["error"]["code"] == "layout-matches-no-gpu"
        assert not (short_tmp / "state" / "mig-desired.json").exists()  # nothing persisted
        _, after = await node.get("/v1/mig")
        assert [g["actual"] for g in after["gpus"]] == [g["actual"] for g in before["gpus"]]
        assert after["layout"] == before["layout"] is None
    finally:
        await stop_daemon(node)


IMPOSSIBLE_LAYOUTS = NODE_LAYOUTS + """\
  zero-slices:
    - devices: all
      mig-enabled: true
      mig-devices: {"0g.5gb": 1}
  ci-too-large:
    - devices: all
      mig-enabled: true
      mig-devices: {"2c.1g.5gb": 1}
"""


async def test_impossible_profiles_are_listed_as_not_fitting_and_refused_while_the_rest_applies(short_tmp):
    node = await start_daemon(mig_config(short_tmp, NODE, IMPOSSIBLE_LAYOUTS))
    try:
        before = await mig_settled(node)
        status, view = await node.get("/v1/mig/layouts")
        assert status == 200
        layouts = {layout["name"]: layout for layout in view["layouts"]}
        assert layouts["all-3g.20gb"]["fits"] is True
        for name, profile, why in [
                ("zero-slices", "0g.5gb", "slice counts and memory size must be at least 1"),
                ("ci-too-large", "2c.1g.5gb", "a compute instance (2c) cannot be larger than its GPU instance (1g)")]:
            assert layouts[name]["fits"] is False
            assert f"unknown MIG profile {profile} ({why})" in layouts[name]["reason"]
            assert f"mig-configs.{name}[0].mig-devices.{profile}: no GPU offers profile {profile}: {why}; " \
                   "applying this layout is refused" in layouts[name]["warnings"]
            status, refused = await put_layout(node, name)
            assert (status, refused["error"]["code"]) == (422, "layout-does-not-fit"), refused
            assert not (short_tmp / "state" / "mig-desired.json").exists()  # nothing persisted
            _, after = await node.get("/v1/mig")
            assert [g["actual"] for g in after["gpus"]] == [g["actual"] for g in before["gpus"]]
            assert after["layout"] is None
        status, applied = await put_layout(node, "all-3g.20gb")
        assert status == 200, applied
        _, mig = await node.get("/v1/mig")
        assert [g["actual"]["devices"] for g in mig["gpus"]] == [{"3g.20gb": 2}, {"3g.20gb": 2}]
    finally:
        await stop_daemon(node)


REQUEST_CONFIG = """\
version: v1
mig-configs:
  from-request:
    - device-filter: "0x20B010DE"
      devices: [0]
      mig-enabled: true
      mig-devices: {"1g.5gb": 3, "4g.20gb": 1}
"""


async def test_a_layout_sent_with_the_request_is_applied_and_converged_on_after_a_restart(short_tmp):
    config = mig_config(short_tmp, NODE, NODE_LAYOUTS)
    node = await start_daemon(config)
    try:
        await mig_settled(node)
        status, applied = await put_layout(node, "from-request", config=REQUEST_CONFIG)
        assert status == 200, applied
        _, mig = await node.get("/v1/mig")
        assert (mig["layout"], mig["layout_origin"], mig["in_sync"]) == ("from-request", "request", True)
        assert [g["actual"]["devices"] for g in mig["gpus"]] == [{"1g.5gb": 3, "4g.20gb": 1}, {}]
        saved = json.loads((short_tmp / "state" / "mig-desired.json").read_text())
        assert (saved["layout"], saved["origin"]) == ("from-request", "request")
    finally:
        await stop_daemon(node)
    (short_tmp / "sim.json").unlink()  # the hardware comes back bare, as after a reboot
    node = await start_daemon(config)
    try:
        mig = await mig_settled(node)
        assert (mig["layout"], mig["layout_origin"], mig["state"], mig["in_sync"]) == (
            "from-request", "request", "success", True)
        _, gpus = await node.get("/v1/gpus")
        assert [Counter(d["profile"] for d in g["mig"]["devices"]) for g in gpus["gpus"]] == [
            {"1g.5gb": 3, "4g.20gb": 1}, {}]
    finally:
        await stop_daemon(node)


@pytest.mark.parametrize("config, status, code, message", [
    ("version: v1\nmig-configs:\n  x: [{devices: all\n", 422, "layout-config-invalid", "config: line 4: invalid YAML"),
    ("version: v1\nmig-configs:\n  x: [{devices: all, mig-enabled: false, extra: 1}]\n", 422,
     "layout-config-invalid", "key 'extra': unexpected key"),
    (REQUEST_CONFIG.replace("from-request", "other"), 404, "layout-not-found", "no layout 'from-request'"),
    (REQUEST_CONFIG.replace('"0x20B010DE"', '"0x233010DE"'), 422, "layout-matches-no-gpu", "matches no GPU"),
])
async def test_a_bad_config_in_the_request_is_refused_with_nothing_changed(short_tmp, config, status, code, message):
    node = await start_daemon(mig_config(short_tmp, NODE, NODE_LAYOUTS))
    try:
        await mig_settled(node)
        answer_status, answer = await put_layout(node, "from-request", config=config)
        assert (answer_status, answer["error"]["code"]) == (status, code)
        assert message in answer["error"]["message"]
        assert not (short_tmp / "state" / "mig-desired.json").exists()
        status, wrong_type = await put_layout(node, "from-request", config={"version": "v1"})
        assert status == 400, wrong_type
    finally:
        await stop_daemon(node)


async def test_sharing_shows_the_files_warnings(short_tmp):
    text = (FIXTURES / "plugin-with-extras.yaml").read_text()
    node = await start_daemon(sharing_config(short_tmp, NODE, text))
    try:
        status, sharing = await node.get("/v1/sharing")
        assert status == 200 and sharing["strategy"] == "time-slicing"
        assert len(sharing["warnings"]) == 6
        assert sharing["warnings"][0].startswith("kind: unknown key, ignored as the device plugin ignores it")
        assert sharing["warnings"][-1].startswith("sharing.timeSlicing.resources[1].devices: an empty list shares no")
    finally:
        await stop_daemon(node)


# -- gpud … validate (the CLI reads the same checks) ---------------------------------------------


def test_validate_prints_the_warnings_and_strict_refuses_them():
    suspicious = str(FIXTURES / "mig-parted-suspicious.yaml")
    lenient = cli("mig", "validate", suspicious)
    assert lenient.returncode == 0, lenient.stderr
    assert "mig-configs.typos[0].devices: index 1 is repeated" in lenient.stderr
    strict = cli("mig", "validate", "--strict", "--json", suspicious)
    assert strict.returncode == 2
    assert len(json.loads(strict.stderr)["error"]["warnings"]) == 11
    clean = cli("sharing", "validate", "--strict", str(FIXTURES / "plugin-mps.yaml"))
    assert clean.returncode == 0 and clean.stderr == ""
    extras = cli("sharing", "validate", "--strict", str(FIXTURES / "plugin-with-extras.yaml"))
    assert extras.returncode == 2 and "6 warnings" in extras.stderr
