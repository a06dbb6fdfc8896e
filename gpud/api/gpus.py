"""Routes on one GPU beyond its description: POST /v1/gpus/{id}/reset, GET /v1/gpus/{id}/processes,
GET /v1/gpus/{id}/pods."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind, nvml_unavailable
from gpud.gpu_reset import GpuResetter
from gpud.inventory import InventoryService
from gpud.model.inventory import Gpu
from gpud.processes.monitor import ProcessMonitor


def named_gpu(inventory_service: InventoryService, ident: str) -> Gpu:
    """The GPU `ident` names (an index, a GPU- UUID, a PCI bus id, or a MIG device of it); 404 when none."""
    inventory = inventory_service.current
    if inventory is None:
        raise nvml_unavailable("no inventory yet: NVML is not available")
    gpu = inventory.find_gpu(ident)
    if gpu is None:
        raise ApiError(ErrorKind.NOT_FOUND, "gpu-not-found",
                       f"no GPU '{ident}' on this node (give an index, a GPU- UUID "
                       "or a PCI bus id)")
    return gpu


def whole_gpu(inventory_service: InventoryService, ident: str, doing: str) -> Gpu:
    """The GPU `ident` names; 422 not-a-gpu for a MIG device's UUID: `doing` (a reset) takes its whole GPU."""
    gpu = named_gpu(inventory_service, ident)
    if gpu.uuid != ident and any(device.uuid == ident for device in gpu.mig.devices):
        raise ApiError(ErrorKind.REFUSED, "not-a-gpu", f"'{ident}' is a MIG device: {doing} takes its whole GPU "
                                                       f"({gpu.index}, {gpu.uuid}); name the GPU")
    return gpu


class GpuRoutes:
    def __init__(self, resetter: GpuResetter, inventory: InventoryService, body_timeout_s: float,
                 processes: ProcessMonitor, pods_holding: Callable[[Gpu], tuple[float, list[dict]]]):
        self.resetter = resetter
        self.inventory = inventory
        self.body_timeout_s = body_timeout_s
        self.processes = processes
        self.pods_holding = pods_holding  # the kubelet's PodResources answer: its age, the GPU's pods

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/gpus/{id}/reset", self.reset)
        app.router.add_get("/v1/gpus/{id}/processes", self.get_processes)
        app.router.add_get("/v1/gpus/{id}/pods", self.get_pods)

    async def get_pods(self, request: web.Request) -> web.Response:
        """The pods holding the GPU or any of its MIG devices, from the kubelet's last PodResources answer
        while it is fresh (503 pod-resources-unavailable otherwise)."""
        gpu = named_gpu(self.inventory, request.match_info["id"])
        age, pods = self.pods_holding(gpu)
        return json_response({"gpu": gpu.index, "uuid": gpu.uuid, "answer_age_s": round(age, 3), "pods": pods})

    async def get_processes(self, request: web.Request) -> web.Response:
        """The compute processes of a GPU (of each of its MIG devices), or of one MIG device, from the
        monitor's last snapshot: anyone who may read the API sees every user's processes, as
        nvidia-smi shows them to every user."""
        ident = request.match_info["id"]
        gpu = named_gpu(self.inventory, ident)
        snapshot = self.processes.current
        if snapshot is None:
            raise ApiError(ErrorKind.UNAVAILABLE, "not-read-yet", "the compute processes have not been read yet")
        if snapshot.error is not None:
            raise nvml_unavailable(f"the compute processes cannot be read: {snapshot.error}")
        device_uuid = ident if ident.startswith("MIG-") else gpu.uuid
        return json_response({"gpu": gpu.index, "uuid": gpu.uuid, "read_at": snapshot.read_at,
                              "devices": [d.as_dict() for d in snapshot.for_device(gpu, device_uuid)]})

    @admin_only
    async def reset(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"force": (bool, type(None))}) \
            if request.body_exists else {}
        gpu = whole_gpu(self.inventory, request.match_info["id"], "a reset")
        outcome = await self.resetter.reset_gpus([gpu.index], force=bool(body.get("force")))
        after = self.inventory.current
        gpus = [{"index": g.index, "uuid": g.uuid, "lost": g.lost, "mig_mode": g.mig.mode}
                for g in after.gpus if g.index in outcome.gpus]
        return json_response({"gpu": gpu.index, "uuid": gpu.uuid, **outcome.as_dict(), "gpus": gpus})
