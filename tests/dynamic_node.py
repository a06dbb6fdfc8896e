"""A simulated node whose GPUs are all dynamic (dra.dynamic_mig_gpus: all), driven as Kubernetes drives it:
the pool is what `gpud dra-plugin` publishes of gpud's answers (node_devices, plan_slices), each claim is
allocated from it by the scheduler's structured allocator (structured_allocator.py), and prepared and
unprepared by the plugin's own Preparer against the real gpud process (its owner: gpud's socket).

`agreement()` is what must hold after every step: the GPU's instances are exactly the union of the
prepared claims' (same placements, same UUIDs as when they were made), gpud's dynamic records say the
same, and each instance still runs the process its claim's pod started on it.
"""

from __future__ import annotations

import itertools
import re
import signal
from pathlib import Path

from helpers import GpudProcess
from structured_allocator import Unschedulable, allocate, allocated_claim, claim_document

from gpud.client import Client
from gpud.dra.checkpoint import FILE_NAME, PREPARED, load
from gpud.dra.devices import PARTITION, counter_sets, node_devices
from gpud.dra.owner import GpudOwner
from gpud.dra.prepare import ClaimRef, PoolView, Preparer
from gpud.dra.slices import PoolContent, plan_slices

DRIVER, NODE = "gpu.nvidia.com", "node-1"
# deploy/kubernetes/deviceclasses.yaml (NVIDIA's deviceclass-gpu.yaml and deviceclass-mig.yaml)
CLASSES = {name: {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {
    "expression": f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'"}}]}}
    for name, kind in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig"))}
FIRST_PID = 40000


class DynamicNode:
    def __init__(self, tmp: Path, preset: str, server_minor: int = 36):
        self.tmp = tmp
        (tmp / "cdi").mkdir(exist_ok=True)
        (tmp / "gpud.yaml").write_text(f"mig:\n  layouts_file: {tmp / 'absent.yaml'}\ndra:\n  dynamic_mig_gpus: all\n")
        self.gpud_args = ("--simulate", preset, "--sim-state", str(tmp / "sim.json"), "--config", str(tmp / "gpud.yaml"))
        self.gpud = self._start_gpud()
        self.server_minor = server_minor
        self.claims: dict[str, dict] = {}  # uid -> the claim as allocated
        self.made: dict[str, str] = {}  # uid -> the UUID of the MIG device made for it (one device a claim)
        self.pid_of: dict[str, int] = {}  # uid -> the process its pod runs on that device
        self.placed: dict[str, tuple[str, int, int]] = {}  # uid -> (GPU uuid, GI profile id, start) of its partition
        self.view: PoolView | None = None  # the pool as last read
        self.pids = itertools.count(FIRST_PID)
        self.names = itertools.count()
        self.preparer = self._preparer()

    def _start_gpud(self) -> GpudProcess:
        gpud = GpudProcess(self.tmp, *self.gpud_args)
        gpud.wait_healthy()
        gpud.wait_for(lambda: gpud.client.get("/v1/cdi")["spec"], what="gpud's CDI spec written")
        return gpud

    def _preparer(self) -> Preparer:
        checkpoint, corrupt, _ = load(self.tmp / "plugin" / FILE_NAME, "boot")
        assert corrupt is None
        owner = GpudOwner(Client(self.gpud.socket, timeout=30), self.tmp / "no-pod-resources.sock")
        return Preparer(DRIVER, NODE, self.tmp / "cdi", checkpoint, owner)

    def stop(self) -> None:
        self.gpud.stop()

    # -- what the plugin publishes and the scheduler sees --------------------------------------------

    def pool(self) -> PoolView:
        get = self.gpud.client.get
        claims = get("/v1/claims")
        devices, _ = node_devices(get("/v1/gpus"), get("/v1/node"), None, get("/v1/mig/dynamic"), claims.get("shares"))
        return PoolView({d.name: d for d in devices}, get("/v1/cdi")["spec"])

    def slices(self, view: PoolView) -> list[dict]:
        devices = list(view.devices.values())
        parts = plan_slices(PoolContent([d.slice_entry() for d in devices], [s.entry() for s in counter_sets(devices)]),
                            self.server_minor)
        return [{"metadata": {"name": f"slice-{i}"}, "spec": {
            "driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": len(parts)},
            **part}} for i, part in enumerate(parts)]

    def profiles(self) -> list[str]:
        return sorted({p["name"] for g in self.gpud.client.get("/v1/mig/dynamic")["gpus"] for p in g["profiles"]})

    # -- a pod's claim ---------------------------------------------------------------------------

    def claim(self, profile: str | None) -> dict | None:
        """A claim for a MIG device of `profile` (None: a whole GPU), allocated by the structured allocator;
        None when it finds none (unschedulable on this node)."""
        selectors = [] if profile is None else [{"cel": {
            "expression": f"device.attributes['{DRIVER}'].profile == '{profile}'"}}]
        request = {"name": "r", "exactly": {"deviceClassName": "gpu.nvidia.com" if profile is None else "mig.nvidia.com",
                                           "selectors": selectors}}
        name = re.sub(r"[^a-z0-9]+", "-", f"c{next(self.names)}-{profile or 'gpu'}")
        document = claim_document("default", name, [request])
        view = self.view = self.pool()
        try:
            allocation = allocate(self.slices(view), document, list(self.claims.values()), NODE, CLASSES,
                                  server_version=f"1.{self.server_minor}")
        except Unschedulable:
            return None
        return allocated_claim(document, allocation)

    def prepare(self, claim: dict) -> None:
        """Prepared as the kubelet asks; then its pod starts a process on it (a MIG device made for it)."""
        meta = claim["metadata"]
        view = self.view or self.pool()
        prepared = self.preparer.prepare(ClaimRef(meta["namespace"], meta["name"], meta["uid"]), claim, view)
        self.claims[meta["uid"]] = claim
        device = prepared.devices[0]
        published = view.devices[device.device]
        if published.kind == PARTITION:
            self.placed[meta["uid"]] = (published.gpu_uuid, published.partition.gi_profile_id, published.partition.start)
            self.made[meta["uid"]], self.pid_of[meta["uid"]] = device.uuid, next(self.pids)
            self.gpud.client.request("POST", "/v1/sim/processes", {"gpu": device.uuid, "pids": [self.pid_of[meta["uid"]]]})

    def unprepare(self, uid: str) -> None:
        """Its pod ended (its process with it), then the kubelet unprepares the claim."""
        if uid in self.made:
            self.gpud.client.request("POST", "/v1/sim/processes", {"gpu": self.made[uid], "pids": []})
        meta = self.claims[uid]["metadata"]
        self.preparer.unprepare(ClaimRef(meta["namespace"], meta["name"], uid))
        del self.claims[uid]
        self.made.pop(uid, None)
        self.pid_of.pop(uid, None)
        self.placed.pop(uid, None)

    def restart_gpud(self, sig: int = signal.SIGKILL) -> None:
        self.gpud.stop(sig)
        self.gpud = self._start_gpud()
        self.view = None
        self.preparer.owner = GpudOwner(Client(self.gpud.socket, timeout=30), self.tmp / "no-pod-resources.sock")

    # -- what must hold ------------------------------------------------------------------------

    def agreement(self) -> None:
        gpus = self.gpud.client.get("/v1/gpus")["gpus"]
        dynamic = self.gpud.client.get("/v1/mig/dynamic")
        on_gpus = {m["uuid"]: (g["uuid"], m["gi_profile_id"], m["placement"]["start"], tuple(m["pids"]))
                   for g in gpus for m in g["mig"]["devices"]}
        wanted = {self.made[uid]: placed for uid, placed in self.placed.items()}
        assert {u: where[:3] for u, where in on_gpus.items()} == wanted, (on_gpus, wanted)
        pids = {uuid: where[3] for uuid, where in on_gpus.items()}
        assert pids == {self.made[uid]: (self.pid_of[uid],) for uid in self.made}  # each pod's process still there
        records = {i["uuid"]: i["claim"] for i in dynamic["instances"]}
        assert records == {self.made[uid]: uid for uid in self.made}, (records, self.made)
        checkpoint = self.preparer.checkpoint.claims
        assert set(checkpoint) == set(self.claims) and all(c.state == PREPARED for c in checkpoint.values())
