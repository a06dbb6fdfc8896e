"""Remediation's routes: GET /v1/remediation (the policy the k8s agent and `gpud slurm health` follow, the
reset budget, the results so far) and POST /v1/gpus/{id}/remediate (admin only: reset if the GPU's health
asks for it, never forced, then check)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import ApiError, read_json_object
from gpud.api.gpus import whole_gpu
from gpud.api.responses import json_response
from gpud.base.errors import ErrorKind
from gpud.config import RemediationConfig
from gpud.health.remediation import Remediation
from gpud.inventory import InventoryService

MAX_REQUESTER_CHARACTERS = 64


class RemediationRoutes:
    def __init__(self, remediation: Remediation, policy: Callable[[], RemediationConfig], inventory: InventoryService,
                 body_timeout_s: float):
        self.remediation = remediation
        self.policy = policy  # the remediation section in force (a reload changes it)
        self.inventory = inventory
        self.body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/remediation", self.get_remediation)
        app.router.add_post("/v1/gpus/{id}/remediate", self.remediate)

    async def get_remediation(self, request: web.Request) -> web.Response:
        return json_response({"policy": asdict(self.policy()), "reset_budget": self.remediation.budget.view(),
                              "results": self.remediation.results})

    @admin_only
    async def remediate(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self.body_timeout_s, {"requester": (str, type(None))}) \
            if request.body_exists else {}
        requester = body.get("requester")
        if requester is not None and not (0 < len(requester) <= MAX_REQUESTER_CHARACTERS and requester.isprintable()):
            raise ApiError(ErrorKind.INVALID, "invalid-field",
                           f"field 'requester' must be 1 to {MAX_REQUESTER_CHARACTERS} printable characters "
                           f"(who asks, for the log: k8s-agent, slurm), got {len(requester)} characters"
                           + ("" if requester.isprintable() else " with a control character"))
        gpu = whole_gpu(self.inventory, request.match_info["id"], "a remediation")
        return json_response(await self.remediation.remediate(gpu, requester))
