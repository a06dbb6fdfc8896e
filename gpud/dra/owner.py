"""gpud as the node's one owner of its GPUs, seen from the DRA plugin: a prepared claim's devices are held
in gpud (PUT /v1/claims/{uid}), so the device plugin refuses them to its pods, and released at Unprepare;
devices the device plugin handed out (the kubelet's PodResources API) are refused to a claim; a claim
that shares through MPS is made a client of gpud's supervised MPS daemon of each device, with its limits; a
claim for a dynamic MIG placement has gpud make that MIG device (PUT /v1/mig/dynamic/{uid}) and destroy it at
Unprepare; a share of a GPU's memory is held with its consumed capacity, counted in gpud's one ledger.
Blocking calls (gpud's standard-library client): the plugin makes them off its event loop."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterable

import grpc

from gpud.base.quantity import parse_quantity
from gpud.client import ApiFailure, Client, DaemonUnreachable
from gpud.device_plugin.api import podresources_pb, podresources_rpc
from gpud.dra.config import Sharing

MPS_START_WAIT_S = 10.0  # a daemon gpud starts for the claim answers within a second or two
LIST_TIMEOUT_S = 5.0
CDI_WAIT_S = 5.0  # gpud rewrites its spec as soon as it has read the new MIG device
# gpud answers 503 `starting` until its first inventory is read and its dynamic MIG devices are converged,
# a second or two after a (re)start, say a package upgrade's: the claim waits that out rather than fail a pod
STARTING_WAIT_S = 20.0


class OwnerRefused(Exception):
    """gpud refused or could not be asked: the message says which, and why."""


def quantity_mib(text: str) -> int:
    """A memory quantity in whole MiB, as NVIDIA's MPS limits are (sharing.go limit.Megabyte); at least 1."""
    try:
        mib = int(parse_quantity(text.strip())) >> 20
    except ValueError:
        raise OwnerRefused(f"{text!r} is not a memory quantity such as 10Gi") from None
    if mib < 1:
        raise OwnerRefused(f"the memory limit {text} is below 1 MiB")
    return mib


def mps_limits(sharing: Sharing, uuids: list[str]) -> dict[str, tuple[float | None, int | None]]:
    """Per device UUID: (active thread percentage, pinned memory MiB) of an MPS config; the per-device
    limits name a device by its UUID or its position in the claim (sharing.go Normalize)."""
    mps = sharing.mps or {}
    threads = mps.get("defaultActiveThreadPercentage")
    default = mps.get("defaultPinnedDeviceMemoryLimit")
    memory = {uuid: quantity_mib(default) if default else None for uuid in uuids}
    for key, value in (mps.get("defaultPerDevicePinnedMemoryLimit") or {}).items():
        uuid = uuids[int(key)] if key.isdigit() and int(key) < len(uuids) else key
        if uuid not in memory:
            raise OwnerRefused(f"defaultPerDevicePinnedMemoryLimit names device {key!r}, which the claim does not have")
        memory[uuid] = quantity_mib(value)
    return {uuid: (None if threads is None else float(threads), memory[uuid]) for uuid in uuids}


class GpudOwner:
    def __init__(self, client: Client, pod_resources_socket):
        self.client = client
        self.pod_resources_socket = pod_resources_socket

    def hold(self, uid: str, namespace: str, name: str, driver: str, devices: Iterable[str],
             sharing: Sharing | None, capacity: dict[str, dict] | None = None) -> None:
        """capacity: device UUID -> {"memory_mib", "compute_percent"} of a share (consumed capacity)."""
        body = {"namespace": namespace, "name": name, "driver": driver, "devices": list(devices),
                "sharing": None if sharing is None else {"strategy": sharing.strategy, **(
                    {"interval": sharing.interval} if sharing.interval else {})}}
        if capacity:
            body["capacity"] = capacity
        self._call("PUT", f"/v1/claims/{uid}", body, "hold the devices in gpud")

    def make_mig_devices(self, uid: str, placements: list[dict]) -> list[dict]:
        """gpud makes the claim's MIG devices at exactly these placements ({"gpu", "gi_profile_id",
        "placement_start"} each), or answers those it made for the claim already; each with its "uuid"."""
        return self._call("PUT", f"/v1/mig/dynamic/{uid}", {"devices": placements},
                          "make the claim's MIG devices")["devices"]

    def destroy_mig_devices(self, uid: str) -> list[str]:
        """gpud destroys the MIG devices it made for the claim (none: nothing to do); their UUIDs."""
        try:
            status, answer = self._past_start("DELETE", f"/v1/mig/dynamic/{uid}", None, ok_statuses=(404,))
        except ApiFailure as exc:
            raise OwnerRefused(f"gpud refused to destroy the claim's MIG devices: {exc}") from None
        except DaemonUnreachable as exc:
            raise OwnerRefused(f"could not destroy the claim's MIG devices: gpud is unreachable ({exc})") from None
        return [] if status == 404 else answer["destroyed"]  # 404: a gpud without dynamic MIG made none

    def node_cdi_spec(self, uuids: Iterable[str]) -> dict:
        """gpud's CDI node spec once it has a device for each of uuids (a MIG device gpud just made is added
        as its inventory is read again)."""
        wanted = set(uuids)
        deadline = time.monotonic() + CDI_WAIT_S
        while True:
            status, cdi = self.client.request("GET", "/v1/cdi", ok_statuses=(404, 503))
            spec = cdi.get("spec") if status == 200 and cdi.get("enabled") else None
            missing = wanted - {d.get("name") for d in (spec or {}).get("devices") or []}
            if spec is not None and not missing:
                return spec
            if time.monotonic() > deadline:
                raise OwnerRefused(f"gpud's CDI spec has no device for {', '.join(sorted(missing)) or 'anything'} "
                                   f"after {CDI_WAIT_S:g} s (GET /v1/cdi says why)")
            time.sleep(0.05)  # a poll of gpud while it writes its spec

    def release(self, uid: str) -> None:
        self._call("DELETE", f"/v1/claims/{uid}", None, "release the devices in gpud")

    def mps_client(self, uid: str, uuid: str, threads: float | None, memory_mib: int | None) -> dict:
        """What a client of the MPS daemon gpud runs for this device needs (GET /v1/mps/{name}/client-env),
        once the daemon runs."""
        deadline = time.monotonic() + MPS_START_WAIT_S
        while True:
            claims = self._call("GET", "/v1/claims", None, "read gpud's claims")
            daemon = next((d["mps_daemon"] for c in claims["claims"] if c["uid"] == uid for d in c["devices"]
                           if d["uuid"] == uuid), None)
            query = {k: v for k, v in (("threads_percent", threads), ("memory_mib", memory_mib)) if v is not None}
            client = None
            if daemon is not None:
                path = f"/v1/mps/{urllib.parse.quote(daemon)}/client-env" + (
                    f"?{urllib.parse.urlencode(query)}" if query else "")
                status, client = self.client.request("GET", path, ok_statuses=(404,))
                if status == 404:
                    client = None
            if client is not None and client["state"] == "running":
                return client
            if time.monotonic() > deadline:
                state = client["state"] if client else "not started"
                raise OwnerRefused(f"gpud's MPS daemon {daemon or '(none)'} for {uuid} is {state} after "
                                   f"{MPS_START_WAIT_S:g} s (gpud mps status says why)")
            time.sleep(0.1)  # a poll of gpud while its daemon starts

    def device_plugin_holders(self) -> dict[str, list[tuple[str, str]]]:
        """Device UUID -> (the pod container the device plugin gave it to, the resource name) of each holder,
        from the kubelet's PodResources List (replica and gpu-memory unit IDs `<uuid>::<n>` name their device);
        {} where there is no such socket (no device plugin path on this node)."""
        if not self.pod_resources_socket.exists():
            return {}
        with grpc.insecure_channel(f"unix://{self.pod_resources_socket}") as channel:
            try:
                answer = podresources_rpc.PodResourcesListerStub(channel).List(
                    podresources_pb.ListPodResourcesRequest(), timeout=LIST_TIMEOUT_S)
            except grpc.RpcError as exc:
                raise OwnerRefused(f"the kubelet's PodResources API ({self.pod_resources_socket}) did not answer: "
                                   f"{exc.details() if hasattr(exc, 'details') else exc}") from None
        holders: dict[str, list[tuple[str, str]]] = {}
        for pod in answer.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    for device_id in devices.device_ids:
                        holders.setdefault(device_id.partition("::")[0], []).append((
                            f"pod {pod.namespace}/{pod.name} container {container.name} ({devices.resource_name})",
                            devices.resource_name))
        return holders

    def counted_resource(self) -> str | None:
        """The resource of gpud's gpu_memory units (GET /v1/allocations), counted in the same ledger as the
        claims' shares; None where gpu_memory is off."""
        allocations = self._call("GET", "/v1/allocations", None, "read gpud's gpu_memory resource")
        return allocations.get("resource") if allocations.get("enabled") else None

    def _past_start(self, method: str, path: str, body, ok_statuses: tuple[int, ...] = ()) -> tuple[int, dict]:
        """The answer once gpud is past its start (see STARTING_WAIT_S); any other failure at once."""
        deadline = time.monotonic() + STARTING_WAIT_S
        while True:
            try:
                return self.client.request(method, path, body, ok_statuses=ok_statuses)
            except ApiFailure as exc:
                if exc.code != "starting" or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)  # a poll of gpud while it starts

    def _call(self, method: str, path: str, body, what: str):
        try:
            return self._past_start(method, path, body)[1]
        except ApiFailure as exc:
            raise OwnerRefused(f"gpud refused to {what}: {exc}") from None
        except DaemonUnreachable as exc:
            raise OwnerRefused(f"could not {what}: gpud is unreachable ({exc})") from None

