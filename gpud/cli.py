"""The `gpud` command: `gpud serve` runs the daemon; the other subcommands are clients of its socket
(gpud.cli_client), or check local files. Exit codes and error output: gpud.cli_output."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from gpud import __version__, cli_client, doctor
from gpud.cli_output import (EXIT_CODES, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE, SOCKET_ORDER,
                             CliError, drop_stdout, exit_for_status, print_json, report_error, warn)
from gpud.config import LOG_FORMATS, LOG_LEVELS, Config, ConfigError, load_config
from gpud.slurm import health as slurm_health

CLIENT_TIMEOUT_S = 30.0
CHANGE_TIMEOUT_S = 300.0  # a GPU reset ends processes and re-reads the node: it takes longer than a read
# The kinds of health reason gpud raises (gpud/health: checks, tracker, service); a test reads them there.
HEALTH_REASON_KINDS = ("diag", "driver", "ecc", "fabric", "fabric-manager", "infiniband", "lost", "mps", "nvlink",
                       "pcie", "power", "rdma", "recovery-action", "remapped-rows", "reset-required", "retired-pages",
                       "temperature", "throttle", "xid")
# DCGM's diagnostic runs up to health.check_timeout_s (at most 2 h): the client waits that long and a minute
CHECK_TIMEOUT_S = 7200.0 + 60.0


class UsageError(Exception):
    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message)
        self.message, self.usage, self.prog = message, usage, prog


class _Parser(argparse.ArgumentParser):
    """Raises UsageError instead of exiting, so that main reports it (as JSON with --json)."""

    def error(self, message: str):
        raise UsageError(message, self.format_usage(), self.prog)

    def parse_known_args(self, args=None, namespace=None):
        # Each command refuses what it does not know itself, so the error shows its own usage
        # (argparse would leave them to `gpud`, which shows the top-level usage).
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        choices = [str(choice) for choice in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {', '.join(choices)})"
                                             + (f"; did you mean {close[0]!r}?" if close else ""))


class _ServeHelp(argparse.HelpFormatter):
    """`gpud serve --help` lists the simulator's presets, read when help is asked for: loading the
    simulator would slow every other command down."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.dest != "simulate":
            return super()._get_help_string(action)
        from gpud.nvml.sim.presets import PRESETS

        presets = "; ".join(f"{name} ({preset.description})" for name, preset in PRESETS.items())
        return f"{action.help}: {presets}; or MODEL:COUNT[,MODEL:COUNT…]".replace("%", "%%")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in (argv[:argv.index("--")] if "--" in argv else argv)
    try:
        args = build_parser().parse_args(argv)
        as_json = getattr(args, "json", False)
        args.json = as_json
        return args.run(args)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except UsageError as exc:
        if not as_json:
            print(exc.usage, end="", file=sys.stderr)
        command = exc.prog.removeprefix("gpud").strip()  # report_error says "gpud: " itself
        return report_error(CliError(EXIT_USAGE, "usage", f"{command}: {exc.message}" if command else exc.message),
                            as_json)
    except CliError as exc:
        return report_error(exc, as_json)
    except BrokenPipeError:
        drop_stdout()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130  # the shell's code for Ctrl-C


def epilog() -> str:
    codes = "\n".join(textwrap.fill(meaning, 78, initial_indent=f"  {code}  ", subsequent_indent="     ")
                      for code, meaning in EXIT_CODES)
    order = "\n".join(textwrap.fill(place, 78, initial_indent=f"  {n}. ", subsequent_indent="     ")
                      for n, place in enumerate(SOCKET_ORDER, 1))
    return (f"exit status:\n{codes}\n\nthe daemon's socket, first found:\n{order}\n\n"
            "--json prints the API's JSON; metrics and mig export print {\"format\": ..., \"text\": ...},\n"
            "watch one event a line; serve, device-plugin, k8s-agent and slurm health refuse --json (exit 2).\n"
            "With --json, an error is one JSON object on stderr:\n"
            '  {"error": {"code": ..., "message": ...}, "exit_code": N}')


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpud", description="Owns the NVIDIA GPUs of this node.", epilog=epilog(),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gpud {__version__}")
    commands = _group(parser, "commands")
    _add_serve(commands)
    _add_device_plugin(commands)
    _add_k8s_agent(commands)
    _add_dra_plugin(commands)
    _add_client(commands, "status", cli_client.status, "the daemon, the node and its health (exit 1 if not healthy)")
    _add_gpus(commands)
    _add_health(commands)
    _add_check(commands)
    _add_client(commands, "reload", cli_client.reload, "re-read the config files, as systemctl reload does",
                timeout=CHANGE_TIMEOUT_S)
    watch = _add_client(commands, "watch", cli_client.watch, "follow the event stream, one line per event "
                                                             "(exit 3 when gpud goes away)")
    watch.add_argument("--since", type=int, help="replay events after this sequence number first")
    watch.add_argument("--epoch", help="the gpud run that sequence number is of (each event's 'epoch'): "
                                       "after a restart, gpud says so and replays the new run from its start")
    watch.add_argument("--types", help="comma-separated: health,mig,mps,sharing,inventory,kubernetes,allocations,claims")
    _add_mig(commands)
    _add_mps(commands)
    _add_sharing(commands)
    _add_client(commands, "claims", cli_client.claims, "the GPUs and MIG devices Kubernetes DRA claims hold on this "
                "node, as gpud dra-plugin reported them (the device plugin hands none of them out)")
    _add_client(commands, "kubernetes", cli_client.kubernetes, "what gpud k8s-agent last reported: the API server, "
                                                               "the labels it acts on, the GPUHealthy condition, "
                                                               "what it cannot do and why (exit 1 on a problem)")
    _add_client(commands, "nfd", cli_client.nfd, "the labels gpud writes for Node Feature Discovery (exit 1 if the "
                                                 "file could not be written)")
    _add_client(commands, "cdi", cli_client.cdi, "the CDI spec gpud writes for container runtimes: its path, kind "
                                                 "and device names (exit 1 if it could not be written)")
    _add_slurm(commands)
    _add_client(commands, "metrics", cli_client.metrics, "the Prometheus metrics gpud serves")
    _add_sim(commands)
    config = _group(commands.add_parser("config", help="work with config files"), "config commands")
    validate = config.add_parser("validate", help="check a config file without starting anything (exit 2 invalid)")
    validate.add_argument("path", nargs="?", type=Path, default=Path("/etc/gpud/gpud.yaml"))
    _local_command(validate, _config_validate)
    doctor.register(commands)
    return parser


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """Subcommands under parser; given none, the command says which there are (exit 2)."""
    def missing(args: argparse.Namespace) -> int:
        raise UsageError(f"choose a command: {', '.join(sub.choices)}", parser.format_usage(), parser.prog)

    parser.set_defaults(run=missing)
    _json_option(parser)
    sub = parser.add_subparsers(title=title, metavar="COMMAND")
    return sub


def _json_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: an option given to `gpud gpus` is not undone by the defaults of `gpud gpus reset`
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON (errors too, on stderr)")


def _local_command(parser: argparse.ArgumentParser, run) -> argparse.ArgumentParser:
    _json_option(parser)
    parser.set_defaults(run=run, parser=parser)
    return parser


def _add_client(commands: Any, name: str, run, text: str, timeout: float = CLIENT_TIMEOUT_S,
                **details: Any) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=text, description=text)
    _client_options(parser, run, timeout, **details)
    return parser


def _client_options(parser: argparse.ArgumentParser, run, timeout: float = CLIENT_TIMEOUT_S,
                    **details: Any) -> None:
    """A subcommand that talks to the daemon's socket: the options every such command takes."""
    parser.add_argument("--socket", type=Path, default=argparse.SUPPRESS,
                        help="the daemon's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, your own)")
    _json_option(parser)
    parser.set_defaults(run=lambda args: _client_call(args, run, timeout), parser=parser, **details)


def _client_call(args: argparse.Namespace, run, timeout: float) -> int:
    from gpud.client import ApiFailure, Client, DaemonUnreachable

    try:
        return run(args, Client(getattr(args, "socket", None), timeout=timeout))
    except DaemonUnreachable as exc:
        raise CliError(EXIT_UNREACHABLE, "daemon-unreachable", str(exc)) from None
    except ApiFailure as exc:
        details = {key: value for key, value in exc.error.items() if key not in ("code", "message")}
        raise CliError(exit_for_status(exc.status), exc.code, str(exc), http_status=exc.status,
                       **details) from None


# -- the command tree ----------------------------------------------------------------------------


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the daemon", formatter_class=_ServeHelp)
    serve.add_argument("--config", type=Path, help="config file (default /etc/gpud/gpud.yaml, if present)")
    serve.add_argument("--socket", help="API socket path (default /run/gpud/gpud.sock as root, "
                                        "else $XDG_RUNTIME_DIR/gpud/gpud.sock, or /tmp/gpud-UID/gpud.sock "
                                        "where XDG_RUNTIME_DIR is unset)")
    serve.add_argument("--state-dir", help="persisted state (default /var/lib/gpud as root, "
                                           "$XDG_STATE_HOME/gpud otherwise)")
    serve.add_argument("--simulate", metavar="PRESET", help="run on a simulated node")
    serve.add_argument("--sim-state", help="file holding the simulated GPUs' state (default: in the runtime dir)")
    serve.add_argument("--sim-driver", metavar="VERSION",
                       help="NVIDIA driver version the simulated node behaves as, e.g. 535.183.01, 550.90.07, "
                            "580.65.06 (branches differ in what NVML answers)")
    serve.add_argument("--log-level", choices=LOG_LEVELS)
    serve.add_argument("--log-format", choices=LOG_FORMATS)
    _local_command(serve, _serve)


def _add_device_plugin(commands: Any) -> None:
    from gpud.device_plugin import DEFAULT_KUBELET_DIR, DEFAULT_POD_RESOURCES_SOCKET

    plugin = commands.add_parser("device-plugin", help="run a kubelet device plugin that follows gpud's shared "
                                                       "resources (a client of gpud's socket)",
                                 epilog="It needs grpcio's compiled module: on a Python that the package has no "
                                        "compiled libraries for (gpud runs on pure-Python ones there) it says so "
                                        "and exits 127.")
    plugin.add_argument("--socket", type=Path, help="gpud's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, "
                                                    "your own)")
    plugin.add_argument("--kubelet-dir", type=Path, default=DEFAULT_KUBELET_DIR,
                        help=f"where kubelet.sock is and the plugin's sockets go (default {DEFAULT_KUBELET_DIR})")
    plugin.add_argument("--unhealthy-after", type=_seconds, default=30.0, metavar="SECONDS",
                        help="report every device Unhealthy once gpud has been unreachable this long (default 30)")
    plugin.add_argument("--device-list-strategy", type=_device_list_strategies, default="cdi-annotations",
                        metavar="STRATEGY[,STRATEGY]",
                        help="how Allocate names devices to the container runtime, as NVIDIA's plugin: envvar "
                             "(NVIDIA_VISIBLE_DEVICES, for NVIDIA's container runtime), cdi-annotations (any "
                             "kubelet; a CDI-enabled runtime), cdi-cri (kubelet 1.29+); default cdi-annotations")
    plugin.add_argument("--pod-resources-socket", type=Path, default=DEFAULT_POD_RESOURCES_SOCKET,
                        help="the kubelet's PodResources API, read to tell gpud which pods hold gpu-memory units "
                             f"(default {DEFAULT_POD_RESOURCES_SOCKET})")
    plugin.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    plugin.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    _local_command(plugin, _device_plugin)  # --json: its usage errors as JSON, as every command's


def _add_k8s_agent(commands: Any) -> None:
    agent = commands.add_parser("k8s-agent", help="run the Kubernetes node agent: node labels drive MIG layouts and "
                                                  "sharing, health goes to the Node (a client of gpud's socket)")
    agent.add_argument("--kubeconfig", type=Path, help="the cluster (default: $KUBECONFIG, else the service account "
                                                       "of the pod it runs in)")
    agent.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                       help="this node's Node object (default: $NODE_NAME)")
    agent.add_argument("--socket", type=Path, help="gpud's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, "
                                                    "your own)")
    agent.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    agent.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    _local_command(agent, _k8s_agent)


def _add_dra_plugin(commands: Any) -> None:
    from gpud.dra import DEFAULT_CDI_DIR, DEFAULT_DRIVER_NAME, DEFAULT_KUBELET_DIR

    plugin = commands.add_parser("dra-plugin", help="run a Kubernetes DRA kubelet plugin: gpud's GPUs and MIG devices "
                                                    "as ResourceSlices, claims prepared as CDI specs (a client of "
                                                    "gpud's socket and of the Kubernetes API)",
                                 epilog="It needs grpcio's compiled module, as device-plugin does.")
    plugin.add_argument("--socket", type=Path, help="gpud's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, "
                                                    "your own)")
    plugin.add_argument("--kubeconfig", type=Path, help="the cluster (default: $KUBECONFIG, else the service account "
                                                        "of the pod it runs in)")
    plugin.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                        help="this node's Node object, and the name of its pool (default: $NODE_NAME)")
    plugin.add_argument("--kubelet-dir", type=Path, default=DEFAULT_KUBELET_DIR,
                        help=f"the kubelet's --root-dir: plugins_registry/ and plugins/ are in it (default "
                             f"{DEFAULT_KUBELET_DIR})")
    plugin.add_argument("--driver-name", type=_driver_name, default=DEFAULT_DRIVER_NAME,
                        help=f"the DRA driver's name (default {DEFAULT_DRIVER_NAME}, NVIDIA's: DeviceClasses and "
                             "claims written for NVIDIA's driver work unchanged)")
    plugin.add_argument("--cdi-dir", type=Path, default=DEFAULT_CDI_DIR,
                        help=f"where each claim's CDI spec is written (default {DEFAULT_CDI_DIR})")
    plugin.add_argument("--pod-resources-socket", type=Path,
                        help="the kubelet's PodResources API, read so that a GPU the device plugin handed out is "
                             "never prepared for a claim (default <kubelet-dir>/pod-resources/kubelet.sock)")
    plugin.add_argument("--unhealthy-after", type=_seconds, default=30.0, metavar="SECONDS",
                        help="report every device Unknown (and taint it unmonitored) once gpud has been unreachable "
                             "this long (default 30)")
    plugin.add_argument("--taint-no-execute", action="store_true",
                        help="taint a device that needs a reset, a reboot or inspection NoExecute (its pods are "
                             "evicted) instead of NoSchedule")
    plugin.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    plugin.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    _local_command(plugin, _dra_plugin)


def _add_gpus(commands: Any) -> None:
    gpus = commands.add_parser("gpus", help="the GPUs, their MIG devices and health; show, reset, processes")
    _client_options(gpus, cli_client.gpus)
    sub = gpus.add_subparsers(title="gpus commands", metavar="COMMAND")
    for name, run, text in (("show", cli_client.gpu_show, "one GPU with its health"),
                            ("processes", cli_client.gpu_processes, "the compute processes on a GPU and its MIG "
                                                                    "devices, with memory, SM use and owner")):
        _add_client(sub, name, run, text).add_argument("id", help="GPU index, GPU or MIG UUID, or PCI bus id")
    reset = _add_client(sub, "reset", cli_client.gpu_reset, "reset a GPU (with the NVLink peers it needs); "
                                                            "says what blocks it", timeout=CHANGE_TIMEOUT_S)
    reset.add_argument("id", help="GPU index, GPU UUID or PCI bus id")
    reset.add_argument("--force", action="store_true", help="end the compute processes on the GPUs first")


def _add_health(commands: Any) -> None:
    health = commands.add_parser("health", help="the health of each GPU and MIG device, with reasons")
    _client_options(health, cli_client.health)
    clear = _add_client(health.add_subparsers(title="health commands", metavar="COMMAND"), "clear",
                        cli_client.health_clear, "clear a device's health reasons (all, or one kind)")
    clear.add_argument("id", help="GPU index, GPU or MIG UUID, or PCI bus id")
    clear.add_argument("--kind", choices=HEALTH_REASON_KINDS, metavar="KIND",
                       help=f"clear only reasons of this kind: {', '.join(HEALTH_REASON_KINDS)}")


def _add_check(commands: Any) -> None:
    check = _add_client(commands, "check", cli_client.check, "run DCGM's diagnostic on the GPUs now (dcgmi diag) "
                                                             "and fold its verdict into health; exit 1 unless it "
                                                             "passed", timeout=CHECK_TIMEOUT_S)
    check.add_argument("--level", type=int, choices=(1, 2), default=1,
                       help="1: quick (dcgmi diag -r 1, seconds), 2: medium (-r 2, about two minutes)")
    check.add_argument("--force", action="store_true", help="run even while compute processes use the GPUs")
    check.add_argument("--last", action="store_true", help="show the last run instead of running one")


def _add_mig(commands: Any) -> None:
    mig = _group(commands.add_parser("mig", help="MIG layouts: status, layouts, apply, export, validate"),
                 "mig commands")
    _add_client(mig, "status", cli_client.mig_status, "the desired layout and each GPU's state (exit 1 out of sync)")
    layouts = _add_client(mig, "layouts", cli_client.mig_layouts, "the named layouts that fit this node, one line "
                                                                  "each (* = current)")
    layouts.add_argument("--all", action="store_true", help="then the layouts that do not fit, with why")
    export = _add_client(mig, "export", cli_client.mig_export, "this node's MIG layout as a mig-parted file")
    export.add_argument("--name", help="the layout's name in the file (default: current)")
    apply = _add_client(mig, "apply", cli_client.mig_apply, "apply a named layout", timeout=CHANGE_TIMEOUT_S)
    apply.add_argument("layout")
    apply.add_argument("--file", type=Path, help="take the layout from this mig-parted file (sent to gpud) "
                                                 "instead of gpud's layouts file")
    apply.add_argument("--dry-run", action="store_true", help="show the plan; touch nothing")
    apply.add_argument("--force", action="store_true", help="destroy MIG devices even if processes run on them")
    apply.add_argument("--no-wait", action="store_true", help="return once the apply has started")
    validate = mig.add_parser("validate", help="check a mig-parted layouts file (exit 0 valid, 2 invalid)")
    validate.add_argument("path", type=Path)
    validate.add_argument("--strict", action="store_true", help="warnings are errors (exit 2)")
    _local_command(validate, _mig_validate)


def _add_mps(commands: Any) -> None:
    mps = _group(commands.add_parser("mps", help="MPS control daemons: status, start, stop, restart, env"),
                 "mps commands")
    _add_client(mps, "status", cli_client.mps_status, "the MPS daemons and their limits (exit 1 if one is down)")
    for action in ("start", "stop", "restart"):
        control = _add_client(mps, action, cli_client.mps_control, f"{action} one MPS daemon",
                              timeout=CHANGE_TIMEOUT_S, action=action)
        control.add_argument("name")
    env = _add_client(mps, "env", cli_client.mps_env, "the environment a container needs to be a client of one "
                                                      "MPS daemon")
    env.add_argument("name")
    env.add_argument("--memory-mib", type=int, help="pinned device memory limit per device")
    env.add_argument("--threads-percent", type=float, help="active thread percentage")
    quit_all = _local_command(mps.add_parser("quit-all", help="end every MPS control daemon gpud left running "
                                                              "(the packages' preremove runs it as root)"),
                              _mps_quit_all)
    quit_all.add_argument("--config", type=Path, help="config file (default /etc/gpud/gpud.yaml, if present)")


def _add_sharing(commands: Any) -> None:
    sharing = commands.add_parser("sharing", help="shared resources (time-slicing, MPS replicas), the config in "
                                                  "force and why; use, validate")
    _client_options(sharing, cli_client.sharing)
    sub = sharing.add_subparsers(title="sharing commands", metavar="COMMAND")
    use = _add_client(sub, "use", cli_client.sharing_use, "put a named config of sharing.configs_dir in force "
                                                          "(kept across restarts)", timeout=CHANGE_TIMEOUT_S)
    which = use.add_mutually_exclusive_group(required=True)
    which.add_argument("name", nargs="?", help="the config's name (its file in sharing.configs_dir)")
    which.add_argument("--default", action="store_true", help="back to sharing.default_config")
    use.add_argument("--reason", help="why, kept with the choice and shown by gpud sharing")
    _add_client(sub, "allocations", cli_client.sharing_allocations,
                "gpu_memory's units per device: allocated/total GiB and the pods holding them, as the device "
                "plugin reported the kubelet allocated them (exit 1 on a problem)")
    validate = sub.add_parser(
        "validate", help="check a device-plugin sharing file (exit 0 valid, 2 invalid)")
    validate.add_argument("path", type=Path)
    validate.add_argument("--strict", action="store_true", help="warnings are errors (exit 2)")
    _local_command(validate, _sharing_validate)


def _add_slurm(commands: Any) -> None:
    slurm = _group(commands.add_parser("slurm", help="Slurm: the gres.conf of this node's GPUs; drain and resume it by health"), "slurm commands")
    gres = _add_client(slurm, "gres", cli_client.slurm_gres, "the gres.conf gpud builds for this node (slurm.gres_file "
                                                             "holds it, if set; exit 1 if it could not be written)")
    gres.add_argument("--node-line", action="store_true",
                      help="print the Gres= of this node's line in slurm.conf instead")
    text = "slurmd's HealthCheckProgram (and Prolog with --prolog): drain this node on an unhealthy GPU, resume it " \
           "once healthy if gpud drained it"
    health = slurm.add_parser("health", help=text, description=text, epilog=slurm_health.epilog(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    slurm_health.add_arguments(health)
    _local_command(health, _slurm_health)


def _add_sim(commands: Any) -> None:
    sim = _group(commands.add_parser("sim", help="fault drills on a simulated node (gpud serve --simulate)"),
                 "sim commands")
    xid = _add_client(sim, "xid", cli_client.sim_xid, "raise an XID event on a GPU or MIG device")
    xid.add_argument("gpu", help="GPU index or UUID")
    xid.add_argument("xid", type=int)
    xid.add_argument("--gi", type=int, help="GPU-instance id the XID is attributed to")
    xid.add_argument("--ci", type=int, help="compute-instance id the XID is attributed to")
    lost = _add_client(sim, "lost", cli_client.sim_lost, "the GPU falls off the bus")
    lost.add_argument("gpu", help="GPU index or UUID")
    lost.add_argument("--how", help="how NVML reports the loss (e.g. is-lost, unknown)")
    _add_client(sim, "recover", cli_client.sim_recover, "a lost GPU comes back").add_argument(
        "gpu", help="GPU index or UUID")
    processes = _add_client(sim, "processes", cli_client.sim_processes,
                            "set the compute processes on a GPU or MIG device (none: end them all)")
    processes.add_argument("gpu", help="GPU index, GPU UUID, or MIG UUID on a GPU in MIG mode")
    processes.add_argument("pids", type=int, nargs="*", metavar="PID")
    ecc = _add_client(sim, "ecc", cli_client.sim_ecc, "an ECC error on a GPU")
    ecc.add_argument("gpu", help="GPU index or UUID")
    ecc.add_argument("--double-bit", action="store_true", help="uncorrectable (default: single-bit, corrected)")
    holders = _add_client(sim, "holders", cli_client.sim_holders, "another process holds the GPU open, or all "
                                                                  "such processes let go")
    holders.add_argument("gpu", help="GPU index or UUID")
    holders.add_argument("--process", help="program name of the holder")
    holders.add_argument("--pid", type=int, help="its process id")
    holders.add_argument("--release", action="store_true", help="every holder lets go")


# -- commands that run here ----------------------------------------------------------------------


def _refuse_json(args: argparse.Namespace) -> None:
    """serve and device-plugin run until stopped and print logs, not a document: --json would promise
    what they do not print."""
    if args.json:
        args.parser.error("--json: it prints logs, not a JSON document (JSON logs: --log-format json)")


def _serve(args: argparse.Namespace) -> int:
    from gpud import daemon
    from gpud.logs import configure_logging

    _refuse_json(args)
    overrides = {"api.socket": args.socket, "state_dir": args.state_dir, "simulate": args.simulate,
                 "sim_state": args.sim_state, "sim_driver": args.sim_driver, "log.level": args.log_level,
                 "log.format": args.log_format}
    config = _checked_config(lambda: load_config(args.config).with_overrides(**overrides))
    configure_logging(config.log.level, config.log.format)

    def reread() -> Config:
        return load_config(args.config).with_overrides(**overrides)

    return asyncio.run(daemon.serve(config, reread))


def _slurm_health(args: argparse.Namespace) -> int:
    if args.json:  # what it saw and did, a line each, for slurmd's log
        args.parser.error("--json: it prints lines for slurmd's log, not a document")
    return slurm_health.run(args)


def _device_plugin(args: argparse.Namespace) -> int:
    from gpud.logs import configure_logging
    from gpud.python_libraries import EXIT_NO_LIBRARIES, grpc_missing_message

    _refuse_json(args)
    try:  # grpcio has no pure-Python build: a Python the package has no compiled tree for runs without it
        import grpc  # noqa: F401
    except ImportError as exc:
        print(grpc_missing_message("device-plugin", exc), file=sys.stderr)
        return EXIT_NO_LIBRARIES
    from gpud.device_plugin.plugin import run

    configure_logging(args.log_level, args.log_format)
    return run(args.socket, args.kubelet_dir, args.unhealthy_after, args.device_list_strategy,
               args.pod_resources_socket)


def _k8s_agent(args: argparse.Namespace) -> int:
    from gpud.kubernetes.agent import serve
    from gpud.logs import configure_logging

    _refuse_json(args)
    if not args.node_name:
        args.parser.error("--node-name: which Node is this one? (or set $NODE_NAME, as the DaemonSet does from "
                          "spec.nodeName)")
    configure_logging(args.log_level, args.log_format)
    return asyncio.run(serve(args.kubeconfig, args.node_name, args.socket))


def _dra_plugin(args: argparse.Namespace) -> int:
    from gpud.logs import configure_logging
    from gpud.python_libraries import EXIT_NO_LIBRARIES, grpc_missing_message

    _refuse_json(args)
    if not args.node_name:
        args.parser.error("--node-name: which Node is this one? (or set $NODE_NAME, as the DaemonSet does from "
                          "spec.nodeName)")
    if not args.kubelet_dir.is_dir():
        args.parser.error(f"--kubelet-dir: no directory {args.kubelet_dir}: run on a node whose kubelet runs, or give "
                          "the kubelet's --root-dir")
    try:
        import grpc  # noqa: F401
    except ImportError as exc:
        print(grpc_missing_message("dra-plugin", exc), file=sys.stderr)
        return EXIT_NO_LIBRARIES
    from gpud.dra.plugin import run

    configure_logging(args.log_level, args.log_format)
    return run(args.socket, args.kubeconfig, args.node_name, args.kubelet_dir, args.driver_name, args.cdi_dir,
               args.taint_no_execute, args.pod_resources_socket, args.unhealthy_after)


def _driver_name(text: str) -> str:
    """A DRA driver name: a lower-case DNS subdomain of at most 63 characters (k8s.io/api resource/v1
    types.go ResourceSliceSpec.Driver)."""
    if len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a driver name: a lower-case DNS subdomain of at most 63 "
                                         "characters, e.g. gpu.nvidia.com")
    return text


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return seconds


def _device_list_strategies(text: str) -> tuple:
    from gpud.device_plugin.allocation import DeviceListStrategy

    names = [name.strip() for name in text.split(",")]
    valid = [s.value for s in DeviceListStrategy]
    unknown = [name for name in names if name not in valid]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(valid)} at most once, comma-separated")
    return tuple(DeviceListStrategy(name) for name in names)


def _mps_quit_all(args: argparse.Namespace) -> int:
    """Where the config cannot be read, its defaults: only root's pipe directories are acted on then."""
    from gpud.mps.removal import quit_all

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        warn(f"{exc}: acting on the default MPS pipe root, and on root's daemons only")
        config = Config()
    outcomes = asyncio.run(quit_all(config.mps_pipe_root, config.mps_log_root, config.mps.control_binary,
                                    config.mps.user))
    if args.json:
        print_json([{"name": outcome.name, "refused": outcome.refused} for outcome in outcomes])
    for outcome in outcomes:
        if outcome.refused is not None:
            warn(f"left running: {outcome.name}: {outcome.refused}")
        elif not args.json:
            print(f"quit: {outcome.name}")
    return EXIT_OK if all(outcome.refused is None for outcome in outcomes) else EXIT_PROBLEM


def _config_validate(args: argparse.Namespace) -> int:
    _checked_config(lambda: load_config(args.path))
    if args.json:
        print_json({"path": str(args.path), "valid": True})
    else:
        print(f"{args.path}: valid")
    return EXIT_OK


def _checked_config(load) -> Config:
    """The config, with the simulated node it names (preset and driver) checked too."""
    from gpud.nvml.sim import PresetError, SimError, parse_preset
    from gpud.nvml.sim.drivers import parse_driver

    try:
        config = load()
        if config.simulate:
            parse_preset(config.simulate)
            parse_driver(config.sim_driver)
    except (ConfigError, PresetError, SimError) as exc:
        raise CliError(EXIT_USAGE, "config-invalid", str(exc)) from None
    return config


def _mig_validate(args: argparse.Namespace) -> int:
    from gpud.mig.layouts import LayoutError, check_layouts_file

    return _validate_file(args, check_layouts_file, LayoutError,
                          lambda layouts: {"layouts": list(layouts)},
                          lambda layouts: f"{len(layouts)} layouts: {', '.join(layouts)}")


def _sharing_validate(args: argparse.Namespace) -> int:
    from gpud.sharing.config import SharingConfigError, check_sharing_file

    return _validate_file(args, check_sharing_file, SharingConfigError,
                          lambda config: {"strategy": config.strategy, "mig_strategy": config.mig_strategy},
                          lambda config: f"strategy {config.strategy}, MIG strategy {config.mig_strategy}")


def _validate_file(args: argparse.Namespace, check, error_type: type, facts, summary) -> int:
    """`gpud … validate FILE [--strict]`: exit 0 with a summary (warnings on stderr), or 2 with the
    error; with --strict, warnings are errors."""
    path = args.path
    try:
        loaded, warnings = check(path)
    except error_type as exc:
        raise CliError(EXIT_USAGE, "file-invalid", str(exc)) from None
    except OSError as exc:
        raise CliError(EXIT_USAGE, "file-unreadable", f"{path}: {exc.strerror or exc}") from None
    if args.strict and warnings:
        raise CliError(EXIT_USAGE, "file-warnings", f"{path}: {len(warnings)} warning{'s' if len(warnings) > 1 else ''} (--strict)", warnings=warnings)
    if args.json:
        print_json({"path": str(path), "valid": True, **facts(loaded), "warnings": warnings})
        return EXIT_OK
    for text in warnings:
        warn(text)
    print(f"{path}: valid, {summary(loaded)}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
