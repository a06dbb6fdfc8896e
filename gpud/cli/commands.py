"""gpud's commands: the module of gpud.cli that adds each, and the line `gpud --help` shows for it.

Kept apart from the modules, so that `gpud --help` and a mistyped command list every command without
importing any (gpud.cli.parser)."""

from __future__ import annotations

# (command, module of gpud.cli, the function there that adds it, its help line), in the order of `gpud --help`
COMMANDS = (
    ("serve", "serve", "add_serve", "run the daemon"),
    ("device-plugin", "kubernetes", "add_device_plugin",
     "run a kubelet device plugin that follows gpud's shared resources (a client of gpud's socket)"),
    ("k8s-agent", "kubernetes", "add_k8s_agent",
     "run the Kubernetes node agent: node labels drive MIG layouts and sharing, health goes to the"
     " Node (a client of gpud's socket)"),
    ("dra-plugin", "kubernetes", "add_dra_plugin",
     "run a Kubernetes DRA kubelet plugin: gpud's GPUs and MIG devices as ResourceSlices, claims "
     "prepared as CDI specs (a client of gpud's socket and of the Kubernetes API)"),
    ("status", "serve", "add_status", "the daemon, the node and its health (exit 1 if not healthy)"),
    ("gpus", "gpus", "add_gpus", "the GPUs, their MIG devices and health; show, reset, processes"),
    ("health", "health", "add_health", "the health of each GPU and MIG device, with reasons"),
    ("check", "health", "add_check",
     "run DCGM's diagnostic on the GPUs now (dcgmi diag) and fold its verdict into health; exit 1 "
     "unless it passed"),
    ("reload", "serve", "add_reload", "re-read the config files, as systemctl reload does"),
    ("watch", "watch", "add_watch", "follow the event stream, one line per event (exit 3 when gpud goes away)"),
    ("mig", "mig", "add_mig", "MIG layouts: status, layouts, apply, export, validate"),
    ("mps", "mps", "add_mps", "MPS control daemons: status, start, stop, restart, env"),
    ("sharing", "sharing", "add_sharing",
     "shared resources (time-slicing, MPS replicas), the config in force and why; use, validate"),
    ("claims", "kubernetes", "add_claims",
     "the GPUs and MIG devices Kubernetes DRA claims hold on this node, as gpud dra-plugin "
     "reported them (the device plugin hands none of them out)"),
    ("kubernetes", "kubernetes", "add_kubernetes",
     "what gpud k8s-agent last reported: the API server, the labels it acts on, the GPUHealthy "
     "condition, what it cannot do and why (exit 1 on a problem)"),
    ("nfd", "node_files", "add_nfd",
     "the labels gpud writes for Node Feature Discovery (exit 1 if the file could not be written)"),
    ("cdi", "node_files", "add_cdi",
     "the CDI spec gpud writes for container runtimes: its path, kind and device names (exit 1 if "
     "it could not be written)"),
    ("slurm", "slurm", "add_slurm", "Slurm: the gres.conf of this node's GPUs; drain and resume it by health"),
    ("metrics", "serve", "add_metrics", "the Prometheus metrics gpud serves"),
    ("sim", "sim", "add_sim", "fault drills on a simulated node (gpud serve --simulate)"),
    ("config", "serve", "add_config", "work with config files"),
    ("doctor", "doctor", "add_doctor",
     "check this node read-only: driver, GPUs, nvidia-smi, resets, NVLink, permissions (exit 0 ok,"
     " 1 problems, 2 cannot run)"),
)
_HELP = {name: text for name, _module, _adder, text in COMMANDS}


def command_help(name: str) -> str:
    return _HELP[name]
