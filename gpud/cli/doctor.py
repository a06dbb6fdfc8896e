"""`gpud doctor`: a read-only self-check of this node, run by an operator, with or without a gpud daemon.

It opens its own NVML session, reads what gpud relies on, compares that with what nvidia-smi
prints, and says what would block a GPU reset and which reads need root. It changes nothing:
NVML queries only (gpud.nvml.doctor_reads), nvidia-smi listing commands only (gpud.nvml.smi),
and /proc reads (gpud.base.host).

Exit codes: 0 nothing wrong, 1 problems found (one line each, with what to do), 2 cannot run
(no NVML library, driver not loaded, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpud.cli.arguments import local_command
from gpud.cli.commands import command_help

TYPE_CHECKING = False  # NVML, the simulator and the checks are imported when the doctor runs, not for --help
if TYPE_CHECKING:
    from contextlib import ExitStack
    from typing import Any

EXIT_OK, EXIT_PROBLEMS, EXIT_CANNOT_RUN = 0, 1, 2
_EXIT_CODES = {"ok": EXIT_OK, "problems": EXIT_PROBLEMS, "cannot-run": EXIT_CANNOT_RUN}


def add_doctor(subparsers: Any) -> None:
    """Adds `doctor` to the `gpud` command's subcommands."""
    doctor = subparsers.add_parser("doctor", help=command_help("doctor"))
    doctor.add_argument("--simulate", metavar="PRESET", help="check a simulated node instead of the real NVML")
    doctor.add_argument("--sim-state", type=Path, help="the simulated node's state file (default: the one "
                                                       "`gpud serve --simulate PRESET` uses, if it exists)")
    doctor.add_argument("--sim-driver", metavar="VERSION", help="driver version the simulated node behaves as")
    local_command(doctor, run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpud")
    add_doctor(parser.add_subparsers())
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    args.json = getattr(args, "json", False)
    return args.run(args)


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from gpud.cli.doctor_checks import cannot_run, examine
    from gpud.nvml import smi
    from gpud.nvml.session import NO_GPU_HINT

    with ExitStack() as stack:
        try:
            nvml = _backend(args, stack)
        except Exception as exc:  # no pynvml; PresetError, SimError, a driver the simulator does not know
            report = cannot_run(f"cannot load the simulated node: {exc}" if args.simulate
                                else f"cannot load pynvml: {exc}; {NO_GPU_HINT}")
        else:
            report = examine(nvml, simulated=bool(args.simulate), smi_path=smi.find())
    print(json.dumps(report, indent=2) if args.json else render(report))
    return _EXIT_CODES[report["status"]]


def _backend(args: argparse.Namespace, stack: ExitStack) -> Any:
    from gpud.nvml.session import load_backend

    if not args.simulate:
        return load_backend(None, None)[0]
    import tempfile

    from gpud.config import Config

    state = args.sim_state or Config(simulate=args.simulate).sim_state_path
    if not state.exists() and args.sim_state is None:  # no simulated daemon's node to look at: a fresh one
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpud-doctor-"))) / "sim.json"
    driver = {"driver": args.sim_driver} if args.sim_driver else {}
    return load_backend(args.simulate, state, **driver)[0]


# -- text ----------------------------------------------------------------------------------------


def render(report: dict) -> str:
    if report["status"] == "cannot-run":
        return f"gpud doctor: cannot run: {report['error']}\nResult: cannot run (exit {EXIT_CANNOT_RUN})"
    driver = report["driver"]
    lines = [f"gpud doctor ({report['backend']} backend)", "",
             f"driver       {driver['version']} (NVML {driver['nvml_version']}, CUDA {driver['cuda_version']}): "
             + ("supported" if driver["supported"] else "NOT supported") + f", minimum R{driver['minimum_branch']}"]
    for gpu in report["gpus"]:
        lines += ["", *_render_gpu(gpu)]
    smi_part, permissions = report["nvidia_smi"], report["permissions"]
    lines += ["", f"nvidia-smi   {smi_part['path'] or '-'}: {smi_part['summary']}",
              f"permissions  {permissions['summary']}"]
    lines += _render_denied(permissions["denied"])
    lines += [f"  {c['what']} need root, as gpud runs now ({c['source']})" for c in permissions["changes_need_root"]]
    lines += _render_list("Problems", report["problems"]) + _render_list("Notes", report["notes"])
    count = len(report["problems"])
    lines += ["", f"Result: {count} problem{'s' if count != 1 else ''} (exit {EXIT_PROBLEMS})" if count
              else f"Result: OK (exit {EXIT_OK})"]
    return "\n".join(lines)


def _render_gpu(gpu: dict) -> list[str]:
    if "error" in gpu:
        return [f"GPU {gpu['index']}        cannot be read: {gpu['error']}"]
    mig = gpu["mig"]
    if mig["capable"]:
        table = f"{len(mig['profiles'])} profiles" if mig["profiles_readable"] else "profile table not readable"
        mig_line = (f"{mig['current']} (pending {mig['pending']}), {table}, {len(mig['devices'])} MIG devices"
                    + "".join(f"\n               {d['index']}: {d['name']} {d['uuid']}" for d in mig["devices"]))
    else:
        mig_line = "not supported"
    blockers = gpu["reset_blockers"] or ["nothing would block a reset now"]
    return [f"GPU {gpu['index']}        {gpu['name']}",
            f"  UUID       {gpu['uuid']}",
            f"  bus id     {gpu['bus_id']}   minor {gpu['minor_number']}   memory {gpu['memory_total_mib']} MiB",
            f"  MIG        {mig_line}",
            f"  NVLink     {gpu['nvlink']['summary']}",
            f"  fabric     {gpu['fabric']['summary']}",
            f"  reset      {blockers[0]}", *(f"             {line}" for line in blockers[1:])]


def _render_denied(denied: list[dict]) -> list[str]:
    """One line per read that needs root, naming every GPU it was refused on."""
    gpus: dict[tuple[str, str], list[str]] = {}
    for entry in denied:
        gpus.setdefault((entry["read"], entry["loses"]), []).append(str(entry["gpu"]))
    return [f"  {read} needs root (GPU {', '.join(indexes)}): without it gpud loses {loses}"
            for (read, loses), indexes in gpus.items()]


def _render_list(title: str, items: list[str]) -> list[str]:
    return ["", f"{title}:", *(f"  - {item}" for item in items)] if items else []


if __name__ == "__main__":
    sys.exit(main())
