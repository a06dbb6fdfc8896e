"""`kubectl gpud inspect` run by the real kubectl (Debian's kubernetes-client, or whichever kubectl is on the
PATH; scripts/test-all installs Debian's where none is) against the API stand-in: kubectl finds the plugin
on the PATH, the plugin reads the cluster through kubectl, and prints what is allocated of each node's GPUs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import IN_CI, REPO
from kube_api_stand_in import KubeApiStandIn

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None and not IN_CI, reason="no kubectl here (Debian: apt-get install "
                                "kubernetes-client; scripts/test-all installs it)")
DRIVER = "gpu.nvidia.com"
A100 = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.replicas": "1"}


@pytest.fixture
def plugin_path(tmp_path) -> Path:
    """A directory with kubectl-gpud (as the entry point pip writes, run by this interpreter, on this checkout)
    for the PATH."""
    assert KUBECTL is not None, "CI installs kubectl (scripts/test-all)"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    plugin = bin_dir / "kubectl-gpud"
    plugin.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from gpud.kubectl_plugin.main import main\nsys.exit(main())\n")
    plugin.chmod(0o755)
    return bin_dir


def kubectl_gpud(plugin_path: Path, *args: str, kubeconfig: Path | None = None, **env: str):
    """`kubectl gpud ARGS` as an operator types it, with a home of its own (kubectl's discovery cache)."""
    home = plugin_path.parent / "home"
    home.mkdir(exist_ok=True)
    environment = {"PATH": f"{plugin_path}:{os.path.dirname(KUBECTL)}:/usr/bin:/bin", "HOME": str(home),
                   **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {}), **env}
    return subprocess.run([KUBECTL, "gpud", *args], capture_output=True, text=True, env=environment, timeout=120)


def gpu_cluster(api: KubeApiStandIn) -> None:
    """node-a: 8 A100 through the device plugin; node-b: DRA only (2 GPUs, one in MIG mode with two MIG
    devices); node-c: a GPU memory resource of 1 GiB units; cpu-1: no GPU."""
    api.create_node("node-a", A100)
    api.set_node_resources("node-a", {"cpu": "64", "nvidia.com/gpu": "8"})
    api.create_node("node-b", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})
    api.create_node("node-c", {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "40960",
                               "nvidia.com/gpu-memory.total-mib": "79872"})
    api.set_node_resources("node-c", {"nvidia.com/gpu-memory": "78"})
    api.create_node("cpu-1")
    # 2 GPUs; an init container asking 3 makes the pod's request 3 (component-helpers PodRequests)
    api.create_pod("default", "train", "node-a", [{"name": "main", "limits": {"nvidia.com/gpu": "2"}}],
                   init_containers=[{"name": "warm", "limits": {"nvidia.com/gpu": "3"}}])
    api.create_pod("default", "infer", "node-a", [{"name": "main", "limits": {"nvidia.com/gpu": "1"}}])
    api.create_pod("default", "done", "node-a", [{"name": "main", "limits": {"nvidia.com/gpu": "4"}}],
                   phase="Succeeded")
    api.create_pod("default", "pending", None, [{"name": "main", "limits": {"nvidia.com/gpu": "4"}}], phase="Pending")
    api.create_pod("kube-system", "small", "node-c", [{"name": "main", "limits": {"nvidia.com/gpu-memory": "7"}}])
    devices = [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, "uuid": {"string": "GPU-0"}},
                "capacity": {"memory": {"value": "80Gi"}}},
               *({"name": f"gpu-1-mig-3g40gb-9-{start}",
                  "attributes": {"type": {"string": "mig"}, "uuid": {"string": f"MIG-{start}"},
                                 "parentUUID": {"string": "GPU-1"}},
                  "capacity": {"memory": {"value": "40Gi"}}} for start in (0, 4))]
    status, answer = api.http("admin").request("POST", "/apis/resource.k8s.io/v1/resourceslices", body={
        "metadata": {"name": "node-b-gpus"},
        "spec": {"driver": DRIVER, "nodeName": "node-b", "pool": {"name": "node-b", "generation": 1,
                                                                   "resourceSliceCount": 1}, "devices": devices}})
    assert status == 201, answer
    api.create_resource_claim("default", "whole", [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}],
                              [{"request": "gpu", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}],
                              node="node-b")
    api.create_resource_claim("default", "mig", [{"name": "mig", "deviceClassName": "mig.nvidia.com"}],
                              [{"request": "mig", "driver": DRIVER, "pool": "node-b",
                                "device": "gpu-1-mig-3g40gb-9-4"}],
                              node="node-b")
    api.create_resource_claim("default", "waiting", [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}], None)


def test_kubectl_finds_the_plugin_and_it_shows_each_nodes_gpus_and_the_clusters(plugin_path):
    with KubeApiStandIn() as api:
        gpu_cluster(api)
        result = kubectl_gpud(plugin_path, "inspect", kubeconfig=api.kubeconfig("admin"))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            "NODE               GPUS  MIG  GPU MEMORY (GiB)  PODS  CLAIMS  PRODUCT",
            "node-a             4/8   0/0  320/640           2     0       NVIDIA-A100-SXM4-80GB",
            "node-b             1/1   1/2  120/160           0     2       NVIDIA-H100-80GB-HBM3",
            "node-c             0/0   0/0  7/80              1     0       -",
            "cluster (3 nodes)  5/9   1/2  447/880 (51%)     3     2"], result.stdout
        assert api.unmodelled == []
        # what kubectl asked: discovery, then lists; pods filtered by the server, not by the plugin
        pods = [r for r in api.requests if r["path"] == "/api/v1/pods"]
        assert pods and all(r["query"]["fieldSelector"] == "status.phase!=Succeeded,status.phase!=Failed" for r in pods)


def test_json_and_one_node_and_a_label_selector(plugin_path):
    with KubeApiStandIn() as api:
        gpu_cluster(api)
        config = api.kubeconfig("admin")
        result = kubectl_gpud(plugin_path, "inspect", "--json", "--kubeconfig", str(config))
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["resource_api"] is True and document["driver"] == DRIVER
        node_a = next(node for node in document["nodes"] if node["name"] == "node-a")
        assert node_a["pods"] == ["default/infer", "default/train"] or sorted(node_a["pods"]) == ["default/infer",
                                                                                                  "default/train"]
        assert node_a["device_plugin"] == {"nvidia.com/gpu": {"kind": "gpu", "capacity": 8, "allocatable": 8,
                                                              "requested": 4}}
        assert document["cluster"]["gpu_memory_mib"] == {"allocated": 457728.0, "total": 901120.0}
        only = json.loads(kubectl_gpud(plugin_path, "inspect", "--json", "--node", "cpu-1", kubeconfig=config).stdout)
        assert [node["name"] for node in only["nodes"]] == ["cpu-1"] and only["cluster"]["gpus"]["total"] == 0
        missing = kubectl_gpud(plugin_path, "inspect", "--node", "nowhere", kubeconfig=config)
        assert missing.returncode == 2 and 'nodes "nowhere" not found' in missing.stderr, missing.stderr
        picked = kubectl_gpud(plugin_path, "inspect", "-l", "nvidia.com/gpu.count=2", kubeconfig=config)
        assert picked.returncode == 0 and [line.split()[0] for line in picked.stdout.splitlines()[1:-1]] == ["node-c"]


def test_a_cluster_without_resource_k8s_io_counts_the_device_plugin_alone(plugin_path):
    with KubeApiStandIn(resource_api=False) as api:
        api.create_node("node-a", A100)
        api.set_node_resources("node-a", {"nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "0"})
        api.create_pod("default", "train", "node-a", [{"name": "main", "limits": {"nvidia.com/gpu": "8"}}])
        result = kubectl_gpud(plugin_path, "inspect", kubeconfig=api.kubeconfig("admin"))
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[1:] == [
            "node-a            8/8   0/0  640/640           1     -       NVIDIA-A100-SXM4-80GB",
            "cluster (1 node)  8/8   0/0  640/640 (100%)    1     -"]
        assert not [r for r in api.requests if r["path"].startswith("/apis/resource.k8s.io/")]


def test_forbidden_unreachable_and_a_wrong_context_are_said_with_gpuds_exit_codes(plugin_path):
    with KubeApiStandIn() as api:
        api.create_node("node-a", A100)
        forbidden = kubectl_gpud(plugin_path, "inspect", kubeconfig=api.kubeconfig("agent"))  # no RBAC rule at all
        assert forbidden.returncode == 1 and forbidden.stdout == ""
        assert ('nodes is forbidden: User "system:serviceaccount:gpud-system:gpud-k8s-agent" cannot list resource '
                '"nodes" in API group "" at the cluster scope') in forbidden.stderr, forbidden.stderr
        assert "needs list of nodes and pods" in forbidden.stderr
        wrong = kubectl_gpud(plugin_path, "inspect", "--context", "nowhere", kubeconfig=api.kubeconfig("admin"))
        assert wrong.returncode == 2 and "nowhere" in wrong.stderr, wrong.stderr
        api.down()
        unreachable = kubectl_gpud(plugin_path, "inspect", "--json", "--request-timeout", "5",
                                   kubeconfig=api.kubeconfig("admin"))
        assert unreachable.returncode == 3, unreachable.stderr
        error = json.loads(unreachable.stderr.strip().splitlines()[-1])
        assert error["error"]["code"] == "api-unreachable" and error["exit_code"] == 3


def test_without_kubectl_the_plugin_says_how_to_get_it(tmp_path):
    from gpud.kubectl_plugin.main import main

    os.environ["KUBECTL_PATH"] = str(tmp_path / "no-kubectl")
    try:
        assert main(["inspect"]) == 2
    finally:
        del os.environ["KUBECTL_PATH"]


def test_usage_errors_exit_2(plugin_path):
    result = kubectl_gpud(plugin_path, "inspect", "--request-timeout", "-1")
    assert result.returncode == 2 and "between 0 and 3600 seconds" in result.stderr
    assert kubectl_gpud(plugin_path, "frobnicate").returncode == 2
