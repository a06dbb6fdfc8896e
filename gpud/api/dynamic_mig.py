"""GET /v1/mig/dynamic: the dynamic MIG GPUs (dra.dynamic_mig_gpus), their profiles' placements and the DRA
claims' MIG devices; PUT and DELETE /v1/mig/dynamic/{uid}: `gpud dra-plugin` making a claim's MIG devices
at Prepare and destroying them at Unprepare (gpud/mig/dynamic.py). Changing routes need the rights PUT
/v1/claims needs."""

from __future__ import annotations

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.claims import claim_uid
from gpud.api.errors import ApiError, read_json_object
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind
from gpud.mig.dynamic import DynamicMig, WantedDevice

MAX_DEVICES = 16  # a claim's dynamic MIG devices: more than a node's GPUs hold at their smallest profile
_DEVICE_KEYS = {"gpu": str, "gi_profile_id": int, "placement_start": int}
_MAX_ID = 1 << 31  # NVML's ids and starts are C unsigned ints; far above any real one


class DynamicMigRoutes:
    def __init__(self, dynamic: DynamicMig, body_timeout_s: float):
        self.dynamic = dynamic
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/mig/dynamic", self.get)
        app.router.add_put("/v1/mig/dynamic/{uid}", self.put)
        app.router.add_delete("/v1/mig/dynamic/{uid}", self.delete)

    async def get(self, request: web.Request) -> web.Response:
        return json_response(self.dynamic.view())

    @admin_only
    async def put(self, request: web.Request) -> web.Response:
        uid = claim_uid(request)
        body = await read_json_object(request, self._body_timeout_s, {"devices": (list,)})
        return json_response(await self.dynamic.prepare(uid, _devices(body["devices"])))

    @admin_only
    async def delete(self, request: web.Request) -> web.Response:
        return json_response(await self.dynamic.unprepare(claim_uid(request)))


def _devices(devices: list) -> tuple[WantedDevice, ...]:
    """The body's devices, each {"gpu": GPU UUID, "gi_profile_id": int, "placement_start": int}, none twice."""
    if not 1 <= len(devices) <= MAX_DEVICES:
        raise ApiError(ErrorKind.INVALID, "invalid-field", f"field 'devices' must list 1 to {MAX_DEVICES} devices")
    wanted = []
    for number, device in enumerate(devices):
        where = f"devices[{number}]"
        if not isinstance(device, dict) or set(device) != set(_DEVICE_KEYS):
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"{where} must be an object with exactly the keys {', '.join(_DEVICE_KEYS)}")
        for key, kind in _DEVICE_KEYS.items():
            value = device[key]
            if not isinstance(value, kind) or isinstance(value, bool) or \
                    (kind is int and not 0 <= value < _MAX_ID) or (kind is str and not 0 < len(value) <= 128):
                wanted_kind = "a GPU UUID" if kind is str else f"an integer from 0 to {_MAX_ID - 1}"
                raise ApiError(ErrorKind.INVALID, "invalid-field", f"{where}.{key} must be {wanted_kind}")
        wanted.append(WantedDevice(device["gpu"], device["gi_profile_id"], device["placement_start"]))
    if len({w.key for w in wanted}) != len(wanted):
        raise ApiError(ErrorKind.INVALID, "invalid-field", "field 'devices' names a device twice")
    return tuple(wanted)
