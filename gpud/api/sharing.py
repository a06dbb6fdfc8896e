"""GET /v1/sharing: the sharing document, answered from its body encoded once per change; PUT
/v1/sharing/config: which named config (sharing.configs_dir) is in force; GET and PUT
/v1/allocations: gpu_memory's units as the device plugin reports the kubelet allocated them."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import encoded_json_response, json_response
from gpud.base.errors import ErrorKind
from gpud.sharing.gpu_memory import Allocation, GpuMemory
from gpud.sharing.service import SharingView

# A report's bounds: a node's units are a few thousand at 1 GiB units (8 GPUs of 141 GiB: 1128);
# these leave room for small units while keeping a hostile report's cost bounded.
MAX_REPORTED_IDS = 100_000
MAX_REPORTED_PODS = 10_000
MAX_NAME_LENGTH = 253  # Kubernetes' longest namespace, pod or container name is a DNS subdomain
MAX_ID_LENGTH = 512
# PUT /v1/allocations' bounds: MAX_REPORTED_IDS IDs of up to ~100 bytes quoted, and each pod's object.
ALLOCATIONS_MAX_BYTES = 16 << 20
ALLOCATIONS_MAX_VALUES = MAX_REPORTED_IDS + 8 * MAX_REPORTED_PODS + 16


class SharingRoutes:
    def __init__(self, sharing: SharingView, choose: Callable[[str | None, str | None], Awaitable[dict]],
                 body_timeout_s: float):
        self.sharing = sharing
        self._choose = choose  # (name or None for the default, reason) -> the `config` block; GpudError refuses
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/sharing", self.get)
        app.router.add_put("/v1/sharing/config", self.put_config)

    async def get(self, request: web.Request) -> web.Response:
        return encoded_json_response(self.sharing.body)

    @admin_only
    async def put_config(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s, {"name": (str, type(None)),
                                                                      "reason": (str, type(None))})
        return json_response({"config": await self._choose(body.get("name"), body.get("reason"))})


class AllocationRoutes:
    def __init__(self, gpu_memory: GpuMemory, body_timeout_s: float):
        self.gpu_memory = gpu_memory
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/allocations", self.get)
        app.router.add_put("/v1/allocations", self.put)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.gpu_memory.view())

    @admin_only
    async def put(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s,
                                      {"resource": (str,), "read_at": (int, float), "pods": (list,)},
                                      limit=ALLOCATIONS_MAX_BYTES, max_values=ALLOCATIONS_MAX_VALUES)
        self.gpu_memory.check_reporter(body["resource"])
        return json_response(self.gpu_memory.report(*_allocations(body)))


def _allocations(body: dict) -> tuple[float, list[Allocation]]:
    """The report's time and allocations, from PUT /v1/allocations' body (its top-level types checked)."""
    read_at = body["read_at"]
    if not 0 <= read_at < 1e11:
        raise ApiError(ErrorKind.INVALID, "invalid-field", "field 'read_at' must be a Unix time in seconds")
    pods = body["pods"]
    if len(pods) > MAX_REPORTED_PODS:
        raise ApiError(ErrorKind.INVALID, "too-many-pods",
                       f"at most {MAX_REPORTED_PODS} pods in a report, got {len(pods)}")
    allocations, ids = [], 0
    for position, pod in enumerate(pods):
        allocations.append(_allocation(pod, position))
        ids += len(allocations[-1].device_ids)
        if ids > MAX_REPORTED_IDS:
            raise ApiError(ErrorKind.INVALID, "too-many-ids", f"at most {MAX_REPORTED_IDS} device IDs in a report")
    return float(read_at), allocations


def _allocation(pod: Any, position: int) -> Allocation:
    where = f"pods[{position}]"
    if not isinstance(pod, dict):
        raise ApiError(ErrorKind.INVALID, "invalid-field", f"{where} must be an object")
    unknown = sorted(set(pod) - {"namespace", "pod", "container", "device_ids"})
    if unknown:
        raise ApiError(ErrorKind.INVALID, "unknown-field", f"{where}: unknown field(s) {', '.join(unknown)[:200]}")
    for key in ("namespace", "pod", "container"):
        value = pod.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LENGTH:
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"{where}.{key} must be a string of 1 to {MAX_NAME_LENGTH} characters")
    ids = pod.get("device_ids")
    if not isinstance(ids, list) or not all(isinstance(id_, str) and 0 < len(id_) <= MAX_ID_LENGTH for id_ in ids):
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       f"{where}.device_ids must be a list of strings of 1 to {MAX_ID_LENGTH} characters")
    return Allocation(pod["namespace"], pod["pod"], pod["container"], tuple(ids))
