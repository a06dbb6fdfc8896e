"""The MIG routes: status, named layouts, apply (with dry run and wait), export."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, off_the_loop, read_json_object
from gpud.api.responses import encoded_json_response, json_response
from gpud.base.encoding import encode
from gpud.base.errors import ErrorKind, nvml_unavailable
from gpud.inventory import InventoryService
from gpud.mig.layouts import Layout, LayoutError, LayoutsFile, check_layouts, export_layout, layout_named
from gpud.mig.overview import layouts_overview
from gpud.mig.preflight import plan_layout
from gpud.mig.reconciler import MigReconciler
from gpud.mig.sync import actual_of, root_needed
from gpud.model.inventory import Inventory
from gpud.model.mig import GpuPlan

# An inline `config` (PUT /v1/mig) is a mig-parted file sent in the request: 64 KiB is nine times the
# layouts gpud ships, and reads in a fraction of a second (a 1 MiB one took seconds). A larger file
# belongs in the layouts file (mig.layouts_file), read once per change.
MAX_INLINE_CONFIG_BYTES = 64 << 10


def plan_view(plans: dict[str, GpuPlan]) -> list[dict]:
    return [{
        "index": plan.index, "uuid": plan.uuid, "mutations": plan.mutations, "keep": plan.kept,
        "destroy": [{"gi_id": gi, "ci_id": ci} for gi, ci in plan.destroy_cis]
                   + [{"gi_id": gi, "ci_id": None} for gi in plan.destroy_gis],
        "create": [{"profile": gi.name, "placement": {"start": gi.placement.start, "size": gi.placement.size},
                    "compute_instances": [ci.name for ci in gi.compute_instances]} for gi in plan.create_gis]
                  + [{"profile": ci.name, "gi_id": gi_id, "compute_instances": [ci.name]}
                     for gi_id, ci in plan.create_cis],
    } for plan in sorted(plans.values(), key=lambda p: p.index)]


class MigRoutes:
    def __init__(self, reconciler: MigReconciler, inventory: InventoryService, layouts_file: LayoutsFile,
                 body_timeout_s: float):
        self.reconciler = reconciler
        self.inventory = inventory
        self.layouts_file = layouts_file
        self.body_timeout_s = body_timeout_s
        # (layouts, inventory, active layout, the encoded answer) of the last GET /v1/mig/layouts
        self._layouts_answer: tuple[dict[str, Layout], Inventory, str | None, bytes] | None = None

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/mig", self.status)
        app.router.add_put("/v1/mig", self.apply)
        app.router.add_get("/v1/mig/layouts", self.layouts)
        app.router.add_get("/v1/mig/export", self.export)

    def _inventory(self):
        if self.inventory.current is None:
            raise nvml_unavailable("no inventory yet: NVML is not available")
        return self.inventory.current

    async def status(self, request: web.Request) -> web.Response:
        return json_response(self.reconciler.view(self.inventory.current))

    async def layouts(self, request: web.Request) -> web.Response:
        """Planning every layout takes tens of milliseconds, so the answer is computed once per layouts
        file, GPU state and active layout (a refresh that found nothing new keeps it), off the event
        loop, and served encoded until one of them changes."""
        source, layouts = self.layouts_file.layouts()
        inventory = self._inventory()
        active = self.reconciler.status.layout
        cached = self._layouts_answer
        if cached is None or cached[0] is not layouts or cached[2] != active or \
                not (cached[1] is inventory.gpus or cached[1] == inventory.gpus):
            warnings = self.layouts_file.warnings()
            view = await asyncio.to_thread(layouts_overview, source, layouts, warnings, inventory, active)
            cached = self._layouts_answer = (layouts, inventory.gpus, active, encode(view))
        return encoded_json_response(cached[3])

    @admin_only
    async def apply(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s,
                                      {"layout": (str,), "config": (str, type(None)),
                                       "force": (bool, type(None)), "dry_run": (bool, type(None))})
        wait = request.query.get("wait", "false").lower()
        if wait not in ("true", "false", "1", "0"):
            raise ApiError(ErrorKind.INVALID, "invalid-query", f"query 'wait' must be true or false, got {wait!r}")
        layout, origin = await self._requested_layout(body["layout"], body.get("config"))
        force = bool(body.get("force"))
        if body.get("dry_run"):
            _desired, plans = plan_layout(layout, self._inventory(), force, self.reconciler.dynamic)
            return json_response({"layout": layout.name, "dry_run": True, "needs_root": root_needed(plans),
                                  "plan": plan_view(plans)})
        plans, applying = await self.reconciler.apply(layout, force=force, origin=origin)
        if wait in ("false", "0"):
            return json_response({"layout": layout.name, "state": "applying", "plan": plan_view(plans)}, status=202)
        view = await asyncio.shield(applying)  # this request's apply as it ended, whatever ran after it
        if view["state"] == "success":
            return json_response({**view, "plan": plan_view(plans)})
        code = "reset-required" if view["state"] == "reset-required" else "apply-failed"
        raise ApiError(ErrorKind.CONFLICT, code, view["error"] or f"MIG apply ended in state {view['state']}", mig=view)

    async def _requested_layout(self, name: str, config: str | None) -> tuple[Layout, str]:
        """(the layout, where it is defined): from the mig-parted file sent in `config`, read exactly
        as the layouts file is (on a body-parser thread), else from the layouts file."""
        if config is None:
            source, layouts = self.layouts_file.layouts()
            return layout_named(layouts, name, source), source
        size = len(config.encode("utf-8", "surrogatepass"))
        if size > MAX_INLINE_CONFIG_BYTES:
            raise ApiError(ErrorKind.TOO_LARGE, "config-too-large",
                           f"the inline config is {size} bytes; inline configs are limited "
                           f"to {MAX_INLINE_CONFIG_BYTES} bytes (put a larger file in "
                           "mig.layouts_file)", limit=MAX_INLINE_CONFIG_BYTES, size=size)
        try:
            layouts, _warnings = await off_the_loop(check_layouts, config, "config")
        except LayoutError as exc:
            raise ApiError(ErrorKind.REFUSED, "layout-config-invalid", str(exc)) from None
        return layout_named(layouts, name, "the request's config"), "request"

    async def export(self, request: web.Request) -> web.Response:
        inventory = self._inventory()
        per_gpu = [(g.index, actual_of(g)["mig_enabled"], actual_of(g)["devices"])
                   for g in inventory.gpus if g.mig.capable and not g.lost]
        name = request.query.get("name", "current")
        return web.Response(text=export_layout(name, per_gpu), content_type="application/yaml")

