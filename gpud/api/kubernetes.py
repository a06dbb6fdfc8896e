"""GET /v1/kubernetes: the settings of `gpud k8s-agent` (the `kubernetes:` section) and the status it
last reported; PUT /v1/kubernetes/agent: the agent reports its status (kept in memory only)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import read_any_json_object
from gpud.api.responses import json_response
from gpud.config import KubernetesConfig

# The agent's status is a summary (its node, its last actions, its errors), not a log.
MAX_AGENT_STATUS_BYTES = 64 << 10


class KubernetesAgentStatus:
    """The status the agent reported last, and when: served as it came, lost when gpud stops (the agent
    reports again)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None
        self.reported_at: float | None = None

    def report(self, status: dict[str, Any]) -> None:
        self.status, self.reported_at = status, time.time()


class KubernetesRoutes:
    def __init__(self, settings: Callable[[], KubernetesConfig], agent: KubernetesAgentStatus, body_timeout_s: float):
        self._settings = settings  # the kubernetes section in force (a reload changes it)
        self.agent = agent
        self._body_timeout_s = body_timeout_s

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/kubernetes", self.get)
        app.router.add_put("/v1/kubernetes/agent", self.put_agent)

    async def get(self, request: web.Request) -> web.Response:
        return json_response({"settings": asdict(self._settings()), "agent": self.agent.status,
                              "agent_reported_at": self.agent.reported_at})

    @admin_only
    async def put_agent(self, request: web.Request) -> web.Response:
        self.agent.report(await read_any_json_object(request, self._body_timeout_s, MAX_AGENT_STATUS_BYTES))
        return json_response({"agent": self.agent.status, "agent_reported_at": self.agent.reported_at})
