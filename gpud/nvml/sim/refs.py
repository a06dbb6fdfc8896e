"""Reading the ctypes arguments of NVML's out-parameter calls."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from pynvml import NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INVALID_ARGUMENT, NVMLError

from .placement import Span

_BYREF = type(ctypes.byref(ctypes.c_int()))


def _unwrap_byref(arg: object) -> object:
    return arg._obj if isinstance(arg, _BYREF) else arg


def _target(arg: object) -> object:
    """The object behind byref(x), pointer(x) or x itself."""
    arg = _unwrap_byref(arg)
    return arg.contents if isinstance(arg, ctypes._Pointer) else arg


def read_span(placement: object) -> Span:
    """A placement passed as a struct, byref(struct) or pointer(struct)."""
    struct = _target(placement)
    try:
        return Span(int(struct.start), int(struct.size))
    except (AttributeError, TypeError, ValueError):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT) from None


def write_array(
    items: Sequence[object], array_ref: object, count_ref: object, null_array_allowed: bool = True
) -> None:
    """The count/array out-parameter pattern of the placement and instance listings.

    countRef (byref(c_uint)) holds the capacity of the array on input and the number of items
    on output. With array_ref None the placement calls only report the count (nvml.h); the
    instance listings refuse it with INVALID_ARGUMENT (null_array_allowed False). With too small a
    capacity the call reports the count and raises INSUFFICIENT_SIZE.
    """
    count = _target(count_ref)
    if not isinstance(count, ctypes.c_uint):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    array = _unwrap_byref(array_ref)
    if array is None and not null_array_allowed:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    capacity = count.value if not isinstance(array, ctypes.Array) else min(count.value, len(array))
    count.value = len(items)
    if array is None:
        return
    if capacity < len(items):
        raise NVMLError(NVML_ERROR_INSUFFICIENT_SIZE)
    for index, item in enumerate(items):
        array[index] = item
