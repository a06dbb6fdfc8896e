"""GET /v1/claims: the devices Kubernetes DRA claims hold on this node; PUT and DELETE /v1/claims/{uid}: the
DRA plugin holding and releasing them (gpud/claims.py)."""

from __future__ import annotations

import re

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind
from gpud.claims import ClaimRegistry, Hold, Share

UID = re.compile(r"[0-9a-fA-F][0-9a-fA-F-]{0,62}")
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a namespace or claim name: a DNS subdomain
MAX_DEVICES = 64  # a claim's devices on one node: more than any node has
MAX_MEMORY_MIB = 1 << 30  # a share's memory: a PiB, more than any GPU has
STRATEGIES = ("TimeSlicing", "MPS")
INTERVALS = ("Default", "Short", "Medium", "Long")  # NVIDIA's TimeSliceInterval, gpud's time-slice names lowered


class ClaimRoutes:
    def __init__(self, registry: ClaimRegistry, body_timeout_s: float):
        self.registry = registry
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/claims", self.get)
        app.router.add_put("/v1/claims/{uid}", self.put)
        app.router.add_delete("/v1/claims/{uid}", self.delete)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.registry.view())

    @admin_only
    async def put(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._body_timeout_s, {
            "namespace": (str,), "name": (str,), "driver": (str,), "devices": (list,),
            "sharing": (dict, type(None)), "capacity": (dict, type(None))})
        return json_response(await self.registry.hold(_wanted(claim_uid(request), body)))

    @admin_only
    async def delete(self, request: web.Request) -> web.Response:
        return json_response(await self.registry.release(claim_uid(request)))


def claim_uid(request: web.Request) -> str:
    """The route's {uid}: a Kubernetes UID, or 400."""
    uid = request.match_info["uid"]
    if not UID.fullmatch(uid):
        raise ApiError(ErrorKind.INVALID, "invalid-uid",
                       "a claim UID is a Kubernetes UID (hex digits and dashes, at most 63)")
    return uid


def _wanted(uid: str, body: dict) -> Hold:
    """The hold PUT /v1/claims/{uid}'s body asks for (its top-level types checked)."""
    for key in ("namespace", "name"):
        if not NAME.fullmatch(body[key]):
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"field {key!r} must be a Kubernetes name (a DNS subdomain)")
    if not NAME.fullmatch(body["driver"]) or len(body["driver"]) > 63:
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       "field 'driver' must be a DRA driver name (a DNS subdomain, at most 63)")
    devices = body["devices"]
    if not devices or len(devices) > MAX_DEVICES or not all(isinstance(d, str) for d in devices):
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       f"field 'devices' must list 1 to {MAX_DEVICES} GPU or MIG UUIDs")
    sharing = body.get("sharing") or {}
    if not isinstance(sharing, dict) or set(sharing) - {"strategy", "interval"}:
        raise ApiError(ErrorKind.INVALID, "invalid-field", "field 'sharing' takes 'strategy' and 'interval' only")
    strategy, interval = sharing.get("strategy"), sharing.get("interval")
    if strategy is not None and strategy not in STRATEGIES:
        raise ApiError(ErrorKind.INVALID, "invalid-field", f"sharing.strategy must be one of {', '.join(STRATEGIES)}")
    if interval is not None and (strategy != "TimeSlicing" or interval not in INTERVALS):
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       f"sharing.interval is TimeSlicing's: one of {', '.join(INTERVALS)}")
    capacity = _capacity(body.get("capacity") or {}, devices)
    if capacity and strategy != "MPS":
        raise ApiError(ErrorKind.INVALID, "capacity-needs-mps", "a claim with capacity shares its GPUs through MPS "
                       "(its memory and compute are its MPS client limits): sharing.strategy must be MPS")
    return Hold(uid, body["namespace"], body["name"], body["driver"], tuple(devices), strategy, interval,
                capacity=capacity)


def _capacity(capacity: dict, devices: list[str]) -> dict[str, Share]:
    """PUT /v1/claims/{uid}'s `capacity`: device UUID -> what the claim consumed of it (the allocation's
    consumedCapacity: memory in MiB, compute in percent of the GPU's SMs)."""
    shares = {}
    for uuid, share in capacity.items():
        where = f"capacity[{uuid[:80]!r}]"
        if uuid not in devices:
            raise ApiError(ErrorKind.INVALID, "invalid-field", f"{where}: not one of the claim's devices")
        if not isinstance(share, dict) or set(share) != {"memory_mib", "compute_percent"}:
            raise ApiError(ErrorKind.INVALID, "invalid-field", f"{where} takes 'memory_mib' and 'compute_percent', "
                                                               "both and only")
        memory, compute = share["memory_mib"], share["compute_percent"]
        if type(memory) is not int or not 1 <= memory <= MAX_MEMORY_MIB:
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"{where}.memory_mib must be an integer from 1 to {MAX_MEMORY_MIB}")
        if type(compute) is not int or not 1 <= compute <= 100:
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"{where}.compute_percent must be an integer from 1 to 100")
        shares[uuid] = Share(memory, compute)
    return shares
