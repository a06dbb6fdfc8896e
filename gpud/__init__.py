"""gpud: the node daemon that owns the NVIDIA GPUs of one host."""

__version__ = "0.1.0"
