"""Routes on one GPU beyond its description: POST /v1/gpus/{id}/reset, GET /v1/gpus/{id}/processes."""

from __future__ import annotations

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, json_errors, read_json_object
from gpud.api.responses import json_response
from gpud.gpu_reset import GpuResetter, ResetBlocked, ResetBusy
from gpud.inventory import InventoryService
from gpud.nvml.host_tools import ResetFailed
from gpud.nvml.session import NvmlUnavailable
from gpud.processes.monitor import ProcessMonitor


class GpuRoutes:
    def __init__(self, resetter: GpuResetter, inventory: InventoryService, body_timeout_s: float,
                 processes: ProcessMonitor):
        self.resetter = resetter
        self.inventory = inventory
        self.body_timeout_s = body_timeout_s
        self.processes = processes

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/gpus/{id}/reset", self.reset)
        app.router.add_get("/v1/gpus/{id}/processes", self.get_processes)

    @json_errors
    async def get_processes(self, request: web.Request) -> web.Response:
        """The compute processes of a GPU (of each of its MIG devices), or of one MIG device, from the
        monitor's last snapshot: anyone who may read the API sees every user's processes, as
        nvidia-smi shows them to every user."""
        ident = request.match_info["id"]
        gpu = self._gpu(ident)
        snapshot = self.processes.current
        if snapshot is None:
            raise ApiError(503, "not-read-yet", "the compute processes have not been read yet")
        if snapshot.error is not None:
            raise ApiError(503, "nvml-unavailable", f"the compute processes cannot be read: {snapshot.error}")
        device_uuid = ident if ident.startswith("MIG-") else gpu.uuid
        return json_response({"gpu": gpu.index, "uuid": gpu.uuid, "read_at": snapshot.read_at,
                              "devices": [d.as_dict() for d in snapshot.for_device(gpu, device_uuid)]})

    def _gpu(self, ident: str):
        inventory = self.inventory.current
        if inventory is None:
            raise ApiError(503, "nvml-unavailable", "no inventory yet: NVML is not available")
        gpu = inventory.find_gpu(ident)
        if gpu is None:
            raise ApiError(404, "gpu-not-found", f"no GPU '{ident}' on this node (give an index, a GPU- UUID "
                                                 "or a PCI bus id)")
        return gpu

    @admin_only
    @json_errors
    async def reset(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"force": (bool, type(None))}) \
            if request.body_exists else {}
        ident = request.match_info["id"]
        gpu = self._gpu(ident)
        if gpu.uuid != ident and any(device.uuid == ident for device in gpu.mig.devices):
            raise ApiError(422, "not-a-gpu", f"'{ident}' is a MIG device: a reset takes its whole GPU "
                                             f"({gpu.index}, {gpu.uuid}); name the GPU")
        try:
            outcome = await self.resetter.reset_gpus([gpu.index], force=bool(body.get("force")))
        except ResetBlocked as exc:
            raise ApiError(409, "reset-blocked", f"{exc}. Nothing was changed", blockers=[b.as_dict() for b in
                                                                                        exc.blockers],
                           reset_gpus=list(exc.group)) from None
        except ResetBusy as exc:
            raise ApiError(409, "reset-in-progress", str(exc)) from None
        except ResetFailed as exc:
            raise ApiError(409, "reset-failed", f"{exc}; gpud's NVML session is back, the GPUs are as the "
                                                "driver left them") from None
        except NvmlUnavailable as exc:
            raise ApiError(503, "nvml-unavailable", str(exc)) from None
        after = self.inventory.current
        gpus = [{"index": g.index, "uuid": g.uuid, "lost": g.lost, "mig_mode": g.mig.mode}
                for g in after.gpus if g.index in outcome.gpus]
        return json_response({"gpu": gpu.index, "uuid": gpu.uuid, **outcome.as_dict(), "gpus": gpus})
