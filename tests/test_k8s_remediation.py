"""The k8s agent's remediation loop end to end (gpud/kubernetes/remediation.py): real agent processes, simulated
gpuds, the kubelet stand-in's PodResources, and the API stand-in's pods, PodDisruptionBudgets, evictions and
Leases (tests/kube_api_stand_in.py, each behaviour cited) with the agent's RBAC as deploy/kubernetes/rbac.yaml
grants it.

The stand-ins have no kubelet that ends an evicted pod's containers: `Kubelet` below does what the kubelet does
then (the pod leaves the API once its containers ended, its devices leave PodResources, its processes leave the
GPU)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import cli, start_daemon, stop_daemon, until_async
from kube_api_stand_in import KubeApiStandIn
from kube_manifests import stand_in_as_deployed
from kubelet_stand_in import Kubelet as KubeletStandIn
from test_k8s_agent import AgentProcess, gpud_config

pytestmark = pytest.mark.slow

NODES = ("gpu-node-1", "gpu-node-2")
TAINT = {"key": "nvidia.com/gpu.unhealthy", "value": "gpud", "effect": "NoSchedule"}
ANNOTATION = "nvidia.com/gpu.remediation"
OPT_OUT = "nvidia.com/gpu.remediation-opt-out"
LEASE_NAMESPACE = "gpud-system"
RESET_XID = 95  # uncontained memory error: gpud's catalog (gpud/health/xids.yaml) asks for a GPU reset
REBOOT_XID = 79  # fallen off the bus: a reboot


@pytest.fixture
def kube():
    with stand_in_as_deployed([LEASE_NAMESPACE], NODES) as api:
        yield api


@dataclass
class Node:
    name: str
    kube: KubeApiStandIn
    kubelet: KubeletStandIn
    gpud: object  # helpers.Running
    agent: AgentProcess
    tmp: Path

    def k8s(self) -> dict:
        return self.kube.node(self.name)

    def annotation(self) -> dict | None:
        raw = (self.k8s()["metadata"].get("annotations") or {}).get(ANNOTATION)
        return json.loads(raw) if raw else None

    def tainted(self) -> bool:
        return TAINT in (self.k8s()["spec"].get("taints") or [])

    def condition(self) -> dict | None:
        return next((c for c in self.k8s()["status"].get("conditions", []) if c["type"] == "GPUHealthy"), None)

    def events(self, reason: str | None = None) -> list[dict]:
        """In the order they were written (the list is in name order: names end in random hex)."""
        return sorted((e for e in self.kube.events() if e["involvedObject"]["name"] == self.name
                       and (reason is None or e["reason"] == reason)),
                      key=lambda e: int(e["metadata"]["resourceVersion"]))

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events() if e["reason"].startswith("Remediation")]

    async def uuid(self, index: int) -> str:
        return (await self.gpud.get(f"/v1/gpus/{index}"))[1]["uuid"]

    async def run_pod(self, name: str, gpu: int, pid: int, labels: dict | None = None,
                      annotations: dict | None = None, namespace: str = "default") -> None:
        """A pod the scheduler put here, given GPU `gpu` by the device plugin, its process on that GPU."""
        self.kube.create_pod(namespace, name, self.name, [{"name": "main", "limits": {"nvidia.com/gpu": "1"}}],
                             labels=labels, annotations=annotations)
        with self.kubelet._changed:
            self.kubelet.pod_devices[(namespace, name)] = {"main": {"nvidia.com/gpu": [await self.uuid(gpu)]}}
        assert (await self.gpud.post("/v1/sim/processes", {"gpu": gpu, "pids": [pid]}))[0] == 200

        async def listed():
            status, body = await self.gpud.get(f"/v1/gpus/{gpu}/pods")
            return status == 200 and any(p["name"] == name for p in body["pods"])
        await until_async(listed, 10, f"pod {name} in the kubelet's PodResources as gpud reads them")

    async def end_pod(self, namespace: str, name: str, gpu: int, evicted: bool = True) -> None:
        """What the kubelet does once a pod's containers ended: devices released, and an evicted pod's
        object gone (one that ended by itself stays, Succeeded, until it is garbage collected)."""
        with self.kubelet._changed:
            self.kubelet.pod_devices.pop((namespace, name), None)
        assert (await self.gpud.post("/v1/sim/processes", {"gpu": gpu, "pids": []}))[0] == 200
        if evicted:
            self.kube.finish_pod_termination(namespace, name)

    async def end_pod_while_gpud_is_down(self, namespace: str, name: str) -> None:
        with self.kubelet._changed:
            self.kubelet.pod_devices.pop((namespace, name), None)
        self.kube.finish_pod_termination(namespace, name)

    def restart_agent(self, kill: bool) -> None:
        if kill:
            self.agent.proc.send_signal(signal.SIGKILL)
            self.agent.proc.wait(10)
        else:
            self.agent.stop()
        self.agent = AgentProcess(self.tmp, self.kube, self.gpud.daemon.config.socket_path, node=self.name)


def remediation_config(tmp: Path, kubelet: KubeletStandIn, sim_driver: str | None = None, dcgmi: str | None = None,
                       **policy):
    config = gpud_config(tmp, "A100-SXM4-40GB:2").with_overrides(sim_driver=sim_driver, **{
        "health.dcgmi": dcgmi or str(tmp / "no-dcgmi"),
        "metrics.pod_resources_socket": str(kubelet.pod_resources_socket), "metrics.pod_resources_refresh_s": 1.0,
        "health.check_interval_s": 0.5, "remediation.enabled": True, "remediation.lease_duration_s": 10})
    for key, value in policy.items():
        config = config.with_overrides(**{f"remediation.{key}": value})
    return config


@contextlib.asynccontextmanager
async def nodes(tmp_factory, kube, count: int = 1, sim_driver: str | None = None, dcgmi: str | None = None,
                **policy):
    """`count` nodes, each its kubelet stand-in, simulated gpud (two A100s) and agent process."""
    started: list[Node] = []
    try:
        for name in NODES[:count]:
            tmp = tmp_factory()
            plugins = tmp / "kubelet" / "device-plugins"
            plugins.mkdir(parents=True)
            kubelet = KubeletStandIn(plugins)
            gpud = await start_daemon(remediation_config(tmp, kubelet, sim_driver, dcgmi, **policy))
            agent = AgentProcess(tmp, kube, gpud.daemon.config.socket_path, node=name)
            started.append(Node(name, kube, kubelet, gpud, agent, tmp))
        for node in started:
            await until_async(lambda: node.condition(), 30, f"{node.name}'s first condition")
        yield started
    finally:
        for node in started:
            await asyncio.to_thread(node.agent.stop)
            await stop_daemon(node.gpud)
            node.kubelet.stop()


@pytest.fixture
def tmp_factory(short_tmp):
    made = iter(range(100))
    def make() -> Path:
        path = short_tmp / f"n{next(made)}"
        path.mkdir()
        return path
    return make


async def test_a_gpu_that_needs_a_reset_is_drained_past_a_blocking_pdb_reset_checked_and_returned(tmp_factory, kube):
    async with nodes(tmp_factory, kube) as (node,):
        await node.run_pod("train", gpu=0, pid=7001, labels={"app": "train"})
        await node.run_pod("other", gpu=1, pid=7002, labels={"app": "other"})  # on the healthy GPU: stays
        kube.create_pdb("default", "train", {"app": "train"}, disruptions_allowed=0)
        started = time.monotonic()
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(node.tainted, 10, "the taint")
        await until_async(lambda: node.events("RemediationEvictionBlocked"), 20, "the eviction refused by the PDB")
        assert node.annotation()["step"] == "draining"
        pod = kube.pod("default", "train")
        assert not pod["metadata"].get("deletionTimestamp")  # a 429 is waited on, never forced
        kube.set_pdb_status("default", "train", disruptions_allowed=1)  # the disruption controller, later
        await until_async(lambda: kube.pod("default", "train")["metadata"].get("deletionTimestamp"), 15,
                          "the pod evicted once the budget allows")
        assert not kube.pod("default", "other")["metadata"].get("deletionTimestamp")
        await node.end_pod("default", "train", 0)
        await until_async(lambda: node.events("RemediationSucceeded"), 60, "the remediation's end")
        took = time.monotonic() - started
        await until_async(lambda: not node.tainted(), 10, "the taint removed")
        await until_async(lambda: node.condition()["status"] == "True", 10, "GPUHealthy True")
        assert node.annotation() is None
        assert node.reasons()[:3] == ["RemediationStarted", "RemediationDraining", "RemediationEvictionBlocked"]
        assert node.reasons()[-3:] == ["RemediationEvicted", "RemediationResetting", "RemediationSucceeded"]
        lease = kube.lease(LEASE_NAMESPACE, "gpud-remediation-cluster-0")
        assert not lease["spec"].get("holderIdentity")  # given back
        remediation = (await node.gpud.get("/v1/remediation"))[1]
        assert remediation["results"]["passed"] == 1 and remediation["reset_budget"]["used"] == 1
        agent = (await node.gpud.get("/v1/kubernetes"))[1]["agent"]
        print(f"remediation took {took:.1f} s; agent requests {agent['requests']}")


async def test_a_gpu_that_needs_a_reboot_escalates_at_once_and_marks_the_node(tmp_factory, kube):
    async with nodes(tmp_factory, kube, reboot_marker="annotation") as (node,):
        await node.run_pod("train", gpu=1, pid=7101)
        await node.gpud.post("/v1/sim/xid", {"gpu": 1, "xid": REBOOT_XID})
        await until_async(lambda: node.events("RemediationEscalated"), 20, "the escalation")
        assert node.tainted()
        condition = node.condition()
        assert condition["reason"] == "GPURemediationFailed" and "reboot the node" in condition["message"]
        assert "reboot" in node.k8s()["metadata"]["annotations"]["nvidia.com/gpu.reboot-required"]
        assert not kube.pod("default", "train")["metadata"].get("deletionTimestamp")  # a reset cannot help: no drain
        assert node.annotation()["step"] == "escalated"
        # A person clears it by removing the annotation; the GPU still needs a reboot: it escalates again.
        assert kube.http("admin").patch(f"/api/v1/nodes/{node.name}",
                                        {"metadata": {"annotations": {ANNOTATION: None}}})[0] == 200
        await until_async(lambda: node.events("RemediationCleared"), 20, "the clearing seen")
        await until_async(lambda: len(node.events("RemediationEscalated")) == 2, 20, "escalated again")


async def test_two_sick_nodes_with_one_slot_remediate_one_after_the_other(tmp_factory, kube):
    async with nodes(tmp_factory, kube, count=2, max_nodes=1) as (first, second):
        await first.run_pod("train", gpu=0, pid=7051)  # keeps the first node draining until it ends
        await first.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: first.events("RemediationEvicted"), 20, "the first node's pod evicted")
        await second.gpud.post("/v1/sim/xid", {"gpu": 1, "xid": RESET_XID})
        await until_async(lambda: second.events("RemediationWaitingForSlot"), 20, "the second node waiting")
        assert second.tainted()  # tainted while it waits: nothing new lands there
        assert not second.events("RemediationDraining")
        await first.end_pod("default", "train", 0)
        await until_async(lambda: first.events("RemediationSucceeded"), 60, "the first node done")
        await until_async(lambda: second.events("RemediationSucceeded"), 60, "the second node done")
        first_done = int(first.events("RemediationSucceeded")[0]["metadata"]["resourceVersion"])
        second_draining = int(second.events("RemediationDraining")[0]["metadata"]["resourceVersion"])
        assert second_draining > first_done
        assert not first.tainted() and not second.tainted()


async def test_an_agent_killed_mid_drain_resumes_and_an_opted_out_pod_is_waited_for(tmp_factory, kube):
    async with nodes(tmp_factory, kube) as (node,):
        await node.run_pod("notebook", gpu=0, pid=7201, annotations={OPT_OUT: "true"})
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: node.events("RemediationWaitingForPod"), 20, "the opted-out pod waited for")
        await asyncio.to_thread(node.restart_agent, True)
        assert node.annotation()["step"] == "draining" and node.tainted()
        await until_async(lambda: any(e.get("event") == "remediation_resumed" for e in node.agent.events()), 20,
                          "the new agent resuming")
        await asyncio.sleep(6)  # fixed time: more than a tick of the loop, in which nothing may evict the pod
        assert not kube.pod("default", "notebook")["metadata"].get("deletionTimestamp")
        kube.set_pod_phase("default", "notebook", "Succeeded")  # it ended by itself
        await node.end_pod("default", "notebook", 0, evicted=False)
        await until_async(lambda: node.events("RemediationSucceeded"), 60, "the remediation's end")
        assert "RemediationEvicted" not in node.reasons()
        await until_async(lambda: not node.tainted(), 10, "the taint removed")


async def test_a_gpu_held_past_the_drain_timeout_escalates_and_gives_its_slot_back(tmp_factory, kube):
    async with nodes(tmp_factory, kube, drain_timeout_s=8) as (node,):
        # A process outside any pod holds the GPU (nv-hostengine, a user's job): the reset is refused.
        assert (await node.gpud.post("/v1/sim/processes", {"gpu": 0, "pids": [7301]}))[0] == 200
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: node.events("RemediationEscalated"), 40, "the escalation")
        condition = node.condition()
        assert condition["reason"] == "GPURemediationFailed" and "7301" in condition["message"], condition
        assert node.tainted()
        lease = kube.lease(LEASE_NAMESPACE, "gpud-remediation-cluster-0")
        assert not lease["spec"].get("holderIdentity")


async def test_dry_run_says_every_step_and_takes_none(tmp_factory, kube):
    async with nodes(tmp_factory, kube, dry_run=True) as (node,):
        await node.run_pod("train", gpu=0, pid=7401)
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        event = (await until_async(lambda: node.events("RemediationDryRun"), 20, "the dry run's plan"))[0]
        assert "evict pod default/train" in event["message"] and "reset and check GPU 0" in event["message"]
        await asyncio.sleep(6)  # fixed time: a tick of the loop, in which nothing may be done
        assert node.annotation() is None and not node.tainted()
        assert not kube.pod("default", "train")["metadata"].get("deletionTimestamp")
        plan = [line for line in node.agent.events() if line.get("event") == "remediation_dry_run"]
        assert any("evict pod default/train" in line["would"] for line in plan)


async def test_the_node_policy_evicts_every_pod_but_daemonsets_and_gpud_kubernetes_shows_the_step(tmp_factory, kube):
    async with nodes(tmp_factory, kube, evict="node", grace_period_s=7) as (node,):
        await node.run_pod("train", gpu=1, pid=7501)  # on the healthy GPU: the node policy evicts it too
        kube.create_pod("default", "web", node.name, [{"name": "main"}])
        kube.create_pod("default", "exporter", node.name, [{"name": "main"}], owner_references=[
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "exporter", "uid": "d1", "controller": True}])
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: kube.pod("default", "train")["metadata"].get("deletionTimestamp")
                          and kube.pod("default", "web")["metadata"].get("deletionTimestamp"), 20, "the evictions")
        assert kube.pod("default", "train")["metadata"]["deletionGracePeriodSeconds"] == 7  # remediation.grace_period_s
        assert not kube.pod("default", "exporter")["metadata"].get("deletionTimestamp")  # as kubectl drain skips it

        async def remediation_line():
            shown = await asyncio.to_thread(cli, "kubernetes", socket=node.gpud.daemon.config.socket_path)
            line = next(line for line in shown.stdout.splitlines() if line.startswith("remediation:"))
            return line if "DRAINING GPU 0" in line and "default/train" in line else None
        await until_async(remediation_line, 10, "`gpud kubernetes` saying the step (the agent reports each second)")
        await node.end_pod("default", "train", 1)
        kube.finish_pod_termination("default", "web")
        await until_async(lambda: node.events("RemediationSucceeded"), 60, "the remediation's end")
        assert not node.tainted()


async def test_kureds_sentinel_marks_an_escalated_node_and_goes_once_it_is_healthy_and_checked(tmp_factory, kube):
    sentinel = tmp_factory() / "reboot-required"
    async with nodes(tmp_factory, kube, reboot_marker="kured", reboot_sentinel=str(sentinel)) as (node,):
        await node.gpud.post("/v1/sim/xid", {"gpu": 1, "xid": REBOOT_XID})
        await until_async(lambda: node.events("RemediationEscalated"), 20, "the escalation")
        assert "reboot the node" in sentinel.read_text()
        # A person cleared the GPU's health (a reboot would, too): the agent checks it and ends the escalation.
        uuid = await node.uuid(1)
        assert (await node.gpud.post(f"/v1/health/{uuid}/clear", {}))[0] == 200
        await until_async(lambda: node.events("RemediationSucceeded"), 30, "the escalation's end")
        assert not sentinel.exists() and not node.tainted() and node.annotation() is None


async def test_gpud_restarted_mid_drain_leaves_nothing_half_done(tmp_factory, kube):
    async with nodes(tmp_factory, kube) as (node,):
        await node.run_pod("train", gpu=0, pid=7601)
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: kube.pod("default", "train")["metadata"].get("deletionTimestamp"), 20,
                          "the eviction")
        config = node.gpud.daemon.config
        await stop_daemon(node.gpud)  # the second fault: gpud goes away mid-drain
        await node.end_pod_while_gpud_is_down("default", "train")
        await asyncio.sleep(2)  # fixed time: the agent finds gpud gone for a few of its passes
        assert node.annotation()["step"] == "draining" and node.tainted()
        node.gpud = await start_daemon(config)
        # The simulated GPU still holds the pod's process and XID, as a driver's would: gone with the pod.
        assert (await node.gpud.post("/v1/sim/processes", {"gpu": 0, "pids": []}))[0] == 200
        await until_async(lambda: node.events("RemediationSucceeded"), 60, "the remediation's end")
        assert not node.tainted() and node.annotation() is None


async def test_xid_48_is_reset_where_the_driver_says_a_reset_mends_it_and_79_is_a_reboot(tmp_factory, kube):
    """XID 48 (a double-bit ECC error): NVIDIA's catalog says reboot where the driver says nothing; a driver of
    R565 or later reports its recovery action, a GPU reset for this one, and that is what gpud follows."""
    async with nodes(tmp_factory, kube, sim_driver="580.65.06") as (node,):
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": 48})
        await until_async(lambda: node.events("RemediationSucceeded"), 60, "XID 48 remediated by a reset")
        assert node.reasons()[-2:] == ["RemediationResetting", "RemediationSucceeded"]
        escalated = len(node.events("RemediationEscalated"))  # XID 48 may have, before the driver's action came
        await node.gpud.post("/v1/sim/xid", {"gpu": 1, "xid": REBOOT_XID})
        await until_async(lambda: len(node.events("RemediationEscalated")) > escalated, 20, "XID 79 escalated")
        assert "reboot the node" in node.condition()["message"] and node.tainted()


async def test_a_check_that_fails_after_the_reset_escalates_and_keeps_the_node_out_of_service(tmp_factory, kube):
    from test_health_closed_loop import stand_in_dcgmi

    dcgmi = stand_in_dcgmi(tmp_factory(), "no-hostengine")  # DCGM installed, its host engine down: every run fails
    async with nodes(tmp_factory, kube, dcgmi=str(dcgmi)) as (node,):
        await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
        await until_async(lambda: node.events("RemediationEscalated"), 60, "the escalation")
        condition = node.condition()
        assert condition["reason"] == "GPURemediationFailed", condition
        assert "the check after the reset failed (dcgm-diag-1)" in condition["message"], condition
        assert node.tainted() and node.annotation()["step"] == "escalated"
        assert not node.events("RemediationSucceeded")
