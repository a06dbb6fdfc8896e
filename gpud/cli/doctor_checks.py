"""What `gpud doctor` (gpud.cli.doctor) finds on this node, as its report: the driver, each GPU (MIG, reset
blockers, NVLink, fabric), nvidia-smi's view compared with NVML's, and what needs root. Read-only: NVML
queries (gpud.nvml.doctor_reads), nvidia-smi listing commands (gpud.nvml.smi), /proc reads (gpud.base.host)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpud.base.host import Holder, describe_holder, device_holders, module_blockers
from gpud.model.driver import MINIMUM_BRANCH, driver_problem
from gpud.model.inventory import normal_bus_id
from gpud.nvml import smi
from gpud.nvml.doctor_reads import GiProfile, GpuReading, NodeReading, read_node
from gpud.nvml.privileges import ROOT_ONLY
from gpud.nvml.session import NO_GPU_HINT, describe_error

SCHEMA = "gpud-doctor/1"
NVML_NO_PERMISSION = 4  # nvml.h NVML_ERROR_NO_PERMISSION

# What gpud cannot do when a read answers NO_PERMISSION (doctor_reads' read names).
_LOSSES = {
    "mig.gpu_instances": "the MIG instance tree: gpud cannot show, plan or reconcile MIG devices",
    "mig.devices": "the MIG devices (UUIDs, processes) in /v1/gpus and health",
    "mig.profiles": "the MIG profile table read from the driver (gpud falls back to its last or shipped table)",
    "mig.mode": "the MIG mode: gpud cannot tell whether MIG is on",
    "processes": "the compute processes per GPU (MIG apply safety checks, reset preflight)",
    "process_name": "the names of compute processes",
    "fabric": "the NVLink fabric state",
    "nvlink": "the NVLink link states (health)",
    "memory": "the GPU memory size",
    "minor_number": "the device node (/dev/nvidia<minor>) needed to find who holds the GPU before a reset",
}


class _Findings:
    """Problems (each makes doctor exit 1) and notes (for information); a note that holds for several
    GPUs is said once, naming them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._notes: dict[str, list[int]] = {}

    def note(self, text: str, gpu: int | None = None) -> None:
        self._notes.setdefault(text, []).extend([] if gpu is None else [gpu])

    def notes(self) -> list[str]:
        return [text if not gpus else f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}: {text}"
                for text, gpus in self._notes.items()]


# -- the check -----------------------------------------------------------------------------------


def cannot_run(error: str) -> dict:
    return {"schema": SCHEMA, "status": "cannot-run", "error": error, "problems": [], "notes": []}


def examine(nvml: Any, *, simulated: bool, smi_path: str | None, proc: Path = Path("/proc"),
            dev: Path = Path("/dev")) -> dict:
    """The whole report for this backend. Opens and closes its own NVML session."""
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError (LibraryNotFound, DriverNotLoaded, ...), OSError, SimError
        if simulated:
            return cannot_run(f"the simulated node cannot start: {describe_error(exc)}")
        return cannot_run(f"NVML cannot start: {describe_error(exc)}: is the NVIDIA driver installed and loaded "
                          f"(lsmod | grep nvidia; nvidia-smi)? {NO_GPU_HINT} (or gpud doctor --simulate dgx-a100)")
    try:
        reading = read_node(nvml)
        holders = _simulated_holders(nvml, reading) if simulated else None
    except nvml.NVMLError as exc:
        return cannot_run(f"NVML answers nvmlInit but not the node's first reads: {describe_error(exc)}")
    finally:
        _shutdown(nvml)
    return _report(reading, simulated=simulated, smi_path=smi_path, holders=holders, proc=proc, dev=dev)


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:  # nothing left to do about it: doctor is finishing
        pass


def _simulated_holders(nvml: Any, reading: NodeReading) -> dict[int, list[Holder]]:
    """A simulated node's device holders are the simulator's, not this host's processes."""
    return {gpu.index: [Holder(pid, name, f"/dev/nvidia{gpu.minor_number}")
                        for pid, name in nvml.sim_holders(gpu.index)]
            for gpu in reading.gpus if gpu.error is None}


def _report(reading: NodeReading, *, simulated: bool, smi_path: str | None,
            holders: dict[int, list[Holder]] | None, proc: Path, dev: Path) -> dict:
    findings = _Findings()
    root = os.geteuid() == 0
    report = {
        "schema": SCHEMA,
        "backend": "simulated" if simulated else "nvml",
        "running_as_root": root,
        "driver": _driver(reading, findings),
        "gpus": [_gpu(gpu, findings, holders, proc, dev) for gpu in reading.gpus],
        "nvidia_smi": _compare_with_smi(reading, smi_path, findings),
        "permissions": _permissions(reading, root, findings),
    }
    findings.problems += [f"reading {f.read} failed: {f.error}" for f in reading.failures
                          if f.code != NVML_NO_PERMISSION]
    findings.note("doctor's own NVML session is not counted as a reset blocker: it ends when doctor exits")
    report.update(status="problems" if findings.problems else "ok", problems=findings.problems,
                  notes=findings.notes())
    return report


def _driver(reading: NodeReading, findings: _Findings) -> dict:
    problem = driver_problem(reading.driver_version)
    if problem:
        findings.problems.append(problem)
    return {"version": reading.driver_version, "nvml_version": reading.nvml_version,
            "cuda_version": reading.cuda_version, "minimum_branch": MINIMUM_BRANCH, "supported": problem is None}


# -- one GPU -------------------------------------------------------------------------------------


def _gpu(gpu: GpuReading, findings: _Findings, holders: dict[int, list[Holder]] | None, proc: Path,
         dev: Path) -> dict:
    where = f"GPU {gpu.index}"
    if gpu.error:
        findings.problems.append(f"{where}: NVML gives no handle for it ({gpu.error}): look for Xid 79 in the "
                                 "kernel log (GPU fallen off the bus); a GPU reset or a reboot may bring it back")
        return {"index": gpu.index, "error": gpu.error}
    findings.problems += [f"{where}: reading {f.read} failed: {f.error}" for f in gpu.failures
                          if f.code != NVML_NO_PERMISSION]
    return {
        "index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "bus_id": gpu.bus_id,
        "minor_number": gpu.minor_number, "memory_total_mib": gpu.memory_total_mib,
        "mig": _mig(gpu, findings),
        "compute_processes": [{"pid": p.pid, "name": p.name} for p in gpu.processes],
        "reset_blockers": _reset_blockers(gpu, holders, proc, dev),
        "nvlink": _nvlink(gpu, findings),
        "fabric": _fabric(gpu, findings),
    }


def _mig(gpu: GpuReading, findings: _Findings) -> dict:
    if gpu.mig_current is None:
        return {"capable": False}
    if gpu.mig_pending != gpu.mig_current:
        findings.note(f"MIG mode {gpu.mig_pending} is pending: it takes effect after a GPU reset", gpu.index)
    if not gpu.gi_profiles_answered:
        findings.note(f"the driver does not give the MIG profile table while MIG is {gpu.mig_current} (R535 "
                      "drivers answer NOT_SUPPORTED with MIG off): gpud uses the table it last read, or the one "
                      "shipped with it", gpu.index)
    return {"capable": True, "current": gpu.mig_current, "pending": gpu.mig_pending,
            "profiles_readable": gpu.gi_profiles_answered,
            "profiles": [{"id": p.id, "name": p.name, "slices": p.slices, "instances": p.instances,
                          "memory_mib": p.memory_mib} for p in gpu.gi_profiles],
            "gpu_instance_count": gpu.gpu_instance_count,
            "devices": [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in gpu.mig_devices]}


def _reset_blockers(gpu: GpuReading, holders: dict[int, list[Holder]] | None, proc: Path, dev: Path) -> list[str]:
    """Who would make `nvidia-smi -r` refuse this GPU now: holders of its device node, kernel modules
    that hold every GPU, and its compute processes (nvidia-smi(1): a reset needs the GPU free of
    every application). holders None: this host's processes, found in /proc."""
    if holders is not None:
        found, lines = holders.get(gpu.index, []), []
    elif gpu.minor_number is not None:
        found = device_holders([str(dev / f"nvidia{gpu.minor_number}")], exclude_pids={os.getpid()}, proc=proc)
        lines = module_blockers(proc)
    else:
        found, lines = [], ["the GPU's minor number is unknown, so its device node's holders cannot be looked up"]
    held_by = {h.pid for h in found}
    return [describe_holder(h) for h in found] + lines + \
        [f"PID {p.pid} ({p.name or '?'}) runs on the GPU: stop it, or wait for it to finish"
         for p in gpu.processes if p.pid not in held_by]


def _nvlink(gpu: GpuReading, findings: _Findings) -> dict:
    links = gpu.nvlinks
    inactive = links.present - links.active
    if links.present == 0:
        summary = "no NVLink"
    elif links.active == 0:
        # NVLink-capable PCIe boards without a bridge report every link inactive: not a fault
        # (NVIDIA/NVSentinel#1481, NVIDIA/DCGM#198).
        summary = f"no bridge: all {links.present} links inactive"
    elif inactive:
        summary = f"{inactive} of {links.present} links inactive"
        findings.note(f"{summary} while the others are active: if every link should be up (NVSwitch systems, "
                      "full bridges), check nvidia-smi nvlink -s and the kernel log", gpu.index)
    else:
        summary = f"all {links.present} links active"
    return {"links": links.present, "active": links.active, "inactive": inactive, "summary": summary}


def _fabric(gpu: GpuReading, findings: _Findings) -> dict:
    fabric = gpu.fabric
    if fabric is None:
        return {"state": "unknown", "summary": "this driver does not offer the fabric query"}
    if fabric.state == "not-supported":
        return {"state": fabric.state, "summary": "not applicable (no NVLink fabric)"}
    if fabric.state in ("not-started", "in-progress") or fabric.status not in (None, "Success"):
        # Fabric Manager registers each GPU of an NVSwitch system; until it has, CUDA cannot use the GPU there.
        detail = fabric.status if fabric.state == "completed" else f"registration {fabric.state}"
        findings.problems.append(f"GPU {gpu.index}: NVLink fabric {detail}: check nvidia-fabricmanager "
                        "(systemctl status nvidia-fabricmanager) and its log")
    return {"state": fabric.state, "summary": fabric.status or fabric.state}


# -- nvidia-smi ----------------------------------------------------------------------------------


def _compare_with_smi(reading: NodeReading, smi_path: str | None, findings: _Findings) -> dict:
    if smi_path is None:
        return {"path": None, "compared": False, "summary": "nvidia-smi is not on PATH: comparison skipped",
                "mismatches": []}
    try:
        mismatches = smi_mismatches(reading, smi.parse_query_xml(smi.run(smi_path, ("-q", "-x"))),
                                    smi.parse_lgip(smi.run(smi_path, ("mig", "-lgip"))))
    except smi.SmiError as exc:
        findings.problems.append(f"nvidia-smi: {exc}: check the driver installation (nvidia-smi and NVML come with it)")
        return {"path": smi_path, "compared": False, "summary": str(exc), "mismatches": []}
    findings.problems += [f"nvidia-smi disagrees with NVML: {m}: check that gpud and nvidia-smi use the same "
                          "driver (nvidia-smi --version; ldconfig -p | grep libnvidia-ml)" for m in mismatches]
    summary = "agrees with NVML (-q -x and mig -lgip)" if not mismatches else f"{len(mismatches)} mismatches"
    return {"path": smi_path, "compared": True, "summary": summary, "mismatches": mismatches}


def smi_mismatches(reading: NodeReading, report: smi.SmiReport, profiles: list[smi.SmiGiProfile]) -> list[str]:
    """Where nvidia-smi's `-q -x` report and `mig -lgip` table disagree with what NVML answered."""
    return _compare_query(reading, report) + _compare_profiles(reading, profiles)


def _compare_query(reading: NodeReading, report: smi.SmiReport) -> list[str]:
    mismatches = []
    if report.driver_version and report.driver_version != reading.driver_version:
        mismatches.append(f"driver version: NVML {reading.driver_version}, nvidia-smi {report.driver_version}")
    readable = [gpu for gpu in reading.gpus if gpu.error is None]
    if len(report.gpus) != len(reading.gpus):
        mismatches.append(f"GPU count: NVML {len(reading.gpus)}, nvidia-smi {len(report.gpus)}")
    by_uuid = {gpu.uuid: gpu for gpu in report.gpus if gpu.uuid}
    for gpu in readable:
        listed = by_uuid.get(gpu.uuid)
        if listed is None:
            mismatches.append(f"GPU {gpu.index} ({gpu.uuid}) is not in nvidia-smi -q -x")
            continue
        mismatches += _compare_gpu(gpu, listed)
    return mismatches


def _compare_gpu(gpu: GpuReading, listed: smi.SmiGpu) -> list[str]:
    theirs_mig_devices = len(listed.mig_devices) if listed.mig_current == "enabled" else 0
    pairs = (("name", gpu.name, listed.name),
             ("bus id", normal_bus_id(gpu.bus_id or ""), normal_bus_id(listed.bus_id)),
             ("MIG mode", gpu.mig_current, listed.mig_current),
             ("memory total (MiB)", gpu.memory_total_mib, listed.memory_total_mib),
             ("MIG device count", len(gpu.mig_devices), theirs_mig_devices))
    return [f"GPU {gpu.index} {what}: NVML {ours}, nvidia-smi {theirs}" for what, ours, theirs in pairs
            if theirs is not None and ours != theirs]


def _compare_profiles(reading: NodeReading, profiles: list[smi.SmiGiProfile]) -> list[str]:
    mismatches = []
    for gpu in reading.gpus:
        listed = {p.id: p for p in profiles if p.gpu == gpu.index}
        ours = {p.id: p for p in gpu.gi_profiles}
        if not listed or not gpu.gi_profiles_answered:
            continue  # one side lists no table for it (no MIG, or an R535 driver with MIG off): nothing to compare
        for profile_id in sorted(ours.keys() ^ listed.keys()):
            side = "NVML" if profile_id in ours else "nvidia-smi mig -lgip"
            mismatches.append(f"GPU {gpu.index} GPU-instance profile {profile_id} is listed only by {side}")
        for profile_id in sorted(ours.keys() & listed.keys()):
            mismatches += _compare_profile(gpu.index, ours[profile_id], listed[profile_id])
    return mismatches


def _compare_profile(index: int, ours: GiProfile, theirs: smi.SmiGiProfile) -> list[str]:
    where = f"GPU {index} profile {ours.id}"
    found = []
    if ours.name and ours.name != theirs.name:
        found.append(f"{where} name: NVML {ours.name}, nvidia-smi {theirs.name}")
    if ours.instances != theirs.total:
        found.append(f"{where} instances: NVML {ours.instances}, nvidia-smi {theirs.total}")
    if abs(ours.memory_mib / 1024 - theirs.memory_gib) > 0.006:  # -lgip prints GiB with two decimals
        found.append(f"{where} memory: NVML {ours.memory_mib} MiB, nvidia-smi {theirs.memory_gib} GiB")
    return found


# -- permissions ---------------------------------------------------------------------------------


def _permissions(reading: NodeReading, root: bool, findings: _Findings) -> dict:
    denied = [{"gpu": gpu.index, "read": f.read, "loses": _LOSSES.get(f.read, f.read)}
              for gpu in reading.gpus for f in gpu.failures if f.code == NVML_NO_PERMISSION]
    # What a gpud running as this user could not do: the driver refuses it to all but root.
    mig_capable = any(gpu.mig_current is not None for gpu in reading.gpus)
    changes = [] if root else [{"change": change, "what": what, "source": source}
                               for change, (what, source) in ROOT_ONLY.items() if change != "mig" or mig_capable]
    if root:
        summary = "running as root"
    else:
        summary = (f"running as uid {os.geteuid()}: " + (f"{len(denied)} reads need root" if denied
                                                          else "every read answered")
                   + "; " + ", ".join(c["change"] for c in changes) + " need root")
        findings.note("not root: other users' processes holding the GPUs cannot be seen; run doctor as root "
                      "for the full list of reset blockers")
    return {"root": root, "summary": summary, "denied": denied, "changes_need_root": changes}
