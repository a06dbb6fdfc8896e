"""Keeps the node's ResourceSlices of this driver equal to what gpud has, as k8s.io/dynamic-resource-allocation
resourceslice/resourceslicecontroller.go does for NVIDIA's driver:
- one pool named after the node, its slices owned by the Node (ownerReference, controller: true), so they
  go with it; `generateName: <index>-<driver>-<node>-` as that controller names them;
- a change of the devices (a MIG layout, a lost GPU, a driver upgrade, a taint) is written with a higher
  pool generation in every slice of the pool: consumers use only the slices of a pool's highest generation
  (resource.k8s.io/v1 types.go ResourcePool.Generation);
- a pool too big for one slice is split (at most 128 devices a slice, 64 when devices carry taints:
  types.go ResourceSliceMaxDevices, ResourceSliceMaxDevicesWithTaintsOrConsumesCounters), each slice
  saying how many the pool has (resourceSliceCount);
- the node's slices are watched (field selectors spec.nodeName and spec.driver): one deleted (the kubelet
  deletes a node's slices when it starts, and a driver's 30 s after the driver disconnects:
  pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go wipeResourceSlices) or changed by someone else is
  written again at once; slices already equal to what gpud has are left alone (a restart of the plugin
  writes nothing), so an idle node costs only its watch.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable

from gpud.base.logs import get_logger
from gpud.dra.kube import DraApi
from gpud.kubernetes.agent import Backoff
from gpud.kubernetes.node_api import KubeError

log = get_logger("dra_plugin")

MAX_DEVICES, MAX_DEVICES_WITH_TAINTS = 128, 64
# A burst of changes (the kubelet's wipe deletes every slice of the node, an XID on 8 GPUs) is written
# once: the publisher waits this long after the first before it compares and writes.
COALESCE_S = 0.05
GENERATE_NAME_MAX = 253 - 5  # the server appends 5 characters (apiserver names.SimpleNameGenerator)


def split_devices(devices: list[dict]) -> list[list[dict]]:
    """The pool's devices in slices of at most the API server's limit (never an empty pool: one slice)."""
    limit = MAX_DEVICES_WITH_TAINTS if any(d.get("taints") for d in devices) else MAX_DEVICES
    return [devices[i:i + limit] for i in range(0, len(devices), limit)] or [[]]


def slice_body(driver: str, node: str, node_uid: str, generation: int, count: int, index: int,
               devices: list[dict]) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": f"{index:05d}-{driver}-{node}-"[:GENERATE_NAME_MAX],
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                          "controller": True}]},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
                 "devices": devices},
    }


def _devices_of(slice_: dict) -> list[dict]:
    return (slice_.get("spec") or {}).get("devices") or []


class SlicePublisher:
    """desired(): the device entries the pool should have now (None: nothing known yet, publish nothing)."""

    def __init__(self, api: DraApi, desired: Callable[[], list[dict] | None]):
        self.api = api
        self.desired = desired
        self.node_uid: str | None = None
        self.slices: dict[str, dict] = {}  # name -> slice, as last seen by the watch or written
        self.resource_version: str | None = None
        self.generation = 0
        self.problem: str | None = None
        self.taints_refused = False  # the API server took no taints (its DRADeviceTaints gate is off)
        self._dirty = asyncio.Event()
        self._dirty.set()

    def changed(self) -> None:
        """gpud's devices or health changed: publish soon."""
        self._dirty.set()

    async def run(self) -> None:
        await asyncio.gather(self._publish_loop(), self._watch_loop())

    # -- publishing --------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._dirty.wait()
            await asyncio.sleep(COALESCE_S)  # fixed time: gathers a burst into one write
            self._dirty.clear()
            try:
                await self.publish()
            except KubeError as exc:
                wait = backoff.next()
                report = log.warning if str(exc) != self.problem else log.debug
                report("slices_not_published", error=str(exc), retry_in_s=round(wait, 1))
                self.problem = str(exc)
                await asyncio.sleep(wait)  # a backoff: the API server refused or is away
                self._dirty.set()
                continue
            backoff.reset()
            self.problem = None

    async def publish(self) -> None:
        desired = self.desired()
        if desired is None:
            return
        if self.node_uid is None:
            self.node_uid = (await self.api.read_node())["metadata"]["uid"]
        if self.taints_refused:
            desired = [{k: v for k, v in d.items() if k != "taints"} for d in desired]
        chunks = split_devices(desired)
        existing = sorted(self.slices.values(), key=lambda s: s["metadata"]["name"])
        current = [_devices_of(s) for s in existing]
        generations = {((s.get("spec") or {}).get("pool") or {}).get("generation", 0) for s in existing}
        counts = {((s.get("spec") or {}).get("pool") or {}).get("resourceSliceCount") for s in existing}
        if (sorted(map(_key, current)) == sorted(map(_key, chunks)) and len(generations) == 1
                and counts == {len(chunks)}):
            return  # already what gpud has (a restart, or an event that changed nothing published)
        self.generation = max([self.generation, *generations]) + 1
        written = []
        for index, devices in enumerate(chunks):
            body = slice_body(self.api.driver, self.api.node_name, self.node_uid, self.generation, len(chunks),
                              index, devices)
            if index < len(existing):
                old = existing[index]
                body["metadata"] = {**copy.deepcopy(old["metadata"]), "ownerReferences": body["metadata"]["ownerReferences"]}
                body["metadata"].pop("generateName", None)
                try:
                    result = await self.api.update_slice(body)
                except KubeError as exc:
                    if exc.status != 404:
                        raise
                    # deleted since it was seen (the watch's DELETED is on its way): made anew
                    self.slices.pop(old["metadata"]["name"], None)
                    result = await self.api.create_slice(slice_body(self.api.driver, self.api.node_name, self.node_uid,
                                                                    self.generation, len(chunks), index, devices))
            else:
                result = await self.api.create_slice(body)
            self._check_taints(devices, result)
            self.slices[result["metadata"]["name"]] = result
            written.append(result["metadata"]["name"])
        for old in existing[len(chunks):]:
            await self.api.delete_slice(old["metadata"]["name"])
            self.slices.pop(old["metadata"]["name"], None)
        log.info("slices_published", generation=self.generation, slices=written, devices=len(desired),
                 tainted=sorted(d["name"] for d in desired if d.get("taints")))

    def _check_taints(self, sent: list[dict], answer: dict) -> None:
        """An API server whose DRADeviceTaints gate is off drops the field (its strategy's dropDisabledFields):
        said once, and taints are left out from then on."""
        if self.taints_refused or not any(d.get("taints") for d in sent):
            return
        if not any(d.get("taints") for d in _devices_of(answer)):
            self.taints_refused = True
            log.warning("device_taints_dropped", consequence="the API server keeps no device taints (its "
                        "DRADeviceTaints feature gate is off): unhealthy devices are told by the health stream "
                        "and gpud's API only")

    # -- watching the node's slices --------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        backoff = Backoff()
        while True:
            try:
                listed = await self.api.list_slices()
                self.slices = {s["metadata"]["name"]: s for s in listed.get("items") or []}
                self.resource_version = listed["metadata"]["resourceVersion"]
                self._dirty.set()
                backoff.reset()
                while True:
                    async for kind, obj in self.api.watch_slices(self.resource_version):
                        self._on_event(kind, obj)
            except KubeError as exc:
                if exc.status != 410:
                    wait = backoff.next()
                    log.warning("slice_watch_failed", error=str(exc), retry_in_s=round(wait, 1))
                    await asyncio.sleep(wait)  # a backoff before listing again

    def _on_event(self, kind: str, obj: dict) -> None:
        self.resource_version = obj.get("metadata", {}).get("resourceVersion") or self.resource_version
        if kind == "BOOKMARK":
            return
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            if self.slices.pop(name, None) is not None:
                log.info("slice_deleted", slice=name, action="publishing again")
                self._dirty.set()
            return
        ours = self.slices.get(name)
        self.slices[name] = obj
        if ours is None or ours.get("metadata", {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
            self._dirty.set()  # someone else's write, or ours echoed: publish() compares and writes only if needed


def _key(devices: list[dict]) -> str:
    return json.dumps(sorted(devices, key=lambda d: d.get("name", "")), sort_keys=True)
