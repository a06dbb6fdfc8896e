"""Keeps the node's ResourceSlices of this driver equal to what gpud has, as k8s.io/dynamic-resource-allocation
resourceslice/resourceslicecontroller.go does for NVIDIA's driver:
- one pool named after the node, its slices owned by the Node (ownerReference, controller: true), so they
  go with it; `generateName: <index>-<driver>-<node>-` as that controller names them;
- a change of the devices (a MIG layout, a lost GPU, a driver upgrade, a taint) is written with a higher
  pool generation in every slice of the pool: consumers use only the slices of a pool's highest generation
  (resource.k8s.io/v1 types.go ResourcePool.Generation);
- a pool too big for one slice is split (at most 128 devices a slice, 64 when devices carry taints or
  consume counters: k8s.io/api resource/v1 types.go v0.35.0 ResourceSliceMaxDevices,
  ResourceSliceMaxDevicesWithTaintsOrConsumesCounters; 64 with taints is kept for 1.34 too), each slice
  saying how many the pool has (resourceSliceCount);
- dynamic MIG GPUs' counter sets (KEP-4815) in the form of the server's version, as NVIDIA's driver
  chooses it (cmd/gpu-kubelet-plugin/driver.go shouldUseSplitResourceSlices): for 1.34 each set in one
  slice with the devices that consume it (generateCombinedResourceSlices; v0.34.0 validates a device's
  counters against its own slice's sets, at most 32 shared counters a slice: ResourceSliceMaxSharedCounters),
  for 1.35+ slices of counter sets apart from the device slices ("Only one of Devices and SharedCounters
  can be set in a ResourceSlice", v0.35.0; at most 8 sets a slice, ResourceSliceMaxCounterSets, each of at
  most 32 counters, ResourceSliceMaxCountersPerCounterSet: generateSplitResourceSlices);
- fields of a gate the server has off are dropped by it (resourceslice/strategy.go dropDisabledFields):
  seen in its answer, said once, and left out from then on (taints, shares' allowMultipleAllocations and
  request policies; counters: `desired` is asked again and leaves out what needs them);
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
from dataclasses import dataclass, field

from gpud.base.logs import get_logger
from gpud.dra.kube import DraApi
from gpud.kubernetes.agent import Backoff
from gpud.kubernetes.node_api import KubeError

log = get_logger("dra_plugin")

MAX_DEVICES, MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 128, 64
MAX_COUNTER_SETS = 8  # 1.35+ (in 1.34 a GPU's set goes in its devices' slice: one set a slice)
SPLIT_SINCE_MINOR = 35  # the first minor version that takes no counter sets beside devices
# A burst of changes (the kubelet's wipe deletes every slice of the node, an XID on 8 GPUs) is written
# once: the publisher waits this long after the first before it compares and writes.
COALESCE_S = 0.05
GENERATE_NAME_MAX = 253 - 5  # the server appends 5 characters (apiserver names.SimpleNameGenerator)


@dataclass(frozen=True)
class PoolContent:
    """What the pool should hold: device entries (spec.devices[]) and counter sets (spec.sharedCounters[])."""

    devices: list[dict]
    counter_sets: list[dict] = field(default_factory=list)


def split_devices(devices: list[dict]) -> list[list[dict]]:
    """Devices in slices of at most the API server's limit."""
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if advanced else MAX_DEVICES
    return [devices[i:i + limit] for i in range(0, len(devices), limit)]


def plan_slices(content: PoolContent, server_minor: int) -> list[dict]:
    """The specs' contents of the pool's slices ({"devices": [...]}, {"sharedCounters": [...]} or, for
    1.34, both) in the form the server takes; never none (an empty pool: one slice without devices)."""
    sets = content.counter_sets
    if server_minor >= SPLIT_SINCE_MINOR:
        parts = [{"sharedCounters": sets[i:i + MAX_COUNTER_SETS]} for i in range(0, len(sets), MAX_COUNTER_SETS)]
        others = content.devices
    else:
        consumers: dict[str, list[dict]] = {s["name"]: [] for s in sets}
        others = []
        for device in content.devices:
            consumed = [c["counterSet"] for c in device.get("consumesCounters") or []]
            (consumers[consumed[0]] if consumed and consumed[0] in consumers else others).append(device)
        parts = [{"sharedCounters": [s], "devices": consumers[s["name"]]} for s in sets]
    return parts + [{"devices": chunk} for chunk in split_devices(others) or ([] if parts else [[]])]


def slice_body(driver: str, node: str, node_uid: str, generation: int, count: int, index: int,
               part: dict) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": f"{index:05d}-{driver}-{node}-"[:GENERATE_NAME_MAX],
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                          "controller": True}]},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
                 **part},
    }


def _devices_of(slice_: dict) -> list[dict]:
    return (slice_.get("spec") or {}).get("devices") or []


def _counter_sets_of(slice_: dict) -> list[dict]:
    return (slice_.get("spec") or {}).get("sharedCounters") or []


class SlicePublisher:
    """desired(): what the pool should have now (None: nothing known yet, publish nothing); asked again
    once `counters_refused`, it must leave out counters and what cannot go without them."""

    def __init__(self, api: DraApi, desired: Callable[[], PoolContent | None], server_minor: int = 34):
        self.api = api
        self.desired = desired
        self.server_minor = server_minor
        self.node_uid: str | None = None
        self.slices: dict[str, dict] = {}  # name -> slice, as last seen by the watch or written
        self.resource_version: str | None = None
        self.generation = 0
        self.problem: str | None = None
        self.taints_refused = False  # the API server took no taints (its DRADeviceTaints gate is off)
        self.counters_refused = False  # ... no counters (DRAPartitionableDevices off)
        self.shares_refused = False  # ... no allowMultipleAllocations (DRAConsumableCapacity off)
        self._dirty = asyncio.Event()
        self._dirty.set()

    def changed(self) -> None:
        """gpud's devices or health changed: publish soon."""
        self._dirty.set()

    def use_server_minor(self, minor: int) -> None:
        """The API server's minor version, learnt before the publisher runs: the form of the slices."""
        self.server_minor = minor

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
        content = self.desired()
        if content is None:
            return
        if self.node_uid is None:
            self.node_uid = (await self.api.read_node())["metadata"]["uid"]
        parts = plan_slices(PoolContent([self._without_refused(d) for d in content.devices], content.counter_sets),
                            self.server_minor)
        existing = sorted(self.slices.values(), key=lambda s: s["metadata"]["name"])
        generations = {((s.get("spec") or {}).get("pool") or {}).get("generation", 0) for s in existing}
        counts = {((s.get("spec") or {}).get("pool") or {}).get("resourceSliceCount") for s in existing}
        if (sorted(_key(_devices_of(s), _counter_sets_of(s)) for s in existing)
                == sorted(_key(p.get("devices") or [], p.get("sharedCounters") or []) for p in parts)
                and len(generations) == 1 and counts == {len(parts)}):
            return  # already what gpud has (a restart, or an event that changed nothing published)
        self.generation = max([self.generation, *generations]) + 1
        written = []
        for index, part in enumerate(parts):
            body = slice_body(self.api.driver, self.api.node_name, self.node_uid, self.generation, len(parts),
                              index, part)
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
                                                                    self.generation, len(parts), index, part))
            else:
                result = await self.api.create_slice(body)
            self._check_dropped(part, result)
            self.slices[result["metadata"]["name"]] = result
            written.append(result["metadata"]["name"])
        for old in existing[len(parts):]:
            await self.api.delete_slice(old["metadata"]["name"])
            self.slices.pop(old["metadata"]["name"], None)
        devices = [d for p in parts for d in p.get("devices") or []]
        log.info("slices_published", generation=self.generation, slices=written, devices=len(devices),
                 counter_sets=sum(len(p.get("sharedCounters") or []) for p in parts),
                 tainted=sorted(d["name"] for d in devices if d.get("taints")))

    def _without_refused(self, device: dict) -> dict:
        """A device entry without the fields the server was seen to drop."""
        if self.taints_refused and "taints" in device:
            device = {k: v for k, v in device.items() if k != "taints"}
        if self.shares_refused and "allowMultipleAllocations" in device:
            device = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
            device["capacity"] = {name: {k: v for k, v in capacity.items() if k != "requestPolicy"}
                                  for name, capacity in device["capacity"].items()}
        return device

    def _check_dropped(self, sent: dict, answer: dict) -> None:
        """An API server whose gate of a field is off drops the field (its strategy's dropDisabledFields):
        said once, and the field is left out from then on."""
        devices, answered = sent.get("devices") or [], _devices_of(answer)
        if not self.taints_refused and any(d.get("taints") for d in devices) \
                and not any(d.get("taints") for d in answered):
            self.taints_refused = True
            log.warning("device_taints_dropped", consequence="the API server keeps no device taints (its "
                        "DRADeviceTaints feature gate is off): unhealthy devices are told by the health stream "
                        "and gpud's API only")
        if not self.shares_refused and any(d.get("allowMultipleAllocations") for d in devices) \
                and not any(d.get("allowMultipleAllocations") for d in answered):
            self.shares_refused = True
            self._dirty.set()
            log.warning("shared_devices_dropped", consequence="the API server keeps no allowMultipleAllocations "
                        "(its DRAConsumableCapacity feature gate is off): a shared GPU goes to one claim at a time")
        sent_counters = sent.get("sharedCounters") or any(d.get("consumesCounters") for d in devices)
        if not self.counters_refused and sent_counters \
                and not (_counter_sets_of(answer) or any(d.get("consumesCounters") for d in answered)):
            self.counters_refused = True
            self._dirty.set()
            log.error("counters_dropped", consequence="the API server keeps no counters (its DRAPartitionableDevices "
                      "feature gate is off): dynamic MIG GPUs are published whole, without MIG partitions")

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


def _key(devices: list[dict], counter_sets: list[dict]) -> str:
    return json.dumps([sorted(devices, key=lambda d: d.get("name", "")),
                       sorted(counter_sets, key=lambda c: c.get("name", ""))], sort_keys=True)
