"""Benchmark: what `gpud k8s-agent` costs the Kubernetes API server (issue 22).

Usage: python bench/k8s_agent_requests.py [--idle-seconds S] [--renewals N]

A simulated DGX A100 (`gpud serve --simulate dgx-a100`), the Kubernetes API stand-in
(tests/kube_api_stand_in.py, as strict as the real server) and one real agent process. Every request
the agent makes is counted as the API server sees it:
- idle: S seconds in which nothing changes, during which the stand-in ends the agent's watch N times,
  as the server does when a watch's timeoutSeconds runs out (the agent asks for 5-10 minutes, 7.5 on
  average). Idle requests per node-hour = requests per watch renewal x renewals per hour at the
  agent's own timeouts + every other idle request, per hour, as measured. One renewal is from a
  compacted resourceVersion (410 Gone): it costs a GET more, and is shown on its own.
- per change: a MIG label change (until its state is success), a sharing label change, and a GPU
  health change and its recovery (with the opt-in taint): the requests from the change until the agent
  is quiet again.
Prints each, and what 5,000 such nodes would ask of the API server per second. Goals: idle <= 60
requests per node-hour, <= 10 per change.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gpud.client import Client  # noqa: E402
from gpud.kubernetes.node_api import WATCH_TIMEOUT_S  # noqa: E402
from kube_api_stand_in import AGENT_USER, KubeApiStandIn  # noqa: E402
from simulated_gpud import wait  # noqa: E402
from kube_manifests import agent_rbac_rules, sharing_configs  # noqa: E402

NODE = "gpu-node-1"
FLEET = 5000
IDLE_GOAL, CHANGE_GOAL = 60, 10
QUIET_S = 2.0  # no request from the agent for this long: it has settled


def agent_requests(kube) -> list:
    return [r for r in list(kube.requests) if r["user"] == AGENT_USER]


def settle(kube, since: int) -> collections.Counter:
    """The agent's requests after the first `since`, once it has made none for QUIET_S."""
    last_count, quiet_from = -1, time.monotonic()
    while time.monotonic() - quiet_from < QUIET_S:
        count = len(agent_requests(kube))
        if count != last_count:
            last_count, quiet_from = count, time.monotonic()
        time.sleep(0.05)
    return collections.Counter(r["verb"] for r in agent_requests(kube)[since:])


def label(kube, key: str, value: str | None) -> None:
    kube.label(NODE, key, value)


def node_labels(kube) -> dict:
    return kube.node(NODE)["metadata"].get("labels") or {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--renewals", type=int, default=6)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gk", dir="/tmp"))
    configs = work / "configs"
    configs.mkdir()
    for name, text in sharing_configs().items():
        (configs / name).write_text(text)
    (work / "gpud.yaml").write_text(json.dumps({
        "mig": {"layouts_file": str(work / "absent.yaml")},
        "sharing": {"configs_dir": str(configs)}, "kubernetes": {"taint_unhealthy": True}}))
    sock = work / "g.sock"
    gpud = subprocess.Popen([sys.executable, "-m", "gpud", "serve", "--simulate", "dgx-a100", "--sim-state",
                             str(work / "sim.json"), "--state-dir", str(work / "state"), "--socket", str(sock),
                             "--config", str(work / "gpud.yaml"), "--log-level", "error"], cwd=REPO,
                            stdout=subprocess.DEVNULL)
    agent = None
    try:
        with KubeApiStandIn() as kube:
            kube.bind_agent_rbac(agent_rbac_rules())
            kube.create_node(NODE)
            wait(sock.exists, 30, "gpud's socket")
            client = Client(sock, timeout=10)
            agent = subprocess.Popen([sys.executable, "-m", "gpud", "k8s-agent", "--kubeconfig",
                                      str(kube.kubeconfig("agent")), "--node-name", NODE, "--socket", str(sock),
                                      "--log-level", "error"], cwd=REPO, stdout=subprocess.DEVNULL,
                                     env={**os.environ, "KUBECONFIG": ""})
            wait(lambda: any(c["type"] == "GPUHealthy" for c in kube.node(NODE)["status"].get("conditions", [])),
                 60, "the agent's first condition")
            start = settle(kube, 0)
            print(f"start-up: {sum(start.values())} requests ({dict(start)})")

            # -- idle --------------------------------------------------------------------------------
            mark = len(agent_requests(kube))
            began = time.monotonic()
            for _ in range(args.renewals):
                time.sleep(args.idle_seconds / (args.renewals + 1))
                kube.end_watches()
            time.sleep(args.idle_seconds / (args.renewals + 1))
            idle = settle(kube, mark)
            idle_s = time.monotonic() - began
            watches = idle["watch"]
            other = sum(idle.values()) - watches
            per_renewal = watches / args.renewals
            mean_watch_s = sum(WATCH_TIMEOUT_S) / 2
            per_hour = per_renewal * 3600 / mean_watch_s + other * 3600 / idle_s
            mark = len(agent_requests(kube))
            kube.compact()
            kube.end_watches()
            gone = settle(kube, mark)
            print(f"idle: {idle_s:.0f} s, {args.renewals} watch renewals: {dict(idle)} "
                  f"-> {per_renewal:.2f} requests a renewal, {other} others")
            print(f"  renewal from a compacted resourceVersion (410): {sum(gone.values())} requests ({dict(gone)})")
            all_gone = sum(gone.values()) * 3600 / mean_watch_s + other * 3600 / idle_s
            print(f"  per node-hour idle: {per_hour:.1f} (a watch every {mean_watch_s / 60:.1f} min on average; "
                  f"even if every renewal met a 410: {all_gone:.1f})"
                  f" -> {'PASS' if per_hour <= IDLE_GOAL else 'FAIL'} (goal <= {IDLE_GOAL})")
            print(f"  {FLEET} nodes: {per_hour * FLEET / 3600:.1f} requests/s to the API server, "
                  f"{FLEET} watches open")

            # -- per change ---------------------------------------------------------------------------
            changes = {}
            mark = len(agent_requests(kube))
            label(kube, "nvidia.com/mig.config", "all-1g.5gb")
            wait(lambda: node_labels(kube).get("nvidia.com/mig.config.state") == "success", 120, "MIG success")
            changes["MIG label change (to success)"] = settle(kube, mark)
            mark = len(agent_requests(kube))
            label(kube, "nvidia.com/device-plugin.config", "tesla-t4")
            wait(lambda: any(e["reason"] == "SharingConfigApplied" for e in kube.events()), 30, "sharing applied")
            changes["sharing label change"] = settle(kube, mark)
            mark = len(agent_requests(kube))
            client.request("POST", "/v1/sim/xid", {"gpu": 2, "xid": 79})
            wait(lambda: any(c["type"] == "GPUHealthy" and c["status"] == "False"
                             for c in kube.node(NODE)["status"]["conditions"]), 30, "GPUHealthy False")
            changes["GPU unhealthy (condition, taint)"] = settle(kube, mark)
            mark = len(agent_requests(kube))
            uuid = client.get("/v1/gpus/2")["uuid"]
            client.request("POST", f"/v1/health/{uuid}/clear", {})
            wait(lambda: any(c["type"] == "GPUHealthy" and c["status"] == "True"
                             for c in kube.node(NODE)["status"]["conditions"]), 30, "GPUHealthy True")
            changes["GPU recovered (condition, taint)"] = settle(kube, mark)
            worst = 0
            for what, counted in changes.items():
                worst = max(worst, sum(counted.values()))
                print(f"{what}: {sum(counted.values())} requests ({dict(counted)})")
            print(f"per change: at most {worst} -> {'PASS' if worst <= CHANGE_GOAL else 'FAIL'} "
                  f"(goal <= {CHANGE_GOAL})")
            listed = [r for r in agent_requests(kube) if r["verb"] == "list"]
            print(f"lists of Nodes: {len(listed)}; calls the stand-in does not model: {len(kube.unmodelled)}")
            return 0 if per_hour <= IDLE_GOAL and worst <= CHANGE_GOAL and not listed else 1
    finally:
        for process in (agent, gpud):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(15)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
