"""Errors of the simulator's own control surface (the NVML surface raises pynvml.NVMLError)."""


class SimError(ValueError):
    """A sim_* control call with arguments that do not fit the simulated machine."""
