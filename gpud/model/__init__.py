"""The vocabulary every layer of gpud shares: the inventory's GPUs and MIG devices, the MIG model,
driver versions, the names Kubernetes accepts, dcgm-exporter's labels. Immutable types and
pure functions that import nothing of gpud outside this package (tests/test_architecture.py, "layers"),
as mig-parted's pkg/types (github.com/NVIDIA/mig-parted)."""
