"""What health hears from: NVML's events, the kernel log, each GPU's readings and the node's own checks."""
