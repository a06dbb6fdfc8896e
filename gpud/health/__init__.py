"""GPU health: the XID catalog, the per-device health tracker, and the checks and monitor that feed it."""
