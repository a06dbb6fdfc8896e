"""The API's two places in the daemon's component list: the socket's path claimed first of all (a second gpud
on the same socket stops there, before it reads or writes any state), and the socket served once everything
the routes answer from has started."""

from __future__ import annotations

from gpud.api.latency import RequestLatency
from gpud.api.server import Api, UnixSocketListener
from gpud.base.lifecycle import Component, Tasks
from gpud.config import ApiConfig


class SocketClaim(Component):
    name = "socket"

    def __init__(self, listener: UnixSocketListener):
        self.listener = listener

    async def start(self, tasks: Tasks) -> None:
        self.listener.claim()  # SocketInUse: another gpud serves this socket

    async def stop(self) -> None:
        self.listener.close()


class ApiServing(Component):
    """Serves the API at once (it answers 503 until NVML is up); stopping ends open watch streams, lets
    in-flight requests finish (api.shutdown_timeout_s) and stops accepting."""

    name = "api"

    def __init__(self, listener: UnixSocketListener, api: Api, latency: RequestLatency, settings: ApiConfig):
        self.listener, self.api, self.latency, self.settings = listener, api, latency, settings

    async def start(self, tasks: Tasks) -> None:
        settings = self.settings
        await self.api.start(self.listener.open(), self.latency, idle_timeout_s=settings.idle_timeout_s,
                             shutdown_timeout_s=settings.shutdown_timeout_s,
                             max_connections=settings.max_connections,
                             max_connections_per_peer=settings.max_connections_per_peer,
                             admin_reserved_connections=settings.admin_reserved_connections)

    async def stop(self) -> None:
        await self.api.stop()
