"""`gpud k8s-agent`: one node's gpud and the Kubernetes API, both as a client.

Node labels drive gpud (NVIDIA's GPU operator contracts): `nvidia.com/mig.config` applies a MIG layout
and `nvidia.com/mig.config.state` reports it (mig-manager's values), `nvidia.com/device-plugin.config`
chooses a named sharing config. gpud's health goes back as the Node condition `GPUHealthy`, an opt-in
taint and Events. The agent reads and writes its own Node only (docs/kubernetes.md).
"""

MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
SHARING_CONFIG_LABEL = "nvidia.com/device-plugin.config"
CONDITION_TYPE = "GPUHealthy"
TAINT_KEY = "nvidia.com/gpu.unhealthy"
TAINT_EFFECT = "NoSchedule"
# The value of the taint the agent adds: it removes a taint of its key only when it carries this
# value, so one an operator set by hand (any other value) stays.
TAINT_VALUE = "gpud"
COMPONENT = "gpud-k8s-agent"
