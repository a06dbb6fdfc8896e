"""The kubelet's PodResources List, read in a thread of its own every `refresh_s` with a deadline, so a
slow, absent or failing kubelet never holds up a scrape or /healthz: a render uses the last answer, and
an answer older than STALE_AFTER_REFRESHES refreshes labels nothing (and GET /v1/gpus/{id}/pods answers
503 instead of it). A failure is logged once until it
changes, and counted (gpud_pod_resources_reads_total).

dcgm-exporter asks the kubelet on every scrape, with a 10 s deadline (kubernetes.go connectionTimeout,
listPods); gpud's scrapes are served from a cache, so it asks on a schedule of its own instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from gpud.base.errors import ErrorKind, GpudError
from gpud.base.lifecycle import Component, Tasks
from gpud.base.logs import get_logger
from gpud.base.samples import Family
from gpud.claims import ClaimRegistry
from gpud.inventory import InventoryService
from gpud.model.inventory import Gpu
from gpud.pod_resources.grpc_unary import GrpcCallError, call
from gpud.pod_resources.holdings import Holding, holdings, pods_holding
from gpud.pod_resources.labels import LabelSets, device_labels
from gpud.pod_resources.messages import MalformedAnswer, Pod, parse_list_answer
from gpud.sharing.service import SharingView

log = get_logger("pod_resources")

# PodResourcesLister's List (api.proto: package v1)
LIST_METHOD = "/v1.PodResourcesLister/List"
# The most an answer may be: grpc-go's default for what a client receives (4 MiB) times four, ~40,000
# containers with a GPU each.
MAX_ANSWER_BYTES = 16 << 20
STALE_AFTER_REFRESHES = 3
OK, FAILED, NO_SOCKET = "ok", "failed", "no_socket"


class PodResourcesReader(Component):
    name = "pod-resources"

    def __init__(self, socket_path: Path | None, inventory: InventoryService, claims: ClaimRegistry,
                 sharing: SharingView, *, refresh_s: float, timeout_s: float):
        self.socket_path = socket_path  # None: not read
        self.inventory, self.claims, self.sharing = inventory, claims, sharing
        self.refresh_s, self.timeout_s = refresh_s, timeout_s
        self.reads = {OK: 0, FAILED: 0, NO_SOCKET: 0}
        self._answer: tuple[int, float, tuple[Pod, ...]] | None = None  # (version, read at, pods)
        self._problem: str | None = None
        self._lock = threading.Lock()  # the counts and the answer, between the thread and the event loop
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # What the fresh answer's containers hold, and their label sets, computed once per (answer, inventory,
        # claims, own resources): a scrape and each GET /v1/gpus/{id}/pods read them, never the answer again.
        self._held: tuple[tuple, tuple[Holding, ...]] | None = None
        self._labels: tuple[tuple, LabelSets] | None = None

    async def start(self, tasks: Tasks) -> None:
        if self.socket_path is None:
            return
        log.info("pod_resources_reading", socket=str(self.socket_path), every_s=self.refresh_s,
                 timeout_s=self.timeout_s)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="pod-resources", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        await asyncio.to_thread(self._thread.join, self.timeout_s + 1.0)  # a List in flight ends by its deadline
        self._thread = None

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.read_once()
            self._stopping.wait(self.refresh_s)

    def read_once(self) -> None:
        assert self.socket_path is not None
        if not self.socket_path.exists():  # no kubelet here (yet): no labels, and nothing is wrong
            self._done(NO_SOCKET, None, f"no socket at {self.socket_path}")
            return
        try:
            pods = parse_list_answer(call(self.socket_path, LIST_METHOD, b"", self.timeout_s, MAX_ANSWER_BYTES))
        except (GrpcCallError, MalformedAnswer) as exc:
            self._done(FAILED, None, f"{type(exc).__name__}: {exc}")
            return
        self._done(OK, pods, None)

    def _done(self, result: str, pods: tuple[Pod, ...] | None, problem: str | None) -> None:
        with self._lock:
            self.reads[result] += 1
            if pods is not None:
                previous = self._answer
                version = previous[0] + (previous[2] != pods) if previous else 1
                self._answer = (version, time.monotonic(), pods)
            said, self._problem = self._problem, problem
        if problem != said:  # once until it changes
            if problem is None:
                log.info("pod_resources_read", socket=str(self.socket_path), pods=len(pods or ()))
            else:
                (log.info if result == NO_SOCKET else log.warning)(
                    "pod_resources_unread", socket=str(self.socket_path), reason=problem,
                    retry_every_s=self.refresh_s, labels="the last answer's until it is "
                    f"{self.refresh_s * STALE_AFTER_REFRESHES:g} s old, then none")

    # -- the event loop --------------------------------------------------------------------------

    def _fresh(self) -> tuple[int, float, tuple[Pod, ...]] | None:
        answer = self._answer
        if answer is None or time.monotonic() - answer[1] > self.refresh_s * STALE_AFTER_REFRESHES:
            return None
        return answer

    def state(self) -> tuple[int, bool]:
        """What the labels depend on besides the inventory and the claims (the metrics cache's key): the
        answer's version, and whether it is fresh."""
        answer = self._answer
        return (answer[0] if answer else 0), self._fresh() is not None

    def _holdings(self) -> tuple[tuple, tuple[Holding, ...]] | None:
        """(its key, what the containers hold) from the last answer while it is fresh."""
        answer, inventory = self._fresh(), self.inventory.current
        if answer is None or inventory is None:
            return None
        holds, own = tuple(self.claims.holds.values()), self._own_resources()
        key = (answer[0], inventory, holds, own)
        if self._held is None or self._held[0] != key:
            self._held = (key, tuple(holdings(answer[2], inventory, holds, own)))
        return self._held

    def labels(self) -> LabelSets:
        """The label sets of each device's series, from the last answer while it is fresh."""
        held = self._holdings()
        if held is None:
            return {}
        if self._labels is None or self._labels[0] != held[0]:
            self._labels = (held[0], device_labels(held[1]))
        return self._labels[1]

    def pods_holding(self, gpu: Gpu) -> tuple[float, list[dict]]:
        """The age of the last answer and the pods it says hold the GPU or its MIG devices (GET
        /v1/gpus/{id}/pods); GpudError (unavailable) pod-resources-unavailable, saying why, without a
        fresh answer."""
        held, answer = self._holdings(), self._answer
        if held is None or answer is None:
            raise GpudError(ErrorKind.UNAVAILABLE, "pod-resources-unavailable",
                            f"gpud has no fresh answer from the kubelet's PodResources API: {self._why_unanswered()}")
        return time.monotonic() - answer[1], pods_holding(gpu, held[1])

    def _why_unanswered(self) -> str:
        if self.socket_path is None:
            return ("not configured (metrics.pod_resources_socket is empty, or unset on a simulated node: "
                    "set it to the kubelet's pod-resources/kubelet.sock)")
        answer, problem, said = self._answer, self._problem, []
        if answer is not None:
            said.append(f"the last answer is {time.monotonic() - answer[1]:.0f} s old (stale after "
                        f"{self.refresh_s * STALE_AFTER_REFRESHES:g} s)")
        elif problem is None:
            said.append(f"not read yet from {self.socket_path}")
        if problem is not None:
            said.append(f"the last read: {problem}")
        return f"{'; '.join(said)} (read every {self.refresh_s:g} s)"

    def _own_resources(self) -> frozenset[str]:
        """The resources gpud's own device plugin serves (renamed, shared, gpu-memory)."""
        document = self.sharing.document or {}
        return frozenset(resource["name"] for resource in document.get("resources", ()))

    def collect(self) -> Iterable[Family]:
        if self.socket_path is None:
            return
        reads = Family("gpud_pod_resources_reads_total",
                       "Reads of the kubelet's PodResources List for the Kubernetes labels, by result: ok, "
                       "failed (the kubelet did not answer in time, or not well), no_socket.", "counter")
        with self._lock:
            for result, count in self.reads.items():
                reads.add({"result": result}, count)
        yield reads
        fresh = Family("gpud_pod_resources_fresh", "1 while the Kubernetes labels come from a List answer "
                       f"younger than {STALE_AFTER_REFRESHES} refreshes; 0: no labels are written.", "gauge")
        fresh.add({}, float(self._fresh() is not None))
        yield fresh
        answer = self._answer
        if answer is not None:
            age = Family("gpud_pod_resources_answer_age_seconds",
                         "Seconds since the kubelet's last PodResources List answer.", "gauge")
            age.add({}, round(time.monotonic() - answer[1], 3))
            yield age
