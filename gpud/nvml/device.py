"""Whole-GPU settings through NVML. Runs on the NVML thread."""

from __future__ import annotations

from typing import Any

_COMPUTE_MODES = {"default": "NVML_COMPUTEMODE_DEFAULT", "exclusive_process": "NVML_COMPUTEMODE_EXCLUSIVE_PROCESS",
                  "prohibited": "NVML_COMPUTEMODE_PROHIBITED"}


def set_compute_mode(nvml: Any, index: int, mode: str) -> None:
    """MPS needs EXCLUSIVE_PROCESS on its GPUs: only the MPS server then opens a context there."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    nvml.nvmlDeviceSetComputeMode(handle, getattr(nvml, _COMPUTE_MODES[mode]))
