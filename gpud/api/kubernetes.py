"""GET /v1/kubernetes: the settings of `gpud k8s-agent` (the `kubernetes:` section) and the status it
last reported; PUT /v1/kubernetes/agent: the agent reports its status (kept in memory only)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable, Iterator

from aiohttp import web

from gpud.api.auth import admin_only
from gpud.api.errors import read_any_json_object
from gpud.api.responses import json_response
from gpud.base.lifecycle import Component
from gpud.base.samples import Family
from gpud.config import KubernetesConfig
from gpud.model.dcgm_labels import HOSTNAME

# The agent's status is a summary (its node, its last actions, its errors), not a log.
MAX_AGENT_STATUS_BYTES = 64 << 10


class KubernetesAgentStatus(Component):
    """The status the agent reported last, and when: served as it came, lost when gpud stops (the agent
    reports again). When is a series too, so an alert can say the agent stopped reporting."""

    name = "kubernetes-agent"

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None
        self.reported_at: float | None = None

    def report(self, status: dict[str, Any]) -> None:
        self.status, self.reported_at = status, time.time()

    def collect(self) -> Iterator[Family]:
        """No series before the agent's first report: a node without the agent has nothing to alert on."""
        reported = Family("gpud_kubernetes_agent_last_report_timestamp_seconds",
                          "When gpud k8s-agent last reported its status (Unix time); it reports at least every minute.",
                          "gauge")
        if self.reported_at is not None:
            reported.add({"hostname": HOSTNAME}, self.reported_at)
        yield reported


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
