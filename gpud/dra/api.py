"""The kubelet's DRA APIs' generated modules: the DRAPlugin service v1 and v1beta1, the plugin watcher's
registration and the DRA resource health service (the .proto files beside this one), generated when gpud
is built."""

from __future__ import annotations

try:
    from gpud.dra import dra_health_pb2 as health_pb
    from gpud.dra import dra_health_pb2_grpc as health_rpc
    from gpud.dra import dra_v1_pb2 as v1_pb
    from gpud.dra import dra_v1_pb2_grpc as v1_rpc
    from gpud.dra import dra_v1beta1_pb2 as v1beta1_pb
    from gpud.dra import dra_v1beta1_pb2_grpc as v1beta1_rpc
    from gpud.dra import pluginregistration_pb2 as registration_pb
    from gpud.dra import pluginregistration_pb2_grpc as registration_rpc
except ImportError as exc:  # a source tree that was never built
    raise ImportError("gpud/dra/*_pb2*.py are missing: they are generated from the .proto files when gpud is "
                      "built; run `pip install -e .` (or build the package)") from exc

# PluginInfo.type of a DRA plugin (k8s.io/kubelet pkg/apis/pluginregistration/v1/constants.go DRAPlugin)
PLUGIN_TYPE = "DRAPlugin"
# The gRPC services the plugin serves, as PluginInfo.supported_versions names them (k8s.io/kubelet
# pkg/apis/dra/v1/types.go DRAPluginService, v1beta1/types.go, dra-health/v1alpha1/types.go): the kubelet
# takes the first of the list it supports (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go
# validateSupportedServices), so v1 comes first; a 1.32-1.33 kubelet knows only v1beta1.
V1_SERVICE = "v1.DRAPlugin"
V1BETA1_SERVICE = "v1beta1.DRAPlugin"
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
SUPPORTED_SERVICES = (V1_SERVICE, V1BETA1_SERVICE, HEALTH_SERVICE)

__all__ = ["HEALTH_SERVICE", "PLUGIN_TYPE", "SUPPORTED_SERVICES", "V1BETA1_SERVICE", "V1_SERVICE", "health_pb",
           "health_rpc", "registration_pb", "registration_rpc", "v1_pb", "v1_rpc", "v1beta1_pb", "v1beta1_rpc"]
