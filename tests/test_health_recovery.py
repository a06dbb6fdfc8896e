"""The driver's recovery action in the health model: its own reason beside gpud's suggestion, XID reasons
that clear once the driver says the GPU recovered, reboots that do not help escalating, and the
subjects that are no GPU (the node, InfiniBand ports). On inventory snapshots built by hand."""

from __future__ import annotations

import pytest

from gpud.health.reasons import parse_reasons
from gpud.health.states import Health
from gpud.health.tracker import NODE, HealthTracker
from test_health_tracker import NODE as INVENTORY, Clock, xid_info

HOUR = 3600.0


@pytest.fixture
def clock() -> Clock:
    return Clock()


def tracker_for(clock: Clock, boot: str = "boot-1", **kwargs) -> HealthTracker:
    tracker = HealthTracker(clear_after_passes=3, clock=clock, boot_id=boot, **kwargs)
    tracker.set_inventory(INVENTORY)
    return tracker


def gpu_view(tracker: HealthTracker, index: int) -> dict:
    return next(gpu for gpu in tracker.view(INVENTORY)["gpus"] if gpu["index"] == index)


def test_the_drivers_action_is_said_beside_gpuds_and_is_a_reason_of_its_own(clock):
    tracker = tracker_for(clock)
    assert gpu_view(tracker, 1)["driver_action"] is None  # not read yet, or a branch without the field
    changes = tracker.record_driver_action("GPU-1", "gpu-reset")
    assert [(c.device, c.state, c.driver_action) for c in changes] == [("GPU-1", Health.UNHEALTHY, "gpu-reset")]
    view = gpu_view(tracker, 1)
    assert view["driver_action"] == "gpu-reset" and view["suggested_action"] == "reset-gpu"
    assert [(r["kind"], r["code"], r["clears"]) for r in view["reasons"]] == [("recovery-action", "gpu-reset", "driver")]
    assert tracker.record_driver_action("GPU-1", "gpu-reset") == []  # the same again is no change
    changes = tracker.record_driver_action("GPU-1", "none")
    assert [(c.state, c.driver_action) for c in changes] == [(Health.HEALTHY, "none")]
    assert gpu_view(tracker, 1)["suggested_action"] == "none"


def test_a_branch_without_the_field_changes_nothing(clock):
    tracker = tracker_for(clock)
    tracker.record_xid("GPU-1", xid_info(48), None, None)
    assert tracker.record_driver_action("GPU-1", None) == []
    assert gpu_view(tracker, 1)["state"] == Health.UNHEALTHY and gpu_view(tracker, 1)["driver_action"] is None


def test_drain_p2p_degrades_and_asks_the_work_to_stop(clock):
    tracker = tracker_for(clock)
    tracker.record_driver_action("GPU-2", "drain-p2p")
    view = gpu_view(tracker, 2)
    assert view["state"] == Health.DEGRADED and view["suggested_action"] == "restart-app"


def test_an_xid_clears_once_the_driver_says_the_gpu_recovered(clock):
    tracker = tracker_for(clock)
    tracker.record_xid("GPU-1", xid_info(48), None, None)  # double-bit ECC: reset-gpu
    clock.now += 1
    changes = tracker.record_driver_action("GPU-1", "none")  # "none" before it ever asked: not a recovery
    assert [(c.state, c.driver_action) for c in changes] == [(Health.UNHEALTHY, "none")]  # only the driver's word is new
    assert tracker.record_driver_action("GPU-1", "none") == []
    clock.now += 1
    tracker.record_driver_action("GPU-1", "gpu-reset")
    clock.now += 5
    changes = tracker.record_driver_action("GPU-1", "none")  # recovered (a reset gpud did not see)
    assert [(c.device, c.previous, c.state) for c in changes] == [("GPU-1", Health.UNHEALTHY, Health.HEALTHY)]


def test_an_xid_after_the_drivers_last_request_stays(clock):
    tracker = tracker_for(clock)
    tracker.record_driver_action("GPU-1", "gpu-reset")
    clock.now += 1
    tracker.record_xid("GPU-1", xid_info(48), None, None)  # a new XID after the driver asked
    clock.now += 1
    tracker.record_driver_action("GPU-1", "none")
    assert [r["kind"] for r in gpu_view(tracker, 1)["reasons"]] == ["xid"]


def test_an_xid_needing_inspection_never_clears_by_itself(clock):
    tracker = tracker_for(clock)
    tracker.record_xid("GPU-1", xid_info(79), None, None)  # fallen off the bus
    info = xid_info(79)
    tracker.record_driver_action("GPU-1", "node-reboot")
    clock.now += 1
    tracker.record_driver_action("GPU-1", "none")
    remaining = [(r["kind"], r["code"]) for r in gpu_view(tracker, 1)["reasons"]]
    assert (("xid", "79") in remaining) == (info.action == "inspect-hardware")


def test_reasons_from_before_a_reboot_clear_when_the_driver_says_none(clock):
    first = tracker_for(clock, boot="boot-1")
    first.record_xid("GPU-1", xid_info(48), None, None)
    first.record_xid("GPU-0", xid_info(48), 1, 0)  # a MIG device's
    saved = parse_reasons(first.export())
    after_reboot = HealthTracker(clock=clock, boot_id="boot-2")
    after_reboot.restore(saved, earlier_boot=True)
    after_reboot.set_inventory(INVENTORY)
    assert gpu_view(after_reboot, 1)["state"] == Health.UNHEALTHY  # restored: the driver has not spoken yet
    after_reboot.record_driver_action("GPU-1", "none")
    after_reboot.record_driver_action("GPU-0", "none")
    assert after_reboot.view(INVENTORY)["status"] == Health.HEALTHY
    same_boot = HealthTracker(clock=clock, boot_id="boot-1")
    same_boot.restore(saved, earlier_boot=False)
    same_boot.set_inventory(INVENTORY)
    same_boot.record_driver_action("GPU-1", "none")
    assert gpu_view(same_boot, 1)["state"] == Health.UNHEALTHY  # a gpud restart is no recovery


def test_reboots_that_do_not_help_escalate_to_inspect_hardware_across_restarts(clock):
    needs = None
    for boot in ("boot-1", "boot-2"):
        tracker = HealthTracker(clock=clock, boot_id=boot, reboot_escalation=(3, 24 * HOUR))
        tracker.restore({}, reboot_needs=needs)
        tracker.set_inventory(INVENTORY)
        tracker.record_driver_action("GPU-2", "node-reboot")
        tracker.record_driver_action("GPU-2", "none")
        tracker.record_driver_action("GPU-2", "node-reboot")  # twice in one boot counts once
        assert "inspect-hardware" != gpu_view(tracker, 2)["suggested_action"]
        needs = tracker.reboot_needs
        clock.now += HOUR
    tracker = HealthTracker(clock=clock, boot_id="boot-3", reboot_escalation=(3, 24 * HOUR))
    tracker.restore({}, reboot_needs=needs)
    tracker.set_inventory(INVENTORY)
    tracker.record_driver_action("GPU-2", "node-reboot")
    view = gpu_view(tracker, 2)
    assert view["suggested_action"] == "inspect-hardware"
    escalation = next(r for r in view["reasons"] if r["code"] == "repeated-reboot")
    assert escalation["clears"] == "admin" and "3 boots within 24 h" in escalation["message"]
    tracker.record_driver_action("GPU-2", "none")
    assert gpu_view(tracker, 2)["suggested_action"] == "inspect-hardware"  # only an administrator clears it
    tracker.clear("GPU-2")
    assert gpu_view(tracker, 2)["state"] == Health.HEALTHY


def test_reboots_outside_the_window_do_not_count(clock):
    tracker = HealthTracker(clock=clock, boot_id="boot-9", reboot_escalation=(3, 24 * HOUR))
    tracker.restore({}, reboot_needs={"GPU-2": {"boot-1": clock.now - 30 * HOUR, "boot-2": clock.now - 2 * HOUR}})
    tracker.set_inventory(INVENTORY)
    tracker.record_driver_action("GPU-2", "node-reboot")
    assert gpu_view(tracker, 2)["suggested_action"] == "reboot"
    assert set(tracker.reboot_needs["GPU-2"]) == {"boot-2", "boot-9"}  # the old one forgotten


def test_an_xid_needing_a_reboot_counts_as_a_boot_that_needed_one(clock):
    tracker = HealthTracker(clock=clock, boot_id="boot-3", reboot_escalation=(2, 24 * HOUR))
    tracker.restore({}, reboot_needs={"GPU-1": {"boot-2": clock.now - HOUR}})
    tracker.set_inventory(INVENTORY)
    reboot_xids = [number for number in range(1, 200) if xid_info(number).action == "reboot"
                   and xid_info(number).affects_health]
    assert reboot_xids, "the catalog has XIDs whose action is a reboot"
    tracker.record_xid("GPU-1", xid_info(reboot_xids[0]), None, None)
    assert gpu_view(tracker, 1)["suggested_action"] == "inspect-hardware"


def test_subjects_are_healthy_until_checked_and_go_with_their_port(clock):
    tracker = tracker_for(clock)
    assert tracker.view(INVENTORY)["node"] == {"state": Health.HEALTHY, "reasons": []}
    tracker.set_subjects("ib:", ["ib:mlx5_0/1", "ib:mlx5_1/1"])
    changes = tracker.observe("ib:mlx5_1/1", "infiniband", "port-down", ("unhealthy", "inspect-hardware", "down"))
    assert [(c.device, c.gpu_index, c.state) for c in changes] == [("ib:mlx5_1/1", None, Health.UNHEALTHY)]
    view = tracker.view(INVENTORY)
    assert view["status"] == Health.UNHEALTHY  # the node's status is the worst of everything
    assert [(s["name"], s["state"]) for s in view["subjects"]] == [("ib:mlx5_0/1", Health.HEALTHY), ("ib:mlx5_1/1", Health.UNHEALTHY)]
    changes = tracker.set_subjects("ib:", ["ib:mlx5_0/1"])  # the HCA went away
    assert [s["name"] for s in tracker.view(INVENTORY)["subjects"]] == ["ib:mlx5_0/1"]
    assert tracker.view(INVENTORY)["status"] == Health.HEALTHY


def test_node_reasons_are_not_persisted_and_do_not_touch_the_gpus(clock):
    tracker = tracker_for(clock)
    tracker.observe(NODE, "driver", "mismatch", ("unhealthy", "reboot", "module 570, library 580"))
    view = tracker.view(INVENTORY)
    assert view["node"]["state"] == Health.UNHEALTHY and all(gpu["state"] == Health.HEALTHY for gpu in view["gpus"])
    assert tracker.export() == {}
    for _ in range(3):
        tracker.observe(NODE, "driver", "mismatch", None)
    assert tracker.view(INVENTORY)["node"]["state"] == Health.HEALTHY
