"""MIG layout files (mig-parted's v1 format) and MIG profile names.

Expected counts come from the profile tables in shared/reference/mig-profiles.md §3, and the
mig-parted files are NVIDIA's own (shared/peer-configs/mig-parted), loaded unchanged.
"""

from pathlib import Path

import pytest
import yaml

from gpud.mig.layouts import (
    Layout,
    LayoutEntry,
    LayoutError,
    default_layouts,
    export_layout,
    load_layouts,
    parse_layouts,
)
from gpud.model.mig_profile_names import MigProfileName

PEER_CONFIGS = Path("/work/shared/peer-configs/mig-parted")
SHIPPED_FILE = Path(__file__).parents[1] / "etc/gpud/mig-layouts.yaml"
needs_peer_configs = pytest.mark.skipif(not PEER_CONFIGS.is_dir(), reason="mig-parted's files are not here")

# -- profile names ---------------------------------------------------------------------------------

CANONICAL_NAMES = ["1g.5gb", "7g.141gb", "1c.3g.20gb", "4c.7g.40gb", "1g.5gb+me", "1g.24gb+me.all",
                   "4g.96gb+gfx", "1g.24gb-me", "1c.2g.12gb+me"]


@pytest.mark.parametrize("name", CANONICAL_NAMES)
def test_profile_name_formats_back_to_itself(name):
    assert str(MigProfileName.parse(name)) == name


def test_profile_name_parts():
    assert MigProfileName.parse("1c.3g.20gb") == MigProfileName(1, 3, 20, "")
    assert MigProfileName.parse("1c.3g.20gb").gi_name == "3g.20gb"
    assert MigProfileName.parse("3g.20gb+me") == MigProfileName(3, 3, 20, "+me")
    assert MigProfileName.parse("3g.20gb+me").gi_name == "3g.20gb+me"


def test_compute_instance_as_large_as_its_gpu_instance_is_written_without_the_c_part():
    assert MigProfileName.parse("3c.3g.20gb") == MigProfileName.parse("3g.20gb")
    assert str(MigProfileName.parse("3c.3g.20gb")) == "3g.20gb"
    assert str(MigProfileName(7, 7, 40, "")) == "7g.40gb"


@pytest.mark.parametrize("text, reason", [
    ("4c.3g.20gb", "cannot be larger than its GPU instance"),
    ("0g.5gb", "at least 1"), ("1g.0gb", "at least 1"), ("0c.1g.5gb", "at least 1"),
    ("1g.5gb+xx", "unknown attribute '+xx'"), ("1g.5gb+me.al", "unknown attribute"),
    ("1g.5gb-gfx", "unknown attribute"),
    ("1g. 5gb", "expected <G>g.<GB>gb"), (" 1g.5gb", "expected"), ("1g.5gb ", "expected"),
    ("1G.5GB", "expected"), ("1g5gb", "expected"), ("g.5gb", "expected"), ("1g.5gb+", "expected"),
    ("1g.5", "expected"), ("", "expected"), ("01g.5gb", "expected"), ("1g.5gb+me+gfx", "expected"),
    ("1c.2c.3g.20gb", "expected"), ("-1g.5gb", "expected"), ("MIG 1g.5gb", "expected"), ("junk", "expected"),
])
def test_bad_profile_names_are_refused_naming_the_text(text, reason):
    with pytest.raises(ValueError) as error:
        MigProfileName.parse(text)
    assert repr(text) in str(error.value)
    assert reason in str(error.value)


def test_bad_profile_name_message_lists_the_forms():
    with pytest.raises(ValueError, match=r"<C>c\.<G>g\.<GB>gb .*\+me, \+me\.all, \+gfx or -me"):
        MigProfileName.parse("junk")


def test_profile_name_fields_are_checked_when_built_directly():
    with pytest.raises(ValueError):
        MigProfileName(4, 3, 20, "")
    with pytest.raises(ValueError):
        MigProfileName(1, 1, 5, "+foo")


# -- mig-parted's own files ------------------------------------------------------------------------


def _entry_as_written(raw: dict) -> LayoutEntry:
    """What an entry of a mig-parted file means, read straight from the YAML."""
    written_filter = raw.get("device-filter", [])
    filters = [written_filter] if isinstance(written_filter, str) else written_filter
    devices = raw["devices"]
    return LayoutEntry(
        devices=None if devices == "all" else tuple(devices),
        device_filter=tuple(f.lower() for f in filters),
        mig_enabled=raw["mig-enabled"],
        mig_devices={name: count for name, count in (raw.get("mig-devices") or {}).items() if count},
    )


@needs_peer_configs
@pytest.mark.parametrize("file_name", [
    "deployments_systemd_config-default.yaml", "examples_config.yaml", "examples_dgx-station-80gb-config.yaml",
])
def test_mig_parted_configs_load_unchanged(file_name):
    path = PEER_CONFIGS / file_name
    raw = yaml.safe_load(path.read_text())["mig-configs"]
    layouts = load_layouts(path)
    assert list(layouts) == list(raw)
    for name, entries in raw.items():
        assert layouts[name] == Layout(name, tuple(_entry_as_written(entry) for entry in entries))


@needs_peer_configs
def test_mig_parted_default_config_details():
    layouts = load_layouts(PEER_CONFIGS / "deployments_systemd_config-default.yaml")
    assert len(layouts) == 81
    assert layouts["all-disabled"].entries == (LayoutEntry(None, (), False, {}),)
    assert layouts["all-enabled"].entries == (LayoutEntry(None, (), True, {}),)
    one_slice = layouts["all-1g.10gb"].entries
    assert [entry.mig_devices for entry in one_slice] == [{"1g.10gb": 7}, {"1g.10gb": 4}]
    assert one_slice[1].device_filter == ("0x20b010de", "0x20b110de", "0x20f110de", "0x20f610de")
    assert layouts["all-1g.24gb.me.all"].entries[0].mig_devices == {"1g.24gb+me.all": 1}
    assert layouts["all-1g.24gb-me"].entries[0].mig_devices == {"1g.24gb-me": 4}
    balanced = layouts["all-balanced"]
    assert len(balanced.entries) == 12
    # the A30 entry's filter is written as a plain string, not a list
    assert balanced.for_gpu(0, "0x20B710DE", True).mig_devices == {"1g.6gb": 2, "2g.12gb": 1}
    assert balanced.for_gpu(0, "0x20B010DE", True).mig_devices == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}


@needs_peer_configs
def test_mig_parted_example_config():
    layouts = load_layouts(PEER_CONFIGS / "examples_config.yaml")
    assert list(layouts) == ["all-disabled", "all-enabled", "all-1g.5gb", "all-1g.5gb.me", "all-1g.10gb",
                             "all-2g.10gb", "all-3g.20gb", "all-balanced", "custom-config"]
    custom = layouts["custom-config"]
    assert [(entry.devices, entry.mig_enabled, entry.mig_devices) for entry in custom.entries] == [
        ((0, 1, 2, 3), False, {}),
        ((4,), True, {"1g.5gb": 7}),
        ((5,), True, {"2g.10gb": 3}),
        ((6,), True, {"3g.20gb": 2}),
        ((7,), True, {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}),
    ]
    assert custom.for_gpu(8, "0x20B010DE", True) is None  # not listed: left alone


@needs_peer_configs
def test_mig_parted_dgx_station_config_keeps_the_display_gpu_out():
    layouts = load_layouts(PEER_CONFIGS / "examples_dgx-station-80gb-config.yaml")
    assert len(layouts) == 9
    balanced = layouts["all-balanced-dgx-station-80"]
    assert balanced.for_gpu(0, "0x20B210DE", True).mig_devices == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert balanced.for_gpu(3, "0x1FB010DE", False) is None  # `all` skips GPUs without MIG
    k8s = layouts["balanced-k8s-dgx-station-80"]
    assert k8s.for_gpu(2, "0x20B210DE", True).mig_devices == {"2g.20gb": 3, "1g.10gb": 1}
    assert k8s.for_gpu(3, "0x1FB010DE", False).mig_enabled is False  # listed explicitly, MIG off: fine
    assert k8s.for_gpu(3, "0x20B210DE", True) is None


@needs_peer_configs
@pytest.mark.parametrize("file_name", [
    "deployments_systemd_hooks-default.yaml", "deployments_systemd_hooks-minimal.yaml",
])
def test_mig_parted_hooks_files_are_not_layout_files(file_name):
    path = PEER_CONFIGS / file_name
    with pytest.raises(LayoutError, match="not a MIG layout file") as error:
        load_layouts(path)
    assert str(error.value).startswith(f"{path}: key 'hooks': ")


# -- the layouts gpud ships ------------------------------------------------------------------------

# Per model (mig-profiles.md §2-§3): PCI ids, compute slices, memory slices, and for each GPU-instance
# profile the number that fit on an empty GPU and how many memory slices one takes.
MODELS = {
    "A100-40GB": (("0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"), 7, 8, {
        "1g.5gb": (7, 1), "1g.5gb+me": (1, 1), "1g.10gb": (4, 2), "2g.10gb": (3, 2), "3g.20gb": (2, 4),
        "4g.20gb": (1, 4), "7g.40gb": (1, 8)}),
    "A100-80GB": (("0x20B210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE"), 7, 8, {
        "1g.10gb": (7, 1), "1g.10gb+me": (1, 1), "1g.20gb": (4, 2), "2g.20gb": (3, 2), "3g.40gb": (2, 4),
        "4g.40gb": (1, 4), "7g.80gb": (1, 8)}),
    "H100-80GB": (("0x233010DE", "0x233110DE", "0x232210DE", "0x232410DE"), 7, 8, {
        "1g.10gb": (7, 1), "1g.10gb+me": (1, 1), "1g.20gb": (4, 2), "2g.20gb": (3, 2), "3g.40gb": (2, 4),
        "4g.40gb": (1, 4), "7g.80gb": (1, 8)}),
    "H100-NVL": (("0x232110DE",), 7, 8, {
        "1g.12gb": (7, 1), "1g.12gb+me": (1, 1), "1g.24gb": (4, 2), "2g.24gb": (3, 2), "3g.47gb": (2, 4),
        "4g.47gb": (1, 4), "7g.94gb": (1, 8)}),
    "H200": (("0x233510DE", "0x233B10DE"), 7, 8, {
        "1g.18gb": (7, 1), "1g.18gb+me": (1, 1), "1g.35gb": (4, 2), "2g.35gb": (3, 2), "3g.71gb": (2, 4),
        "4g.71gb": (1, 4), "7g.141gb": (1, 8)}),
    "A30": (("0x20B710DE",), 4, 4, {
        "1g.6gb": (4, 1), "1g.6gb+me": (1, 1), "2g.12gb": (2, 2), "2g.12gb+me": (1, 2), "4g.24gb": (1, 4)}),
}

SINGLE_PROFILE_LAYOUTS = [
    "all-1g.5gb", "all-1g.5gb.me", "all-2g.10gb", "all-3g.20gb", "all-4g.20gb", "all-7g.40gb",
    "all-1g.10gb", "all-1g.20gb", "all-2g.20gb", "all-3g.40gb", "all-4g.40gb", "all-7g.80gb",
    "all-1g.6gb", "all-2g.12gb", "all-4g.24gb",
    "all-1g.18gb", "all-1g.35gb", "all-2g.35gb", "all-3g.71gb", "all-4g.71gb", "all-7g.141gb",
]

BALANCED = {
    "A100-40GB": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
    "A100-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H100-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H100-NVL": {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1},
    "H200": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
    "A30": {"1g.6gb": 2, "2g.12gb": 1},
}

MODEL_GPUS = [(model, pci_id) for model, (pci_ids, *_) in MODELS.items() for pci_id in pci_ids]


@pytest.fixture(scope="module")
def shipped() -> dict[str, Layout]:
    return load_layouts(SHIPPED_FILE)


def test_shipped_file_has_the_standard_layouts_in_order(shipped):
    assert list(shipped) == ["all-disabled", "all-enabled", *SINGLE_PROFILE_LAYOUTS, "all-balanced"]


def test_default_layouts_are_the_shipped_file(shipped):
    assert default_layouts() == shipped


@pytest.mark.parametrize("model, pci_id", MODEL_GPUS)
def test_shipped_on_off_layouts(shipped, model, pci_id):
    assert shipped["all-disabled"].for_gpu(0, pci_id, True) == LayoutEntry(None, (), False, {})
    assert shipped["all-enabled"].for_gpu(0, pci_id, True) == LayoutEntry(None, (), True, {})


@pytest.mark.parametrize("layout_name", SINGLE_PROFILE_LAYOUTS)
def test_shipped_single_profile_layouts_fill_the_gpus_that_have_the_profile(shipped, layout_name):
    layout = shipped[layout_name]
    profile = layout_name.removeprefix("all-").replace(".me", "+me")  # mig-parted writes "+" as "." in names
    fitted = []
    for model, pci_id in MODEL_GPUS:
        capacities = MODELS[model][3]
        entry = layout.for_gpu(0, pci_id, True)
        if profile in capacities:
            assert entry.mig_devices == {profile: capacities[profile][0]}, (model, pci_id)
            fitted.append(model)
        else:  # the GPU lacks the profile, so the layout cannot be applied to it
            assert entry is None or not set(entry.mig_devices) & set(capacities), (model, pci_id)
    assert fitted


@pytest.mark.parametrize("model, pci_id", MODEL_GPUS)
def test_shipped_balanced_layout_per_model(shipped, model, pci_id):
    _, compute_slices, memory_slices, capacities = MODELS[model]
    counts = shipped["all-balanced"].for_gpu(0, pci_id, True).mig_devices
    assert counts == BALANCED[model]
    assert all(count <= capacities[profile][0] for profile, count in counts.items())
    assert sum(MigProfileName.parse(p).gi_slices * n for p, n in counts.items()) == compute_slices
    assert sum(capacities[p][1] * n for p, n in counts.items()) == memory_slices


# -- files gpud refuses ----------------------------------------------------------------------------

GOOD_ENTRY = "{devices: all, mig-enabled: false}"


def _layout_file(bad_entry: str) -> str:
    """A file whose layout 'bad' has the given (flow-style) entry as its entry 2."""
    return (f"version: v1\nmig-configs:\n  good:\n    - {GOOD_ENTRY}\n"
            f"  bad:\n    - {GOOD_ENTRY}\n    - {bad_entry}\n")


def _error(text: str) -> str:
    with pytest.raises(LayoutError) as error:
        parse_layouts(text, "custom.yaml")
    return str(error.value)


def test_error_names_file_layout_entry_and_key():
    text = _layout_file("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: two}}").replace("bad", "all-balanced")
    with pytest.raises(LayoutError) as error:
        parse_layouts(text, "mig-layouts.yaml")
    assert str(error.value) == ("mig-layouts.yaml: layout 'all-balanced', entry 2, key 'mig-devices.1g.5gb': "
                                "count must be an integer >= 0, got 'two'")


@pytest.mark.parametrize("entry, key, reason", [
    ("{devices: all, mig-enabled: false, mig-device: {}}", "mig-device", "unexpected key"),
    ("{mig-enabled: false}", "devices", "missing"),
    ("{devices: some, mig-enabled: false}", "devices", "must be 'all' or a list of GPU indices, got 'some'"),
    ("{devices: ALL, mig-enabled: false}", "devices", "got 'ALL'"),
    ("{devices: 0, mig-enabled: false}", "devices", "got 0"),
    # [], [-1] and [0, 1, 0] load with warnings, as mig-parted takes them: tests/test_nvidia_files.py
    ("{devices: [0, '1'], mig-enabled: false}", "devices", "got '1'"),
    ("{devices: [1.0], mig-enabled: false}", "devices", "got 1.0"),
    ("{devices: [true], mig-enabled: false}", "devices", "got True"),
    ("{devices: all, mig-devices: {}}", "mig-enabled", "missing"),
    ("{devices: all, mig-enabled: 'true'}", "mig-enabled", "must be true or false, got 'true'"),
    ("{devices: all, mig-enabled: 1}", "mig-enabled", "got 1"),
    ("{devices: all, mig-enabled: true}", "mig-devices", "required when mig-enabled is true"),
    ("{devices: all, mig-enabled: false, mig-devices: {1g.5gb: 1}}", "mig-devices", "must be absent or empty"),
    ("{devices: all, mig-enabled: true, mig-devices: [1g.5gb]}", "mig-devices", "must be a mapping"),
    ("{devices: all, mig-enabled: true, mig-devices: null}", "mig-devices", "null counts as missing"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 0, 2g.10gb: 0}}", "mig-devices", "all counts are 0"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}", "mig-devices.1g.5gb", "got -1"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: true}}", "mig-devices.1g.5gb", "got True"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: '7'}}", "mig-devices.1g.5gb", "got '7'"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 1.5}}", "mig-devices.1g.5gb", "got 1.5"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5xb: 1}}", "mig-devices.1g.5xb", "invalid MIG profile name"),
    ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb+foo: 1}}", "mig-devices.1g.5gb+foo", "unknown attribute"),
    # 4c.3g.20gb and 0g.5gb load with a warning, as mig-parted takes them: tests/test_nvidia_files.py
    ("{devices: all, mig-enabled: true, mig-devices: {7: 1}}", "mig-devices.7", "invalid MIG profile name '7'"),
    ("{devices: all, mig-enabled: true, mig-devices: {3g.20gb: 1, 3c.3g.20gb: 1}}", "mig-devices.3c.3g.20gb",
     "the same MIG profile as an earlier key"),
    # A malformed PCI id string loads with a warning and never matches, as in mig-parted: tests/test_nvidia_files.py
    ("{devices: all, mig-enabled: false, device-filter: ['0x20B010DE', 42]}", "device-filter", "42 is not a PCI id"),
    ("{devices: all, mig-enabled: false, device-filter: {a: b}}", "device-filter", "must be a PCI id or a list"),
])
def test_bad_entries_are_refused(entry, key, reason):
    message = _error(_layout_file(entry))
    assert message.startswith(f"custom.yaml: layout 'bad', entry 2, key '{key}': ")
    assert reason in message


def test_entry_that_is_not_a_mapping_is_refused():
    assert _error(_layout_file("all")).startswith("custom.yaml: layout 'bad', entry 2: must be a mapping")


ONE_LAYOUT = "mig-configs:\n  a:\n    - {devices: all, mig-enabled: false}\n"


@pytest.mark.parametrize("text, message", [
    (ONE_LAYOUT, "custom.yaml: key 'version': missing"),
    ("version: v2\n" + ONE_LAYOUT, "custom.yaml: key 'version': unknown version 'v2', expected 'v1'"),
    ("version: 1\n" + ONE_LAYOUT, "custom.yaml: key 'version': unknown version 1"),
    ("version: v1\nextra: 1\n" + ONE_LAYOUT, "custom.yaml: key 'extra': not a MIG layout file"),
    ("version: v1\n", "custom.yaml: key 'mig-configs': must map at least one layout name"),
    ("version: v1\nmig-configs: {}\n", "custom.yaml: key 'mig-configs': must map at least one layout name"),
    ("version: v1\nmig-configs: [a]\n", "custom.yaml: key 'mig-configs': must map at least one layout name"),
    ("version: v1\nmig-configs:\n  a: []\n", "custom.yaml: layout 'a': must be a non-empty list of entries"),
    ("version: v1\nmig-configs:\n  a:\n", "custom.yaml: layout 'a': must be a non-empty list of entries"),
    ("version: v1\nmig-configs:\n  1: [{devices: all, mig-enabled: false}]\n",
     "custom.yaml: key 'mig-configs': layout name must be a string, got 1"),
    ("", "custom.yaml: not a MIG layout file"),
    ("- version: v1\n", "custom.yaml: not a MIG layout file"),
])
def test_bad_files_are_refused(text, message):
    assert _error(text).startswith(message)


def test_yaml_syntax_error_gives_the_line():
    text = "version: v1\nmig-configs:\n  a:\n    - devices: [0, 1\n      mig-enabled: false\n"
    assert _error(text).startswith("custom.yaml: line 5: invalid YAML: ")


def test_a_layout_named_twice_is_refused_with_the_line():
    text = f"version: v1\nmig-configs:\n  a:\n    - {GOOD_ENTRY}\n  a:\n    - {GOOD_ENTRY}\n"
    assert _error(text) == "custom.yaml: line 5: invalid YAML: key 'a' given twice"


def test_layout_file_keeps_file_order_and_accepts_yaml_anchors():
    text = (f"version: v1\nmig-configs:\n  zeta:\n    - &off {GOOD_ENTRY}\n  alpha:\n    - *off\n"
            "  mid:\n    - {<<: *off, mig-enabled: true, mig-devices: {}}\n")
    layouts = parse_layouts(text)
    assert list(layouts) == ["zeta", "alpha", "mid"]
    assert layouts["mid"].entries[0].mig_enabled is True


def test_profile_names_are_canonical_and_zero_counts_dropped():
    layouts = parse_layouts(_layout_file("{devices: [2, 0], mig-enabled: true, device-filter: '0x20B010DE:0x145F10DE', "
                                         "mig-devices: {3c.3g.20gb: 1, 1c.3g.20gb: 2, 1g.5gb: 0}}"))
    assert layouts["bad"].entries[1] == LayoutEntry(
        devices=(2, 0), device_filter=("0x20b010de:0x145f10de",), mig_enabled=True,
        mig_devices={"3g.20gb": 1, "1c.3g.20gb": 2})


# -- which entry a GPU gets ------------------------------------------------------------------------


def _layout(*entries: str) -> Layout:
    body = "".join(f"    - {entry}\n" for entry in entries)
    return parse_layouts(f"version: v1\nmig-configs:\n  test:\n{body}")["test"]


SEVEN_1G = "{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 7}}"


def test_devices_all_and_index_lists():
    layout = _layout("{devices: [0, 2], mig-enabled: false}")
    assert layout.for_gpu(0, "0x20B010DE", True).mig_enabled is False
    assert layout.for_gpu(1, "0x20B010DE", True) is None
    assert _layout(SEVEN_1G).for_gpu(5, "0x20B010DE", True).mig_devices == {"1g.5gb": 7}


def test_device_filters_compare_case_insensitively():
    entry = _layout("{devices: all, mig-enabled: false, device-filter: ['0x20B010DE', '0x20b710de']}").entries[0]
    assert entry.matches(0, "0x20b010de") and entry.matches(0, "0x20B010DE") and entry.matches(0, "0x20B710DE")
    assert not entry.matches(0, "0x20B210DE")
    assert _layout(GOOD_ENTRY).entries[0].matches(0, "0x1EB810DE")  # no filter: any GPU


def test_device_filter_with_subsystem():
    entry = _layout("{devices: all, mig-enabled: false, device-filter: '0x20B010DE:0x145F10DE'}").entries[0]
    assert entry.matches(0, "0x20B010DE", "0x145f10de")
    assert not entry.matches(0, "0x20B010DE", "0x134F10DE")
    assert not entry.matches(0, "0x20B010DE")  # subsystem unknown: cannot be the one named
    primary_only = _layout("{devices: all, mig-enabled: false, device-filter: '0x20B010DE'}").entries[0]
    assert primary_only.matches(0, "0x20B010DE", "0x134F10DE")


def test_index_and_filter_must_both_match():
    layout = _layout("{devices: [1], mig-enabled: false, device-filter: '0x20B010DE'}")
    assert layout.for_gpu(1, "0x20B010DE", True) is not None
    assert layout.for_gpu(1, "0x20B210DE", True) is None
    assert layout.for_gpu(0, "0x20B010DE", True) is None


def test_last_matching_entry_wins():
    off_for_gpu1 = "{devices: [1], mig-enabled: false}"
    layout = _layout(SEVEN_1G, off_for_gpu1)
    assert layout.for_gpu(1, "0x20B010DE", True).mig_enabled is False
    assert layout.for_gpu(0, "0x20B010DE", True).mig_devices == {"1g.5gb": 7}
    assert _layout(off_for_gpu1, SEVEN_1G).for_gpu(1, "0x20B010DE", True).mig_devices == {"1g.5gb": 7}


def test_gpu_without_mig_is_skipped_by_all():
    assert _layout(SEVEN_1G).for_gpu(0, "0x1EB810DE", False) is None
    assert _layout(GOOD_ENTRY).for_gpu(0, "0x1EB810DE", False) is None
    off_for_gpu0 = "{devices: [0], mig-enabled: false}"
    assert _layout(off_for_gpu0, SEVEN_1G).for_gpu(0, "0x1EB810DE", False).devices == (0,)


def test_gpu_without_mig_listed_with_mig_on_is_an_error():
    layout = _layout(GOOD_ENTRY, "{devices: [0, 3], mig-enabled: true, mig-devices: {}}")
    with pytest.raises(LayoutError, match=r"layout 'test', entry 2: .*GPU 3 is not MIG-capable"):
        layout.for_gpu(3, "0x1EB810DE", False)


# -- export ----------------------------------------------------------------------------------------

NODE = [
    (0, True, {"1g.5gb": 7}),
    (1, False, {}),
    (2, True, {"1g.5gb": 7, "2g.10gb": 0}),
    (3, True, {}),
    (4, True, {"1g.5gb+me": 1, "1c.3g.20gb": 2, "3g.20gb": 1}),
    (5, False, {}),
]


def test_export_round_trips():
    layouts = parse_layouts(export_layout("current", NODE))
    assert list(layouts) == ["current"]
    layout = layouts["current"]
    for index, mig_enabled, counts in NODE:
        entry = layout.for_gpu(index, "0x20B010DE", True)
        assert (entry.mig_enabled, entry.mig_devices) == (mig_enabled, {p: n for p, n in counts.items() if n})
    assert layout.for_gpu(6, "0x20B010DE", True) is None


def test_export_groups_gpus_with_the_same_settings():
    document = yaml.safe_load(export_layout("current", NODE))
    assert document["version"] == "v1"
    assert [entry["devices"] for entry in document["mig-configs"]["current"]] == [[0, 2], [1, 5], [3], [4]]
    assert "mig-devices" not in document["mig-configs"]["current"][1]


@pytest.mark.parametrize("per_gpu, reason", [
    ([(0, False, {"1g.5gb": 1})], "must be absent or empty when mig-enabled is false"),
    ([(0, True, {"1g.5xb": 1})], "invalid MIG profile name"),
    ([(0, True, {}), (0, False, {})], "GPU 0 given more than once"),
    ([], "must be a non-empty list of entries"),
])
def test_export_refuses_what_would_not_load(per_gpu, reason):
    with pytest.raises(LayoutError, match=reason):
        export_layout("current", per_gpu)


def test_unreadable_file_is_a_layout_error(tmp_path):
    with pytest.raises(LayoutError, match=r"missing\.yaml: cannot read the file"):
        load_layouts(tmp_path / "missing.yaml")
