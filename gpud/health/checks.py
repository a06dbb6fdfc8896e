"""Periodic checks: what a GPU's readings mean for its health, one (kind, code) result each.

A result is (severity, action, message) when something is wrong, None when the check passes;
the tracker turns results into reasons, with hysteresis so a value near a limit cannot flap.
"""

from __future__ import annotations

from gpud.nvml.health import FabricReading, Readings, fabric_health_bits

Problem = tuple[str, str, str] | None
# Clock-event reasons that are the hardware slowing the GPU down, not idling or a set limit.
HW_SLOWDOWN, HW_THERMAL_SLOWDOWN, HW_POWER_BRAKE = 0x8, 0x40, 0x80
SHUTDOWN_MARGIN_C = 5
# PCIe replays between two checks above which a link counts as marginal (DCGM watches the rate too).
PCIE_REPLAYS_PER_CHECK = 100


def check_readings(readings: Readings, previous: Readings | None = None,
                   nvlinks_ever_up: frozenset[int] = frozenset()) -> dict[tuple[str, str], Problem]:
    """nvlinks_ever_up: the GPU's links seen active before (this reading's included)."""
    return {
        ("nvlink", "links-down"): _nvlinks(readings, nvlinks_ever_up),
        ("pcie", "replays"): _pcie(readings, previous),
        ("retired-pages", "pending"): _flag(readings.retired_pages_pending, "degraded", "reset-gpu",
                                            "a page retirement is pending: a GPU reset applies it"),
        ("reset-required", "nvml"): _flag(readings.reset_required, "unhealthy", "reset-gpu",
                                          "NVML answers that the GPU requires a reset"),
        ("temperature", "slowdown"): _temperature(readings),
        ("throttle", "hardware-slowdown"): _throttle(readings),
        ("ecc", "dbe-volatile"): _count(readings.ecc_dbe_volatile, "unhealthy", "reset-gpu",
                                        "uncorrectable (double-bit) ECC errors since the last reset"),
        ("remapped-rows", "pending"): _flag(readings.remap_pending, "degraded", "reset-gpu",
                                           "a row remap is pending: a GPU reset activates it"),
        ("remapped-rows", "failed"): _flag(readings.remap_failed, "unhealthy", "inspect-hardware",
                                           "row remapping failed: the memory needs inspection"),
        ("power", "over-limit"): _power(readings),
        ("fabric", "not-ready"): _fabric_ready(readings.fabric),
        ("fabric", "health"): _fabric_health(readings.fabric),
    }


# nvml.h nvmlGpuFabricState_t: NOT_SUPPORTED 0, NOT_STARTED 1, IN_PROGRESS 2, COMPLETED 3.
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
FABRIC_COMPLETED = 3
# nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*: a field's TRUE is 1, FALSE 2, NOT_SUPPORTED 0; the
# incorrect-configuration field is NONE 1, NOT_SUPPORTED 0, or the value naming what is wrong.
_TRUE, _CONFIGURATION_NONE = 1, 1
_CONFIGURATIONS = {2: "incorrect system GUID", 3: "incorrect chassis serial number", 4: "no partition",
                   5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location",
                   8: "GPU state invalid"}


def _fabric_ready(fabric: FabricReading | None) -> Problem:
    """The GPU's NVLink fabric (NVSwitch systems, Hopper and later): until Fabric Manager trained it,
    CUDA fails on the GPU ("system not yet initialized", cudaErrorSystemNotReady)."""
    if fabric is None:
        return None
    if fabric.state != FABRIC_COMPLETED:
        state = FABRIC_STATES.get(fabric.state, f"in state {fabric.state}")
        return ("unhealthy", "reset-gpu",
                f"the NVLink fabric is {state}: Fabric Manager has not trained it and CUDA fails on this GPU; "
                "check that nvidia-fabricmanager runs (journalctl -u nvidia-fabricmanager), then reset the GPU")
    if fabric.status != 0:
        return ("unhealthy", "reset-gpu",
                f"the GPU's NVLink fabric registration failed (NVML status {fabric.status}): read Fabric Manager's "
                "log (/var/log/fabricmanager.log), then reset the GPU")
    return None


def _fabric_health(fabric: FabricReading | None) -> Problem:
    """The fabric's health mask (nvmlGpuFabricInfo_v3 and later) on a trained fabric."""
    if fabric is None or fabric.state != FABRIC_COMPLETED or not fabric.health_mask:
        return None
    bits = fabric_health_bits(fabric.health_mask)
    configuration = bits.get("incorrect_configuration", 0)
    if configuration not in (0, _CONFIGURATION_NONE):
        what = _CONFIGURATIONS.get(configuration, f"code {configuration}")
        return "unhealthy", "inspect-hardware", f"the NVLink fabric is incorrectly configured: {what}"
    if bits.get("route_unhealthy") == _TRUE:
        return "unhealthy", "inspect-hardware", "the NVLink fabric reports an unhealthy route"
    if bits.get("degraded_bw") == _TRUE:
        return "degraded", "inspect-hardware", "the NVLink fabric runs at degraded bandwidth (links or switches lost)"
    recovering = [name for key, name in (("route_recovery", "route recovery"),
                                          ("access_timeout_recovery", "access-timeout recovery"))
                  if bits.get(key) == _TRUE]
    if recovering:
        return "degraded", "none", f"the NVLink fabric is in {' and '.join(recovering)}: the driver recovers it"
    return None


def _temperature(r: Readings) -> Problem:
    if r.temperature_c is None:
        return None
    if r.shutdown_c and r.temperature_c >= r.shutdown_c - SHUTDOWN_MARGIN_C:
        return "unhealthy", "inspect-hardware", f"{r.temperature_c} °C, near the shutdown limit of {r.shutdown_c} °C"
    if r.slowdown_c and r.temperature_c >= r.slowdown_c:
        return "degraded", "inspect-hardware", f"{r.temperature_c} °C, at or over the slowdown limit of {r.slowdown_c} °C"
    return None


def _throttle(r: Readings) -> Problem:
    bits = (r.throttle_reasons or 0) & (HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE)
    if not bits:
        return None
    names = [name for bit, name in ((HW_SLOWDOWN, "hardware slowdown"), (HW_THERMAL_SLOWDOWN, "thermal slowdown"),
                                    (HW_POWER_BRAKE, "power brake")) if bits & bit]
    return "degraded", "inspect-hardware", "clocks held down: " + ", ".join(names)


def _nvlinks(r: Readings, ever_up: frozenset[int]) -> Problem:
    """Only links that were up count: a PCIe board without a bridge has every link present but
    inactive from the start, which is no fault (NVIDIA/NVSentinel#1481, NVIDIA/DCGM#198)."""
    if not r.nvlinks_up:
        return None
    down = [link for link in sorted(ever_up) if link < len(r.nvlinks_up) and not r.nvlinks_up[link]]
    if not down:
        return None
    if len(down) == len(ever_up):
        return "unhealthy", "inspect-hardware", f"every NVLink link that was up is down ({len(down)} links)"
    return "degraded", "inspect-hardware", \
        f"NVLink link(s) {', '.join(map(str, down))} of {len(ever_up)} active links down"


def _pcie(r: Readings, previous: Readings | None) -> Problem:
    if r.pcie_replays is None or previous is None or previous.pcie_replays is None:
        return None
    grown = r.pcie_replays - previous.pcie_replays
    if grown <= PCIE_REPLAYS_PER_CHECK:
        return None
    return "degraded", "inspect-hardware", f"{grown} PCIe replays since the last check: a marginal link"


def _power(r: Readings) -> Problem:
    if r.power_w is None or not r.power_limit_w or r.power_w <= r.power_limit_w * 1.05:
        return None
    return "degraded", "inspect-hardware", f"drawing {r.power_w:.0f} W over its {r.power_limit_w:.0f} W limit"


def _count(value: int | None, severity: str, action: str, message: str) -> Problem:
    return (severity, action, f"{value} {message}") if value else None


def _flag(value: bool | None, severity: str, action: str, message: str) -> Problem:
    return (severity, action, message) if value else None
