"""The agent's remediation loop: a GPU that needs a reset goes back to service without a person.

Opt-in (gpud.yaml `remediation.enabled`, read from GET /v1/remediation). Steps, each an Event on the
Node, a log line and a line of `gpud kubernetes`:
1. the node is tainted (the agent's nvidia.com/gpu.unhealthy) so nothing new lands on it;
2. it waits for one of the pool's `remediation.max_nodes` slots (gpud/kubernetes/leases.py);
3. draining: the pods that use the GPU (gpud's GET /v1/gpus/{id}/pods, from the kubelet's PodResources)
   or, with `evict: node`, every pod kubectl drain would evict, go through the Eviction API, so a
   PodDisruptionBudget that forbids it (429) is waited on, never forced; a pod with the opt-out
   annotation is waited for, never evicted;
4. resetting: gpud resets the GPU (never forced, within its hourly reset budget) and checks it
   (POST /v1/gpus/{id}/remediate); only a passing check ends the loop, and with it the taint;
5. anything else escalates: the node stays tainted, GPUHealthy says what a person must do, the slot is
   given back, and (`reboot_marker`) the node is marked for a reboot manager.
The loop's state lives in the Node's annotation nvidia.com/gpu.remediation, written at each step, so a
restarted agent (or gpud, or the node's pod) resumes where it was. A person ends an escalation by
removing that annotation; the agent ends it itself once the GPUs are healthy and a check passes (after
a reboot, say).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud.base import bounded_json
from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.client import ApiFailure, DaemonUnreachable
from gpud.kubernetes.health import MESSAGE_LIMIT, Verdict
from gpud.kubernetes.leases import WHOLE_CLUSTER, LeaseSlots
from gpud.kubernetes.node_api import KubeError

if TYPE_CHECKING:
    from gpud.kubernetes.agent import Agent

log = get_logger("k8s_agent")

ANNOTATION = "nvidia.com/gpu.remediation"
REBOOT_ANNOTATION = "nvidia.com/gpu.reboot-required"
RESET = "reset-gpu"
NEEDS_A_PERSON = {"reboot": "reboot the node", "inspect-hardware": "have the GPU's hardware inspected"}
WAITING, DRAINING, RESETTING, ESCALATED = "waiting-for-slot", "draining", "resetting", "escalated"
STEPS = (WAITING, DRAINING, RESETTING, ESCALATED)
TICK_S = 5.0  # while a remediation is under way: slots, evictions and pods are looked at this often
# kubectl drain retries an eviction a PodDisruptionBudget refused every 5 s (k8s.io/kubectl pkg/drain/drain.go
# evictPods: apierrors.IsTooManyRequests -> time.Sleep(5 * time.Second)); the tick does the same.
RECHECK_S = 300.0  # an escalated node whose GPUs look healthy again is checked at most this often
PASS_SPACING_S = 1.0  # gpud's own events (a remediation's answer is one) wake the loop: not more often than this
HISTORY = 20  # the last steps shown in `gpud kubernetes`
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"  # a static pod's API mirror: not evictable (kubectl drain)
TERMINAL = ("Succeeded", "Failed")


def gpu_actions(health: dict) -> tuple[list[dict], list[dict]]:
    """The GPUs (index, uuid, action, why) that a reset mends, and those that need a person: by the `remedy`
    gpud's health gives each, as gpud's POST /v1/gpus/{id}/remediate decides it (the driver's recovery
    action, where it reports one, deciding reset or reboot)."""
    resets, person = [], []
    for gpu in health.get("gpus") or []:
        remedy = gpu.get("remedy")
        if remedy != RESET and remedy not in NEEDS_A_PERSON:
            continue
        reasons = list(gpu.get("reasons") or [])
        for mig in gpu.get("mig_devices") or []:
            reasons += mig.get("reasons") or []
        said = "; ".join(dict.fromkeys(f"{r.get('message') or r.get('code')}" for r in reasons
                                       if r.get("action") in (RESET, *NEEDS_A_PERSON)))
        entry = {"index": gpu.get("index"), "uuid": gpu.get("uuid"), "action": remedy, "why": said[:300]}
        (resets if remedy == RESET else person).append(entry)
    return resets, person


def _named(gpus: list[dict]) -> str:
    return ", ".join(f"GPU {g['index']}" for g in gpus)


def _pod_key(pod: dict) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


# The loop's state as the annotation holds it: each key and the types it may have.
STATE_KEYS = {"step": (str,), "gpus": (list,), "why": (str,), "since": (int, float), "step_since": (int, float),
              "lease": (str, type(None)), "detail": (str, type(None)), "passed": (list,)}


def state_from_annotation(raw: str) -> dict | None:
    """The loop's state from the Node's annotation, or None when it is not one the agent wrote (anyone who
    may edit the Node can write it: up to the API server's 256 KiB of annotations, nested at will)."""
    try:
        state = bounded_json.loads(raw, what=f"annotation {ANNOTATION}")
    except ValueError:
        return None
    if not isinstance(state, dict) or any(not isinstance(state.get(key), types) for key, types in STATE_KEYS.items()):
        return None
    if state["step"] not in STEPS or not all(isinstance(g, dict) and isinstance(g.get("uuid"), str)
                                             and isinstance(g.get("index"), int) for g in state["gpus"]):
        return None
    if not all(isinstance(uuid, str) for uuid in state["passed"]):
        return None
    if not isinstance(state.get("drain_since", 0), (int, float)):  # written once draining began
        return None
    return state


def _opted_out(pod: dict, annotation: str | None) -> bool:
    """remediation.opt_out_annotation set to "true" on the pod: waited for, never evicted."""
    return bool(annotation) and ((pod.get("metadata") or {}).get("annotations") or {}).get(annotation) == "true"


def drainable(pod: dict) -> bool:
    """What kubectl drain evicts (k8s.io/kubectl pkg/drain/filters.go): not a DaemonSet's pod (it would
    come back at once), not a mirror pod, not one already ended."""
    meta = pod.get("metadata") or {}
    if MIRROR_ANNOTATION in (meta.get("annotations") or {}):
        return False
    if any(owner.get("kind") == "DaemonSet" for owner in meta.get("ownerReferences") or []):
        return False
    return (pod.get("status") or {}).get("phase") not in TERMINAL


class Remediation:
    def __init__(self, agent: "Agent"):
        self.agent = agent
        self.api = agent.api
        self.policy: dict[str, Any] = {"enabled": False}
        self.state: dict[str, Any] | None = None  # as in the Node's annotation
        self._loaded = False  # the annotation has been read from the Node
        self.wake = asyncio.Event()
        self._said: set[tuple[str, str]] = set()  # (reason, subject) already an Event in this remediation
        self._dry_plan: tuple | None = None
        self._last_check = 0.0
        self._recovered = False  # an escalated node's GPUs were seen sick: their recovery is checked at once
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.counts: collections.Counter[str] = collections.Counter()
        self._slot_cache: tuple[tuple, LeaseSlots] | None = None
        self._saved_version = 0  # the Node's resourceVersion after the agent last wrote the annotation

    # -- what the rest of the agent asks --------------------------------------------------------------

    def holds_taint(self) -> bool:
        return self.state is not None

    def condition(self, seen: Verdict) -> Verdict:
        """GPUHealthy while a remediation is under way or escalated: says so, and what a person must do."""
        if self.state is None:
            return seen
        if self.state["step"] == ESCALATED:
            message = f"remediation of {_named(self.state['gpus'])} escalated: {self.state.get('detail')}"
            reason = "GPURemediationFailed"
        else:
            message = f"remediating {_named(self.state['gpus'])} ({self.state['step']}): {self.state['why']}"
            reason = "GPURemediationInProgress"
        message = f"{message}; {seen.message}" if seen.status != "True" else message
        if len(message) > MESSAGE_LIMIT:
            message = message[:MESSAGE_LIMIT - 1] + "…"
        return Verdict("False", reason, message, taint=True)

    # -- the loop ------------------------------------------------------------------------------------

    async def run(self) -> None:
        from gpud.kubernetes.agent import Backoff

        backoff = Backoff()
        while True:
            try:
                await within(self.wake.wait(), TICK_S if self.state or not self._loaded else None)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            if self.agent.node is None:
                continue
            try:
                await self._pass()
                backoff.reset()
                if self.state is not None:
                    await asyncio.sleep(PASS_SPACING_S)
            except DaemonUnreachable as exc:
                self._note(detail=f"gpud unreachable: {exc}")
                await asyncio.sleep(backoff.next())
                self.wake.set()
            except KubeError as exc:
                self.agent._kube_failed("remediate", exc)
                await asyncio.sleep(backoff.next())
                self.wake.set()

    async def _pass(self) -> None:
        try:
            self.policy = (await self.agent._gpud("GET", "/v1/remediation")).get("policy") or {}
        except ApiFailure as exc:
            if exc.status != 404:  # 404: a gpud from before remediation: it is off
                raise DaemonUnreachable(str(exc)) from None
            self.policy = {"enabled": False}
        if not self._loaded:
            self._load()
        elif self._cleared_by_a_person():
            await self._end("RemediationCleared", "Normal", f"{ANNOTATION} removed from the Node: the escalated "
                            f"remediation of {_named(self.state['gpus'])} is over; it starts again if gpud still "
                            "says a GPU needs a reset")
        if not self.policy.get("enabled"):
            if self.state is not None:
                await self._end("RemediationCancelled", "Normal", "remediation.enabled is off: the remediation "
                                f"of {_named(self.state['gpus'])} stops where it was ({self.state['step']})")
            self._note()
            return
        resets, person = gpu_actions(await self.agent._gpud("GET", "/v1/health"))
        if self.policy.get("dry_run"):
            await self._dry_run(resets, person)
            return
        self._dry_plan = None
        if self.state is None:
            if not resets and not person:
                self._note()
                return
            await self._start(resets, person)
        step = self.state["step"]
        if step == ESCALATED and self.state.get("cause") == "needs-a-person" and resets and not person:
            # The driver's recovery action came after the XID's reboot (it is read on the next health pass),
            # or a person's look changed the picture: a reset mends it now, so the loop starts over.
            await self._mark_reboot(None)
            await self._event("Normal", "RemediationRetried", f"{_named(resets)}: a GPU reset mends it now "
                              "(the driver's recovery action says so): remediating")
            self.state = None
            await self._start(resets, [])
            step = self.state["step"]
        if step == WAITING:
            await self._waiting()
        if self.state and self.state["step"] == DRAINING:
            await self._draining()
        if self.state and self.state["step"] == RESETTING:
            await self._resetting()
        if self.state and self.state["step"] == ESCALATED and step == ESCALATED:
            await self._escalated(resets, person)

    def _cleared_by_a_person(self) -> bool:
        """An escalation whose annotation someone removed, in a Node newer than the agent's last write (a
        watch event from before that write must not count)."""
        if self.state is None or self.state["step"] != ESCALATED:
            return False
        if ANNOTATION in self._annotations():
            return False
        return int(((self.agent.node or {}).get("metadata") or {}).get("resourceVersion") or 0) > self._saved_version

    def _load(self) -> None:
        self._loaded = True
        raw = self._annotations().get(ANNOTATION)
        if raw is None:
            return
        state = state_from_annotation(raw)
        if state is None:
            log.error("remediation_annotation_unreadable", node=self.agent.node_name, annotation=ANNOTATION,
                      value=raw[:200], doing="starting over from gpud's health")
            return
        self.state = state
        log.info("remediation_resumed", node=self.agent.node_name, step=state["step"], gpus=state["gpus"])
        self._step_history(state["step"], "resumed after a restart of the agent")

    # -- steps ---------------------------------------------------------------------------------------

    async def _start(self, resets: list[dict], person: list[dict]) -> None:
        now = time.time()
        gpus = person or resets
        why = "; ".join(f"GPU {g['index']}: {g['why']} ({g['action']})" for g in gpus)
        self.state = {"step": WAITING, "gpus": [{"index": g["index"], "uuid": g["uuid"]} for g in gpus],
                      "why": why, "since": now, "step_since": now, "lease": None, "detail": None, "passed": []}
        self._said.clear()
        self.counts["started"] += 1
        await self.agent._publish_health()  # tainted before anything else: nothing new lands meanwhile
        if person:
            self.state["cause"] = "needs-a-person"
            what = " and ".join(sorted({NEEDS_A_PERSON[g["action"]] for g in person}))
            await self._escalate(f"{why}: a reset cannot help; {what}")
            return
        await self._save()
        await self._event("Warning", "RemediationStarted", f"{_named(gpus)} needs a reset ({why}): the node is "
                          "tainted; the pods that use it are evicted once a remediation slot is free")

    def _slots(self) -> LeaseSlots:
        pool_label = self.policy.get("pool_label")
        labels = (self.agent.node or {}).get("metadata", {}).get("labels") or {}
        pool = (labels.get(pool_label) if pool_label else None) or WHOLE_CLUSTER
        slots = self._slot_cache
        key = (self.policy.get("lease_namespace"), pool, int(self.policy.get("max_nodes") or 1),
               int(self.policy.get("lease_duration_s") or 60))
        if slots is None or slots[0] != key:
            slots = (key, LeaseSlots(self.api, key[0], pool, key[2], key[3]))
            self._slot_cache = slots
        return slots[1]

    async def _waiting(self) -> None:
        slots = self._slots()
        name = await slots.take_a_slot(self.state.get("lease"))
        if name is None:
            await self._once("Normal", "RemediationWaitingForSlot", "slots",
                             f"all {slots.slots} remediation slots of pool {slots.pool!r} are held by other nodes "
                             f"(remediation.max_nodes): waiting for one")
            self._note(detail=f"waiting for one of {slots.slots} slots of pool {slots.pool!r}")
            return
        self.state["lease"] = name
        self.state.setdefault("drain_since", time.time())
        await self._step(DRAINING, f"took slot {slots.namespace}/{name}")
        await self._event("Normal", "RemediationDraining", f"slot {name} taken: evicting the pods that use "
                          f"{_named(self.state['gpus'])} ({self.policy.get('evict', 'gpu')} policy)")

    async def _holding(self) -> bool:
        """Renews the slot; False (and back to waiting) when it was lost."""
        if await self._slots().renew(self.state["lease"]):
            return True
        await self._event("Warning", "RemediationSlotLost", f"slot {self.state['lease']} expired and another node "
                          "took it: waiting for a slot again before going on")
        self.state["lease"] = None
        await self._step(WAITING, "the slot was lost")
        return False

    async def _pods_in_the_way(self, gpus: list[dict]) -> tuple[list[dict], list[str]]:
        """The pod objects to evict or wait for, and what holds these GPUs that no pod object explains."""
        pods = await self.api.list_pods()
        if self.policy.get("evict") == "node":
            return [pod for pod in pods if drainable(pod)], []
        by_key = {_pod_key(pod): pod for pod in pods}
        found, unexplained = {}, []
        for gpu in gpus:
            try:
                document = await self.agent._gpud("GET", f"/v1/gpus/{gpu['uuid']}/pods")
            except ApiFailure as exc:
                unexplained.append(f"gpud cannot say which pods use GPU {gpu['index']}: {exc}")
                continue
            for entry in document.get("pods") or []:
                key = (entry.get("namespace", ""), entry.get("name", ""))
                pod = by_key.get(key)
                if pod is None:
                    unexplained.append(f"pod {key[0]}/{key[1]} (gone from the API, its containers still hold "
                                       f"GPU {gpu['index']})")
                elif (pod.get("status") or {}).get("phase") not in TERMINAL:
                    found[key] = pod
        return [found[key] for key in sorted(found)], unexplained

    async def _draining(self) -> None:
        if not await self._holding():
            return
        pods, waiting = await self._pods_in_the_way(self.state["gpus"])
        annotation = self.policy.get("opt_out_annotation")
        grace = self.policy.get("grace_period_s")
        for pod in pods:
            namespace, name = _pod_key(pod)
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                waiting.append(f"pod {namespace}/{name} (terminating)")
                continue
            if _opted_out(pod, annotation):
                waiting.append(f"pod {namespace}/{name} (opted out with {annotation}: waited for)")
                await self._once("Normal", "RemediationWaitingForPod", f"{namespace}/{name}",
                                 f"pod {namespace}/{name} carries {annotation}=true: it is waited for, never evicted")
                continue
            try:
                await self.api.evict(namespace, name, grace)
            except KubeError as exc:
                if exc.status == 404:
                    continue
                if exc.status == 429:
                    waiting.append(f"pod {namespace}/{name} (a disruption budget forbids its eviction for now)")
                    self.counts["evictions_refused"] += 1
                    await self._once("Warning", "RemediationEvictionBlocked", f"{namespace}/{name}",
                                     f"pod {namespace}/{name}: {exc.message}; retried every {TICK_S:g} s")
                    continue
                raise
            self.counts["evictions"] += 1
            waiting.append(f"pod {namespace}/{name} (evicted)")
            await self._event("Normal", "RemediationEvicted", f"pod {namespace}/{name} evicted: it uses "
                              f"{_named(self.state['gpus'])}")
        if waiting:
            self._note(detail="waiting for " + ", ".join(waiting))
            await self._past_drain_timeout("still held: " + ", ".join(waiting))
            return
        await self._step(RESETTING, "no pod uses the GPUs any more")
        await self._once("Normal", "RemediationResetting", "reset", f"{_named(self.state['gpus'])} free: resetting "
                         "and checking")

    async def _past_drain_timeout(self, what: str) -> bool:
        """Escalates (True) once the GPUs have not been free for drain_timeout_s since draining began."""
        limit = float(self.policy.get("drain_timeout_s") or 3600)
        if time.time() - self.state.get("drain_since", self.state["step_since"]) < limit:
            return False
        await self._escalate(f"the GPUs were not free after {limit:g} s (remediation.drain_timeout_s): {what}; "
                             "end those workloads, or reset the GPU by hand")
        return True

    async def _resetting(self) -> None:
        if not await self._holding():
            return
        for gpu in self.state["gpus"]:
            if gpu["uuid"] in self.state["passed"]:
                continue
            try:
                result = await self._remediate(gpu)
            except ApiFailure as exc:
                if exc.code == "reset-blocked":  # a pod the kubelet had not reported yet, or a process outside pods
                    self._note(detail=f"GPU {gpu['index']}: {exc}")
                    if not await self._past_drain_timeout(str(exc)):
                        await self._step(DRAINING, f"GPU {gpu['index']} still held: draining again")
                    return
                if exc.code == "reset-budget-spent":
                    self._note(detail=f"GPU {gpu['index']}: {exc}")
                    await self._once("Warning", "RemediationWaitingForBudget", gpu["uuid"], str(exc))
                    return
                if exc.status == 503:
                    raise DaemonUnreachable(str(exc)) from None
                self.counts["resets_refused"] += 1
                todo = NEEDS_A_PERSON.get(exc.error.get("action"), "reset the GPU by hand or reboot the node")
                await self._escalate(f"GPU {gpu['index']}: gpud refused the reset: {exc}; {todo}")
                return
            self.counts["resets"] += bool(result.get("reset"))
            check = result.get("check") or {}
            if not check.get("passed"):
                await self._escalate(f"GPU {gpu['index']}: the check after the reset failed ({check.get('how')}): "
                                     + "; ".join(check.get("problems") or ["no reason given"])
                                     + "; reboot the node, and have the GPU inspected if that does not help")
                return
            self.state["passed"].append(gpu["uuid"])
            await self._save()
        self.counts["succeeded"] += 1
        await self._end("RemediationSucceeded", "Normal", f"{_named(self.state['gpus'])} reset and checked: back "
                        "in service, the taint removed")

    async def _escalated(self, resets: list[dict], person: list[dict]) -> None:
        """Ends once the GPUs are healthy again (a reboot, a person's reset) and a check passes: checked as
        soon as they turn healthy, and while they stay so (a failed check) every RECHECK_S."""
        if resets or person:
            self._recovered = True  # the next healthy pass is a recovery: checked at once
            return
        if not self._recovered and time.monotonic() - self._last_check < RECHECK_S:
            return
        self._recovered = False
        self._last_check = time.monotonic()
        for gpu in self.state["gpus"]:
            try:
                result = await self._remediate(gpu)
            except ApiFailure as exc:
                self._note(detail=f"{self.state['detail']} (re-check: {exc})")
                return
            if not (result.get("check") or {}).get("passed"):
                return
        await self._end("RemediationSucceeded", "Normal", f"{_named(self.state['gpus'])} healthy again and checked: "
                        "back in service, the taint removed")

    async def _remediate(self, gpu: dict) -> dict:
        """gpud's POST /v1/gpus/{id}/remediate: a reset where one is due, and the check after it."""
        return await self.agent._gpud("POST", f"/v1/gpus/{gpu['uuid']}/remediate", {"requester": "k8s-agent"},
                                      self.agent.gpud_apply)

    async def _escalate(self, detail: str) -> None:
        self.counts["escalated"] += 1
        if self.state.get("lease"):
            await self._slots().release(self.state["lease"])
            self.state["lease"] = None
        self.state["detail"] = detail
        self._last_check = time.monotonic()
        await self._step(ESCALATED, detail)
        await self._mark_reboot(detail)
        await self.agent._publish_health()  # the condition says it before the Event does
        await self._event("Warning", "RemediationEscalated", detail)

    async def _end(self, reason: str, event_type: str, message: str) -> None:
        if self.state.get("lease"):
            await self._slots().release(self.state["lease"])
        self._step_history("done", message)
        self.state = None
        self._said.clear()
        await self._save()
        await self._mark_reboot(None)
        await self.agent._publish_health()  # untainted before the Event says so
        await self._event(event_type, reason, message)

    # -- dry run -------------------------------------------------------------------------------------

    async def _dry_run(self, resets: list[dict], person: list[dict]) -> None:
        plan_key = (tuple(g["uuid"] for g in resets), tuple(g["uuid"] for g in person), self.policy.get("evict"))
        if plan_key == self._dry_plan:
            return
        self._dry_plan = plan_key
        steps = []
        if person:
            steps.append(f"taint the node and escalate {_named(person)}: "
                         + "; ".join(f"{g['why']} ({NEEDS_A_PERSON[g['action']]})" for g in person))
        elif resets:
            slots = self._slots()
            steps.append(f"taint the node ({_named(resets)} needs a reset)")
            steps.append(f"take one of {slots.slots} remediation slots of pool {slots.pool!r}")
            pods, waiting = await self._pods_in_the_way(resets)
            annotation = self.policy.get("opt_out_annotation")
            for pod in pods:
                namespace, name = _pod_key(pod)
                steps.append(f"{'wait for' if _opted_out(pod, annotation) else 'evict'} pod {namespace}/{name}")
            steps += [f"wait for {what}" for what in waiting]
            steps += [f"reset and check GPU {g['index']}" for g in resets]
            steps.append("remove the taint once every check passes")
        for step in steps:
            log.info("remediation_dry_run", node=self.agent.node_name, would=step)
        self.agent._note("remediation", dry_run_plan=steps, step="dry-run" if steps else None)
        if steps:
            await self._event("Normal", "RemediationDryRun", "remediation.dry_run: would " + "; ".join(steps))

    # -- state, Events, status -----------------------------------------------------------------------

    async def _step(self, step: str, detail: str) -> None:
        self.state["step"], self.state["step_since"] = step, time.time()
        if step != ESCALATED:
            self.state["detail"] = None
        self._step_history(step, detail)
        log.info("remediation_step", node=self.agent.node_name, step=step, gpus=self.state["gpus"], detail=detail)
        await self._save()

    def _step_history(self, step: str, detail: str) -> None:
        self.history.append({"at": time.time(), "step": step, "detail": detail[:300]})
        self._note()

    async def _save(self) -> None:
        value = json.dumps(self.state, separators=(",", ":")) if self.state is not None else None
        if value != self._annotations().get(ANNOTATION):
            self.agent.node = await self.api.patch_annotations({ANNOTATION: value})
            self._saved_version = int(self.agent.node["metadata"].get("resourceVersion") or 0)
        self._note()

    async def _mark_reboot(self, why: str | None) -> None:
        """remediation.reboot_marker: what a reboot manager reads (kured's sentinel file, or an annotation)."""
        marker = self.policy.get("reboot_marker") or "none"
        if marker == "annotation":
            value = why[:1024] if why else None
            if self._annotations().get(REBOOT_ANNOTATION) != value:
                self.agent.node = await self.api.patch_annotations({REBOOT_ANNOTATION: value})
        elif marker == "kured":
            sentinel = Path(self.policy.get("reboot_sentinel") or "/var/run/reboot-required")
            try:
                if why:
                    await asyncio.to_thread(sentinel.write_text, f"gpud k8s-agent: {why}\n")
                else:
                    await asyncio.to_thread(sentinel.unlink, True)
            except OSError as exc:
                log.error("reboot_sentinel_not_written", path=str(sentinel), error=os.strerror(exc.errno or 0)
                          or str(exc))
                self.agent._problem("mark the node for reboot", f"{sentinel}: {exc}")
                return
            self.agent._problem("mark the node for reboot", None)
        if why:
            log.warning("remediation_reboot_marked", node=self.agent.node_name, marker=marker, why=why)

    def _annotations(self) -> dict:
        """The Node's annotations as the agent last saw them."""
        return ((self.agent.node or {}).get("metadata") or {}).get("annotations") or {}

    async def _event(self, event_type: str, reason: str, message: str) -> None:
        await self.agent._event(event_type, reason, message)

    async def _once(self, event_type: str, reason: str, subject: str, message: str) -> None:
        if (reason, subject) not in self._said:
            self._said.add((reason, subject))
            await self._event(event_type, reason, message)

    def _note(self, **extra: Any) -> None:
        state = self.state or {}
        self.agent._note("remediation", enabled=bool(self.policy.get("enabled")),
                         dry_run=bool(self.policy.get("dry_run")),
                         step=state.get("step"),
                         gpus=[g.get("index") for g in state.get("gpus", [])] or None,
                         why=state.get("why"), lease=state.get("lease"),
                         detail=extra.get("detail", state.get("detail")),
                         history=list(self.history), counts=dict(self.counts))
