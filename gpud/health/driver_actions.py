"""The driver's recovery actions (nvml.h nvmlDeviceGetFieldValues NVML_FI_DEV_GET_GPU_RECOVERY_ACTION,
NVML_GPU_RECOVERY_ACTION_*) as gpud names them, and what each asks of the operator."""

from __future__ import annotations

from gpud.health.states import Action, Health

# By value; "none": nothing needed.
DRIVER_ACTIONS = {0: "none", 1: "gpu-reset", 2: "node-reboot", 3: "drain-p2p", 4: "drain-and-reset",
                  5: "recover-imex-domain", 6: "bus-reset", 7: "system-reboot"}
# (severity, gpud's action, message). NVIDIA's "Error Recovery and Response Flags"
# (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/error-recovery-and-response-flags.html): drain P2P is
# the driver recovering by itself once peer traffic stops; the others need the reset or reboot they name.
_REASONS = {
    "gpu-reset": (Health.UNHEALTHY, Action.RESET_GPU, "the driver asks for a GPU reset"),
    "bus-reset": (Health.UNHEALTHY, Action.RESET_GPU, "the driver asks for a bus reset of the GPU"),
    "drain-and-reset": (Health.UNHEALTHY, Action.RESET_GPU,
                        "the driver asks for the GPU to be drained of work, then reset"),
    "node-reboot": (Health.UNHEALTHY, Action.REBOOT, "the driver asks for a node reboot"),
    "system-reboot": (Health.UNHEALTHY, Action.REBOOT, "the driver asks for a system reboot"),
    "drain-p2p": (Health.DEGRADED, Action.RESTART_APP, "the driver asks for peer-to-peer traffic to drain: stop "
                                                       "the work using P2P/NVLink on this GPU; the driver recovers "
                                                       "once it stops"),
    "recover-imex-domain": (Health.UNHEALTHY, Action.RESTART_APP, "the driver asks for the IMEX domain to be "
                                                                  "recovered (restart nvidia-imex across the domain)"),
}
REBOOT_ACTIONS = ("node-reboot", "system-reboot")
RESET_ACTIONS = ("gpu-reset", "drain-and-reset")  # the actions a GPU reset answers (health.auto_reset)


def driver_action_name(value: int | None) -> str | None:
    """The action's name for the value the driver reports; None where the driver reports none."""
    return None if value is None else DRIVER_ACTIONS.get(value, f"action-{value}")


def driver_action_reason(action: str) -> tuple[Health, Action, str]:
    return _REASONS.get(action, (Health.UNHEALTHY, Action.RESET_GPU, f"the driver asks for recovery action {action!r}"))


def remedy(action: str, driver: str | None) -> str | None:
    """What brings a GPU back, from gpud's strongest suggested action for it and its MIG devices and the
    driver's recovery action: inspect-hardware, reboot, reset-gpu, or None when none of them. A remediation
    (gpud.health.remediation, the k8s agent, `gpud slurm health`) goes by it. Where the driver reports its
    recovery action (R565 and later) it decides reset or reboot (NVIDIA's "Error Recovery and Response
    Flags"), over the XID catalog's action: an XID 48 is a reboot in the catalog, a reset where the driver
    says a reset mends it."""
    if action == Action.INSPECT_HARDWARE:
        return action
    if driver in REBOOT_ACTIONS or (action == Action.REBOOT and driver not in RESET_ACTIONS):
        return Action.REBOOT
    if driver in RESET_ACTIONS or action == Action.RESET_GPU:
        return Action.RESET_GPU
    return None
