"""POST /v1/sim/*: fault injection on a simulated node (--simulate). Registered only there: on a
real node, /v1/sim/* answers why it is absent."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, error_response, read_json_object
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind, nvml_unavailable
from gpud.base.logs import get_logger
from gpud.inventory import InventoryService
from gpud.nvml.session import NvmlSession, NvmlUnavailable, describe_error
from gpud.nvml.sim import SimError

log = get_logger("api")


class SimRoutes:
    def __init__(self, session: NvmlSession, inventory: InventoryService, body_timeout_s: float):
        self.session = session
        self.inventory = inventory
        self.body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        for name, handler in (("xid", self.sim_xid), ("gpu-lost", self.sim_gpu_lost),
                              ("gpu-recover", self.sim_gpu_recover), ("processes", self.sim_processes),
                              ("holders", self.sim_holders), ("ecc", self.sim_ecc),
                              ("recovery-action", self.sim_recovery_action), ("fabric", self.sim_fabric)):
            app.router.add_post(f"/v1/sim/{name}", handler)

    @admin_only
    async def sim_xid(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "xid": (int,),
                                                                     "gi_id": (int, type(None)),
                                                                     "ci_id": (int, type(None)),
                                                                     "nvml_event": (bool, type(None))})
        if not 0 < body["xid"] < 1 << 16:
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"field 'xid' must be between 1 and 65535, got {body['xid']}")
        # nvml_event false: the driver logs it to the kernel log only, as an XID NVML's event set missed
        await self._sim_call("sim_inject_xid", body["gpu"], body["xid"], body.get("gi_id"), body.get("ci_id"),
                             nvml_event=body.get("nvml_event") is not False)
        log.warning("sim_xid_injected", gpu=body["gpu"], xid=body["xid"], gi_id=body.get("gi_id"),
                    ci_id=body.get("ci_id"), nvml_event=body.get("nvml_event") is not False)
        return json_response({"injected": "xid", **body})

    @admin_only
    async def sim_gpu_lost(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "how": (str, type(None))})
        how = {"how": body["how"]} if body.get("how") is not None else {}  # else the simulator's default
        await self._sim_call("sim_set_gpu_lost", body["gpu"], **how)
        log.warning("sim_gpu_lost", gpu=body["gpu"], how=body.get("how"))
        await self.inventory.refresh("simulated GPU loss")
        return json_response({"injected": "gpu-lost", **body})

    @admin_only
    async def sim_gpu_recover(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str)})
        await self._sim_call("sim_recover_gpu", body["gpu"])
        log.warning("sim_gpu_recovered", gpu=body["gpu"])
        await self.inventory.refresh("simulated GPU recovery")
        return json_response({"injected": "gpu-recovered", **body})

    @admin_only
    async def sim_holders(self, request: web.Request) -> web.Response:
        """Another host process holds the GPU's device node (a monitoring agent, a CUDA app), or
        every such process lets go (release)."""
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "process": (str, type(None)),
                                                                     "pid": (int, type(None)),
                                                                     "release": (bool, type(None))})
        _check_holder(body)
        if body.get("release"):
            await self._sim_call("sim_release_holders", body["gpu"])
            log.info("sim_holders_released", gpu=body["gpu"])
            injected = "holders-released"
        else:
            await self._sim_call("sim_add_holder", body["gpu"], body["process"], body["pid"])
            log.info("sim_holder_added", gpu=body["gpu"], process=body["process"], pid=body["pid"])
            injected = "holder"
        holders = await self._sim_call("sim_holders", body["gpu"])
        return json_response({"injected": injected, **body,
                          "holders": [{"pid": pid, "process": process} for pid, process in holders]})

    @admin_only
    async def sim_processes(self, request: web.Request) -> web.Response:
        """The compute processes of a GPU or MIG device: `pids` (each with the simulator's default
        memory), or `processes`, each {"pid", "used_memory_mib", "sm_percent"} (the last two optional)."""
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "pids": (list, type(None)),
                                                                     "processes": (list, type(None))})
        if (body.get("pids") is None) == (body.get("processes") is None):
            raise ApiError(ErrorKind.INVALID, "invalid-body", "give either 'pids' or 'processes'")
        processes = body["pids"] if body.get("pids") is not None else body["processes"]
        if not all(_is_pid(p) for p in body.get("pids") or ()):
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           "field 'pids' must be a list of process ids (positive integers)")
        for process in body.get("processes") or ():
            _check_process(process)
        await self._sim_call("sim_set_processes", body["gpu"], processes)
        log.info("sim_processes_set", gpu=body["gpu"], pids=[p if isinstance(p, int) else p["pid"] for p in processes])
        await self.inventory.refresh("simulated processes")
        return json_response({"injected": "processes", **body})

    @admin_only
    async def sim_ecc(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "double_bit": (bool,)})
        await self._sim_call("sim_inject_ecc", body["gpu"], body["double_bit"])
        log.warning("sim_ecc_injected", gpu=body["gpu"], double_bit=body["double_bit"])
        return json_response({"injected": "ecc", **body})

    @admin_only
    async def sim_recovery_action(self, request: web.Request) -> web.Response:
        """The driver's recovery action (NVML_GPU_RECOVERY_ACTION_*: 0 none, 1 GPU reset, 2 node reboot, 3 drain
        P2P, 4 drain and reset), as the driver sets it; a driver before R565 has none to set (422)."""
        body = await read_json_object(request, self.body_timeout_s, {"gpu": (int, str), "action": (int,)})
        await self._sim_call("sim_set_recovery_action", body["gpu"], body["action"])
        log.warning("sim_recovery_action_set", gpu=body["gpu"], action=body["action"])
        return json_response({"injected": "recovery-action", **body})

    @admin_only
    async def sim_fabric(self, request: web.Request) -> web.Response:
        """The GPU's NVLink fabric as the driver reports it (state, status, health mask); all null: as
        Fabric Manager left it."""
        body = await read_json_object(request, self.body_timeout_s, {
            "gpu": (int, str), "state": (int, type(None)), "status": (int, type(None)),
            "health_mask": (int, type(None))})
        await self._sim_call("sim_set_fabric", body["gpu"], state=body.get("state"), status=body.get("status"),
                             health_mask=body.get("health_mask"))
        log.warning("sim_fabric_set", **body)
        return json_response({"injected": "fabric", **body})

    async def _sim_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.session.call(lambda nvml: getattr(nvml, method)(*args, **kwargs))
        except SimError as exc:
            raise ApiError(ErrorKind.REFUSED, "invalid-target", str(exc)) from None
        except NvmlUnavailable as exc:
            raise nvml_unavailable(str(exc)) from None
        except self.session.nvml.NVMLError as exc:
            raise ApiError(ErrorKind.CONFLICT, "nvml-error", describe_error(exc)) from None


def _is_pid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 22


def _check_process(process: Any) -> None:
    def whole(value: Any, low: int, high: int) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high)

    if not isinstance(process, dict) or set(process) - {"pid", "used_memory_mib", "sm_percent"} or \
            not _is_pid(process.get("pid")) or not whole(process.get("used_memory_mib"), 1, 1 << 24) or \
            not whole(process.get("sm_percent"), 0, 100):
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       "field 'processes' must list objects with 'pid' (a process id), and "
                       "optionally 'used_memory_mib' (a positive integer) and 'sm_percent' "
                       f"(0 to 100); got {process!r:.200}")


def _check_holder(body: dict) -> None:
    process, pid = body.get("process"), body.get("pid")
    if body.get("release"):
        if process is not None or pid is not None:
            raise ApiError(ErrorKind.INVALID, "invalid-body", "give either release: true, or process and pid")
        return
    if process is None or pid is None:
        raise ApiError(ErrorKind.INVALID, "missing-field", "a holder needs 'process' and 'pid' (or give release: true)")
    if not 0 < pid < 1 << 22:
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       f"field 'pid' must be a process id (a positive integer), got {pid}")
    if not process.strip() or not process.isprintable() or len(process) > 64:
        raise ApiError(ErrorKind.INVALID, "invalid-field",
                       "field 'process' must be a program name (1 to 64 printable characters)")


def register_not_simulated(app: web.Application) -> None:
    """A real node: /v1/sim/* says why fault injection is absent."""
    app.router.add_route("*", "/v1/sim/{what:.*}", _not_simulated)


async def _not_simulated(request: web.Request) -> web.Response:
    return error_response(404, "not-simulated", "fault injection exists only on a simulated node (--simulate)")
