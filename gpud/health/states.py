"""The closed sets of names health speaks in: a device's state, what a reason asks of an operator, and
what clears a reason. Each is written as its value wherever it goes (the API, health.json, the log,
metric labels), so comparing with the plain string works as before."""

from __future__ import annotations

from gpud.model.named import Named


class Health(Named):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


# A state's value in metrics and its rank for "the worst of": 0 healthy, 1 degraded, 2 unhealthy.
HEALTH_RANK = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2}


class Action(Named):
    """What a reason asks of an operator, weakest first: "fix-service" is a host service to start or
    install (a node reason's), the rest as the XID catalog's actions."""

    NONE = "none"
    RESTART_APP = "restart-app"
    FIX_SERVICE = "fix-service"
    RESET_GPU = "reset-gpu"
    REBOOT = "reboot"
    INSPECT_HARDWARE = "inspect-hardware"


ACTION_RANK = tuple(Action)


class Clears(Named):
    """What takes a reason away."""

    CHECK = "check"  # checks pass again
    RESET = "reset"  # a GPU reset, the GPU back, or the driver saying it recovered
    DRIVER = "driver"  # the driver's recovery action is none again
    ADMIN = "admin"  # only an administrator's clear
