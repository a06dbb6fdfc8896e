"""The CUDA time-slice length per GPU (`sharing.timeSlicing.interval`), set with nvidia-smi."""

from __future__ import annotations

import shutil

from gpud.base import child
from gpud.base.logs import get_logger
from gpud.model.inventory import Inventory

log = get_logger("sharing")
# nvidia-smi compute-policy --set-timeslice takes these numbers.
INTERVALS = {"default": 0, "short": 1, "medium": 2, "long": 3}
NVIDIA_SMI_TIMEOUT_S = 20.0  # one GPU's setting; the DRA plugin's hold waits up to 30 s for gpud
NVIDIA_SMI_OUTPUT_CAP = 65536  # a line per GPU


async def apply_time_slice(interval: str | None, inventory: Inventory) -> dict | None:
    """Sets the interval on every GPU; returns what happened, for /v1/sharing. None: nothing asked."""
    if interval is None:
        return None
    return await set_time_slice(interval, [gpu.index for gpu in inventory.gpus if not gpu.lost])


async def set_time_slice(interval: str, indices: list[int]) -> dict:
    """Sets the interval (one of INTERVALS) on these GPUs, one nvidia-smi run each."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        log.warning("time_slice_not_applied", interval=interval, why="nvidia-smi is not installed")
        return {"interval": interval, "applied": False, "reason": "nvidia-smi is not installed", "gpus": []}
    results = []
    for index in indices:
        argv = [smi, "compute-policy", "-i", str(index), "--set-timeslice", str(INTERVALS[interval])]
        try:  # a DRA claim's Prepare waits for this: never without end
            run = await child.run(argv, timeout_s=NVIDIA_SMI_TIMEOUT_S, output_cap=NVIDIA_SMI_OUTPUT_CAP,
                                  merge_stderr=True)
        except OSError as exc:
            ok, output = False, f"cannot run {smi}: {exc.strerror or exc}"
        else:
            ok = run.exit_code == 0
            output = run.failure(NVIDIA_SMI_TIMEOUT_S, NVIDIA_SMI_OUTPUT_CAP) or run.text()
        results.append({"index": index, "applied": ok, "reason": None if ok else output.strip()[-300:]})
        log.info("time_slice_set", gpu=index, interval=interval, ok=ok)
    return {"interval": interval, "applied": all(r["applied"] for r in results), "reason": None, "gpus": results}


async def claim_time_slice(indices: list[int], interval: str) -> str | None:
    """A DRA claim's time-slice interval set on its GPUs: why it failed, or None."""
    result = await set_time_slice(interval.lower(), indices)
    if result["applied"]:
        return None
    return result["reason"] or "; ".join(f"GPU {g['index']}: {g['reason']}" for g in result["gpus"] if not g["applied"])
