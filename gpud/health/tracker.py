"""Device health: why each GPU and MIG device is healthy, degraded or unhealthy.

A device's reasons come from XIDs, periodic checks, the inventory (a lost GPU), the driver's recovery
action, and go away with a passing check, a GPU reset, the driver saying the GPU recovered, or an
administrator's clear. Its state is the worst of its reasons. A MIG device also carries its GPU's
reasons: what breaks the GPU breaks every MIG device on it.

Beside the devices there are subjects that are no GPU's: the node itself ("node": driver mismatch,
Fabric Manager, GPUDirect RDMA) and each InfiniBand/RoCE port ("ib:mlx5_0/1"). They are checked as
devices are, and re-derived after a restart, so never persisted.

Every input returns the Changes it caused, and only real transitions (state or set of reasons), so a
flood of one repeated XID bumps a counter instead of flooding the watch stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace

from gpud.health.catalog import Severity, XidInfo
from gpud.health.driver_actions import REBOOT_ACTIONS, driver_action_reason, remedy
from gpud.health.reasons import Change, Key, Reason, TrackedDevice, suggested_action, worst
from gpud.health.states import ACTION_RANK, Action, Clears, Health
from gpud.model.inventory import Gpu, Inventory

LOST_MESSAGE = "the GPU is lost: it fell off the bus or stopped responding"
# Reasons others re-derive after a restart, so they are not persisted: the inventory says again which
# GPUs are lost, the MPS manager which daemons are down.
REDERIVED_KINDS = ("lost", "mps")
NODE = "node"  # the subject of node-level reasons
ESCALATION = "repeated-reboot"  # the recovery-action reason of a GPU a reboot does not fix


class HealthTracker:
    def __init__(self, clear_after_passes: int = 3, clock: Callable[[], float] = time.time, *, boot_id: str = "",
                 reboot_escalation: tuple[int, float] = (3, 86400.0)):
        self._clear_after_passes = clear_after_passes
        self._clock = clock
        self._devices: dict[str, TrackedDevice] = {}  # by UUID; each GPU followed by its MIG devices
        self._subjects: dict[str, TrackedDevice] = {NODE: TrackedDevice(None)}  # by name: the node, InfiniBand ports
        self._restored: dict[str, dict[Key, Reason]] = {}  # persisted reasons of devices not learned yet
        self._driver_actions: dict[str, str | None] = {}  # GPU UUID -> the driver's recovery action now
        self._driver_acted_at: dict[str, float] = {}  # GPU UUID -> when the driver last asked for an action
        # Reasons restored from before this boot: the driver's "none" after a reboot is their recovery.
        self._from_earlier_boot: set[tuple[str, Key]] = set()
        self._boot_id = boot_id
        self._escalate_after, self._escalation_window_s = reboot_escalation
        # GPU UUID -> {boot id: when}: the boots in which the GPU needed a node reboot (persisted)
        self.reboot_needs: dict[str, dict[str, float]] = {}

    # -- persistence -------------------------------------------------------------------------

    def export(self) -> dict[str, list[dict]]:
        """Each device's own reasons, as restore() takes them; devices restored but not seen again
        are kept, so a GPU that comes back later still has its reasons."""
        document = {uuid: [asdict(r) for r in reasons.values() if r.kind not in REDERIVED_KINDS]
                    for uuid, reasons in self._restored.items()}
        for uuid, device in self._devices.items():
            document[uuid] = [asdict(r) for r in device.reasons.values() if r.kind not in REDERIVED_KINDS]
        return {uuid: reasons for uuid, reasons in document.items() if reasons}

    def restore(self, reasons: dict[str, dict[Key, Reason]], *, earlier_boot: bool = False,
                reboot_needs: dict[str, dict[str, float]] | None = None) -> None:
        """Takes what export() gave before a restart (read with parse_reasons); the devices get their
        reasons as the inventory names them. earlier_boot: saved before the node last booted."""
        self._restored = {uuid: dict(device) for uuid, device in reasons.items()}  # the tracker's own to change
        if earlier_boot:
            self._from_earlier_boot = {(uuid, key) for uuid, device in reasons.items() for key in device}
        self.reboot_needs = dict(reboot_needs or {})

    # -- inputs ------------------------------------------------------------------------------

    def set_inventory(self, inventory: Inventory) -> list[Change]:
        """Learns the inventory's devices (forgetting any it no longer has) and which GPUs are lost."""
        before = self._summaries()
        self._devices = self._learn(inventory)
        for gpu in inventory.gpus:
            self._update_lost(self._devices[gpu.uuid], gpu)
        return self._changes_since(before)

    def record_xid(self, gpu_uuid: str, info: XidInfo, gi_id: int | None, ci_id: int | None) -> list[Change]:
        """An XID, as the catalog describes it, on a GPU; with GPU/compute-instance ids that name MIG
        devices of it, only on those (None: attributed to no instance)."""
        if gpu_uuid not in self._devices or not info.affects_health:
            return []
        severity = Health.UNHEALTHY if info.severity in (Severity.FATAL, Severity.CRITICAL) else Health.DEGRADED
        # A reset cannot fix what needs a hardware inspection: only an administrator clears that.
        clears = Clears.ADMIN if info.action == Action.INSPECT_HARDWARE else Clears.RESET
        reason = self._reason("xid", str(info.xid), f"XID {info.xid}: {info.name}", severity, info.action, clears)
        before = self._summaries()
        for device in self._xid_targets(gpu_uuid, gi_id, ci_id):
            device.add(reason)
        if info.action == Action.REBOOT:
            self._needs_reboot(gpu_uuid)
        return self._changes_since(before)

    def record_driver_action(self, gpu_uuid: str, action: str | None) -> list[Change]:
        """The driver's recovery action read from a GPU (DRIVER_ACTIONS' names); None where the driver
        has no such field, which changes nothing (the branch's behaviour stands).

        An action other than none is a reason of its own. "none" after the driver asked for an action
        (or after a reboot, for reasons from before it) is the GPU recovered: its XID reasons that a
        reset clears go, on the GPU and its MIG devices."""
        device = self._devices.get(gpu_uuid)
        if device is None or action is None:
            return []
        before = self._summaries()
        self._driver_actions[gpu_uuid] = action
        if action != "none":
            self._driver_acted_at[gpu_uuid] = self._clock()
            severity, gpud_action, message = driver_action_reason(action)
            device.drop(lambda reason: reason.kind == "recovery-action" and reason.code not in (action, ESCALATION))
            device.add(self._reason("recovery-action", action, message, severity, gpud_action, Clears.DRIVER))
            if action in REBOOT_ACTIONS:
                self._needs_reboot(gpu_uuid)
        else:
            acted_at = self._driver_acted_at.get(gpu_uuid)
            for uuid, member in self._family(gpu_uuid):
                member.drop(lambda reason: reason.clears == Clears.DRIVER or (
                    reason.kind == "xid" and reason.clears == Clears.RESET
                    and ((acted_at is not None and reason.last_seen <= acted_at)
                         or (uuid, (reason.kind, reason.code)) in self._from_earlier_boot)))
        return self._changes_since(before)

    def _needs_reboot(self, gpu_uuid: str) -> None:
        """Counts this boot as one in which the GPU needed a node reboot; enough of them within the
        window escalate to inspect-hardware, which only an administrator clears."""
        now = self._clock()
        boots = {boot: when for boot, when in self.reboot_needs.get(gpu_uuid, {}).items()
                 if now - when <= self._escalation_window_s}
        boots.setdefault(self._boot_id, now)
        self.reboot_needs[gpu_uuid] = boots
        if len(boots) >= self._escalate_after:
            hours = self._escalation_window_s / 3600
            message = (f"needed a node reboot in {len(boots)} boots within {hours:g} h: a reboot does not fix it, "
                       "inspect the hardware")
            self._devices[gpu_uuid].add(self._reason("recovery-action", ESCALATION, message, Health.UNHEALTHY,
                                                     Action.INSPECT_HARDWARE, Clears.ADMIN))

    def set_subjects(self, prefix: str, names: Iterable[str]) -> list[Change]:
        """The subjects whose names start with prefix are these now (InfiniBand ports come and go)."""
        before = self._summaries()
        names = set(names)
        for name in [name for name in self._subjects if name.startswith(prefix) and name not in names]:
            del self._subjects[name]
        for name in names:
            self._subjects.setdefault(name, TrackedDevice(None))
        return self._changes_since(before)

    def observe(self, device_uuid: str, kind: str, code: str,
                problem: tuple[str, str, str] | None) -> list[Change]:
        """A periodic check's result: (severity, action, message), or None when it passes. A problem
        shows at once; it goes only after `clear_after_passes` passes in a row, so a value hovering
        at a limit cannot make the device flap."""
        device = self._devices.get(device_uuid) or self._subjects.get(device_uuid)
        if device is None:
            return []  # a device gone since the check read it (a MIG device destroyed meanwhile)
        before = self._summaries()
        if problem is None:
            device.count_pass((kind, code), self._clear_after_passes)
        else:
            severity, action, message = problem
            if severity not in (Health.DEGRADED, Health.UNHEALTHY):
                raise ValueError(f"a problem's severity must be {Health.DEGRADED.value!r} or "
                                 f"{Health.UNHEALTHY.value!r}, not {severity!r}")
            device.add(self._reason(kind, code, message, severity, action, Clears.CHECK))
        return self._changes_since(before)

    def record_reset(self, gpu_uuid: str) -> list[Change]:
        """The GPU was reset: what a reset fixes goes, on the GPU and its MIG devices."""
        return self._drop_in_family(gpu_uuid, lambda reason: reason.clears in (Clears.RESET, Clears.CHECK))

    def clear(self, device_uuid: str, kind: str | None = None) -> list[Change]:
        """An administrator's clear of a device's reasons (of one kind, or all); a GPU's takes its MIG
        devices' too. KeyError for a device gpud does not know."""
        return self._drop_in_family(device_uuid, lambda reason: kind is None or reason.kind == kind)

    # -- outputs -----------------------------------------------------------------------------

    def device(self, uuid: str) -> dict:
        if uuid not in self._devices:
            raise KeyError(uuid)
        return {"uuid": uuid, **self._health_view(uuid)}

    def view(self, inventory: Inventory) -> dict:
        """The /v1/health document for the inventory's GPUs and MIG devices."""
        gpus = [self._gpu_view(gpu) for gpu in sorted(inventory.gpus, key=lambda gpu: gpu.index)]
        node, subjects = self.subjects_view()
        states = [entry["state"] for gpu in gpus for entry in (gpu, *gpu["mig_devices"])]
        return {"status": worst([*states, node["state"], *(subject["state"] for subject in subjects)]),
                "node": node, "gpus": gpus, "subjects": subjects}

    def gpu_states(self) -> dict[str, str]:
        """Effective state by UUID, GPUs and MIG devices."""
        return {uuid: self._effective(device)[0] for uuid, device in self._devices.items()}

    def subject_states(self) -> dict[str, str]:
        """Effective state by subject name: the node, InfiniBand ports."""
        return {name: self._effective(device)[0] for name, device in self._subjects.items()}

    def driver_action(self, gpu_uuid: str) -> str | None:
        return self._driver_actions.get(gpu_uuid)

    def action_for(self, gpu_uuid: str) -> str:
        """gpud's suggested action for the GPU, as /v1/health's suggested_action says it."""
        return suggested_action(self._health_view(gpu_uuid)["reasons"])

    def worst_action(self, gpu: Gpu) -> str:
        """gpud's suggested action for the GPU and its MIG devices, the strongest."""
        return max((self.action_for(uuid) for uuid in (gpu.uuid, *(device.uuid for device in gpu.mig.devices))),
                   key=ACTION_RANK.index)

    def subjects_view(self) -> tuple[dict, list[dict]]:
        """The node's health, and each other subject's (name, state, reasons), by name."""
        views = {name: {"name": name, **self._health_view_of(device)} for name, device in self._subjects.items()}
        node = views.pop(NODE)
        del node["name"]
        return node, [views[name] for name in sorted(views)]

    def _gpu_view(self, gpu: Gpu) -> dict:
        mig_devices = [{"uuid": mig.uuid, "profile": mig.profile, "gi_id": mig.gi_id, "ci_id": mig.ci_id,
                        **self._health_view(mig.uuid)} for mig in gpu.mig.devices]
        view, driver = self._health_view(gpu.uuid), self._driver_actions.get(gpu.uuid)
        strongest = suggested_action([reason for device in (view, *mig_devices) for reason in device["reasons"]])
        return {"index": gpu.index, "uuid": gpu.uuid, **view, "suggested_action": suggested_action(view["reasons"]),
                "driver_action": driver, "remedy": remedy(strongest, driver), "mig_devices": mig_devices}

    def _health_view(self, uuid: str) -> dict:
        """State and reasons; a device not learned yet has nothing recorded against it."""
        return self._health_view_of(self._devices.get(uuid))

    def _health_view_of(self, device: TrackedDevice | None) -> dict:
        state, reasons = self._effective(device) if device else (Health.HEALTHY, ())
        return {"state": state, "reasons": [asdict(reason) for reason in reasons]}

    # -- devices -----------------------------------------------------------------------------

    def _learn(self, inventory: Inventory) -> dict[str, TrackedDevice]:
        devices = {}
        for gpu in sorted(inventory.gpus, key=lambda gpu: gpu.index):
            devices[gpu.uuid] = self._adopt(gpu.uuid, TrackedDevice(gpu.index))
            for mig in gpu.mig.devices:
                devices[mig.uuid] = self._adopt(mig.uuid, TrackedDevice(gpu.index, gpu.uuid, mig.gi_id, mig.ci_id))
        return devices

    def _adopt(self, uuid: str, placed: TrackedDevice) -> TrackedDevice:
        """The device as the inventory places it now, with what is known of it already."""
        known = self._devices.get(uuid)
        if known:
            return replace(placed, reasons=known.reasons, passes=known.passes)
        return replace(placed, reasons=self._restored.pop(uuid, {}))

    def _update_lost(self, device: TrackedDevice, gpu: Gpu) -> None:
        if gpu.lost:
            message = f"{LOST_MESSAGE} (the driver answers: {gpu.error})" if gpu.error else LOST_MESSAGE
            device.add(self._reason("lost", "gpu-lost", message, Health.UNHEALTHY, Action.REBOOT, Clears.RESET))
        else:
            device.drop(lambda reason: reason.kind == "lost")

    def _xid_targets(self, gpu_uuid: str, gi_id: int | None, ci_id: int | None) -> list[TrackedDevice]:
        """The MIG devices the ids name (a GPU-instance id alone names all its compute instances);
        the whole GPU when they name none."""
        if gi_id is not None:
            named = [device for device in self._children(gpu_uuid)
                     if device.gi_id == gi_id and ci_id in (None, device.ci_id)]
            if named:
                return named
        return [self._devices[gpu_uuid]]

    def _children(self, gpu_uuid: str) -> list[TrackedDevice]:
        return [device for device in self._devices.values() if device.parent == gpu_uuid]

    def _drop_in_family(self, uuid: str, matches: Callable[[Reason], bool]) -> list[Change]:
        family = [device for _, device in self._family(uuid)]
        before = self._summaries()
        for device in family:
            device.drop(matches)
        return self._changes_since(before)

    def _family(self, uuid: str) -> list[tuple[str, TrackedDevice]]:
        """The device (KeyError for one gpud does not know) and its MIG devices, with their UUIDs."""
        device = self._devices.get(uuid) or self._subjects[uuid]
        return [(uuid, device), *((child, member) for child, member in self._devices.items() if member.parent == uuid)]

    # -- reasons -----------------------------------------------------------------------------

    def _reason(self, kind: str, code: str, message: str, severity: str, action: str, clears: str) -> Reason:
        now = self._clock()
        return Reason(kind, code, message, severity, action, first_seen=now, last_seen=now, count=1, clears=clears)

    # -- states and changes ------------------------------------------------------------------

    def _effective(self, device: TrackedDevice) -> tuple[str, tuple[Reason, ...]]:
        inherited = tuple(self._devices[device.parent].reasons.values()) if device.parent else ()
        reasons = inherited + tuple(device.reasons.values())
        return worst(reason.severity for reason in reasons), reasons

    def _all(self) -> Iterable[tuple[str, TrackedDevice]]:
        return (*self._devices.items(), *self._subjects.items())

    def _summaries(self) -> dict[str, tuple]:
        return {uuid: self._summary(uuid, device) for uuid, device in self._all()}

    def _summary(self, uuid: str, device: TrackedDevice) -> tuple:
        state, reasons = self._effective(device)
        return state, frozenset((reason.kind, reason.code) for reason in reasons), self._driver_actions.get(uuid)

    def _changes_since(self, before: dict[str, tuple]) -> list[Change]:
        changes = []
        for uuid, device in self._all():
            summary = self._summary(uuid, device)
            previous = before.get(uuid, (Health.HEALTHY, frozenset(), None))  # a device just learned starts healthy
            if summary != previous:
                state, reasons = self._effective(device)
                changes.append(Change(uuid, device.gpu_index, previous[0], state, reasons, summary[2]))
        return changes

