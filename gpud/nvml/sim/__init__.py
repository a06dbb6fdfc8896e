"""A simulated NVML backend with the pynvml module surface, for machines without NVIDIA GPUs."""

from .errors import SimError
from .models import GpuModel
from .presets import PRESETS, PresetError, parse_preset
from .simulator import SimulatedNvml

__all__ = ["PRESETS", "GpuModel", "PresetError", "SimError", "SimulatedNvml", "parse_preset"]
