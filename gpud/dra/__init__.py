"""`gpud dra-plugin`: a Kubernetes DRA kubelet plugin (resource.k8s.io/v1) that is a client of gpud's socket
and of the Kubernetes API. Nothing here talks to NVML."""

from pathlib import Path

# NVIDIA's driver name (kubernetes-sigs/dra-driver-nvidia-gpu): DeviceClasses and claims written for it
# select gpud's devices unchanged.
DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
# The kubelet's --root-dir default: plugins_registry/ and plugins/ are under it.
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet")
# Where container runtimes read CDI specs by default (the CDI spec's dynamic directory).
DEFAULT_CDI_DIR = Path("/var/run/cdi")
