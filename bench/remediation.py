"""Benchmark: a GPU that needs a reset, back in service without a person (issue 40).

Usage: python bench/remediation.py [--rounds N]

A simulated node (two A100s, `gpud serve` in-process with remediation on), the kubelet stand-in's
PodResources, the Kubernetes API stand-in (tests/kube_api_stand_in.py) and one real agent process. Each
round: a pod holds GPU 0, XID 95 asks for a reset, and the clock runs until the node is back in service
(the remediation's RemediationSucceeded Event, and the taint gone); the pod's end is played as the
kubelet plays it, as soon as its eviction is seen. Prints, per round and on average: seconds from the XID
to back in service, and the requests the agent made of the API server for it, by verb (the Events
included), against the same count for a round with remediation off (the health condition and Events
alone) as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import start_daemon, stop_daemon, until_async  # noqa: E402
from kube_api_stand_in import AGENT_USER, KubeApiStandIn  # noqa: E402
from kube_manifests import agent_rbac_rules, agent_role_rules  # noqa: E402
from kubelet_stand_in import Kubelet  # noqa: E402
from test_k8s_agent import AgentProcess  # noqa: E402
from test_k8s_remediation import LEASE_NAMESPACE, NODES, RESET_XID, TAINT, Node, remediation_config  # noqa: E402

NODE = NODES[0]


def agent_requests(kube, since: int) -> collections.Counter:
    return collections.Counter(r["verb"] for r in list(kube.requests)[since:] if r["user"] == AGENT_USER)


async def one_round(node: Node, kube, pid: int, remediate: bool) -> tuple[float, collections.Counter]:
    name = f"train-{pid}"
    await node.run_pod(name, gpu=0, pid=pid)
    await asyncio.sleep(1.5)  # the kubelet's next PodResources answer names the pod
    since = len(kube.requests)
    started = time.monotonic()
    done = len(node.events("RemediationSucceeded"))
    await node.gpud.post("/v1/sim/xid", {"gpu": 0, "xid": RESET_XID})
    if remediate:
        await until_async(lambda: kube.pod("default", name)["metadata"].get("deletionTimestamp"), 60, "the eviction")
        await node.end_pod("default", name, 0)
        await until_async(lambda: len(node.events("RemediationSucceeded")) > done
                          and TAINT not in (node.k8s()["spec"].get("taints") or []), 120, "back in service")
    else:
        await until_async(lambda: node.condition()["status"] == "False", 30, "the condition")
        await node.gpud.post("/v1/sim/processes", {"gpu": 0, "pids": []})
        uuid = await node.uuid(0)
        await node.gpud.post(f"/v1/health/{uuid}/clear", {})
        await until_async(lambda: node.condition()["status"] == "True", 30, "healthy again")
    took = time.monotonic() - started
    await asyncio.sleep(2)  # the agent's last writes of the round
    return took, agent_requests(kube, since)


async def measure(rounds: int, remediate: bool) -> list[tuple[float, collections.Counter]]:
    with tempfile.TemporaryDirectory(prefix="gbr", dir="/tmp") as directory, KubeApiStandIn() as kube:
        tmp = Path(directory)
        kube.bind_agent_rbac(agent_rbac_rules(), agent_role_rules())
        kube.create_namespace(LEASE_NAMESPACE)
        kube.create_node(NODE)
        plugins = tmp / "kubelet" / "device-plugins"
        plugins.mkdir(parents=True)
        kubelet = Kubelet(plugins)
        config = remediation_config(tmp, kubelet).with_overrides(**{
            "remediation.enabled": remediate, "health.auto_reset_max_per_hour": 60})
        gpud = await start_daemon(config)
        agent = AgentProcess(tmp, kube, gpud.daemon.config.socket_path, node=NODE)
        node = Node(NODE, kube, kubelet, gpud, agent, tmp)
        try:
            await until_async(lambda: node.condition(), 30, "the agent running")
            return [await one_round(node, kube, 9000 + index, remediate) for index in range(rounds)]
        finally:
            await asyncio.to_thread(agent.stop)
            await stop_daemon(gpud)
            kubelet.stop()


def show(label: str, results: list[tuple[float, collections.Counter]]) -> float:
    for index, (took, requests) in enumerate(results):
        print(f"{label} round {index + 1}: {took:.2f} s, {sum(requests.values())} requests "
              f"({', '.join(f'{verb} {count}' for verb, count in sorted(requests.items()))})")
    mean = statistics.mean(sum(r.values()) for _, r in results)
    print(f"{label}: {statistics.mean(t for t, _ in results):.2f} s on average, {mean:.1f} requests on average")
    return mean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    baseline = show("remediation off (condition only)", asyncio.run(measure(args.rounds, remediate=False)))
    remediating = show("remediation on", asyncio.run(measure(args.rounds, remediate=True)))
    print(f"requests per remediation / per health change without it: {remediating / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
