"""Sharing as gpud serves it: the document behind GET /v1/sharing, recomputed once per change of the
inventory, health or config, and the time-slice length applied to the GPUs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

from gpud.base.encoding import encode
from gpud.base.logs import get_logger
from gpud.events import EventBus, EventType
from gpud.inventory import InventoryService
from gpud.model.inventory import Inventory
from gpud.sharing.config import SharingConfig, SharingConfigError, check_sharing_file
from gpud.sharing.gpu_memory import ClaimedMemory, GpuMemory
from gpud.sharing.resources import SharingError, compute_sharing
from gpud.sharing.timeslice import apply_time_slice

log = get_logger("sharing")


def read_sharing_file(path: Path, opener: Callable[[str, int], int] | None = None, *,
                      missing_ok: bool = True) -> SharingConfig | None:
    """The sharing config, or None when the file does not exist (missing_ok=False: a SharingConfigError
    too). Raises SharingConfigError; logs what the file holds that the device plugin accepts but may
    not be what was meant. opener: check_sharing_file's."""
    try:
        config, warnings = check_sharing_file(path, opener)
    except FileNotFoundError:
        if not missing_ok:
            raise SharingConfigError(f"{path}: the file is gone") from None
        return None
    for warning in warnings:
        key, _, message = warning.partition(": ")
        log.warning("sharing_file_warning", path=str(path), key=key, warning=message)
    return config


class SharingView:
    """Recomputes the sharing document whenever the inventory or the sharing config changes."""

    def __init__(self, inventory: InventoryService, bus: EventBus, source: Path, *,
                 unhealthy: Callable[[], set[str]] = set, gpu_memory: GpuMemory | None = None,
                 claimed_memory: Callable[[], Mapping[str, tuple[ClaimedMemory, ...]]] = dict):
        self.config: SharingConfig | None = None  # SharingControl sets the one in force
        self.gpu_memory = gpu_memory  # gpud.yaml's gpu_memory: one more resource, beside the sharing config's
        self.source = source
        self.about: dict | None = None  # which config is in force and why: the document's `config` block
        self.document: dict | None = None
        self.time_slice: dict | None = None  # what applying sharing.timeSlicing.interval did
        self._unhealthy = unhealthy  # device UUIDs health calls unhealthy
        self._claimed_memory = claimed_memory  # device UUID -> the memory DRA claims hold on it (gpu_memory's ledger)
        self._bus = bus
        self._inventory = inventory
        self.body = encode(self._empty())  # the document, encoded once per change for GET /v1/sharing
        self._health_changed_due = False
        inventory.subscribe(self.update)
        bus.listen(EventType.HEALTH, self._health_changed)  # an unhealthy device's replicas are served unhealthy
        # gpu_memory's units withdrawn for the memory DRA claims hold follow the claims and the pods' units
        bus.listen(EventType.CLAIMS, lambda _event: self._holds_changed("claims"))
        bus.listen(EventType.ALLOCATIONS, lambda _event: self._holds_changed("allocations"))

    def _health_changed(self, _event: dict) -> None:
        """Health publishes a batch of changes in one go (an XID on a GPU and its MIG devices): the document
        is recomputed once, after the batch, and its event follows the batch's."""
        if not self._health_changed_due:
            self._health_changed_due = True
            asyncio.get_running_loop().call_soon(self._after_health_changes)

    def _after_health_changes(self) -> None:
        self._health_changed_due = False
        self.update(self._inventory.current, reason="health")

    def _holds_changed(self, reason: str) -> None:
        if self.gpu_memory:
            self.update(self._inventory.current, reason=reason)

    def _empty(self) -> dict:
        return {"source": str(self.source), "mig_strategy": None, "strategy": "none", "resources": [], "labels": {},
                "error": "no inventory yet", "warnings": [], "config": self.about}

    def set_config(self, config: SharingConfig | None, inventory: Inventory | None, source: Path,
                   about: dict | None = None, reason: str = "reload") -> None:
        """Takes a re-read sharing config (None: the file is gone), the file it came from and what says
        why it is in force."""
        self.config, self.source, self.about = config, source, about
        if inventory is None:
            self.body = encode(self._empty())
        self.update(inventory, reason)

    def update(self, inventory: Inventory | None, reason: str = "") -> None:
        if inventory is None:
            return
        try:
            computed = compute_sharing(self.config, inventory, frozenset(self._unhealthy()))
        except SharingError as exc:  # e.g. a `devices` selector that matches nothing on this node
            computed = {**self._empty(), "mig_strategy": self.config.mig_strategy if self.config else None,
                        "error": str(exc)}
        document = {**computed, "source": str(self.source) if self.config else None, "time_slice": self.time_slice,
                    "warnings": list(self.config.warnings) if self.config else [], "config": self.about}
        if self.gpu_memory:
            self._add_gpu_memory(document, inventory)
        if document != self.document:
            if self.document is not None:
                log.info("sharing_changed", reason=reason or "inventory", strategy=document["strategy"],
                         resources={r["name"]: r["count"] for r in document["resources"]}, error=document["error"])
            self.document = document
            self.body = encode(document)
            self._bus.publish(EventType.SHARING, {
                "strategy": document["strategy"], "error": document["error"],
                "config": self.about["name"] if self.about else None,
                "resources": {r["name"]: r["count"] for r in document["resources"]},
                "unhealthy": sum(not d["healthy"] for r in document["resources"] for d in r["devices"])})

    def _add_gpu_memory(self, document: dict, inventory: Inventory) -> None:
        """gpu_memory's resource, label and warnings, whatever the sharing config says (it advertises
        devices of its own: memory units), unless the sharing config advertises the same name."""
        gpu_memory = self.gpu_memory
        gpu_memory.update(inventory, self._claimed_memory())
        resource = gpu_memory.resource(frozenset(self._unhealthy()))
        if resource is None:
            return
        document["warnings"] = document["warnings"] + gpu_memory.warnings
        if any(existing["name"] == resource["name"] for existing in document["resources"]):
            document["warnings"].append(f"gpu_memory.resource: {resource['name']} is also a resource of the sharing "
                                        "config; it is advertised as the sharing config says")
            return
        document["resources"] = document["resources"] + [resource]
        document["labels"] = dict(sorted((document["labels"] | gpu_memory.labels()).items()))

    async def apply_time_slice(self, inventory: Inventory | None) -> None:
        """Sets the configured time-slice length on the GPUs (at start and after a reload)."""
        interval = self.config.interval if self.config else None
        if inventory is not None and (interval is not None or self.time_slice is not None):
            self.time_slice = await apply_time_slice(interval, inventory)
            self.document = None
            self.update(inventory, reason="time slice")
