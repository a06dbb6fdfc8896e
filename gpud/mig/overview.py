"""GET /v1/mig/layouts' document: every layout planned against this node's GPUs (whether it fits,
how many GPUs it changes, whether gpud lacks the privilege), with what the layouts file and this
node's GPUs warn of."""

from __future__ import annotations

from gpud.mig.layouts import Layout, NodeGpu, offers
from gpud.mig.preflight import ApplyRefused, plan_layout
from gpud.mig.sync import node_gpus, root_needed
from gpud.model.inventory import Inventory


def layouts_overview(source: str, layouts: dict[str, Layout], file_warnings: list[str], inventory: Inventory,
                     active: str | None) -> dict:
    """Plans every layout: tens of milliseconds for the shipped file, so callers run it off the event loop."""
    gpus = node_gpus(inventory)
    views, node_warnings = [], []
    for layout in layouts.values():
        warnings = _node_warnings(layout, inventory, gpus)
        node_warnings += warnings
        try:
            _desired, plans = plan_layout(layout, inventory, force=True)
            fits, reason, changed, needs_root = True, None, len(plans), root_needed(plans)
        except ApplyRefused as exc:
            fits, reason, changed, needs_root = False, exc.message, None, None
        views.append({"name": layout.name, "fits": fits, "reason": reason, "gpus_changed": changed,
                      "needs_root": needs_root,
                      "matching_gpus": len(layout.selected(gpus)), "active": layout.name == active,
                      "warnings": [w for w in file_warnings if w.startswith(f"mig-configs.{layout.name}[")]
                                  + warnings})
    return {"source": source, "warnings": file_warnings + node_warnings, "layouts": views}


def _node_warnings(layout: Layout, inventory: Inventory, gpus: list[NodeGpu]) -> list[str]:
    """What the layout asks of this node's GPUs that none of them offers: per entry that selects
    some of them, each profile no selected GPU's table has."""
    tables = {gpu.index: gpu.mig.capabilities for gpu in inventory.gpus if gpu.mig.capabilities is not None}
    warnings = []
    for number, entry in enumerate(layout.entries):
        selected = [tables[g.index] for g in gpus if entry.selects(g) and g.index in tables]
        if not selected:
            continue  # the entry is for other nodes, or GPUs whose tables are not known yet
        warnings += [f"mig-configs.{layout.name}[{number}].mig-devices.{profile}: none of the GPUs of "
                     f"this node that the entry selects offers profile {profile}"
                     for profile in entry.mig_devices if not any(offers(t, profile) for t in selected)]
    return warnings
