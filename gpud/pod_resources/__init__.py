"""Which pod's containers hold which GPU and MIG device, from the kubelet's PodResources API (List), for the
Kubernetes labels of /metrics (dcgm-exporter's `pod`, `namespace`, `container` and `dra_*`).

`gpud serve` imports no grpc or protobuf (it runs on the pure-Python tree: packaging/README.md,
"Interpreters"), so List is called with a small gRPC client of its own: HTTP/2 over the kubelet's Unix
socket by python-hyper's h2, pure Python (`grpc_unary`), and the proto's wire format read by hand
(`messages`). The reader
(`reader`) asks in a thread of its own, on a bounded schedule and with a deadline; the labels (`labels`)
are worked out from its last answer at render time.
"""
