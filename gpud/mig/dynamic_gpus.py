"""Which GPUs are dynamic (dra.dynamic_mig_gpus): only DRA claims change their MIG instances, and MIG
layouts leave them alone. Pure: the setting and an inventory in, the GPUs out."""

from __future__ import annotations

from dataclasses import dataclass

from gpud.model.inventory import Gpu, Inventory

SETTING = "dra.dynamic_mig_gpus"


@dataclass(frozen=True)
class DynamicGpus:
    selectors: tuple[str | int, ...] = ()  # GPU indices or UUIDs, or "all" (every MIG-capable GPU)

    def selects(self, gpu: Gpu) -> bool:
        wanted = {str(selector) for selector in self.selectors}
        return ("all" in wanted and gpu.mig.capable) or str(gpu.index) in wanted or gpu.uuid in wanted

    def uuids(self, inventory: Inventory | None) -> frozenset[str]:
        return frozenset(gpu.uuid for gpu in inventory.gpus if self.selects(gpu)) if inventory else frozenset()

    def covered_by_layout(self, inventory: Inventory | None, layout_gpus: dict | None, layout: str | None) -> list[str]:
        """Problems: a persisted layout covers GPUs now dynamic (the layout leaves them alone from now on)."""
        return [f"MIG layout '{layout}' covers GPU {gpu.index} ({gpu.uuid}), now a dynamic MIG GPU ({SETTING}): "
                "the layout leaves it alone; only DRA claims change it"
                for gpu in (inventory.gpus if inventory else ())
                if gpu.uuid in (layout_gpus or {}) and self.selects(gpu)]
