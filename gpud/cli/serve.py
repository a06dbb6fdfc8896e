"""`gpud serve`, and the commands about the daemon itself: status, reload, metrics, config validate."""

from __future__ import annotations

import argparse

from gpud.base.places import DEFAULT_CONFIG_PATH, LOG_FORMATS, LOG_LEVELS
from gpud.cli.arguments import (CHANGE_TIMEOUT_S, add_client, given_socket, group, local_command, path_argument,
                                refuse_json, socket_option)
from gpud.cli.commands import command_help
from gpud.cli.health import device_problems
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, CliError, print_json, print_text, reasons_text

TYPE_CHECKING = False  # the config model (YAML) and the daemon are imported by the commands that use them
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client
    from gpud.config import Config


class _ServeHelp(argparse.HelpFormatter):
    """`gpud serve --help` lists the simulator's presets, read when help is asked for: loading the
    simulator would slow every other command down."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.dest != "simulate":
            return super()._get_help_string(action)
        from gpud.nvml.sim.presets import PRESETS

        presets = "; ".join(f"{name} ({preset.description})" for name, preset in PRESETS.items())
        return f"{action.help}: {presets}; or MODEL:COUNT[,MODEL:COUNT…]".replace("%", "%%")


def add_serve(commands: Any) -> None:
    serve = commands.add_parser("serve", help=command_help("serve"), formatter_class=_ServeHelp)
    serve.add_argument("--config", type=path_argument, help="config file (default /etc/gpud/gpud.yaml, if present)")
    socket_option(serve, "API socket path (default /run/gpud/gpud.sock as root, else "
                         "$XDG_RUNTIME_DIR/gpud/gpud.sock, or /tmp/gpud-UID/gpud.sock where XDG_RUNTIME_DIR is unset)")
    serve.add_argument("--state-dir", help="persisted state, held by one gpud at a time (default /var/lib/gpud "
                                           "as root, $XDG_STATE_HOME/gpud otherwise); on a simulated node also "
                                           "its CDI spec and NFD file, unless cdi.spec_dir or nfd.features_file")
    serve.add_argument("--simulate", metavar="PRESET", help="run on a simulated node")
    serve.add_argument("--sim-state", help="file holding the simulated GPUs' state (default: in the runtime dir)")
    serve.add_argument("--sim-driver", metavar="VERSION",
                       help="NVIDIA driver version the simulated node behaves as, e.g. 535.183.01, 550.90.07, "
                            "580.65.06 (branches differ in what NVML answers)")
    serve.add_argument("--log-level", choices=LOG_LEVELS)
    serve.add_argument("--log-format", choices=LOG_FORMATS)
    local_command(serve, _serve)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from gpud import daemon
    from gpud.base.logs import configure_logging
    from gpud.config import load_config

    refuse_json(args)
    overrides = {"api.socket": given_socket(args), "state_dir": args.state_dir, "simulate": args.simulate,
                 "sim_state": args.sim_state, "sim_driver": args.sim_driver, "log.level": args.log_level,
                 "log.format": args.log_format}
    config = _checked_config(lambda: load_config(args.config).with_overrides(**overrides))
    configure_logging(config.log.level, config.log.format)

    def reread() -> Config:
        return load_config(args.config).with_overrides(**overrides)

    return asyncio.run(daemon.serve(config, reread))


def _checked_config(load) -> Config:
    """The config, with the simulated node it names (preset and driver) checked too."""
    from gpud.config import ConfigError
    from gpud.nvml.sim import PresetError, SimError, parse_preset
    from gpud.nvml.sim.drivers import parse_driver

    try:
        config = load()
        if config.simulate:
            parse_preset(config.simulate)
            parse_driver(config.sim_driver)
    except ConfigError as exc:  # each error with its line and key; several: one a line, under a count
        errors = [str(error) for error in exc.errors]
        if len(errors) == 1:
            raise CliError(EXIT_USAGE, "config-invalid", errors[0]) from None
        raise CliError(EXIT_USAGE, "config-invalid", f"{exc.source}: {len(errors)} errors", errors=errors) from None
    except (PresetError, SimError) as exc:
        raise CliError(EXIT_USAGE, "config-invalid", str(exc)) from None
    return config


def add_status(commands: Any) -> None:
    add_client(commands, "status", _overview, command_help("status"))


def _overview(args: argparse.Namespace, client: Client) -> int:
    health = client.get("/healthz", ok_statuses=(503,))
    node = client.get("/v1/node")
    gpu_health = client.get("/v1/health")
    unhealthy = [gpu for gpu in gpu_health["gpus"] if device_problems(gpu)]
    problem = health["status"] != "ok" or bool(unhealthy)
    if args.json:
        print_json({"health": health, "node": node, "gpu_health": gpu_health})
        return EXIT_PROBLEM if problem else EXIT_OK
    backend = node["backend"] + (f" ({node['simulated_preset']})" if node.get("simulated_preset") else "")
    print(f"gpud {node['gpud_version']} on {node['hostname']}, backend {backend}")
    print(f"health:  {_verdict(health, gpu_health, len(unhealthy))}")
    if node.get("driver_version"):
        print(f"driver:  {node['driver_version']}  CUDA {node['cuda_version']}  NVML {node['nvml_version']}")
        print(f"GPUs:    {node['gpu_count']}  MIG devices: {node['mig_device_count']}")
    for gpu in unhealthy:
        for where, state, reasons in device_problems(gpu):
            print(f"  {where}: {state}" + (f" — {reasons_text(reasons)}" if reasons else ""))
    return EXIT_PROBLEM if problem else EXIT_OK


def _verdict(health: dict, gpu_health: dict, unhealthy: int) -> str:
    """One line for the daemon's and the GPUs' health together: "ok" exactly when `gpud status` exits 0."""
    gpus = len(gpu_health["gpus"])
    counts = f"{gpus - unhealthy} of {gpus} GPUs healthy"
    daemon = "" if health["status"] == "ok" else \
        f"gpud {health['status']}" + (f": {health['reason']}" if health.get("reason") else "")
    if unhealthy:
        return f"{gpu_health['status']} ({counts})" + (f"; {daemon}" if daemon else "")
    return f"{daemon} ({counts})" if daemon else f"ok ({counts})"


def add_reload(commands: Any) -> None:
    add_client(commands, "reload", _reload, command_help("reload"),
               timeout=CHANGE_TIMEOUT_S)


def _reload(args: argparse.Namespace, client: Client) -> int:
    _status, answer = client.request("POST", "/v1/reload", {})
    if args.json:
        print_json(answer)
    else:
        print(f"reloaded: {answer['status']}")
    return EXIT_OK


def add_metrics(commands: Any) -> None:
    add_client(commands, "metrics", _metrics, command_help("metrics"))


def _metrics(args: argparse.Namespace, client: Client) -> int:
    _status, text = client.request_text("GET", "/metrics")
    print_text(args.json, "prometheus-text", text)
    return EXIT_OK


def add_config(commands: Any) -> None:
    config = group(commands.add_parser("config", help=command_help("config")), "config commands")
    validate = config.add_parser("validate", help="check a config file without starting anything (exit 2 invalid)")
    validate.add_argument("path", nargs="?", type=path_argument, default=DEFAULT_CONFIG_PATH)
    local_command(validate, _config_validate)


def _config_validate(args: argparse.Namespace) -> int:
    from gpud.config import load_config

    _checked_config(lambda: load_config(args.path))
    if args.json:
        print_json({"path": str(args.path), "valid": True})
    else:
        print(f"{args.path}: valid")
    return EXIT_OK
