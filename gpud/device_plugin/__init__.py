"""`gpud device-plugin`: a kubelet device plugin (API v1beta1) that is a client of gpud's socket.

state.py holds what the plugin knows of the node; follower.py keeps it current from gpud (/v1/sharing,
/v1/cdi, the MPS client environments, and /v1/watch for when to re-read them); allocation.py answers
Allocate and GetPreferredAllocation from it; endpoint.py is one resource's gRPC server; plugin.py runs
an endpoint per resource and registers each with the kubelet; podresources.py tells gpud which pods hold
gpu-memory units (the kubelet's PodResources API). Nothing here talks to NVML.
"""

from pathlib import Path

# Where the kubelet serves kubelet.sock and plugins put their own sockets (the kubelet's default).
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")
# Where the kubelet serves its PodResources API (pkg/kubelet/apis/podresources/constants.go, the default root dir).
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
