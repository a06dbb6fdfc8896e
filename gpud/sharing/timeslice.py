"""The CUDA time-slice length per GPU (`sharing.timeSlicing.interval`), set with nvidia-smi."""

from __future__ import annotations

import asyncio
import shutil

from gpud.base.logs import get_logger
from gpud.model.inventory import Inventory

log = get_logger("sharing")
# nvidia-smi compute-policy --set-timeslice takes these numbers.
INTERVALS = {"default": 0, "short": 1, "medium": 2, "long": 3}
NVIDIA_SMI_TIMEOUT_S = 20.0  # one GPU's setting; the DRA plugin's hold waits up to 30 s for gpud


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
        proc = await asyncio.create_subprocess_exec(
            smi, "compute-policy", "-i", str(index), "--set-timeslice", str(INTERVALS[interval]),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), NVIDIA_SMI_TIMEOUT_S)
        except asyncio.TimeoutError:  # a DRA claim's Prepare waits for this: never without end
            proc.kill()
            await proc.wait()
            output = f"nvidia-smi did not answer in {NVIDIA_SMI_TIMEOUT_S:g} s: killed".encode()
        ok = proc.returncode == 0
        results.append({"index": index, "applied": ok,
                        "reason": None if ok else output.decode(errors="replace").strip()[-300:]})
        log.info("time_slice_set", gpu=index, interval=interval, ok=ok)
    return {"interval": interval, "applied": all(r["applied"] for r in results), "reason": None, "gpus": results}


async def claim_time_slice(indices: list[int], interval: str) -> str | None:
    """A DRA claim's time-slice interval set on its GPUs: why it failed, or None."""
    result = await set_time_slice(interval.lower(), indices)
    if result["applied"]:
        return None
    return result["reason"] or "; ".join(f"GPU {g['index']}: {g['reason']}" for g in result["gpus"] if not g["applied"])
