"""What a run of DCGM's diagnostic (gpud.health.diag) means for each GPU's health: its worst failed or
warned test, by what dcgm_errors.h says the error asks for (NVIDIA/DCGM on GitHub)."""

from __future__ import annotations

from gpud.health.diag import SEVERITY_CONFIG, SEVERITY_MONITOR, SEVERITY_RESET, DiagRun, DiagTest
from gpud.health.states import ACTION_RANK

# dcgm_errors.h dcgmErrorCategory_t: 9..15 are DCGM_FR_EC_HARDWARE_* (thermal, memory, NVLink, NVSwitch, PCIe,
# power, other); 3..8 DCGM_FR_EC_SOFTWARE_*
HARDWARE_CATEGORIES = range(9, 16)
# nvvs/include/PluginStrings.h: the plugins whose failures are of the GPU itself, not of the node's software
HARDWARE_TESTS = {"memory", "pcie", "diagnostic", "pulse_test", "memtest", "memory_bandwidth", "targeted_stress",
                  "targeted_power", "sm_stress", "eud", "nvbandwidth"}


def _verdict(test: DiagTest) -> tuple[str, str] | None:
    """(severity, action) for one test result; None when it says nothing is wrong."""
    if test.result in ("pass", "skip"):
        return None
    hardware = test.name.split(" ")[0] in HARDWARE_TESTS or test.category in HARDWARE_CATEGORIES
    if test.result == "warn" or test.severity in (SEVERITY_MONITOR, SEVERITY_CONFIG):
        return "degraded", "none"
    if test.severity == SEVERITY_RESET:  # DCGM_ERROR_RESET: "Drain and reset GPU"
        return "unhealthy", "reset-gpu"
    # DCGM_ERROR_ISOLATE ("GPU should be isolated"), TRIAGE, or no severity: hardware is looked at; a failed
    # software (Deployment) test is the node's configuration, which no GPU action fixes
    return "unhealthy", "inspect-hardware" if hardware else "none"


def diag_problems(run: DiagRun) -> dict[int, tuple[str, str, str] | None]:
    """Per GPU index the run has a verdict on: (severity, action, message) for its worst failed or warned
    test, None when its tests passed. A failure of no one GPU (a test's summary) is every GPU's of the run.
    A run that could not run or be read has no verdict on any GPU: {}."""
    if run.outcome in ("error", "unavailable"):
        return {}
    gpus = sorted({test.gpu_index for test in run.tests if test.gpu_index is not None})
    problems: dict[int, tuple[str, str, str] | None] = {gpu: None for gpu in gpus}
    for test in run.tests:
        verdict = _verdict(test)
        if verdict is None:
            continue
        message = f"DCGM diag -r {run.level}: test {test.name} {'warned' if verdict[0] == 'degraded' else 'failed'}" \
                  + (f": {test.info}" if test.info else "")
        for gpu in ([test.gpu_index] if test.gpu_index is not None else gpus):
            problems[gpu] = _worse(problems.get(gpu), (*verdict, message))
    return problems


def _worse(old: tuple[str, str, str] | None, new: tuple[str, str, str]) -> tuple[str, str, str]:
    if old is None:
        return new
    rank = lambda p: ((p[0] == "unhealthy"), ACTION_RANK.index(p[1]))  # noqa: E731
    return new if rank(new) > rank(old) else old
