"""The health model: the XID catalog and the tracker, on inventory snapshots built by hand."""

from __future__ import annotations

import pytest

from gpud.health.catalog import CatalogError, XidCatalog, XidInfo, load_catalog, parse_catalog, shipped_table
from gpud.health.states import Health
from gpud.health.tracker import HealthTracker
from gpud.model.inventory import Gpu, Inventory, MigDevice, MigInfo
from gpud.model.mig import Placement

HOT = ("degraded", "inspect-hardware", "at the slowdown limit")
CATALOG = XidCatalog()


def xid_info(number: int) -> XidInfo:
    """The XID as the health service hands it to the tracker: looked up in the catalog."""
    return CATALOG.info(number)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def mig_device(gpu: int, gi_id: int, ci_id: int = 0) -> MigDevice:
    return MigDevice(uuid=f"MIG-{gpu}-{gi_id}-{ci_id}", index=gi_id, profile="1g.10gb", gi_id=gi_id, ci_id=ci_id,
                     gi_profile_id=19, ci_profile_id=0, placement=Placement(gi_id, 1), memory_total_mib=9856,
                     sm_count=14)


def gpu(index: int, mig_gis: tuple[int, ...] = (), lost: bool = False) -> Gpu:
    mig = MigInfo(capable=True, mode="enabled" if mig_gis else "disabled", pending_mode=None,
                  devices=tuple(mig_device(index, gi_id) for gi_id in mig_gis))
    return Gpu(index=index, uuid=f"GPU-{index}", name="NVIDIA A100-SXM4-80GB",
               pci_bus_id=f"00000000:{index + 7:02x}:00.0", pci_device_id="0x20B210DE", memory_total_mib=81920,
               compute_mode="default", architecture="ampere", cuda_compute_capability="8.0", serial=None, mig=mig,
               lost=lost)


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(driver_version="550.54.15", cuda_version="12.4", nvml_version="12.550.54.15", gpus=gpus)


NODE = inventory(gpu(0, mig_gis=(1, 2)), gpu(1), gpu(2))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tracker(clock) -> HealthTracker:
    tracker = HealthTracker(clear_after_passes=3, clock=clock)
    assert tracker.set_inventory(NODE) == []
    return tracker


def states(tracker: HealthTracker) -> dict[str, str]:
    return {uuid: state for uuid, state in tracker.gpu_states().items() if state != Health.HEALTHY}


# -- catalog -----------------------------------------------------------------------------------


def test_catalog_pinned_entries():
    catalog = XidCatalog()
    assert (catalog.info(79).severity, catalog.info(79).action) == ("fatal", "reboot")
    assert (catalog.info(48).severity, catalog.info(48).action) == ("fatal", "reboot")
    assert (catalog.info(94).severity, catalog.info(94).action) == ("critical", "restart-app")
    assert catalog.info(13).application and catalog.info(13).action == "restart-app"
    assert not catalog.info(13).affects_health and catalog.info(79).affects_health


def test_catalog_application_xids_are_the_device_plugins():
    assert {xid for xid, info in shipped_table().items() if info.application} == {13, 31, 43, 45, 68, 109}


def test_catalog_ranges_and_refinements():
    catalog = XidCatalog()
    assert [catalog.info(xid).name for xid in (144, 150)] == ["NVLink5 error"] * 2
    assert catalog.info(160).severity == "warning"
    assert (catalog.info(167).name, catalog.info(167).action) == ("PCIe fatal timeout", "reboot")


@pytest.mark.parametrize("xid", [999, 2, 151_000])
def test_catalog_unknown_xid(xid):
    info = XidCatalog().info(xid)
    assert (info.xid, info.name, info.severity, info.action, info.application) == (
        xid, "unknown XID", "critical", "reset-gpu", False)
    assert info.affects_health


def test_catalog_info_xid_does_not_affect_health():
    assert not XidCatalog().info(154).affects_health


def test_catalog_config_overrides():
    catalog = load_catalog(application_xids=[13, 94], ignored_xids=[79, 48], unhealthy_xids=[45, 48])
    assert not catalog.info(94).affects_health and catalog.info(94).application  # the list replaces the data's
    assert catalog.info(31).affects_health and not catalog.info(31).application
    assert not catalog.info(79).affects_health  # ignored
    assert catalog.info(48).affects_health  # forced wins over ignored
    assert catalog.info(45).affects_health and catalog.info(45).severity == "critical"  # forced counts as unhealthy


@pytest.mark.parametrize("text, error", [
    ("xids: {79: {name: x, severity: bad, action: none}}", "XID 79: severity must be one of"),
    ("xids: {79: {name: x, severity: info, action: reboot-now}}", "XID 79: action must be one of"),
    ("xids: {79: {name: x, severity: info}}", "XID 79: expected the fields"),
    ("xids: {79: {name: x, severity: info, action: none, colour: red}}", "XID 79: expected the fields"),
    ("xids: {150-144: {name: x, severity: info, action: none}}", "a key must be an XID or a range"),
    ("xids: {1-5: {name: x, severity: info, action: none}, 4-9: {name: y, severity: info, action: none}}",
     "XID 4 is already listed"),
    ("xids: {79: {name: x, severity: info, action: none}, 79: {name: y, severity: info, action: none}}",
     "key '79' given twice"),
    ("[1, 2]", "expected a mapping with the single key 'xids'"),
])
def test_catalog_rejects_bad_data(text, error):
    with pytest.raises(CatalogError, match=error):
        parse_catalog(text, "xids.yaml")


# -- XIDs ------------------------------------------------------------------------------------


def test_fatal_xid_makes_only_its_gpu_unhealthy(tracker):
    changes = tracker.record_xid("GPU-2", xid_info(79), None, None)
    assert [(c.device, c.gpu_index, c.previous, c.state) for c in changes] == [("GPU-2", 2, Health.HEALTHY, Health.UNHEALTHY)]
    (reason,) = changes[0].reasons
    assert (reason.kind, reason.code, reason.action, reason.severity) == ("xid", "79", "reboot", Health.UNHEALTHY)
    assert states(tracker) == {"GPU-2": Health.UNHEALTHY}


def test_application_xid_changes_nothing(tracker):
    assert tracker.record_xid("GPU-1", xid_info(13), None, None) == []
    assert states(tracker) == {}


def test_warning_xid_degrades(tracker):
    (change,) = tracker.record_xid("GPU-1", xid_info(92), None, None)
    assert change.state == Health.DEGRADED


def test_xid_with_mig_ids_hits_only_that_mig_device(tracker):
    changes = tracker.record_xid("GPU-0", xid_info(94), 2, 0)
    assert [(c.device, c.state) for c in changes] == [("MIG-0-2-0", Health.UNHEALTHY)]
    assert states(tracker) == {"MIG-0-2-0": Health.UNHEALTHY}


def test_xid_with_a_gpu_instance_id_alone_hits_its_compute_instances(tracker):
    tracker.record_xid("GPU-0", xid_info(94), 1, None)
    assert states(tracker) == {"MIG-0-1-0": Health.UNHEALTHY}


@pytest.mark.parametrize("gi_id, ci_id", [(None, None), (7, 0)])
def test_xid_on_a_gpu_reaches_its_mig_devices(tracker, gi_id, ci_id):
    changes = tracker.record_xid("GPU-0", xid_info(48), gi_id, ci_id)
    assert {c.device: c.state for c in changes} == {"GPU-0": Health.UNHEALTHY, "MIG-0-1-0": Health.UNHEALTHY,
                                                    "MIG-0-2-0": Health.UNHEALTHY}
    assert tracker.device("MIG-0-1-0")["reasons"][0]["code"] == "48"


def test_repeated_xid_bumps_count_without_a_change(tracker, clock):
    tracker.record_xid("GPU-1", xid_info(79), None, None)
    clock.now += 5
    assert tracker.record_xid("GPU-1", xid_info(79), None, None) == []
    (reason,) = tracker.device("GPU-1")["reasons"]
    assert (reason["count"], reason["first_seen"], reason["last_seen"]) == (2, 1000.0, 1005.0)


def test_a_second_xid_is_a_change(tracker):
    tracker.record_xid("GPU-1", xid_info(79), None, None)
    (change,) = tracker.record_xid("GPU-1", xid_info(48), None, None)
    assert (change.previous, change.state) == (Health.UNHEALTHY, Health.UNHEALTHY)
    assert [r.code for r in change.reasons] == ["79", "48"]


def test_xid_for_a_device_not_in_the_inventory_is_dropped(tracker):
    assert tracker.record_xid("GPU-9", xid_info(79), None, None) == []


# -- lost GPUs and inventory -----------------------------------------------------------------


def test_lost_gpu_is_unhealthy_with_its_mig_devices_until_it_is_back(tracker):
    changes = tracker.set_inventory(inventory(gpu(0, mig_gis=(1, 2), lost=True), gpu(1), gpu(2)))
    assert {c.device: c.state for c in changes} == {"GPU-0": Health.UNHEALTHY, "MIG-0-1-0": Health.UNHEALTHY,
                                                    "MIG-0-2-0": Health.UNHEALTHY}
    reason = changes[0].reasons[0]
    assert (reason.kind, reason.action, reason.clears) == ("lost", "reboot", "reset")
    changes = tracker.set_inventory(NODE)
    assert {c.device: c.state for c in changes} == {"GPU-0": Health.HEALTHY, "MIG-0-1-0": Health.HEALTHY, "MIG-0-2-0": Health.HEALTHY}


def test_removed_mig_devices_are_forgotten(tracker):
    tracker.record_xid("GPU-0", xid_info(94), 2, 0)
    assert tracker.set_inventory(inventory(gpu(0, mig_gis=(1,)), gpu(1), gpu(2))) == []
    assert "MIG-0-2-0" not in tracker.gpu_states()
    with pytest.raises(KeyError):
        tracker.device("MIG-0-2-0")


# -- periodic checks -------------------------------------------------------------------------


def test_check_problem_shows_at_once_and_clears_after_three_passes(tracker):
    (change,) = tracker.observe("GPU-1", "temperature", "slowdown", HOT)
    assert (change.state, change.reasons[0].clears) == (Health.DEGRADED, "check")
    assert tracker.observe("GPU-1", "temperature", "slowdown", None) == []
    assert tracker.observe("GPU-1", "temperature", "slowdown", None) == []
    assert states(tracker) == {"GPU-1": Health.DEGRADED}
    (change,) = tracker.observe("GPU-1", "temperature", "slowdown", None)
    assert (change.previous, change.state, change.reasons) == (Health.DEGRADED, Health.HEALTHY, ())


def test_check_passes_must_be_consecutive(tracker):
    tracker.observe("GPU-1", "temperature", "slowdown", HOT)
    tracker.observe("GPU-1", "temperature", "slowdown", None)
    tracker.observe("GPU-1", "temperature", "slowdown", None)
    assert tracker.observe("GPU-1", "temperature", "slowdown", HOT) == []
    tracker.observe("GPU-1", "temperature", "slowdown", None)
    tracker.observe("GPU-1", "temperature", "slowdown", None)
    assert states(tracker) == {"GPU-1": Health.DEGRADED}


def test_check_severity_rising_is_a_change(tracker):
    tracker.observe("GPU-1", "temperature", "slowdown", HOT)
    (change,) = tracker.observe("GPU-1", "temperature", "slowdown", ("unhealthy", "inspect-hardware", "near shutdown"))
    assert (change.previous, change.state) == (Health.DEGRADED, Health.UNHEALTHY)


def test_check_passes_do_not_clear_xids(tracker):
    tracker.record_xid("GPU-1", xid_info(79), None, None)
    for _ in range(5):
        assert tracker.observe("GPU-1", "xid", "79", None) == []
    assert states(tracker) == {"GPU-1": Health.UNHEALTHY}


def test_check_of_an_unknown_device_is_dropped_and_a_bad_severity_refused(tracker):
    assert tracker.observe("MIG-gone", "mps", "daemon", None) == []
    with pytest.raises(ValueError, match="severity"):
        tracker.observe("GPU-1", "power", "over-limit", ("fatal", "none", "x"))


# -- resets and clears -----------------------------------------------------------------------


def test_reset_clears_what_a_reset_fixes(tracker):
    tracker.record_xid("GPU-0", xid_info(79), None, None)
    tracker.record_xid("GPU-0", xid_info(94), 1, 0)
    tracker.observe("MIG-0-2-0", "mps", "daemon", ("degraded", "restart-app", "MPS daemon down"))
    tracker.record_xid("GPU-1", xid_info(79), None, None)
    changes = tracker.record_reset("GPU-0")
    assert {c.device: c.state for c in changes} == {"GPU-0": Health.HEALTHY, "MIG-0-1-0": Health.HEALTHY, "MIG-0-2-0": Health.HEALTHY}
    assert states(tracker) == {"GPU-1": Health.UNHEALTHY}


def test_reset_keeps_what_needs_a_hardware_inspection(tracker):
    tracker.record_xid("GPU-1", xid_info(64), None, None)
    assert tracker.device("GPU-1")["reasons"][0]["clears"] == "admin"
    assert tracker.record_reset("GPU-1") == []
    (change,) = tracker.clear("GPU-1")
    assert change.state == Health.HEALTHY


def test_admin_clear_by_kind_and_of_a_gpu_with_its_mig_devices(tracker):
    tracker.record_xid("GPU-1", xid_info(64), None, None)
    tracker.observe("GPU-1", "temperature", "slowdown", HOT)
    (change,) = tracker.clear("GPU-1", "xid")
    assert (change.state, [r.kind for r in change.reasons]) == (Health.DEGRADED, ["temperature"])
    tracker.record_xid("GPU-0", xid_info(94), 1, 0)
    changes = tracker.clear("GPU-0")
    assert [(c.device, c.state) for c in changes] == [("MIG-0-1-0", Health.HEALTHY)]
    with pytest.raises(KeyError):
        tracker.clear("GPU-9")


def test_lost_gpu_cleared_by_hand_comes_back_while_still_lost(tracker):
    lost = inventory(gpu(0, mig_gis=(1, 2)), gpu(1, lost=True), gpu(2))
    tracker.set_inventory(lost)
    tracker.clear("GPU-1")
    (change,) = tracker.set_inventory(lost)
    assert (change.device, change.state) == ("GPU-1", Health.UNHEALTHY)


# -- views -----------------------------------------------------------------------------------


def test_view_document(tracker):
    tracker.record_xid("GPU-0", xid_info(94), 2, 0)
    tracker.observe("GPU-2", "temperature", "slowdown", HOT)
    view = tracker.view(NODE)
    assert view["status"] == Health.UNHEALTHY
    assert [(g["index"], g["uuid"], g["state"]) for g in view["gpus"]] == [
        (0, "GPU-0", Health.HEALTHY), (1, "GPU-1", Health.HEALTHY), (2, "GPU-2", Health.DEGRADED)]
    assert [(m["uuid"], m["profile"], m["gi_id"], m["ci_id"], m["state"]) for m in view["gpus"][0]["mig_devices"]] == [
        ("MIG-0-1-0", "1g.10gb", 1, 0, Health.HEALTHY), ("MIG-0-2-0", "1g.10gb", 2, 0, Health.UNHEALTHY)]
    reason = view["gpus"][0]["mig_devices"][1]["reasons"][0]
    assert reason == {"kind": "xid", "code": "94", "message": "XID 94: contained memory error", "severity": Health.UNHEALTHY,
                      "action": "restart-app", "first_seen": 1000.0, "last_seen": 1000.0, "count": 1,
                      "clears": "reset"}


def test_view_of_a_healthy_node(tracker):
    assert tracker.view(NODE)["status"] == Health.HEALTHY
    assert HealthTracker().view(inventory()) == {"status": Health.HEALTHY, "node": {"state": Health.HEALTHY, "reasons": []}, "gpus": [],
                                                 "subjects": []}
