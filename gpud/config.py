"""gpud's one configuration model: typed sections with defaults, loaded from YAML and validated.

Every key here is documented in the shipped etc/gpud/gpud.yaml. A bad file raises ConfigError,
which names the file, the key path and (where the YAML says) the line.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from gpud.base.places import (DEFAULT_CONFIG_PATH, LOG_FORMATS, LOG_LEVELS, SYSTEM_STATE_DIR,
                              user_runtime_dir)
from gpud.base.quantity import parse_quantity
from gpud.base.yamlfile import compose_yaml, read_yaml_text
from gpud.model.driver import driver_branch
from gpud.model.names import (check_config_name, check_dns_label, check_extended_resource_name,
                              check_qualified_name)

NFD_FEATURES_FILE = Path("/etc/kubernetes/node-feature-discovery/features.d/gpud")


class ConfigError(Exception):
    """A configuration file or value that gpud will not start with."""

    def __init__(self, source: str, key: str | None, message: str, line: int | None = None):
        self.source, self.key, self.line, self.reason = source, key, line, message
        where = source
        if line is not None:
            where += f", line {line}"
        if key:
            where += f", key '{key}'"
        super().__init__(f"{where}: {message}")
        self.errors = [self]


class ConfigErrors(ConfigError):
    """Every error found in one file (more than one), in the file's order: the first one's source, key
    and line are this error's, the message lists them all, one a line."""

    def __init__(self, errors: list[ConfigError]):
        first = errors[0]
        self.source, self.key, self.line, self.reason = first.source, first.key, first.line, first.reason
        self.errors = errors
        Exception.__init__(self, f"{first.source}: {len(errors)} errors:\n" + "\n".join(f"  {e}" for e in errors))


def config_error(errors: list[ConfigError]) -> ConfigError:
    """The one error to raise for errors: itself when there is one."""
    return errors[0] if len(errors) == 1 else ConfigErrors(errors)


class _SectionInvalid(Exception):
    """A section had errors, each already recorded in the list being collected."""


def _bounded(low: float | None = None, high: float | None = None, choices: tuple = ()) -> dict:
    return {"low": low, "high": high, "choices": choices}


# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")


def listen_address(text: str) -> tuple[str, int]:
    """Splits host:port (an IPv4 address, a host name, or an IPv6 address in brackets) -> (host, port).
    ValueError says what is wrong. An empty host (":9400", all interfaces to Go programs such as
    dcgm-exporter) is refused: TCP has no authentication, so every interface must be asked for."""
    host, colon, port = text.rpartition(":")
    if not colon:
        raise ValueError(f"expected host:port such as 127.0.0.1:9400; got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"an IPv6 address goes in brackets, as [::1]:9400; got {text!r}")
    elif not host:
        raise ValueError(f"no host in {text!r}: give 127.0.0.1:PORT for this node only, or 0.0.0.0:PORT "
                         "for every interface (anyone who reaches it can read the metrics)")
    elif re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"{host!r} is not an IP address or a host name")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"the port must be a number from 1 to 65535; got {port!r}")
    return host, int(port)


@dataclass(frozen=True)
class ApiConfig:
    # None means "pick by who runs gpud": /run/gpud/gpud.sock for root, $XDG_RUNTIME_DIR otherwise.
    socket: str | None = None
    # Seconds a connection may stay idle (or stay silent before its first request) before it is closed.
    idle_timeout_s: float = field(default=15.0, metadata=_bounded(0.1, 3600))
    # Seconds a client has to send a request body once its headers arrived.
    body_timeout_s: float = field(default=10.0, metadata=_bounded(0.1, 600))
    # Seconds in-flight requests get to finish when gpud stops.
    shutdown_timeout_s: float = field(default=10.0, metadata=_bounded(0, 300))
    # Connections open at once: in all (admins may use every one), from one non-admin uid, and how
    # many of all only admins may use. Beyond them /healthz is answered and anything else gets 429/503.
    max_connections: int = field(default=1024, metadata=_bounded(2, 60000))
    max_connections_per_peer: int = field(default=64, metadata=_bounded(1, 60000))
    admin_reserved_connections: int = field(default=64, metadata=_bounded(1, 60000))
    # The socket is mode 0660, owned by root and this group (when gpud runs as root and the group
    # exists): its members may read. Changing routes need root or membership of admin_group.
    group: str = "gpud"
    admin_group: str = "gpud-admin"


@dataclass(frozen=True)
class LogConfig:
    level: str = field(default="info", metadata=_bounded(choices=LOG_LEVELS))
    format: str = field(default="auto", metadata=_bounded(choices=LOG_FORMATS))


@dataclass(frozen=True)
class InventoryConfig:
    # Seconds between full re-reads of the node, on top of the re-reads after every change gpud makes.
    refresh_interval_s: float = field(default=30.0, metadata=_bounded(1, 3600))


@dataclass(frozen=True)
class NvmlConfig:
    # Back-off between NVML initialisation attempts while the driver is missing: doubles up to the maximum.
    init_retry_initial_s: float = field(default=1.0, metadata=_bounded(0.01, 600))
    init_retry_max_s: float = field(default=60.0, metadata=_bounded(0.01, 3600))


@dataclass(frozen=True)
class MigHooksConfig:
    # Shell commands run (in order, by /bin/sh) before and after a MIG change, only when a GPU changes:
    # e.g. stopping and starting services that hold the GPUs. $GPUD_MIG_LAYOUT and $GPUD_MIG_GPUS
    # (comma-separated indices) say what changes. A failing pre_apply command cancels the apply.
    pre_apply: tuple[str, ...] = ()
    post_apply: tuple[str, ...] = ()
    timeout_s: float = field(default=300.0, metadata=_bounded(1, 3600))


@dataclass(frozen=True)
class MigConfig:
    # Named layouts in mig-parted's v1 format; when the file is absent, the layouts shipped with gpud.
    layouts_file: str = "/etc/gpud/mig-layouts.yaml"
    # A layout applied at start, as mig-manager applies its selected config at boot.
    default_layout: str | None = None
    # An Ampere GPU needs a reset for a MIG mode change; false reports "reset-required" instead.
    allow_gpu_reset: bool = True
    hooks: MigHooksConfig = MigHooksConfig()


@dataclass(frozen=True)
class MpsConfig:
    # Run NVIDIA's MPS control daemon (nvidia-cuda-mps-control) for the devices below.
    enabled: bool = False
    # "all": one daemon per GPU, or per MIG device on a GPU in MIG mode. Or a list of GPU indices,
    # GPU UUIDs (a GPU in MIG mode: one daemon per MIG device) and MIG device UUIDs.
    # `devices: all` is taken as a plain word too, as mig-parted's and the device plugin's files write it.
    devices: tuple[str | int, ...] = field(default=("all",), metadata={"or_word": "all"})
    # Default share of SMs a client may use, in percent (1 to 100). Unset: MPS's own default (100).
    active_thread_percentage: float | None = field(default=None, metadata=_bounded(1, 100))
    # Default device memory a client may pin, per device: in MiB, or as a percent of the device's
    # memory. At most one of the two. Unset: no limit.
    pinned_memory_limit_mib: int | None = field(default=None, metadata=_bounded(1, 1 << 30))
    pinned_memory_limit_percent: float | None = field(default=None, metadata=_bounded(1, 100))
    # The control binary: a name looked up on PATH, or a path.
    control_binary: str = "nvidia-cuda-mps-control"
    # Each daemon gets <pipe_root>/<name>/pipe (CUDA_MPS_PIPE_DIRECTORY) and <log_root>/<name>.
    # Unset: mps/ in the runtime directory (/run/gpud/mps as root); /var/log/gpud/mps as root,
    # mps-logs/ in the state directory otherwise.
    pipe_root: str | None = None
    log_root: str | None = None
    # The user the MPS control daemon (and so its servers) runs as. Unset: gpud's own user.
    user: str | None = None
    # Seconds between liveness checks of each daemon; a dead one is restarted with back-off.
    check_interval_s: float = field(default=1.0, metadata=_bounded(0.1, 60))


@dataclass(frozen=True)
class GpuMemoryConfig:
    # Advertise GPU memory as a resource for the device plugin, in units of unit_mib: a pod asking for
    # k units gets k * unit_mib of one device's memory, enforced as an MPS client limit. The devices
    # covered run MPS daemons (also when mps.enabled is false) whose limits are set per client.
    enabled: bool = False
    # The extended resource name pods request, e.g. aliyun.com/gpu-mem as Alibaba's ACK names it.
    resource: str = field(default="nvidia.com/gpu-memory", metadata={"check": check_extended_resource_name})
    # MiB in one unit (at least 1). A device offers floor(its memory less what the driver reserves / unit_mib).
    unit_mib: int = field(default=1024, metadata=_bounded(1, 1 << 30))
    # "all": every GPU not in MIG mode. Or a list of GPU indices, GPU UUIDs (a GPU in MIG mode: each
    # of its MIG devices) and MIG device UUIDs: MIG devices are covered only where listed.
    devices: tuple[str | int, ...] = field(default=("all",), metadata={"or_word": "all"})
    # Allocate also sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the units' share of the device's memory.
    proportional_threads: bool = False


def memory_quantity_mib(text: str) -> int:
    """A memory quantity such as 10Gi in whole MiB, or ValueError: MPS pins device memory in MiB (NVIDIA's
    dra-driver-nvidia-gpu cmd/gpu-kubelet-plugin/sharing.go, limit.Megabyte), so a share's memory is too."""
    size = parse_quantity(text.strip())
    if size <= 0 or size % (1 << 20):
        raise ValueError(f"{text.strip()!r} is not a positive whole number of MiB (1Mi, 512Mi, 10Gi)")
    return int(size) >> 20


@dataclass(frozen=True)
class ShareMemoryPolicy:
    # The request policy of a shared GPU's `memory` capacity (KEP-5075's requestPolicy: a claim that
    # asks for none gets `default`; one that asks for less than `min` gets `min`, rounded up to a
    # `step`). Kubernetes quantities, whole MiB. default unset: the GPU's whole offered memory (NVIDIA's
    # dra-driver-nvidia-gpu consumable_shares.go, option "memory"); it must be a multiple of step.
    default: str | None = field(default=None, metadata={"check": memory_quantity_mib})
    min: str = field(default="1Mi", metadata={"check": memory_quantity_mib})
    step: str = field(default="1Mi", metadata={"check": memory_quantity_mib})


@dataclass(frozen=True)
class ShareComputePolicy:
    # The request policy of a shared GPU's `compute` capacity: the percent of its SMs a claim's MPS
    # clients may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); default a multiple of step, at least min.
    default: int = field(default=100, metadata=_bounded(1, 100))
    min: int = field(default=1, metadata=_bounded(1, 100))
    step: int = field(default=1, metadata=_bounded(1, 100))


@dataclass(frozen=True)
class DraConfig:
    # Settings of gpud's side of `gpud dra-plugin` (Kubernetes DRA).
    # GPUs shared by DRA claims with counted memory (KEP-5075 consumable capacity): published with
    # allowMultipleAllocations, each claim holding the memory and compute its allocation consumed,
    # enforced as its MPS client limits, counted in one ledger with gpu_memory's units. "all": every
    # GPU not in MIG mode; or a list of GPU indices and UUIDs (a GPU in MIG mode is not shared).
    shared_gpus: tuple[str | int, ...] = field(default=(), metadata={"or_word": "all"})
    share_memory: ShareMemoryPolicy = ShareMemoryPolicy()
    share_compute: ShareComputePolicy = ShareComputePolicy()
    # GPUs whose MIG devices Kubernetes DRA claims make and destroy, one per claim, at the placement the
    # scheduler chose (gpud.mig.dynamic): GPU indices or UUIDs, or `all` (every MIG-capable GPU). MIG
    # layouts leave these GPUs alone. Empty: every GPU keeps its static MIG layout.
    dynamic_mig_gpus: tuple[str | int, ...] = field(default=(), metadata={"or_word": "all"})


@dataclass(frozen=True)
class SharingFileConfig:
    # Time-slicing and MPS replicas in the k8s-device-plugin config format. A missing file: no sharing.
    file: str = "/etc/gpud/sharing.yaml"
    # A directory of named configs in that format, one file per name, as a mounted ConfigMap gives
    # them. The one in force: the name chosen with PUT /v1/sharing/config when the directory holds
    # it, else default_config, else `file`. Unset: `file` alone.
    configs_dir: str | None = None
    # The name used while none is chosen; one missing from configs_dir is reported, not fatal.
    default_config: str | None = field(default=None, metadata={"check": check_config_name})


@dataclass(frozen=True)
class KubernetesConfig:
    # Settings of `gpud k8s-agent`, which reads them from GET /v1/kubernetes.
    # Taint the node nvidia.com/gpu.unhealthy:NoSchedule while a GPU needs a reset, a reboot or
    # hardware inspection.
    taint_unhealthy: bool = False
    # Seconds a MIG change asked by the node label waits for busy MIG devices before it fails.
    mig_busy_timeout_s: float = field(default=3600.0, metadata=_bounded(0, 7 * 86400))


def absolute_path(text: str) -> str:
    """The path, or ValueError when it is not absolute (a file another program looks for by its path)."""
    if not text.startswith("/"):
        raise ValueError(f"must be an absolute path; got {text[:80]!r}")
    return text


@dataclass(frozen=True)
class RemediationConfig:
    # A GPU that needs a reset brought back to service without a person: `gpud k8s-agent` and `gpud slurm
    # health` read these settings from GET /v1/remediation and remediate only when enabled.
    enabled: bool = False
    # Log (and show) every step the loop would take, and take none.
    dry_run: bool = False
    # gpu: evict the pods that use the sick GPU; node: every pod kubectl drain would evict.
    evict: str = field(default="gpu", metadata=_bounded(choices=("gpu", "node")))
    # The evictions' deleteOptions.gracePeriodSeconds; unset: each pod's own.
    grace_period_s: int | None = field(default=None, metadata=_bounded(0, 86400))
    # A pod with this annotation set to "true" is waited for, never evicted.
    opt_out_annotation: str = field(default="nvidia.com/gpu.remediation-opt-out",
                                    metadata={"check": check_qualified_name})
    # Waiting longer than this for the GPU to be free escalates.
    drain_timeout_s: float = field(default=3600.0, metadata=_bounded(5, 7 * 86400))
    # At most this many nodes of a pool remediate at once, each holding a Lease of lease_namespace.
    max_nodes: int = field(default=1, metadata=_bounded(1, 1000))
    # The node label whose value names the node's pool; unset: the cluster is one pool.
    pool_label: str | None = field(default=None, metadata={"check": check_qualified_name})
    lease_namespace: str = field(default="gpud-system", metadata={"check": check_dns_label})
    # A node that dies holding a slot loses it this long after its last renewal.
    lease_duration_s: int = field(default=60, metadata=_bounded(10, 3600))
    # How a GPU that needs a reboot marks its node for the operators' reboot manager: none, annotation
    # (nvidia.com/gpu.reboot-required on the node) or kured (kured's sentinel file, reboot_sentinel).
    reboot_marker: str = field(default="none", metadata=_bounded(choices=("none", "annotation", "kured")))
    reboot_sentinel: str = field(default="/var/run/reboot-required", metadata={"check": absolute_path})
    # Slurm: `scontrol reboot ASAP nextstate=RESUME reason=...` when a GPU needs a reboot.
    slurm_reboot: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    # host:port ("[::1]:9400" for IPv6) of a read-only TCP listener serving only GET /metrics, for
    # Prometheus, which cannot scrape a Unix socket. Unset: /metrics is served on the socket only.
    listen: str | None = field(default=None, metadata={"check": listen_address})
    # Serve the per-process series (gpud_process_*) on metrics.listen too. They name every local
    # user's GPU processes: pid, command name, container runtime and ID, pod UID, systemd unit; and
    # the TCP listener has no authentication, so anyone who reaches it would learn them. false: they
    # are served only on the socket's /metrics, to api.group.
    listen_process_series: bool = False
    # The kubelet's PodResources socket, read for the Kubernetes labels of the GPU and MIG series (pod,
    # namespace, container, and dra_* for DRA claims, as dcgm-exporter writes them). Unset: the kubelet's
    # /var/lib/kubelet/pod-resources/kubelet.sock, whenever it exists; on a simulated node none unless
    # set. "": not read, no such labels.
    pod_resources_socket: str | None = None
    # Seconds between reads of it, and how long one may take. An answer older than three refreshes
    # labels nothing.
    pod_resources_refresh_s: float = field(default=10.0, metadata=_bounded(1, 3600))
    pod_resources_timeout_s: float = field(default=5.0, metadata=_bounded(0.1, 60))
    # Serve the Kubernetes labels on metrics.listen too. They name the node's pods and namespaces, and
    # the TCP listener has no authentication. false: they are on the socket's /metrics only.
    listen_pod_labels: bool = False


@dataclass(frozen=True)
class HealthConfig:
    # Seconds between periodic checks (temperature, clocks, ECC counters, row remapping, power, MPS).
    check_interval_s: float = field(default=5.0, metadata=_bounded(0.5, 3600))
    # A reason found by a periodic check clears after this many passing checks in a row (no flapping).
    clear_after_passes: int = field(default=3, metadata=_bounded(1, 100))
    # XIDs caused by applications, which leave a device healthy (logged and counted only).
    # Unset: 13, 31, 43, 45, 68, 109, as NVIDIA's device plugin.
    application_xids: tuple[int, ...] | None = None
    # XIDs that never affect health; and XIDs that always do, even when listed as application XIDs.
    ignored_xids: tuple[int, ...] = ()
    unhealthy_xids: tuple[int, ...] = ()
    # Read XIDs from the kernel log (host.kmsg) too, for those NVML's events missed (NVML down, before
    # gpud started); each is counted once however many sources report it.
    kernel_log: bool = True
    # The same GPU needing a node reboot this many times within the window (counted across restarts)
    # escalates to inspect-hardware: a reboot does not fix it.
    reboot_escalation_count: int = field(default=3, metadata=_bounded(2, 100))
    reboot_escalation_window_h: float = field(default=24.0, metadata=_bounded(1, 24 * 90))
    # Reset a GPU by itself when the driver's recovery action is a GPU reset and nothing holds it
    # (the reset path of POST /v1/gpus/{id}/reset, with its checks and its refusal when held), at most
    # auto_reset_max_per_hour times an hour on the node. Never a GPU with processes.
    auto_reset: bool = False
    auto_reset_max_per_hour: int = field(default=2, metadata=_bounded(1, 60))
    # InfiniBand/RoCE ports under <host.sysfs>/class/infiniband as health subjects, and GPUDirect
    # RDMA's nvidia_peermem module checked where InfiniBand is present.
    infiniband: bool = True
    peermem: bool = True
    # The Fabric Manager service checked on nodes with local NVSwitches (HGX/DGX A100, H100, B200).
    fabric_manager_unit: str = "nvidia-fabricmanager.service"
    # DCGM's dcgmi for `gpud check` (POST /v1/check). Unset: dcgmi on PATH.
    dcgmi: str | None = None
    check_timeout_s: float = field(default=1800.0, metadata=_bounded(10, 7200))
    # Profiling metrics (DCGM_FI_PROF_*) from NVML's GPM on the GPUs that have it (Hopper and later), per GPU
    # and GPU instance, each over the last profiling interval: one GPM sample per device per interval.
    profiling: bool = True
    profiling_interval_s: float = field(default=10.0, metadata=_bounded(1, 3600))


@dataclass(frozen=True)
class HostConfig:
    # Where the host's procfs, sysfs and kernel log are (node_exporter's --path.procfs/--path.sysfs),
    # for gpud in a container with the host's mounted elsewhere. Unset: /proc, /sys and /dev/kmsg; on a
    # simulated node the simulator's own beside its state (<sim state>.procfs, .sysfs, .kmsg).
    procfs: str | None = None
    sysfs: str | None = None
    kmsg: str | None = None


@dataclass(frozen=True)
class CdiConfig:
    # Write a CDI spec (gpud-gpu.json, kind gpud/gpu) of the node's GPUs, MIG devices and replicas,
    # rewritten on every change, so container runtimes can be handed `--device gpud/gpu=<name>`.
    enabled: bool = True
    # The directory runtimes read specs from. Unset: /var/run/cdi; on a simulated node <state dir>/cdi, so
    # simulated devices never reach the host's runtimes unless this is set, and two simulated nodes of one
    # user (each its own state directory, which one gpud at a time holds) never write one spec.
    spec_dir: str | None = None
    # The host root device nodes are found under (/dev/nvidia0 is <dev_root>/dev/nvidia0); the
    # container path stays /dev/... Only nodes that exist there go in the spec. Unset: /; on a
    # simulated node the simulator's device nodes beside its state file.
    dev_root: str | None = None
    # The driver's table of MIG capability minors. Unset: /proc/driver/nvidia-caps/mig-minors; on a
    # simulated node the simulator's copy beside its state file.
    mig_minors: str | None = None
    # Carry the host driver's user-space files as nvidia-ctk cdi generate does, for the driver version
    # NVML reports: its libraries (from the ld.so.cache), nvidia-smi and the other binaries, GSP
    # firmware, the persistenced and Fabric Manager sockets, and hooks of gpud's own that make the
    # libraries' .so.1 links and the container's linker cache. false: device nodes only, the driver's
    # files left to whatever gives them to containers (NVIDIA's runtime hook, nvidia-ctk's spec).
    driver_files: bool = True
    # The root the driver's files are found under (its etc/ld.so.cache, usr/bin, lib/firmware, run).
    # Unset: /; on a simulated node the simulated driver's file tree beside its state file.
    driver_root: str | None = None


@dataclass(frozen=True)
class NfdConfig:
    # Write Node Feature Discovery's local feature file (nvidia.com/... labels: sharing, MIG layout
    # and its state, health), rewritten on every change. false: none, and gpud's old file is removed.
    enabled: bool = True
    # Unset: NFD's features.d/gpud; on a simulated node <state dir>/nfd/gpud, so simulated GPUs never
    # label the host unless this is set, and two simulated nodes never write one file (as cdi.spec_dir).
    features_file: str | None = None
    # Seconds NFD keeps the labels after gpud's last write (the file's `# +expiry-time`). gpud rewrites
    # the file every half of it, so only a gpud that stopped lets its labels expire.
    expiry_s: float = field(default=600.0, metadata=_bounded(10, 86400))


@dataclass(frozen=True)
class SlurmConfig:
    # Where gpud keeps Slurm's gres.conf of this node's GPUs, MIG devices, shards and MPS (GET
    # /v1/slurm/gres). Unset: no file; the API and `gpud slurm gres` still serve the text.
    gres_file: str | None = None
    # Run `<scontrol> reconfigure` after each write that changed the file, so slurmd re-reads it.
    reconfigure: bool = False
    scontrol: str = "scontrol"
    reconfigure_timeout_s: float = field(default=30.0, metadata=_bounded(1, 600))


@dataclass(frozen=True)
class Config:
    api: ApiConfig = ApiConfig()
    log: LogConfig = LogConfig()
    inventory: InventoryConfig = InventoryConfig()
    nvml: NvmlConfig = NvmlConfig()
    mig: MigConfig = MigConfig()
    mps: MpsConfig = MpsConfig()
    sharing: SharingFileConfig = SharingFileConfig()
    gpu_memory: GpuMemoryConfig = GpuMemoryConfig()
    dra: DraConfig = DraConfig()
    health: HealthConfig = HealthConfig()
    host: HostConfig = HostConfig()
    metrics: MetricsConfig = MetricsConfig()
    cdi: CdiConfig = CdiConfig()
    nfd: NfdConfig = NfdConfig()
    slurm: SlurmConfig = SlurmConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    remediation: RemediationConfig = RemediationConfig()
    state_dir: str | None = None
    # A simulated node instead of the real NVML (a preset name or a spec such as "A100-SXM4-40GB:2,T4:1").
    simulate: str | None = None
    # Where the simulated node keeps its GPU state; None = sim-<preset>.json in the runtime directory.
    sim_state: str | None = None
    # The NVIDIA driver version the simulated node behaves as ("535.183.01", "550.90.07", "580.65.06"):
    # driver branches differ in what NVML answers. None = the simulator's default.
    sim_driver: str | None = None
    # The older name of host.sysfs, still read; give one of the two.
    sysfs: str | None = None

    def with_overrides(self, **changes: Any) -> "Config":
        """Returns a copy with the non-None top-level or dotted ("api.socket") values applied."""
        result = self
        for dotted, value in changes.items():
            if value is None:
                continue
            section, _, key = dotted.partition(".")
            if key:
                result = dataclasses.replace(
                    result, **{section: dataclasses.replace(getattr(result, section), **{key: value})}
                )
            else:
                result = dataclasses.replace(result, **{section: value})
        return _check_consistency(result, "command line")

    # -- derived locations -------------------------------------------------------------------

    @property
    def runtime_dir(self) -> Path:
        if self.api.socket:
            return Path(self.api.socket).parent
        return Path(user_runtime_dir())

    @property
    def socket_path(self) -> Path:
        return Path(self.api.socket) if self.api.socket else Path(user_runtime_dir(), "gpud.sock")

    @property
    def state_path(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        if os.geteuid() == 0:
            return Path(SYSTEM_STATE_DIR)
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "gpud"

    @property
    def mps_pipe_root(self) -> Path:
        return Path(self.mps.pipe_root) if self.mps.pipe_root else self.runtime_dir / "mps"

    @property
    def mps_log_root(self) -> Path:
        if self.mps.log_root:
            return Path(self.mps.log_root)
        return Path("/var/log/gpud/mps") if os.geteuid() == 0 else self.state_path / "mps-logs"

    @property
    def cdi_spec_path(self) -> Path:
        if self.cdi.spec_dir:
            return Path(self.cdi.spec_dir)
        return self.state_path / "cdi" if self.simulate else Path("/var/run/cdi")

    @property
    def pod_resources_socket_path(self) -> Path | None:
        """metrics.pod_resources_socket: the kubelet's when unset (but on a simulated node), None when off."""
        setting = self.metrics.pod_resources_socket
        if setting is None:  # kubernetes/kubernetes pkg/kubelet/config/defaults.go DefaultPodResourcesDirName
            # under the kubelet's root directory (/var/lib/kubelet), dcgm-exporter's default too (pkg/cmd/app.go)
            return None if self.simulate else Path("/var/lib/kubelet/pod-resources/kubelet.sock")
        return Path(setting) if setting else None

    def _node_path(self, setting: str | None, simulated_suffix: str, real: str) -> Path:
        """A path of the node's (the driver's files, device nodes, sysfs): as set; unset, on a simulated
        node the simulator's own beside its state (<sim state><simulated_suffix>), on a real one the host's."""
        if setting:
            return Path(setting)
        if self.simulate:
            state = self.sim_state_path
            return state.with_name(state.name + simulated_suffix)
        return Path(real)

    @property
    def cdi_dev_root(self) -> Path:
        return self._node_path(self.cdi.dev_root, ".dev", "/")

    @property
    def cdi_driver_root(self) -> Path:
        return self._node_path(self.cdi.driver_root, ".driver", "/")

    @property
    def sysfs_path(self) -> Path:
        return self._node_path(self.host.sysfs or self.sysfs, ".sysfs", "/sys")

    @property
    def cpu_topology_sysfs(self) -> Path:
        """The sysfs gres.conf's Cores= are read from. A simulated node's own sysfs (sysfs_path) holds its
        GPUs' PCI devices but no devices/system/cpu: its GPUs' affinity names the host's CPUs, so the
        host's topology is read there too, /sys unless host.sysfs is set."""
        return Path(self.host.sysfs or self.sysfs or "/sys")

    @property
    def procfs_path(self) -> Path:
        return self._node_path(self.host.procfs, ".procfs", "/proc")

    @property
    def kmsg_path(self) -> Path:
        return self._node_path(self.host.kmsg, ".kmsg", "/dev/kmsg")

    @property
    def mig_minors_path(self) -> Path:
        return self._node_path(self.cdi.mig_minors, ".mig-minors", "/proc/driver/nvidia-caps/mig-minors")

    @property
    def nfd_features_path(self) -> Path:
        if self.nfd.features_file:
            return Path(self.nfd.features_file)
        return self.state_path / "nfd" / "gpud" if self.simulate else NFD_FEATURES_FILE

    @property
    def sim_state_path(self) -> Path | None:
        if not self.simulate:
            return None
        if self.sim_state:
            return Path(self.sim_state)
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.simulate.lower())
        return self.runtime_dir / f"sim-{slug}.json"


# -- loading ---------------------------------------------------------------------------------


def load_config(path: Path | None) -> Config:
    """Reads the config file. path None = the default file, which may be absent (defaults apply)."""
    if path is None:
        if not os.path.exists(DEFAULT_CONFIG_PATH):
            return Config()
        path = Path(DEFAULT_CONFIG_PATH)
    source = str(path)
    try:
        text = read_yaml_text(Path(path), lambda reason, line: ConfigError(source, None, reason, line))
    except FileNotFoundError:
        raise ConfigError(source, None, "file not found") from None
    except OSError as exc:
        raise ConfigError(source, None, f"cannot read: {exc}") from None
    return parse_config(text, source)


def parse_config(text: str, source: str = "<config>") -> Config:
    node, data = compose_yaml(text, lambda reason, line: ConfigError(source, None, reason, line))
    if data is None:
        return Config()
    lines = _key_lines(node)
    errors: list[ConfigError] = []
    try:
        config = _build(Config, data, (), source, lines, errors)
    except ConfigError as exc:  # the document itself is not a mapping
        errors.append(exc)
    except _SectionInvalid:
        pass
    if errors:
        raise config_error(errors)
    return _check_consistency(config, source)


def _key_lines(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    """Maps each mapping key path to the line it is on, so errors can point at it."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, path))
    return lines


def _build(cls: type, data: Any, path: tuple, source: str, lines: dict[tuple, int], errors: list[ConfigError]) -> Any:
    """The section, or _SectionInvalid with each of its keys' errors added to errors (every key is checked)."""
    dotted = ".".join(path) or None
    if not isinstance(data, dict):
        raise ConfigError(source, dotted, f"expected a mapping, got {_type_name(data)}", lines.get(path))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    found = len(errors)
    for key, value in data.items():
        key_path = path + (str(key),)
        try:
            if key not in fields:
                known = ", ".join(sorted(fields))
                raise ConfigError(
                    source, ".".join(key_path), f"unknown key (known keys here: {known})", lines.get(key_path)
                )
            values[key] = _convert(hints[key], fields[key], value, key_path, source, lines, errors)
        except ConfigError as exc:
            errors.append(exc)
        except _SectionInvalid:
            pass
    if len(errors) > found:
        raise _SectionInvalid
    return cls(**values)


def _convert(hint: Any, fld: dataclasses.Field, value: Any, path: tuple, source: str, lines: dict,
             errors: list[ConfigError]) -> Any:
    dotted, line = ".".join(path), lines.get(path)
    if dataclasses.is_dataclass(hint):  # a section whose keys are all commented out is its defaults
        return _build(hint, {} if value is None else value, path, source, lines, errors)
    lists = [t for t in _allowed_types(hint) if typing.get_origin(t) is tuple]
    if lists:  # tuple[X, ...], optionally `| None`
        if value is None and type(None) in _allowed_types(hint):
            return None
        if isinstance(value, str) and value == fld.metadata.get("or_word"):
            return (value,)
        return _convert_list(typing.get_args(lists[0])[0], value, dotted, source, line)
    allowed = _allowed_types(hint)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(source, dotted, "must have a value", line)
    written = value  # as the file has it, for messages: 150, not the float 150.0 it becomes
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not any(isinstance(value, t) and not (t is not bool and isinstance(value, bool)) for t in allowed):
        wanted = " or ".join(_type_label(t) for t in allowed if t is not type(None))
        raise ConfigError(source, dotted, f"expected {wanted}, got {_type_name(value)} {value!r}", line)
    bounds = fld.metadata
    if bounds.get("choices") and value not in bounds["choices"]:
        raise ConfigError(source, dotted, f"must be one of {', '.join(bounds['choices'])}; got {value!r}", line)
    low, high = bounds.get("low"), bounds.get("high")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(source, dotted, f"must be between {low:g} and {high:g}; got {written!r}", line)
    if isinstance(value, str) and not value.strip():
        raise ConfigError(source, dotted, "must not be empty", line)
    if "check" in bounds:  # a value with a syntax of its own: the check's ValueError says what is wrong
        try:
            bounds["check"](value)
        except ValueError as exc:
            raise ConfigError(source, dotted, str(exc), line) from None
    return value


def _check_consistency(config: Config, source: str) -> Config:
    """The config, or every rule between keys it breaks as one error (config_error)."""
    errors = []

    def broken(key: str, message: str) -> None:
        errors.append(ConfigError(source, key, message))

    if config.mps.pinned_memory_limit_mib is not None and config.mps.pinned_memory_limit_percent is not None:
        broken("mps.pinned_memory_limit_percent",
               "set mps.pinned_memory_limit_mib or mps.pinned_memory_limit_percent, not both")
    if not config.gpu_memory.devices:
        broken("gpu_memory.devices", "names no device: give `all` or a list of GPU indices, GPU UUIDs and MIG "
                                     "device UUIDs")
    _check_share_policies(config.dra, broken)
    if config.api.admin_reserved_connections >= config.api.max_connections:
        broken("api.admin_reserved_connections", "must be less than api.max_connections")
    if config.nvml.init_retry_initial_s > config.nvml.init_retry_max_s:
        broken("nvml.init_retry_initial_s", "must not exceed nvml.init_retry_max_s")
    if config.sysfs and config.host.sysfs:
        broken("sysfs", "is the older name of host.sysfs: give one of the two")
    if config.sim_driver is not None and driver_branch(config.sim_driver) is None:
        broken("sim_driver", f"not a driver version such as 535.183.01; got {config.sim_driver!r}")
    if errors:
        raise config_error(errors)
    return config


def _check_share_policies(dra: DraConfig, broken: Callable[[str, str], None]) -> None:
    """A request policy the API server takes (k8s.io/api resource/v1 types.go CapacityRequestPolicyRange:
    default at least min, and a multiple of step)."""
    memory, compute = dra.share_memory, dra.share_compute
    policies = [("dra.share_memory", memory_quantity_mib(memory.min), memory_quantity_mib(memory.step),
                 None if memory.default is None else memory_quantity_mib(memory.default), "MiB"),
                ("dra.share_compute", compute.min, compute.step, compute.default, "percent")]
    for key, low, step, default, unit in policies:
        if default is not None and default < low:
            broken(f"{key}.default", f"{default} {unit} is less than {key}.min ({low} {unit})")
        elif default is not None and default % step:
            broken(f"{key}.default", f"{default} {unit} is not a multiple of {key}.step ({step} {unit})")


def _convert_list(item_hint: Any, value: Any, dotted: str, source: str, line: int | None) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(source, dotted, f"expected a list, got {_type_name(value)}", line)
    allowed = _allowed_types(item_hint)
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, allowed) or (isinstance(item, str) and not item.strip()):
            wanted = " or ".join(_type_label(t) for t in allowed)
            raise ConfigError(source, f"{dotted}[{position}]", f"expected {wanted}, got {_type_name(item)} {item!r}",
                              line)
    return tuple(value)


def _allowed_types(hint: Any) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _type_label(t: type) -> str:
    return {str: "a string", float: "a number", int: "an integer", bool: "true or false"}.get(t, t.__name__)


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "nothing"}.get(type(value), type(value).__name__)
