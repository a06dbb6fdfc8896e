"""Opaque handles that are also pynvml's own ctypes pointer types.

NVML puts handles inside structs (nvmlGpuInstanceInfo_t.device, nvmlEventData_t.device, the arrays
filled by nvmlDeviceGetGpuInstances, ...), and a struct field only holds a pointer value. So every
handle is a pointer whose (never dereferenced) address encodes what it refers to; a plain pynvml
pointer copied out of a struct therefore works as a handle too. The subclasses below add equality,
hashing and a readable repr on top.

Address layout (bits): 62-56 tag 0x51 | 55-48 kind | 47-40 GPU index | 39-32 GI id | 31-24 CI id |
23-0 serial. The serial tells a live GI/CI from a destroyed one that had the same id.
"""

from __future__ import annotations

import ctypes
import enum
from typing import NamedTuple

import pynvml

_TAG = 0x51
SERIAL_MASK = 0xFFFFFF


class Kind(enum.IntEnum):
    GPU = 1
    MIG_DEVICE = 2
    GPU_INSTANCE = 3
    COMPUTE_INSTANCE = 4
    EVENT_SET = 5
    GPM_SAMPLE = 6


class HandleRef(NamedTuple):
    kind: Kind
    gpu: int = 0
    gpu_instance: int = 0
    compute_instance: int = 0
    serial: int = 0


def _encode(ref: HandleRef) -> int:
    fields = (_TAG, ref.kind, ref.gpu, ref.gpu_instance, ref.compute_instance)
    prefix = 0
    for value in fields:
        prefix = prefix << 8 | value
    return prefix << 24 | ref.serial


def _address(pointer: ctypes._Pointer) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def decode(obj: object) -> HandleRef | None:
    """What a handle refers to, or None when `obj` is not a simulator handle."""
    if not isinstance(obj, ctypes._Pointer):
        return None
    address = _address(obj)
    if address >> 56 != _TAG:
        return None
    kind, gpu, gpu_instance, compute_instance = ((address >> shift) & 0xFF for shift in (48, 40, 32, 24))
    try:
        return HandleRef(Kind(kind), gpu, gpu_instance, compute_instance, address & SERIAL_MASK)
    except ValueError:
        return None


class _SimHandle:
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ctypes._Pointer) and _address(other) == _address(self)

    def __hash__(self) -> int:
        return hash(_address(self))

    def __repr__(self) -> str:
        ref = decode(self)
        place = {
            Kind.GPU: f"GPU {ref.gpu}",
            Kind.MIG_DEVICE: f"MIG device gpu={ref.gpu} gi={ref.gpu_instance} ci={ref.compute_instance}",
            Kind.GPU_INSTANCE: f"GPU instance gpu={ref.gpu} gi={ref.gpu_instance}",
            Kind.COMPUTE_INSTANCE: (
                f"compute instance gpu={ref.gpu} gi={ref.gpu_instance} ci={ref.compute_instance}"
            ),
            Kind.EVENT_SET: f"event set {ref.serial}",
            Kind.GPM_SAMPLE: f"GPM sample {ref.serial}",
        }[ref.kind]
        return f"<nvml-sim {place}>"


class DeviceHandle(_SimHandle, pynvml.c_nvmlDevice_t):
    _type_ = pynvml.struct_c_nvmlDevice_t


class GpuInstanceHandle(_SimHandle, pynvml.c_nvmlGpuInstance_t):
    _type_ = pynvml.struct_c_nvmlGpuInstance_t


class ComputeInstanceHandle(_SimHandle, pynvml.c_nvmlComputeInstance_t):
    _type_ = pynvml.struct_c_nvmlComputeInstance_t


class EventSetHandle(_SimHandle, pynvml.c_nvmlEventSet_t):
    _type_ = pynvml.struct_c_nvmlEventSet_t


class GpmSampleHandle(_SimHandle, pynvml.c_nvmlGpmSample_t):
    _type_ = pynvml.struct_c_nvmlGpmSample_t


_HANDLE_CLASSES = {
    Kind.GPU: DeviceHandle,
    Kind.MIG_DEVICE: DeviceHandle,
    Kind.GPU_INSTANCE: GpuInstanceHandle,
    Kind.COMPUTE_INSTANCE: ComputeInstanceHandle,
    Kind.EVENT_SET: EventSetHandle,
    Kind.GPM_SAMPLE: GpmSampleHandle,
}


def make_handle(ref: HandleRef) -> _SimHandle:
    handle = _HANDLE_CLASSES[ref.kind]()
    ctypes.c_void_p.from_buffer(handle).value = _encode(ref)
    return handle
