"""The kubelet APIs' generated modules: the device plugin API (api.proto) and the PodResources API
(podresources.proto), generated when gpud is built."""

from __future__ import annotations

try:
    from gpud.device_plugin import api_pb2 as pb
    from gpud.device_plugin import api_pb2_grpc as rpc
    from gpud.device_plugin import podresources_pb2 as podresources_pb
    from gpud.device_plugin import podresources_pb2_grpc as podresources_rpc
except ImportError as exc:  # a source tree that was never built
    raise ImportError("gpud/device_plugin/*_pb2*.py are missing: they are generated from the .proto files when "
                      "gpud is built; run `pip install -e .` (or build the package)") from exc

API_VERSION = "v1beta1"  # RegisterRequest.version the kubelet accepts for this API
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"  # the kubelet's constants for Device.health

__all__ = ["API_VERSION", "HEALTHY", "UNHEALTHY", "pb", "podresources_pb", "podresources_rpc", "rpc"]
