"""NVIDIA's DRA kubelet plugin and `gpud dra-plugin` on the same mock node, for tests/test_dra_vs_nvidia.py
and bench/dra.py.

NVIDIA's gpu-kubelet-plugin (../shared/nvidia-dra-driver, README.md there) loads NVIDIA's mock NVML from a
driver root made here (the mock library, an nvidia-smi, /dev nodes standing in for the driver's); gpud
serve loads the same mock through its real NVML backend, and gpud's plugin reads gpud. Each plugin has its
own kubelet directory and CDI directory, and is called as the kubelet calls it: DRAPlugin v1 over its
dra.sock with a 45 s deadline (pkg/kubelet/cm/dra/plugin: NodePrepareResources' timeout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from helpers import MOCK_NVML_CONFIGS, REPO, SHARED

NVIDIA_DRA_PLUGIN = SHARED / "nvidia-dra-driver" / "bin" / "gpu-kubelet-plugin"
DRIVER = "gpu.nvidia.com"
KUBELET_DEADLINE_S = 45.0
# What both plugins ask of the API server: their Node (the slices' owner), their own slices, the claims
# the kubelet names (NVIDIA's: deployments/helm/.../clusterrole.yaml; gpud's: deploy/kubernetes).
DRA_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
              "verbs": ["get", "list", "watch", "create", "update", "delete", "deletecollection"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}]


def mock_config(name: str) -> Path:
    return MOCK_NVML_CONFIGS / f"mock-nvml-config-{name}.yaml"


def nvidia_missing() -> str | None:
    """Why NVIDIA's plugin cannot run here, or None."""
    if not NVIDIA_DRA_PLUGIN.exists():
        return f"{NVIDIA_DRA_PLUGIN} is absent (../shared is not in this clone)"
    if os.geteuid() != 0:
        return "the driver root's /dev nodes need root (mknod)"
    return None


LIBRARIES = "usr/lib/x86_64-linux-gnu"


def driver_root(root: Path, mock: Path, gpus: int) -> Path:
    """What NVIDIA's plugin takes for a driver root: the mock library as the driver's libnvidia-ml, a stub
    libcuda (its CDI spec's driver files start from libcuda.so.<version>'s directory: without it Prepare
    fails with "failed to locate libcuda.so"), both in the root's ld.so.cache, an nvidia-smi (only looked
    for), the GPUs' and control /dev nodes (without them Prepare fails with "empty device edits"). gpud,
    given the same root (cdi.dev_root, cdi.driver_root), finds the same files. Needs root (mknod)."""
    from helpers import stand_in_nodes

    version = (mock / "libnvidia-ml.so.1").resolve().name.removeprefix("libnvidia-ml.so.")
    libraries = root / LIBRARIES
    libraries.mkdir(parents=True, exist_ok=True)
    (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    (root / "etc").mkdir(exist_ok=True)
    shutil.copy(mock / f"libnvidia-ml.so.{version}", libraries / f"libnvidia-ml.so.{version}")
    (root / "stub.c").write_text("int cuInit(unsigned int flags) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", libraries / f"libcuda.so.{version}",
                    root / "stub.c"], check=True, capture_output=True, timeout=120)
    for name in ("libnvidia-ml", "libcuda"):
        link = libraries / f"{name}.so.1"
        if not link.is_symlink():
            os.symlink(f"{name}.so.{version}", link)
    subprocess.run(["ldconfig", "-r", root], check=True, capture_output=True, timeout=120)
    shutil.copy("/bin/true", root / "usr" / "bin" / "nvidia-smi")
    if not (root / "dev" / "nvidia0").exists():
        stand_in_nodes(root, gpus)
    return root


class Plugin:
    """A plugin process, its log in a file, its DRA socket under <kubelet_dir>/plugins/<driver>/."""

    name = "plugin"

    def __init__(self, work: Path, command: list[str], env: dict[str, str]):
        self.work = work
        self.kubelet_dir = work / "kubelet"
        self.cdi_dir = work / "cdi"
        self.log_path = work / f"{self.name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self._channel = None

    @property
    def dra_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / DRIVER / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.dra_socket.exists() and self.registration_socket.exists()):
            self.alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no sockets after {timeout} s:\n{self.log_text()[-4000:]}")
            time.sleep(0.05)

    def _stub(self):
        import grpc

        from gpud.dra.api import v1_rpc
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.dra_socket}")
        return v1_rpc.DRAPluginStub(self._channel)

    def prepare(self, claims: list[tuple[str, str, str]]) -> dict:
        """NodePrepareResources of (namespace, name, uid) claims: the answer per claim UID."""
        from gpud.dra.api import v1_pb
        request = v1_pb.NodePrepareResourcesRequest(claims=[v1_pb.Claim(namespace=ns, name=name, uid=uid)
                                                            for ns, name, uid in claims])
        return dict(self._stub().NodePrepareResources(request, timeout=KUBELET_DEADLINE_S).claims)

    def unprepare(self, claims: list[tuple[str, str, str]]) -> dict:
        from gpud.dra.api import v1_pb
        request = v1_pb.NodeUnprepareResourcesRequest(claims=[v1_pb.Claim(namespace=ns, name=name, uid=uid)
                                                              for ns, name, uid in claims])
        return dict(self._stub().NodeUnprepareResources(request, timeout=KUBELET_DEADLINE_S).claims)

    def rss_kib(self) -> int:
        """VmRSS of the plugin process (kB, as /proc says)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"{self.name}: no VmRSS")

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class NvidiaDraPlugin(Plugin):
    """NVIDIA's gpu-kubelet-plugin on the mock NVML config (its README's command line)."""

    name = "nvidia"

    def __init__(self, work: Path, kubeconfig: Path, node: str, root: Path, config: Path, *args: str):
        for sub in ("kubelet/plugins", "kubelet/plugins_registry", "cdi"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MOCK_NVML_CONFIG": str(config), "LD_LIBRARY_PATH": str(root / LIBRARIES)}
        super().__init__(work, [
            str(NVIDIA_DRA_PLUGIN), "--kubeconfig", str(kubeconfig), "--node-name", node,
            "--cdi-root", str(work / "cdi"), "--nvidia-driver-root", str(root), "--container-driver-root", str(root),
            "--nvidia-cdi-hook-path", "/bin/true", "--image-name", "example/dra:dev",
            "--kubelet-registrar-directory-path", str(work / "kubelet" / "plugins_registry"),
            "--kubelet-plugins-directory-path", str(work / "kubelet" / "plugins"), "--healthcheck-port", "-1",
            "-v", "4", *args], env)

    @property
    def checkpoint(self) -> Path:
        return self.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"


class GpudDraPlugin(Plugin):
    """`gpud dra-plugin`, a client of gpud's socket."""

    name = "gpud"

    def __init__(self, work: Path, kubeconfig: Path, node: str, gpud_socket: Path, *args: str):
        for sub in ("kubelet", "cdi"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        super().__init__(work, [
            sys.executable, "-m", "gpud", "dra-plugin", "--kubeconfig", str(kubeconfig), "--node-name", node,
            "--socket", str(gpud_socket), "--kubelet-dir", str(work / "kubelet"), "--cdi-dir", str(work / "cdi"),
            "--log-format", "json", *args], {**os.environ, "KUBECONFIG": ""})


def allocated_claim(kube, name: str, device: str, node: str, namespace: str = "default") -> tuple[str, str, str]:
    """A claim the scheduler allocated `device` of the node's pool: (namespace, name, uid)."""
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
    results = [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]
    claim = kube.create_resource_claim(namespace, name, requests, results, node=node)
    return namespace, name, claim["metadata"]["uid"]


def devices_of(kube, node: str) -> dict[str, dict]:
    return {d["name"]: d for s in kube.resource_slices(node, DRIVER) for d in s["spec"].get("devices") or []}


def pool_generation(kube, node: str) -> int | None:
    generations = [s["spec"]["pool"]["generation"] for s in kube.resource_slices(node, DRIVER)]
    return max(generations) if generations else None


class SideBySide:
    """The two plugins on the same mock node (one driver root, one mock config), each against its own API
    server stand-in as node `node` of driver gpu.nvidia.com: `kubes` and `plugins` by "nvidia" and "gpud";
    `gpud` the gpud serve process (real NVML backend on the mock) gpud's plugin reads. `nvidia`: False
    leaves NVIDIA's plugin out (the benchmark without ../shared's binary or root); `nvidia_args` are added
    to its command line."""

    def __init__(self, work: Path, mock: Path, config: Path, node: str = "node1", nvidia: bool = True,
                 server_version: str = "1.34", gpus: int = 8, nvidia_args: tuple[str, ...] = ()):
        from helpers import GpudProcess
        from kube_api_stand_in import KubeApiStandIn

        self.work, self.node = work, node
        self.kubes: dict = {}
        self.plugins: dict[str, Plugin] = {}
        self.gpud = None
        try:
            self.root = driver_root(work / "root", mock, gpus)
            for name in ("nvidia", "gpud") if nvidia else ("gpud",):
                kube = self.kubes[name] = KubeApiStandIn(server_version=server_version)
                kube.create_node(node)
                kube.bind_rbac("dra", DRA_RULES)
            if nvidia:
                self.plugins["nvidia"] = NvidiaDraPlugin(work / "nvidia", self.kubes["nvidia"].kubeconfig("dra"),
                                                         node, self.root, config, *nvidia_args)
            (work / "g").mkdir()
            (work / "gpud.yaml").write_text(
                f"mig:\n  layouts_file: {work / 'absent.yaml'}\n"
                f"cdi:\n  spec_dir: {work / 'gcdi'}\n  dev_root: {self.root}\n  driver_root: {self.root}\n")
            self.gpud = GpudProcess(work / "g", "--config", str(work / "gpud.yaml"),
                                    env={"MOCK_NVML_CONFIG": str(config), "LD_LIBRARY_PATH": str(self.root / LIBRARIES)})
            self.gpud.wait_healthy(60)
            self.plugins["gpud"] = GpudDraPlugin(work / "gpud", self.kubes["gpud"].kubeconfig("dra"), node,
                                                 self.gpud.socket)
            for plugin in self.plugins.values():
                plugin.wait_serving()
        except BaseException:
            self.stop()
            raise

    def devices(self, name: str) -> dict[str, dict]:
        return devices_of(self.kubes[name], self.node)

    def wait_published(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while any(len(self.devices(name)) < count for name in self.plugins):
            for plugin in self.plugins.values():
                plugin.alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"not {count} devices published in {timeout} s: "
                                     f"{ {name: sorted(self.devices(name)) for name in self.plugins} }")
            time.sleep(0.05)

    def stop(self) -> None:
        for plugin in self.plugins.values():
            plugin.stop()
        if self.gpud is not None:
            self.gpud.stop()
        for kube in self.kubes.values():
            kube.stop()
