"""`gpud gpus`: the GPUs and their MIG devices; show, reset, processes."""

from __future__ import annotations

import argparse

from gpud.cli.arguments import CHANGE_TIMEOUT_S, add_client, client_options, quoted
from gpud.cli.commands import command_help
from gpud.cli.health import device_problems
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, reasons_text, table, terminal_columns

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client

MIB = 1 << 20


def add_gpus(commands: Any) -> None:
    gpus = commands.add_parser("gpus", help=command_help("gpus"))
    client_options(gpus, _gpus)
    sub = gpus.add_subparsers(title="gpus commands", metavar="COMMAND")
    for name, run, text in (("show", _gpu_show, "one GPU with its health"),
                            ("processes", _gpu_processes, "the compute processes on a GPU and its MIG "
                                                          "devices, with memory, SM use and owner")):
        add_client(sub, name, run, text).add_argument("id", help="GPU index, GPU or MIG UUID, or PCI bus id")
    reset = add_client(sub, "reset", _gpu_reset, "reset a GPU (with the NVLink peers it needs); "
                                                 "says what blocks it", timeout=CHANGE_TIMEOUT_S)
    reset.add_argument("id", help="GPU index, GPU UUID or PCI bus id")
    reset.add_argument("--force", action="store_true", help="end the compute processes on the GPUs first")


def _gpus(args: argparse.Namespace, client: Client) -> int:
    document = client.get("/v1/gpus")
    health = client.get("/v1/health")
    if args.json:
        print_json({**document, "health": health})
    else:
        print(format_gpu_table(document["gpus"], health))
    return EXIT_OK


def _gpu_show(args: argparse.Namespace, client: Client) -> int:
    gpu = client.get(f"/v1/gpus/{quoted(args.id)}")
    health = client.get(f"/v1/gpus/{quoted(args.id)}/health")
    if args.json:
        print_json({**gpu, "health": health})
        return EXIT_OK
    print(format_gpu_table([gpu], {"gpus": [health]}))
    for where, state, reasons in device_problems(health):
        print(f"{where}: {state} — {reasons_text(reasons)}")
    return EXIT_OK


def _gpu_reset(args: argparse.Namespace, client: Client) -> int:
    _status, outcome = client.request("POST", f"/v1/gpus/{quoted(args.id)}/reset", {"force": args.force})
    if args.json:
        print_json(outcome)
        return EXIT_OK
    peers = f" with its NVLink peers {', '.join(map(str, outcome['peers']))}" if outcome["peers"] else ""
    print(f"GPU {outcome['gpu']} reset{peers}")
    for device, pids in outcome["ended_processes"].items():  # by GPU or MIG device UUID
        print(f"ended processes on {device}: {', '.join(map(str, pids))}")
    for reason in outcome["cleared"]:
        print(f"cleared {reason['kind']} {reason['code']} on {reason['device']}: {reason['message']}")
    lost = [gpu for gpu in outcome["gpus"] if gpu["lost"]]
    for gpu in outcome["gpus"]:
        print(f"GPU {gpu['index']} ({gpu['uuid']}): {'lost' if gpu['lost'] else 'ok'}, MIG {gpu['mig_mode'] or 'n/a'}")
    return EXIT_PROBLEM if lost else EXIT_OK


def _gpu_processes(args: argparse.Namespace, client: Client) -> int:
    document = client.get(f"/v1/gpus/{quoted(args.id)}/processes")
    if args.json:
        print_json(document)
        return EXIT_OK
    rows = [("DEVICE", "PID", "NAME", "MEMORY", "SM %", "OWNER")]
    for device in document.get("devices", []):
        where = _device_text(device)
        if device.get("unavailable"):
            rows.append((where, "-", "-", "-", "-", f"not listed: {device['unavailable']}"))
        for process in device.get("processes", []):
            rows.append((where, str(process.get("pid", "-")), process.get("comm") or "-", _memory_text(process),
                         _percent_text(process), _owner_text(process.get("owner"))))
    print(table(rows, terminal_columns()) if len(rows) > 1 else f"no compute processes on GPU {document.get('gpu')}")
    return EXIT_OK


def _device_text(device: dict) -> str:
    mig = device.get("mig")
    if not mig:
        return "GPU"
    return f"MIG {mig.get('profile') or '?'} gi {mig.get('gi_id')} ci {mig.get('ci_id')}"


def _memory_text(process: dict) -> str:
    used = process.get("used_memory_bytes")
    return "-" if used is None else f"{used // MIB} MiB"


def _percent_text(process: dict) -> str:
    value = process.get("sm_utilization_percent")
    return "-" if value is None else f"{value:g}"


def _owner_text(owner: dict | None) -> str:
    """Who a process belongs to: its container (runtime and short ID, pod), its systemd unit, or its cgroup."""
    owner = owner or {}
    if owner.get("container_id"):
        pod = f" pod {owner['pod_uid']}" if owner.get("pod_uid") else ""
        return f"{owner.get('container_runtime') or 'container'} {owner['container_id'][:12]}{pod}"
    return owner.get("systemd_unit") or owner.get("cgroup") or owner.get("kind") or "-"


def format_gpu_table(gpus: list[dict], health: dict | None = None) -> str:
    """The GPUs and their MIG devices; with /v1/health's document, each device's health too."""
    states = {}
    for gpu in (health or {}).get("gpus", []):
        states[gpu["uuid"]] = gpu["state"]
        states.update((dev["uuid"], dev["state"]) for dev in gpu.get("mig_devices", []))
    rows = [("IDX", "NAME", "UUID", "PCI BUS ID", "MEMORY", "MIG", "STATE", "HEALTH")]
    for gpu in gpus:
        mig = gpu["mig"]
        mig_text = "n/a" if not mig["capable"] else (mig["mode"] or "?") + (
            f" → {mig['pending_mode']}" if mig["pending_mode"] != mig["mode"] else "")
        state = "lost" if gpu["lost"] else ("error" if gpu.get("error") else "ok")
        rows.append((str(gpu["index"]), gpu["name"], gpu["uuid"], gpu["pci_bus_id"],
                     f"{gpu['memory_total_mib']} MiB", mig_text, state, states.get(gpu["uuid"], "-")))
        for dev in mig["devices"]:
            place = dev["placement"]
            rows.append(("", f"└ MIG {dev['profile']}", dev["uuid"],
                         f"gi {dev['gi_id']} ci {dev['ci_id']} @{place['start']}:{place['size']}",
                         f"{dev['memory_total_mib']} MiB", f"{dev['sm_count']} SMs", "",
                         states.get(dev["uuid"], "-")))
    return table(rows)
