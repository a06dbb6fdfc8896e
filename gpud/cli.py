"""The `gpud` command: `gpud serve` runs the daemon; the other subcommands are clients of its socket."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from gpud import __version__, doctor
from gpud.config import LOG_FORMATS, LOG_LEVELS, Config, ConfigError, load_config

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not hasattr(args, "run"):
        _parser().print_help()
        return EXIT_USAGE
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpud", description="Owns the NVIDIA GPUs of this node.")
    parser.add_argument("--version", action="version", version=f"gpud {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", type=Path, help="config file (default /etc/gpud/gpud.yaml, if present)")
    serve.add_argument("--socket", help="API socket path (default /run/gpud/gpud.sock as root, "
                                        "$XDG_RUNTIME_DIR/gpud/gpud.sock otherwise)")
    serve.add_argument("--state-dir", help="persisted state (default /var/lib/gpud as root, "
                                           "$XDG_STATE_HOME/gpud otherwise)")
    serve.add_argument("--simulate", metavar="PRESET",
                       help="run on a simulated node: dgx-a100, dgx-a100-80gb, hgx-h100, hgx-h200, a30, t4, "
                            "rtx-2080ti, or MODEL:COUNT[,MODEL:COUNT…]")
    serve.add_argument("--sim-state", help="file holding the simulated GPUs' state (default: in the runtime dir)")
    serve.add_argument("--sim-driver", metavar="VERSION",
                       help="NVIDIA driver version the simulated node behaves as, e.g. 535.183.01, 550.90.07, "
                            "580.65.06 (branches differ in what NVML answers)")
    serve.add_argument("--log-level", choices=LOG_LEVELS)
    serve.add_argument("--log-format", choices=LOG_FORMATS)
    serve.set_defaults(run=_serve)

    for name, run, text in (("status", _status, "the daemon's health and node summary"),
                            ("gpus", _gpus, "the GPUs and their MIG devices")):
        _client_command(commands.add_parser(name, help=text), run)

    mig = commands.add_parser("mig", help="MIG layouts: status, layouts, apply, export, validate")
    mig_commands = mig.add_subparsers(title="mig commands", metavar="COMMAND")
    for name, run, text in (("status", _mig_status, "the desired layout and each GPU's state"),
                            ("layouts", _mig_layouts, "the named layouts and whether each fits this node"),
                            ("export", _mig_export, "this node's MIG layout as a mig-parted file")):
        _client_command(mig_commands.add_parser(name, help=text), run)
    apply = mig_commands.add_parser("apply", help="apply a named layout")
    apply.add_argument("layout")
    apply.add_argument("--dry-run", action="store_true", help="show the plan; touch nothing")
    apply.add_argument("--force", action="store_true", help="destroy MIG devices even if processes run on them")
    apply.add_argument("--no-wait", action="store_true", help="return once the apply has started")
    _client_command(apply, _mig_apply)
    mig_validate = mig_commands.add_parser("validate", help="check a layouts file (exit 0 valid, 2 invalid)")
    mig_validate.add_argument("path", type=Path)
    mig_validate.set_defaults(run=_mig_validate)

    mps = commands.add_parser("mps", help="MPS control daemons: status, restart")
    mps_commands = mps.add_subparsers(title="mps commands", metavar="COMMAND")
    mps_status = mps_commands.add_parser("status", help="the MPS daemons and their limits")
    mps_restart = mps_commands.add_parser("restart", help="restart one MPS daemon")
    mps_restart.add_argument("name")
    _client_command(mps_status, _mps_status)
    _client_command(mps_restart, _mps_restart)

    sharing = commands.add_parser("sharing", help="shared resources (time-slicing, MPS replicas)")
    _client_command(sharing, _sharing)
    sharing_commands = sharing.add_subparsers(title="sharing commands", metavar="COMMAND")
    sharing_validate = sharing_commands.add_parser("validate", help="check a sharing file (exit 0 valid, 2 invalid)")
    sharing_validate.add_argument("path", type=Path)
    sharing_validate.set_defaults(run=_sharing_validate)

    health = commands.add_parser("health", help="the health of each GPU and MIG device, with reasons")
    watch = commands.add_parser("watch", help="follow the event stream, one line per event")
    watch.add_argument("--since", type=int, help="replay events after this sequence number first")
    watch.add_argument("--epoch", help="the gpud run that sequence number is of (each event's 'epoch'): "
                                       "after a restart, gpud says so and replays the new run from its start")
    watch.add_argument("--types", help="comma-separated: health,mig,mps,sharing,inventory")
    _client_command(health, _health)
    _client_command(watch, _watch)

    config = commands.add_parser("config", help="work with config files")
    config_commands = config.add_subparsers(title="config commands", metavar="COMMAND")
    validate = config_commands.add_parser("validate", help="check a config file without starting anything")
    validate.add_argument("path", nargs="?", type=Path, default=Path("/etc/gpud/gpud.yaml"))
    validate.set_defaults(run=_config_validate)

    doctor.register(commands)
    return parser


def _client_command(parser: argparse.ArgumentParser, run) -> None:
    """A subcommand that talks to the daemon's socket: the options every such command takes."""
    parser.add_argument("--socket", type=Path, help="the daemon's socket (default: found automatically)")
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    parser.set_defaults(run=run)


# -- serve -------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from gpud import daemon
    from gpud.logs import configure_logging

    overrides = {"api.socket": args.socket, "state_dir": args.state_dir, "simulate": args.simulate,
                 "sim_state": args.sim_state, "sim_driver": args.sim_driver, "log.level": args.log_level,
                 "log.format": args.log_format}
    config = _checked_config(lambda: load_config(args.config).with_overrides(**overrides))
    if config is None:
        return EXIT_USAGE
    configure_logging(config.log.level, config.log.format)

    def reread() -> Config:
        return load_config(args.config).with_overrides(**overrides)

    return asyncio.run(daemon.serve(config, reread))


def _config_validate(args: argparse.Namespace) -> int:
    if _checked_config(lambda: load_config(args.path)) is None:
        return EXIT_USAGE
    print(f"{args.path}: valid")
    return EXIT_OK


def _checked_config(load) -> Config | None:
    """The config, with the simulated node it names (preset and driver) checked too; None after saying
    what is wrong."""
    from gpud.nvml.sim import PresetError, SimError, parse_preset
    from gpud.nvml.sim.drivers import parse_driver

    try:
        config = load()
        if config.simulate:
            parse_preset(config.simulate)
            parse_driver(config.sim_driver)
    except (ConfigError, PresetError, SimError) as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return None
    return config


# -- clients -----------------------------------------------------------------------------------


def _client_call(args: argparse.Namespace, fetch) -> int:
    from gpud.client import ApiFailure, Client, DaemonUnreachable

    try:
        return fetch(Client(args.socket))
    except DaemonUnreachable as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ApiFailure as exc:
        print(f"gpud: {exc} ({exc.code})", file=sys.stderr)
        return EXIT_FAILURE


def _status(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        health = client.get("/healthz", ok_statuses=(503,))
        node = client.get("/v1/node")
        if args.json:
            _print_json({"health": health, "node": node})
        else:
            backend = node["backend"] + (f" ({node['simulated_preset']})" if node.get("simulated_preset") else "")
            print(f"gpud {node['gpud_version']} on {node['hostname']}, backend {backend}")
            print(f"health:  {health['status']}" + (f" — {health['reason']}" if health.get("reason") else ""))
            if node.get("driver_version"):
                print(f"driver:  {node['driver_version']}  CUDA {node['cuda_version']}  NVML {node['nvml_version']}")
                print(f"GPUs:    {node['gpu_count']}  MIG devices: {node['mig_device_count']}")
        return EXIT_OK if health["status"] == "ok" else EXIT_FAILURE

    return _client_call(args, fetch)


def _gpus(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        document = client.get("/v1/gpus")
        if args.json:
            _print_json(document)
        else:
            print(format_gpu_table(document["gpus"]))
        return EXIT_OK

    return _client_call(args, fetch)


def _mig_validate(args: argparse.Namespace) -> int:
    from gpud.mig.layouts import LayoutError, load_layouts

    return _validate_file(args.path, load_layouts, LayoutError,
                          lambda layouts: f"{len(layouts)} layouts: {', '.join(layouts)}")


def _validate_file(path: Path, load, error_type: type, summary) -> int:
    """`gpud … validate FILE`: exit 0 with a one-line summary, or 2 with the error."""
    try:
        loaded = load(path)
    except error_type as exc:
        print(f"gpud: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"gpud: {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: valid, {summary(loaded)}")
    return EXIT_OK


def _mig_status(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        view = client.get("/v1/mig")
        if args.json:
            _print_json(view)
            return EXIT_OK
        print(f"layout: {view['layout'] or '(none)'}  state: {view['state']}  in sync: "
              f"{'yes' if view['in_sync'] else 'no'}" + (f"\nerror: {view['error']}" if view["error"] else ""))
        rows = [("GPU", "IN SYNC", "STATE", "DESIRED", "ACTUAL")]
        for gpu in view["gpus"]:
            rows.append((str(gpu["index"]), "yes" if gpu["in_sync"] else "no", gpu["state"] or "-",
                         _devices_text(gpu["desired"]), _devices_text(gpu["actual"])))
        print(_table(rows))
        return EXIT_OK if view["in_sync"] else EXIT_FAILURE

    return _client_call(args, fetch)


def _mig_layouts(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        view = client.get("/v1/mig/layouts")
        if args.json:
            _print_json(view)
            return EXIT_OK
        rows = [("LAYOUT", "FITS", "GPUS TO CHANGE", "")]
        for layout in view["layouts"]:
            rows.append((layout["name"] + (" *" if layout["active"] else ""), "yes" if layout["fits"] else "no",
                         "-" if layout["gpus_changed"] is None else str(layout["gpus_changed"]),
                         layout["reason"] or ""))
        print(f"from {view['source']} (* = current)")
        print(_table(rows))
        return EXIT_OK

    return _client_call(args, fetch)


def _mig_export(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        status, text = client.request_text("GET", "/v1/mig/export")
        print(text, end="")
        return EXIT_OK

    return _client_call(args, fetch)


def _mig_apply(args: argparse.Namespace) -> int:
    import time

    def fetch(client) -> int:
        body = {"layout": args.layout, "force": args.force, "dry_run": args.dry_run}
        _status, started = client.request("PUT", "/v1/mig", body)
        if args.json and (args.dry_run or args.no_wait):
            _print_json(started)
            return EXIT_OK
        for gpu in started["plan"]:
            print(f"GPU {gpu['index']}: keep {gpu['keep']}, destroy {len(gpu['destroy'])}, "
                  f"create {', '.join(c['profile'] for c in gpu['create']) or 'nothing'} "
                  f"({gpu['mutations']} changes)")
        if args.dry_run or args.no_wait:
            return EXIT_OK
        shown: dict[int, str] = {}
        while True:
            view = client.get("/v1/mig")
            for gpu in view["gpus"]:
                if gpu["state"] and shown.get(gpu["index"]) != gpu["state"]:
                    shown[gpu["index"]] = gpu["state"]
                    print(f"GPU {gpu['index']}: {gpu['state']}" + (f" — {gpu['error']}" if gpu["error"] else ""))
            if view["state"] != "applying":
                break
            time.sleep(0.2)
        if args.json:
            _print_json(view)
        print(f"layout {view['layout']}: {view['state']}" + (f" — {view['error']}" if view["error"] else ""))
        return EXIT_OK if view["state"] == "success" else EXIT_FAILURE

    return _client_call(args, fetch)


def _mps_status(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        view = client.get("/v1/mps")
        if args.json:
            _print_json(view)
            return EXIT_OK
        if not view["enabled"]:
            print("MPS is not enabled (mps.enabled in gpud.yaml)")
            return EXIT_OK
        if view["error"]:
            print(f"error: {view['error']}")
        rows = [("NAME", "STATE", "PID", "RESTARTS", "THREADS %", "PINNED MiB", "DEVICES")]
        for daemon in view["daemons"]:
            threads = daemon["active_thread_percentage"]
            rows.append((daemon["name"], daemon["state"], str(daemon["pid"] or "-"), str(daemon["restarts"]),
                         "-" if threads is None else f"{threads:g}",
                         ",".join("-" if m is None else str(m) for m in daemon["pinned_memory_limit_mib"]),
                         ",".join(daemon["devices"])))
        print(_table(rows))
        return EXIT_OK if all(d["state"] == "running" for d in view["daemons"]) else EXIT_FAILURE

    return _client_call(args, fetch)


def _mps_restart(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        _status, daemon = client.request("POST", f"/v1/mps/{args.name}/restart", {})
        if args.json:
            _print_json(daemon)
        else:
            print(f"{daemon['name']}: {daemon['state']}, pid {daemon['pid']}, restarts {daemon['restarts']}")
        return EXIT_OK

    return _client_call(args, fetch)


def _sharing(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        view = client.get("/v1/sharing")
        if args.json:
            _print_json(view)
            return EXIT_OK
        print(f"strategy: {view['strategy']}  MIG strategy: {view['mig_strategy']}  from: {view['source'] or '(none)'}")
        if view["error"]:
            print(f"error: {view['error']}")
        rows = [("RESOURCE", "STRATEGY", "REPLICAS", "COUNT", "HEALTHY")]
        for resource in view["resources"]:
            healthy = sum(d["healthy"] for d in resource["devices"])
            replicas = "mixed" if resource["replicas"] is None else str(resource["replicas"])
            rows.append((resource["name"], resource["strategy"], replicas, str(resource["count"]), str(healthy)))
        print(_table(rows))
        return EXIT_FAILURE if view["error"] else EXIT_OK

    return _client_call(args, fetch)


def _sharing_validate(args: argparse.Namespace) -> int:
    from gpud.sharing.config import SharingConfigError, load_sharing

    return _validate_file(args.path, load_sharing, SharingConfigError,
                          lambda config: f"strategy {config.strategy}, MIG strategy {config.mig_strategy}")


def _health(args: argparse.Namespace) -> int:
    def fetch(client) -> int:
        view = client.get("/v1/health")
        if args.json:
            _print_json(view)
            return EXIT_OK
        print(f"node: {view['status']}")
        rows = [("DEVICE", "STATE", "REASONS")]
        for gpu in view["gpus"]:
            rows.append((f"GPU {gpu['index']}", gpu["state"], _reasons_text(gpu["reasons"])))
            for dev in gpu["mig_devices"]:
                rows.append((f"  └ {dev['profile']} gi {dev['gi_id']} ci {dev['ci_id']}", dev["state"],
                             _reasons_text(dev["reasons"])))
        print(_table(rows))
        return EXIT_OK if view["status"] == "healthy" else EXIT_FAILURE

    return _client_call(args, fetch)


def _reasons_text(reasons: list[dict]) -> str:
    return "; ".join(f"{r['kind']} {r['code']}: {r['message']} (×{r['count']}, action: {r['action']})"
                     for r in reasons)


def _watch(args: argparse.Namespace) -> int:
    query = urllib.parse.urlencode({key: value for key, value in (("since", args.since), ("epoch", args.epoch),
                                                                   ("types", args.types)) if value is not None})

    def follow(client) -> int:
        epoch = args.epoch
        for event in client.stream(f"/v1/watch?{query}" if query else "/v1/watch"):
            if event.get("epoch") != epoch:  # the first line, or gpud restarted since --since
                epoch = event.get("epoch")
                print(f"gpud run {epoch}: resume with --since SEQ --epoch {epoch}", file=sys.stderr, flush=True)
            if event.get("type") == "heartbeat":
                continue
            if args.json:
                print(json.dumps(event), flush=True)
            else:
                print(f"#{event['seq']} {event['type']}: {json.dumps(event.get('data', {}))}", flush=True)
        return EXIT_OK

    try:
        return _client_call(args, follow)
    except KeyboardInterrupt:
        return EXIT_OK


def _devices_text(side: dict | None) -> str:
    if side is None:
        return "(left alone)"
    if not side["mig_enabled"]:
        return "MIG off"
    return ", ".join(f"{count}× {name}" for name, count in side["devices"].items()) or "MIG on, no devices"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_gpu_table(gpus: list[dict]) -> str:
    rows = [("IDX", "NAME", "UUID", "PCI BUS ID", "MEMORY", "MIG", "STATE")]
    for gpu in gpus:
        mig = gpu["mig"]
        mig_text = "n/a" if not mig["capable"] else mig["mode"] + (
            f" → {mig['pending_mode']}" if mig["pending_mode"] != mig["mode"] else "")
        state = "lost" if gpu["lost"] else ("error" if gpu.get("error") else "ok")
        rows.append((str(gpu["index"]), gpu["name"], gpu["uuid"], gpu["pci_bus_id"],
                     f"{gpu['memory_total_mib']} MiB", mig_text, state))
        for dev in mig["devices"]:
            place = dev["placement"]
            rows.append(("", f"└ MIG {dev['profile']}", dev["uuid"],
                         f"gi {dev['gi_id']} ci {dev['ci_id']} @{place['start']}:{place['size']}",
                         f"{dev['memory_total_mib']} MiB", f"{dev['sm_count']} SMs", ""))
    return _table(rows)


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    sys.exit(main())
