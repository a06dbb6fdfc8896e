"""The Kubernetes commands: the processes that run beside gpud as clients of its socket (device-plugin,
k8s-agent, dra-plugin), and what they reported to it (kubernetes, claims)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from gpud.base.places import LOG_FORMATS, LOG_LEVELS
from gpud.cli.arguments import add_client, given_socket, local_command, refuse_json, socket_option
from gpud.cli.commands import command_help
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, print_json, table

TYPE_CHECKING = False  # annotations only: typing and the client are imported where used
if TYPE_CHECKING:
    from typing import Any

    from gpud.client import Client


def add_device_plugin(commands: Any) -> None:
    from gpud.device_plugin import DEFAULT_KUBELET_DIR, DEFAULT_POD_RESOURCES_SOCKET

    plugin = commands.add_parser("device-plugin", help=command_help("device-plugin"),
                                 epilog="It needs grpcio's compiled module: on a Python that the package has no "
                                        "compiled libraries for (gpud runs on pure-Python ones there) it says so "
                                        "and exits 127.")
    socket_option(plugin)
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
    local_command(plugin, _device_plugin)  # --json: its usage errors as JSON, as every command's


def _device_plugin(args: argparse.Namespace) -> int:
    from gpud.base.logs import configure_logging
    from gpud.python_libraries import EXIT_NO_LIBRARIES, grpc_missing_message

    refuse_json(args)
    try:  # grpcio has no pure-Python build: a Python the package has no compiled tree for runs without it
        import grpc  # noqa: F401
    except ImportError as exc:
        print(grpc_missing_message("device-plugin", exc), file=sys.stderr)
        return EXIT_NO_LIBRARIES
    from gpud.device_plugin.plugin import run

    configure_logging(args.log_level, args.log_format)
    return run(given_socket(args), args.kubelet_dir, args.unhealthy_after, args.device_list_strategy,
               args.pod_resources_socket)


def _device_list_strategies(text: str) -> tuple:
    from gpud.device_plugin.allocation import DeviceListStrategy

    names = [name.strip() for name in text.split(",")]
    valid = [s.value for s in DeviceListStrategy]
    unknown = [name for name in names if name not in valid]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(valid)} at most once, comma-separated")
    return tuple(DeviceListStrategy(name) for name in names)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return seconds


def add_k8s_agent(commands: Any) -> None:
    agent = commands.add_parser("k8s-agent", help=command_help("k8s-agent"))
    agent.add_argument("--kubeconfig", type=Path, help="the cluster (default: $KUBECONFIG, else the service account "
                                                       "of the pod it runs in)")
    agent.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                       help="this node's Node object (default: $NODE_NAME)")
    socket_option(agent)
    agent.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    agent.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    local_command(agent, _k8s_agent)


def _need_node_name(args: argparse.Namespace) -> None:
    if not args.node_name:
        args.parser.error("--node-name: which Node is this one? (or set $NODE_NAME, as the DaemonSet does from "
                          "spec.nodeName)")


def _k8s_agent(args: argparse.Namespace) -> int:
    import asyncio

    from gpud.kubernetes.agent import serve
    from gpud.base.logs import configure_logging

    refuse_json(args)
    _need_node_name(args)
    configure_logging(args.log_level, args.log_format)
    return asyncio.run(serve(args.kubeconfig, args.node_name, given_socket(args)))


def add_dra_plugin(commands: Any) -> None:
    from gpud.dra import DEFAULT_CDI_DIR, DEFAULT_DRIVER_NAME, DEFAULT_KUBELET_DIR

    plugin = commands.add_parser("dra-plugin", help=command_help("dra-plugin"),
                                 epilog="It needs grpcio's compiled module, as device-plugin does.")
    socket_option(plugin)
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
    local_command(plugin, _dra_plugin)


def _dra_plugin(args: argparse.Namespace) -> int:
    from gpud.base.logs import configure_logging
    from gpud.python_libraries import EXIT_NO_LIBRARIES, grpc_missing_message

    refuse_json(args)
    _need_node_name(args)
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
    return run(given_socket(args), args.kubeconfig, args.node_name, args.kubelet_dir, args.driver_name, args.cdi_dir,
               args.taint_no_execute, args.pod_resources_socket, args.unhealthy_after)


def _driver_name(text: str) -> str:
    """A DRA driver name: a lower-case DNS subdomain of at most 63 characters (k8s.io/api resource/v1
    types.go ResourceSliceSpec.Driver)."""
    if len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a driver name: a lower-case DNS subdomain of at most 63 "
                                         "characters, e.g. gpu.nvidia.com")
    return text


def add_kubernetes(commands: Any) -> None:
    add_client(commands, "kubernetes", _kubernetes, command_help("kubernetes"))


AGENT_STALE_S = 180.0  # the agent reports at least every minute (gpud/kubernetes/agent.py STATUS_HEARTBEAT_S)


def _kubernetes(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/kubernetes")
    agent = view.get("agent")
    problems = (agent or {}).get("problems") or {}
    age = time.time() - view["agent_reported_at"] if agent is not None else None
    stale = agent is not None and (agent.get("running") is False or age > AGENT_STALE_S)
    code = EXIT_PROBLEM if agent is None or stale or problems or not (agent.get("kubernetes") or {}).get("ok") \
        else EXIT_OK
    if args.json:
        print_json(view)
        return code
    settings = view["settings"]
    print(f"settings: taint_unhealthy {str(settings['taint_unhealthy']).lower()}, "
          f"mig_busy_timeout_s {settings['mig_busy_timeout_s']:g}")
    if agent is None:
        print("agent:    none has reported to this gpud (gpud k8s-agent: docs/kubernetes.md)")
        return code
    api = agent.get("kubernetes") or {}
    state = ("STOPPED" if agent.get("running") is False else
             "NOT reporting (is gpud k8s-agent running?)" if age > AGENT_STALE_S else "running")
    print(f"agent:    {state}, node {agent.get('node')}, last report {age:.0f} s ago")
    print(f"api:      {'reachable' if api.get('ok') else 'NOT reachable: ' + str(api.get('error'))}")
    mig, sharing, health = agent.get("mig") or {}, agent.get("sharing") or {}, agent.get("health") or {}
    print(f"mig:      label {mig.get('label') or '-'}, state {mig.get('state') or '-'}"
          + (f": {mig['detail']}" if mig.get("detail") else ""))
    print(f"sharing:  label {sharing.get('label') or '-'}"
          + (f": {sharing['outcome']}" if sharing.get("outcome") else ""))
    print(f"health:   GPUHealthy {health.get('condition') or '-'} ({health.get('reason') or '-'}), "
          f"taint {'on' if health.get('taint') else 'off'}")
    remediation = agent.get("remediation") or {}
    print("remediation: " + _remediation_line(remediation))
    for step in (remediation.get("dry_run_plan") or []) if remediation.get("dry_run") else []:
        print(f"  would {step}")
    print("requests: " + (", ".join(f"{verb} {count}" for verb, count in sorted((agent.get("requests") or {}).items()))
                          or "none"))
    for what, problem in sorted(problems.items()):
        print(f"problem:  cannot {what}: {problem['why']}")
    return code


def _remediation_line(remediation: dict) -> str:
    """The remediation loop as the agent reported it: off, idle, or its step and what it waits for."""
    if not remediation.get("enabled"):
        return "off (remediation.enabled)"
    mode = "dry run, " if remediation.get("dry_run") else ""
    if not remediation.get("step"):
        return f"{mode}idle"
    gpus = ", ".join(f"GPU {index}" for index in remediation.get("gpus") or []) or "-"
    detail = remediation.get("detail") or remediation.get("why")
    return f"{mode}{remediation['step'].upper()} {gpus}" + (f": {detail}" if detail else "")


def add_claims(commands: Any) -> None:
    add_client(commands, "claims", _claims, command_help("claims"))


def _claims(args: argparse.Namespace, client: Client) -> int:
    """The GPUs and MIG devices Kubernetes DRA claims hold on this node (gpud dra-plugin reported them)."""
    view = client.get("/v1/claims")
    if args.json:
        print_json(view)
        return EXIT_OK
    if not view["claims"]:
        print("no DRA claim holds a device on this node")
        return EXIT_OK
    rows = [("CLAIM", "UID", "DEVICES", "SHARING", "SINCE")]
    for claim in view["claims"]:
        devices = ", ".join(f"GPU {d['gpu_index']}" + ("" if d["uuid"] == d["gpu_uuid"] else f" {d['uuid']}")
                            if d["gpu_index"] is not None else f"{d['uuid']} (gone)" for d in claim["devices"])
        sharing = claim["strategy"] or "-"
        if claim["strategy"] == "MPS":
            sharing += " (" + ", ".join(sorted({d["mps_daemon"] for d in claim["devices"] if d["mps_daemon"]})) + ")"
        rows.append((f"{claim['namespace']}/{claim['name']}", claim["uid"], devices, sharing,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(claim["held_since"]))))
    print(table(rows))
    return EXIT_OK
