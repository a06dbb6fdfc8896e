"""The names of MPS control daemons: gpud's MPS manager starts them under these names, and the claims and
GPU-memory views name the daemon a client is to use."""

from __future__ import annotations

from gpud.model.inventory import Gpu, MigDevice


def daemon_name(gpu: Gpu, mig: MigDevice | None = None) -> str:
    """The name of the daemon serving a whole GPU or one MIG device (its pipe directory's name)."""
    return f"gpu{gpu.index}-gi{mig.gi_id}-ci{mig.ci_id}" if mig else f"gpu{gpu.index}"
