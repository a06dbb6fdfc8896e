"""`gpud slurm health`: slurmd's HealthCheckProgram (and a Prolog with --prolog). Reads gpud's health
through its socket and drains this node with a reason that starts "gpud:" when a GPU, a MIG device or
the node is unhealthy; resumes only a node gpud drained itself; never touches a node someone else
drained or a DOWN node. Slurm runs it as root and does nothing with its result itself (man slurm.conf,
HealthCheckProgram), so every action is an `scontrol update` run here. docs/slurm.md."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE
from gpud.client import ApiFailure, Client, DaemonUnreachable

REASON_PREFIX = "gpud:"
EXIT_GPUD_ANSWER = 4  # gpud answered, but with an HTTP error or a document that is not its health
EXIT_SCONTROL = 5  # scontrol failed: missing, timed out, the node unknown, or its answer unreadable
EXIT_CODES = (
    (EXIT_OK, "done: the node was drained, resumed or left as it should be (what it saw and did is on stdout)"),
    (EXIT_PROBLEM, "--prolog: a GPU of the job is unhealthy, so the job must not start here"),
    (EXIT_USAGE, "bad arguments, or $SLURM_JOB_GPUS is not a list of numbers"),
    (EXIT_UNREACHABLE, "gpud is unreachable: no socket, connection refused, no answer in time; the node is "
                       "left as it is"),
    (EXIT_GPUD_ANSWER, "gpud answered with an HTTP error or not with its health; the node is left as it is"),
    (EXIT_SCONTROL, "scontrol failed (not found, timed out, the node unknown, or an update refused)"),
)
DEFAULT_TIMEOUT_S = 30.0  # slurmd kills the program after 60 s (slurmd.c run_script_health_check)
MAX_REASON = 200  # sinfo -R shows 20 characters; scontrol show node the whole reason
MAX_OUTPUT = 64 * 1024  # of scontrol's output kept (for parsing and messages)

# Short words for gpud's reason kinds (gpud/health: checks, tracker, service), as the drain reason says them.
KIND_TEXT = {"xid": "XID", "ecc": "ECC", "remapped-rows": "remapped rows", "retired-pages": "retired pages",
             "lost": "lost", "driver": "driver", "fabric": "fabric", "fabric-manager": "fabric manager",
             "nvlink": "NVLink", "pcie": "PCIe", "temperature": "temperature", "power": "power",
             "throttle": "throttle", "reset-required": "reset required", "recovery-action": "recovery action",
             "diag": "diag", "mps": "MPS", "infiniband": "IB", "rdma": "RDMA"}
UNHEALTHY, DEGRADED = "unhealthy", "degraded"


class HealthCheckFailed(Exception):
    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


# -- gpud's health, as the reason Slurm will show -------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """A device or subject that is not healthy: "GPU 2", "GPU 3 MIG 1g.5gb", "node", "ib:mlx5_0/1"."""

    subject: str
    gpu_index: int | None  # the GPU it is or lives on; None for the node and other subjects
    state: str  # unhealthy | degraded
    text: str  # its reasons: "XID 79 (reboot)"


def _clean(text: object) -> str:
    """Text from gpud made safe for a one-line reason: printable ASCII without quotes, spaces collapsed."""
    kept = re.sub(r"[^A-Za-z0-9 .,:;()_+/@#%=-]", " ", str(text))
    return " ".join(kept.split())


def reason_text(reason: dict) -> str:
    """One gpud reason: "XID 79 (reboot)", "ECC dbe (reset-gpu)"."""
    kind, code = _clean(reason.get("kind", "")), _clean(reason.get("code", ""))
    words = KIND_TEXT.get(kind, kind) + (f" {code}" if code and code != kind else "")
    action = _clean(reason.get("action", ""))
    return words + (f" ({action})" if action and action != "none" else "")


def _problem(subject: str, gpu_index: int | None, entry: dict) -> Problem | None:
    state = entry.get("state")
    if state not in (UNHEALTHY, DEGRADED):
        return None
    reasons = [r for r in entry.get("reasons") or [] if isinstance(r, dict) and r.get("severity", state) == state]
    text = ", ".join(dict.fromkeys(reason_text(r) for r in reasons)) or state
    return Problem(subject, gpu_index, state, text)


def problems(view: dict, include_infiniband: bool = False) -> list[Problem]:
    """What is not healthy in gpud's /v1/health document, in its order: the node, each GPU and its MIG
    devices, other subjects (InfiniBand ports only with include_infiniband). ValueError if the
    document is not gpud's health."""
    if not isinstance(view, dict) or not isinstance(view.get("gpus"), list):
        raise ValueError("the answer has no list of GPUs")
    found = []
    try:
        node = view.get("node") or {}
        found.append(_problem("node", None, node))
        for gpu in view["gpus"]:
            index = int(gpu["index"])
            found.append(_problem(f"GPU {index}", index, gpu))
            for dev in gpu.get("mig_devices") or []:
                found.append(_problem(f"GPU {index} MIG {_clean(dev.get('profile', '?'))}", index, dev))
        for subject in view.get("subjects") or []:
            name = _clean(subject.get("name", "?"))
            if include_infiniband or not name.startswith("ib:"):
                found.append(_problem(name, None, subject))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unexpected health document ({exc.__class__.__name__}: {exc})") from None
    return [problem for problem in found if problem is not None]


def drain_reason(unhealthy: list[Problem]) -> str:
    """Slurm's node reason for the unhealthy problems: "gpud: GPU 2 XID 79 (reboot); GPU 5 ..."."""
    parts = [f"{p.subject}: {p.text}" if p.gpu_index is None else f"{p.subject} {p.text}" for p in unhealthy]
    reason = f"{REASON_PREFIX} " + "; ".join(dict.fromkeys(parts))
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


# -- the node as Slurm sees it --------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # State= of scontrol show node: "IDLE", "MIXED+DRAIN", "DOWN+DRAIN+NOT_RESPONDING"
    reason: str | None  # without the " [user@time]" Slurm appends

    @property
    def flags(self) -> set[str]:
        return set(self.state.upper().split("+"))

    @property
    def down(self) -> bool:
        return "DOWN" in self.flags

    @property
    def drained(self) -> bool:
        """Drained or draining, or failed (FAIL is a drain an operator sets with state=fail)."""
        return bool({"DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING"} & self.flags)

    @property
    def drained_by_gpud(self) -> bool:
        return self.drained and (self.reason or "").startswith(REASON_PREFIX)


# "Reason=TEXT [user@2026-11-26T10:05:04]": the reason ends at its stamp. Newer Slurm prints
# Comment=, Extra=, InstanceId=... after it (src/api/node_info.c slurm_sprint_node_table).
_REASON = re.compile(r"(?:^|\s)Reason=(.*?)(?: \[[^\s\[\]]*@[0-9T:-]+\])?(?=$| (?:Comment|Extra|InstanceId|"
                     r"InstanceType|ReservationName)=)")


def parse_show_node(text: str) -> SlurmNode:
    """`scontrol show node -o NAME`'s line. ValueError without NodeName= and State=."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
    state = re.search(r"(?:^|\s)State=(\S+)", line)
    if not name or not state:
        raise ValueError(f"no NodeName= and State= in {line[:200]!r}")
    reason = _REASON.search(line)
    text = reason.group(1).strip() if reason else ""
    return SlurmNode(name.group(1), state.group(1), None if text in ("", "(null)", "none") else text)


# -- the decision ---------------------------------------------------------------------------------

NOTHING, DRAIN, UPDATE, RESUME, LEAVE = "nothing", "drain", "update-reason", "resume", "leave"


@dataclass(frozen=True)
class Decision:
    action: str  # NOTHING | DRAIN | UPDATE | RESUME | LEAVE
    why: str
    reason: str | None = None  # the drain reason, for DRAIN and UPDATE


def decide(node: SlurmNode, unhealthy: list[Problem]) -> Decision:
    """What to do with the node given gpud's unhealthy problems (degraded ones never drain)."""
    wanted = drain_reason(unhealthy) if unhealthy else None
    if node.drained and not node.drained_by_gpud:
        return Decision(LEAVE, f"node is {node.state}, drained by someone else ({node.reason or 'no reason'}): "
                               "not gpud's to change")
    if node.down:
        if node.drained_by_gpud and wanted and node.reason != wanted:
            return Decision(UPDATE, f"node is {node.state}, drained by gpud; the reasons changed", wanted)
        return Decision(LEAVE, f"node is {node.state}: a DOWN node is left to Slurm and its operators")
    if wanted is None:
        if node.drained_by_gpud:
            return Decision(RESUME, "every GPU is healthy again; gpud drained the node, so gpud resumes it")
        return Decision(NOTHING, "healthy; nothing to do")
    if not node.drained:
        return Decision(DRAIN, "unhealthy: draining", wanted)
    if node.reason != wanted:
        return Decision(UPDATE, "still unhealthy and already drained by gpud; the reasons changed", wanted)
    return Decision(NOTHING, "still unhealthy; already drained by gpud for this")


# -- the job's GPUs (--prolog) --------------------------------------------------------------------


def parse_job_gpus(text: str) -> list[int]:
    """$SLURM_JOB_GPUS: "0,2" (gres indices). ValueError for anything else."""
    if not re.fullmatch(r"\d+(,\d+)*", text.strip()):
        raise ValueError(f"SLURM_JOB_GPUS={text[:80]!r} is not a comma-separated list of numbers")
    return [int(item) for item in text.strip().split(",")]


def _expand(pattern: str) -> list[str]:
    """Slurm's bracket ranges, one level: "/dev/nvidia[0-3,5]" -> the 5 names."""
    match = re.fullmatch(r"(.*?)\[([0-9,\-]+)\](.*)", pattern)
    if not match:
        return [pattern]
    head, ranges, tail = match.groups()
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        width = len(low) if low.startswith("0") else 0
        names += [f"{head}{n:0{width}d}" for n in range(int(low), int(high or low) + 1)]
    return [name for item in names for name in _expand(item + tail)] if "[" in tail else \
        [name + tail for name in names]


def _hostlist(text: str) -> list[str]:
    """A Slurm list of names: "vm[1-2],gpu7" (commas inside brackets are ranges)."""
    return [name for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text) for name in _expand(item)]


def gres_gpu_minors(gres_conf: str, node: str) -> list[int | None]:
    """The /dev/nvidia minor of each gpu gres device this node's gres.conf lists, in slurmd's index
    order: one per File= name, one per MultipleFiles= record (a MIG device: its GPU's minor);
    gres_common.c common_node_config_load numbers them so. None where no /dev/nvidiaN is named."""
    minors: list[int | None] = []
    for raw in gres_conf.splitlines():
        fields = dict(item.split("=", 1) for item in raw.split("#", 1)[0].split() if "=" in item)
        fields = {key.lower(): value for key, value in fields.items()}
        if fields.get("name") != "gpu" or ("nodename" in fields and node not in _hostlist(fields["nodename"])):
            continue
        if "multiplefiles" in fields:
            files = _hostlist(fields["multiplefiles"])
            gpus = [int(m.group(1)) for f in files if (m := re.fullmatch(r"/dev/nvidia(\d+)", f))]
            minors.append(gpus[0] if gpus else None)
        elif "file" in fields:
            for name in _hostlist(fields["file"]):
                found = re.fullmatch(r"/dev/nvidia(\d+)", name)
                minors.append(int(found.group(1)) if found else None)
    return minors


def job_gpu_indices(job_gpus: list[int], minors: list[int | None], gpu_minors: dict[int, int]) -> set[int] | None:
    """gpud's indices of the job's GPUs, from SLURM_JOB_GPUS's gres indices, gres.conf's device
    minors and gpud's {minor: index}; None when any cannot be mapped (then every GPU is checked)."""
    indices = set()
    for gres_index in job_gpus:
        minor = minors[gres_index] if gres_index < len(minors) else None
        if minor is None or minor not in gpu_minors:
            return None
        indices.add(gpu_minors[minor])
    return indices


# -- running it -----------------------------------------------------------------------------------


class Scontrol:
    """scontrol as a child with a deadline; its failures are HealthCheckFailed(EXIT_SCONTROL)."""

    def __init__(self, path: str, deadline: float, dry_run: bool):
        self.path, self.deadline, self.dry_run = path, deadline, dry_run

    def run(self, *args: str) -> str:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise HealthCheckFailed(EXIT_SCONTROL, f"no time left to run scontrol {' '.join(args)}")
        try:
            result = subprocess.run([self.path, *args], capture_output=True, timeout=remaining,
                                    stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol not found: {self.path}") from None
        except PermissionError as exc:
            raise HealthCheckFailed(EXIT_SCONTROL, f"cannot run {self.path}: {exc.strerror}") from None
        except subprocess.TimeoutExpired:
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol {' '.join(args)} did not finish within "
                                                   f"{remaining:.0f} s") from None
        out = result.stdout[:MAX_OUTPUT].decode(errors="replace")
        if result.returncode != 0:
            said = " ".join((result.stderr[:MAX_OUTPUT].decode(errors="replace") or out).split())[:300]
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol {' '.join(args)} failed (exit "
                                                   f"{result.returncode}): {said or 'no message'}")
        return out

    def show_node(self, node: str) -> SlurmNode:
        text = self.run("show", "node", "-o", node)
        try:
            return parse_show_node(text)
        except ValueError as exc:
            raise HealthCheckFailed(EXIT_SCONTROL, f"cannot read scontrol show node {node}: {exc}") from None

    def update(self, node: str, state: str, reason: str | None = None) -> None:
        # An argv list, no shell: a reason is one argument whatever it holds.
        args = ["update", f"nodename={node}", f"state={state}"] + ([f"reason={reason}"] if reason else [])
        if self.dry_run:
            print("dry run: would run: " + " ".join([self.path, *args[:3]]) +
                  (f' "reason={reason}"' if reason else ""))
            return
        self.run(*args)


def _read_gpud(client: Client, path: str):
    try:
        return client.get(path)
    except DaemonUnreachable as exc:
        raise HealthCheckFailed(EXIT_UNREACHABLE, str(exc)) from None
    except ApiFailure as exc:
        raise HealthCheckFailed(EXIT_GPUD_ANSWER, f"gpud answered {path} with HTTP {exc.status}: {exc}") from None


def node_name(args: argparse.Namespace) -> str:
    return args.node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _default_gres_conf() -> Path:
    return Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent / "gres.conf"


def check(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    name = node_name(args)
    client = Client(args.socket, timeout=max(1.0, min(10.0, args.timeout / 2)))
    try:
        found = problems(_read_gpud(client, "/v1/health"), args.drain_on_infiniband)
    except ValueError as exc:
        raise HealthCheckFailed(EXIT_GPUD_ANSWER, f"gpud's /v1/health is not a health document: {exc}") from None
    unhealthy = [p for p in found if p.state == UNHEALTHY]
    for problem in found:
        print(f"gpud: {problem.subject} {problem.state}: {problem.text}" +
              ("" if problem.state == UNHEALTHY else " (degraded does not drain)"))
    scontrol = Scontrol(args.scontrol, deadline, args.dry_run)
    node = scontrol.show_node(name)
    print(f"slurm: node {node.name} {node.state}" + (f", reason: {node.reason}" if node.reason else ""))
    decision = decide(node, unhealthy)
    print(f"decision: {decision.action}: {decision.why}" + (f": {decision.reason}" if decision.reason else ""))
    if decision.action in (DRAIN, UPDATE):
        scontrol.update(node.name, "drain", decision.reason)
    elif decision.action == RESUME:
        scontrol.update(node.name, "resume")
    if decision.action in (DRAIN, UPDATE, RESUME) and not args.dry_run:
        print(f"done: {decision.action} {node.name}")
    if args.prolog:
        return _prolog_verdict(args, client, name, unhealthy)
    return EXIT_OK


def _prolog_verdict(args: argparse.Namespace, client: Client, name: str, unhealthy: list[Problem]) -> int:
    """Refuses the job when one of its GPUs (or the node itself) is unhealthy."""
    job_gpus_text = os.environ.get("SLURM_JOB_GPUS", "")
    wanted: set[int] | None = None
    if job_gpus_text:
        try:
            job_gpus = parse_job_gpus(job_gpus_text)
        except ValueError as exc:
            raise HealthCheckFailed(EXIT_USAGE, str(exc)) from None
        gres_conf = Path(args.gres_conf) if args.gres_conf else _default_gres_conf()
        try:
            minors = gres_gpu_minors(gres_conf.read_text(), name)
        except OSError as exc:
            minors = []
            print(f"prolog: cannot read {gres_conf} ({exc.strerror}): checking every GPU")
        gpus = _read_gpud(client, "/v1/gpus")
        gpu_minors = {g["minor_number"]: g["index"] for g in (gpus or {}).get("gpus", [])
                      if isinstance(g, dict) and g.get("minor_number") is not None}
        wanted = job_gpu_indices(job_gpus, minors, gpu_minors)
        if wanted is None:
            print(f"prolog: SLURM_JOB_GPUS={job_gpus_text} does not map to gpud's GPUs through {gres_conf}: "
                  "checking every GPU")
        else:
            print(f"prolog: job's GPUs (SLURM_JOB_GPUS={job_gpus_text}) are gpud's GPU "
                  f"{', '.join(map(str, sorted(wanted)))}")
    else:
        print("prolog: no SLURM_JOB_GPUS: checking every GPU")
    refused = [p for p in unhealthy if p.gpu_index is None or wanted is None or p.gpu_index in wanted]
    if refused:
        text = "; ".join(f"{p.subject} {p.text}" for p in refused)
        print(f"gpud: refusing the job on {name}: {text}", file=sys.stderr)
        return EXIT_PROBLEM
    print("prolog: the job's GPUs are healthy")
    return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", type=Path, default=None,
                        help="gpud's socket (default: $GPUD_SOCKET, /run/gpud/gpud.sock, your own)")
    parser.add_argument("--node-name", help="the Slurm node (default: $SLURMD_NODENAME, else the short hostname)")
    parser.add_argument("--scontrol", default="scontrol", help="the scontrol to run (default: scontrol on PATH)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"for everything together (default {DEFAULT_TIMEOUT_S:g}; slurmd kills a health "
                             "check after 60)")
    parser.add_argument("--dry-run", action="store_true", help="print the scontrol update it would run instead")
    parser.add_argument("--prolog", action="store_true",
                        help="as slurmd's Prolog: also exit 1 when a GPU of the job ($SLURM_JOB_GPUS; every GPU "
                             "without it) or the node is unhealthy")
    parser.add_argument("--gres-conf", help="gres.conf, to map $SLURM_JOB_GPUS to GPUs (default: beside "
                                            "$SLURM_CONF, else /etc/slurm/gres.conf)")
    parser.add_argument("--drain-on-infiniband", action="store_true",
                        help="an unhealthy InfiniBand port (ib:...) drains the node too")


def run(args: argparse.Namespace) -> int:
    try:
        return check(args)
    except HealthCheckFailed as exc:
        print(f"gpud slurm health: {exc}", file=sys.stderr)
        return exc.exit_code


def epilog() -> str:
    return "exit status:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES)
