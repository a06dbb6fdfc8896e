"""The device plugin process: an endpoint per shared resource of gpud, each registered with the kubelet.

A resource that appears gets an endpoint and registers; one already registered keeps its endpoint
and only sends new ListAndWatch frames (a MIG change, health); one that disappears first sends an
empty device list (the kubelet then advertises none of it) and its endpoint stops, unless gpud's
sharing document has an error (migStrategy single halfway through a MIG change has no resources
at all): the endpoint then stays, empty, until gpud says which resources there are. Once a second
the kubelet's directory is looked at: a re-created kubelet.sock (the kubelet restarted) has every
endpoint register again; an endpoint whose socket is gone (the kubelet removes plugin sockets when
it starts) is restarted and registers again; a failed registration is retried. Each endpoint registers
in its own task, outside the lock: a kubelet slow to answer one Register delays neither the others nor
a device list (health) going out. Where gpud has a gpu-memory resource, podresources.py reports to gpud
which pods hold its units, read from the kubelet's PodResources API.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

from gpud.base.logs import get_logger
from gpud.base.loops import run_until_stopped, stop_on_signals
from gpud.device_plugin import DEFAULT_KUBELET_DIR, DEFAULT_POD_RESOURCES_SOCKET
from gpud.device_plugin.allocation import DEFAULT_STRATEGIES, DeviceListStrategy
from gpud.device_plugin.endpoint import Endpoint
from gpud.device_plugin.follower import DEFAULT_UNREACHABLE_GRACE_S, GpudFollower
from gpud.device_plugin.podresources import AllocationReporter
from gpud.device_plugin.state import NodeState

log = get_logger("device_plugin")

KUBELET_SOCKET = "kubelet.sock"
KUBELET_CHECK_S = 1.0


class DevicePlugin:
    def __init__(self, gpud_socket: Path | None, kubelet_dir: Path = DEFAULT_KUBELET_DIR,
                 unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S,
                 strategies: tuple[DeviceListStrategy, ...] = DEFAULT_STRATEGIES,
                 pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET):
        self.kubelet_dir = kubelet_dir
        self.strategies = strategies
        self.kubelet_socket = kubelet_dir / KUBELET_SOCKET
        self.follower = GpudFollower(gpud_socket, self.apply, unreachable_grace_s)
        self.state = NodeState()
        self.reporter = AllocationReporter(pod_resources_socket, self.follower.client, lambda: [
            name for name, resource in self.state.resources.items() if resource.strategy == "gpu-memory"],
            lambda: self.follower.epoch)
        self.endpoints: dict[str, Endpoint] = {}
        self._kubelet_identity: tuple[int, int] | None = None
        self._lock = asyncio.Lock()  # one change to the endpoints at a time

    async def serve(self) -> int:
        stop = stop_on_signals()
        log.info("device_plugin_starting", kubelet_dir=str(self.kubelet_dir),
                 gpud_socket=str(self.follower.client.socket_path),
                 device_list_strategy=[s.value for s in self.strategies])
        self._kubelet_identity = self._kubelet_identity_now()  # endpoints register with this kubelet
        failed = await run_until_stopped([self.follower.run(), self._watch_kubelet(), self.reporter.run()], stop,
                                         log, "device_plugin_failed")
        async with self._lock:
            for endpoint in self.endpoints.values():
                await endpoint.stop("the plugin is stopping")
        log.info("device_plugin_stopped", failed=failed)
        return 1 if failed else 0

    async def apply(self, state: NodeState) -> None:
        """Brings the endpoints in line with gpud's resources."""
        async with self._lock:
            self.state = state
            for name in [n for n in self.endpoints if n not in state.resources]:
                await self.endpoints[name].update(replace(self.endpoints[name].resource, devices=()))
                if state.sharing_error is None:
                    await self.endpoints.pop(name).stop("gpud no longer has this resource")
            for name, resource in state.resources.items():
                if name in self.endpoints:
                    await self.endpoints[name].update(resource)
                    continue
                endpoint = Endpoint(resource, self.kubelet_dir, lambda: self.state, self.strategies,
                                    self.reporter.read_soon)
                await endpoint.start()
                self.endpoints[name] = endpoint
                if self._kubelet_identity is not None:
                    endpoint.register_soon(self.kubelet_socket)
            self.reporter.gpud_read()

    async def _watch_kubelet(self) -> None:
        while True:
            await asyncio.sleep(KUBELET_CHECK_S)
            async with self._lock:
                await self._check_kubelet()

    def _kubelet_identity_now(self) -> tuple[int, int] | None:
        """Which kubelet.sock is there: a re-created one (the kubelet restarted) differs."""
        try:
            st = os.stat(self.kubelet_socket)
        except OSError:
            return None
        return (st.st_ino, st.st_ctime_ns)

    async def _check_kubelet(self) -> None:
        identity = self._kubelet_identity_now()
        restarted = identity is not None and identity != self._kubelet_identity
        if identity != self._kubelet_identity:
            log.info("kubelet_socket_changed" if identity else "kubelet_socket_gone", socket=str(self.kubelet_socket))
            self._kubelet_identity = identity
        for endpoint in self.endpoints.values():
            if not endpoint.socket_is_ours():
                log.warning("endpoint_socket_gone", resource=endpoint.resource.name, socket=str(endpoint.socket),
                            action="restarting the endpoint")
                await endpoint.stop("its socket was removed")
                await endpoint.start()
            if identity is not None and (restarted or not (endpoint.registered or endpoint.registering)):
                endpoint.register_soon(self.kubelet_socket)


def run(gpud_socket: Path | None, kubelet_dir: Path, unreachable_grace_s: float,
        strategies: tuple[DeviceListStrategy, ...] = DEFAULT_STRATEGIES,
        pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET) -> int:
    if not kubelet_dir.is_dir():
        log.error("kubelet_dir_missing", kubelet_dir=str(kubelet_dir), message=f"no directory {kubelet_dir}, where "
                  "kubelet.sock is: run on a node whose kubelet runs, or give --kubelet-dir (kubelet's --root-dir "
                  "followed by /device-plugins)")
        return 2
    return asyncio.run(DevicePlugin(gpud_socket, kubelet_dir, unreachable_grace_s, strategies,
                                    pod_resources_socket).serve())
