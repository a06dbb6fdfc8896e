"""The one error type of gpud's refusals: a domain refusal says its kind, slug and details where it is
raised; the API alone knows which HTTP status answers each kind (gpud/api/errors.py, ERROR_STATUS)."""

from __future__ import annotations

from enum import Enum
from typing import Any

# The slug of every refusal for want of NVML; /healthz names it too.
NVML_UNAVAILABLE = "nvml-unavailable"


class ErrorKind(Enum):
    """What went wrong, as far as the one asking is concerned. Two kinds that read alike (invalid and
    refused, failed and tool-failed) are distinct because gpud has always answered them differently."""

    INVALID = "invalid"  # the request is malformed: a field's type, an unknown field, a bad query
    REFUSED = "refused"  # the request is well-formed and cannot be done as asked (a layout that does not fit)
    NOT_FOUND = "not-found"
    CONFLICT = "conflict"  # the node's state stands in the way (busy GPUs, an operation in progress)
    TIMED_OUT = "timed-out"  # the request itself did not arrive in time
    TOO_LARGE = "too-large"
    RATE_LIMITED = "rate-limited"  # a limit of the node's own stands in the way until a time it says (retry_after_s)
    UNSUPPORTED = "unsupported"  # this gpud was not set up to do it
    UNAVAILABLE = "unavailable"  # not now: no NVML, not read yet
    FAILED = "failed"  # gpud failed to do it
    TOOL_FAILED = "tool-failed"  # a program gpud runs for it failed (nvidia-smi, nvidia-cuda-mps-control)
    DISK_FULL = "disk-full"


class GpudError(Exception):
    """A refusal: its kind, a slug (`code`), a sentence and JSON-able details."""

    def __init__(self, kind: ErrorKind, code: str, message: str, **details: Any):
        super().__init__(message)
        self.kind, self.code, self.message, self.details = kind, code, message, details


def nvml_unavailable(message: str) -> GpudError:
    """The refusal of what needs NVML while gpud has none (no driver, a failed session) or has not
    read the GPUs through it yet."""
    return GpudError(ErrorKind.UNAVAILABLE, NVML_UNAVAILABLE, message)
