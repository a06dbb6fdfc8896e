"""Which pods hold the gpu-memory units, from the kubelet's PodResources API, reported to gpud.

The kubelet is the record of what it allocated (it checkpoints it; the plugin keeps nothing): List
is read from the kubelet's pod-resources socket every 10 s, shortly after each Allocate of a gpu-memory
resource, and as soon as the plugin knows of a gpu-memory resource it has not reported to this gpud run
(the plugin started, or gpud restarted: a new event epoch). For each gpu-memory resource whose holders
changed since the last report to this gpud run, gpud gets PUT /v1/allocations, so gpud's view follows
the kubelet's across restarts of either. A missing socket or a failing kubelet or gpud is logged (once
until it changes) and tried again next time; the endpoints go on regardless.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.client import ApiFailure, Client, DaemonUnreachable
from gpud.device_plugin.api import podresources_pb, podresources_rpc

log = get_logger("device_plugin")

READ_EVERY_S = 10.0
# The kubelet records a container's devices (devicemanager podDevices.insert) once Allocate has answered:
# List shows them only after that, so the read waits this long after an Allocate.
AFTER_ALLOCATE_S = 0.5
LIST_TIMEOUT_S = 5.0


def holders(response: podresources_pb.ListPodResourcesResponse, resource: str) -> list[dict[str, Any]]:
    """The containers of a List answer that hold devices of `resource`, in PUT /v1/allocations' shape.
    The kubelet gives one ContainerDevices per device and NUMA node (pkg/kubelet/cm/container_manager_linux.go
    containerDevicesFromResourceDeviceInstances): a container's are gathered into one list."""
    pods = []
    for pod in response.pod_resources:
        for container in pod.containers:
            ids = sorted({i for d in container.devices if d.resource_name == resource for i in d.device_ids})
            if ids:
                pods.append({"namespace": pod.namespace, "pod": pod.name, "container": container.name,
                             "device_ids": ids})
    return sorted(pods, key=lambda p: (p["namespace"], p["pod"], p["container"]))


class AllocationReporter:
    def __init__(self, socket_path: Path, gpud: Client, resources: Callable[[], list[str]],
                 gpud_epoch: Callable[[], str | None]):
        self.socket_path = socket_path
        self.gpud = gpud
        self._resources = resources  # the gpu-memory resources gpud has now
        self._gpud_epoch = gpud_epoch  # the gpud run the plugin follows
        self._reported: dict[str, tuple[str | None, list[dict[str, Any]]]] = {}  # resource -> (epoch, holders)
        self._wake = asyncio.Event()
        self._last_problem: str | None = None

    def read_soon(self) -> None:
        """An Allocate of a gpu-memory resource was answered: read List shortly."""
        self._wake.set()

    def gpud_read(self) -> None:
        """The plugin read gpud's state again: a gpu-memory resource not yet reported to this gpud run is
        read soon (the plugin started, or gpud restarted and has no report)."""
        epoch = self._gpud_epoch()
        if any(resource not in self._reported or self._reported[resource][0] != epoch
               for resource in self._resources()):
            self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await within(self._wake.wait(), READ_EVERY_S)
                await asyncio.sleep(AFTER_ALLOCATE_S)  # fixed time: the kubelet records the allocation after our answer
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.report()

    async def report(self) -> None:
        """One List, and a PUT for each resource whose holders changed (none: nothing asked)."""
        resources = self._resources()
        if not resources:
            return
        try:
            response = await self._list()
            for resource in resources:
                found = holders(response, resource)
                epoch = self._gpud_epoch()
                if self._reported.get(resource) != (epoch, found):
                    body = {"resource": resource, "read_at": time.time(), "pods": found}
                    await asyncio.to_thread(self.gpud.request, "PUT", "/v1/allocations", body)
                    self._reported[resource] = (epoch, found)
                    log.info("allocations_reported", resource=resource, containers=len(found),
                             units=sum(len(p["device_ids"]) for p in found))
        except (grpc.aio.AioRpcError, DaemonUnreachable, ApiFailure) as exc:
            problem = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            report = log.warning if problem != self._last_problem else log.debug  # once, not every 10 s
            report("allocations_not_reported", reason=problem, pod_resources_socket=str(self.socket_path),
                   retry_in_s=READ_EVERY_S)
            self._last_problem = problem
            return
        self._last_problem = None

    async def _list(self) -> podresources_pb.ListPodResourcesResponse:
        async with grpc.aio.insecure_channel(f"unix://{self.socket_path}") as channel:
            return await podresources_rpc.PodResourcesListerStub(channel).List(
                podresources_pb.ListPodResourcesRequest(), timeout=LIST_TIMEOUT_S)
