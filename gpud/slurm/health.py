"""`gpud slurm health`: slurmd's HealthCheckProgram (and a Prolog with --prolog). Reads gpud's health
through its socket and drains this node with a reason that starts "gpud:" when a GPU, a MIG device or
the node is unhealthy; resumes only a node gpud drained itself; never touches a node someone else
drained or a DOWN node. With gpud's remediation policy on, a node gpud drained that no job runs on any
more has its GPUs reset and checked through gpud, and is resumed when they pass (or is left drained
saying why, or asked to reboot). Slurm runs it as root and does nothing with its result itself (man
slurm.conf, HealthCheckProgram), so every action is an `scontrol` run here. docs/slurm.md."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from collections import namedtuple

from gpud.base import child
from gpud.cli.output import EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE
from gpud.client import ApiFailure, BadAnswer, Client, DaemonUnreachable

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
MAX_OUTPUT = 64 * 1024  # of scontrol's output read (for parsing and messages): a node's line is < 2 KiB
MAX_GPUD_ANSWER = 16 << 20  # of gpud's /v1/health and /v1/gpus read: some 100 KiB on a node of 56 MIG devices
GPUD_ANSWER_TIMEOUT_S = 10.0  # for one answer of gpud's, within --timeout
MAX_PRINTED = 300  # characters of one problem's or reason's text printed (slurmd logs every line)
MAX_PROBLEMS_PRINTED = 64

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


ACTION_RESET, ACTION_REBOOT, ACTION_INSPECT = "reset-gpu", "reboot", "inspect-hardware"
# What a GPU's `remedy` in gpud's health may be (gpud/health/tracker.py remedy).
REMEDIES = (ACTION_RESET, ACTION_REBOOT, ACTION_INSPECT)


# Named tuples, not dataclasses: importing dataclasses (inspect) costs more than starting Python, and
# this program runs before every job.
class Problem(namedtuple("Problem", "subject gpu_index state text actions remedy", defaults=((), None))):
    """A device or subject that is not healthy: subject "GPU 2", "GPU 3 MIG 1g.5gb", "node" or
    "ib:mlx5_0/1"; gpu_index the GPU it is or lives on (None for the node and other subjects); state
    unhealthy or degraded; text its reasons ("XID 79 (reboot)"); actions what those reasons ask
    ("reboot", "reset-gpu"...: gpud's suggested actions); remedy, on a GPU and its MIG devices, what
    gpud's health says brings that GPU back (reset-gpu, reboot, inspect-hardware; None: none of them)."""

    __slots__ = ()


def _clean(text: object) -> str:
    """Text from gpud made safe for a one-line reason: printable ASCII without quotes, spaces collapsed."""
    kept = re.sub(r"[^A-Za-z0-9 .,:;()_+/@#%=-]", " ", str(text))
    return " ".join(kept.split())


def _brief(text: str, limit: int = MAX_PRINTED) -> str:
    """Text cut for one line of slurmd's log: a reason from gpud or Slurm can be any length."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def reason_text(reason: dict) -> str:
    """One gpud reason: "XID 79 (reboot)", "ECC dbe (reset-gpu)"."""
    kind, code = _clean(reason.get("kind", "")), _clean(reason.get("code", ""))
    words = KIND_TEXT.get(kind, kind) + (f" {code}" if code and code != kind else "")
    action = _clean(reason.get("action", ""))
    return words + (f" ({action})" if action and action != "none" else "")


def _problem(subject: str, gpu_index: int | None, entry: dict, remedy: object = None) -> Problem | None:
    state = entry.get("state")
    if state not in (UNHEALTHY, DEGRADED):
        return None
    reasons = [r for r in entry.get("reasons") or [] if isinstance(r, dict) and r.get("severity", state) == state]
    text = ", ".join(dict.fromkeys(reason_text(r) for r in reasons)) or state
    return Problem(subject, gpu_index, state, text, tuple(dict.fromkeys(_clean(r.get("action", "")) for r in reasons)),
                   remedy if remedy in REMEDIES else None)


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
            index, remedy = int(gpu["index"]), gpu.get("remedy")
            found.append(_problem(f"GPU {index}", index, gpu, remedy))
            for dev in gpu.get("mig_devices") or []:
                found.append(_problem(f"GPU {index} MIG {_clean(dev.get('profile', '?'))}", index, dev, remedy))
        for subject in view.get("subjects") or []:
            name = _clean(subject.get("name", "?"))
            if include_infiniband or not name.startswith("ib:"):
                found.append(_problem(name, None, subject))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unexpected health document ({exc.__class__.__name__}: {exc})") from None
    return [problem for problem in found if problem is not None]


# What a remediation left, said between gpud's prefix and the problems ("gpud: reboot needed: GPU 1 XID
# 79 (reboot)"): what a person must do, and what a later run reads back to know what was tried. Fixed
# words: a reason that changed on every run would be rewritten on every run.
PLAIN = ""
REBOOT_NEEDED = "reboot needed"
RESET_BLOCKED = "reset blocked, a process outside Slurm holds the GPU: end it"
BUDGET_SPENT = "reset budget spent, gpud retries within the hour"
CHECK_FAILED = "GPU check failed after its reset: inspect it, then gpud health clear"
RESET_FAILED = "GPU reset failed (slurmd's log says why): reset it, then gpud health clear"
MARKS = (PLAIN, REBOOT_NEEDED, RESET_BLOCKED, BUDGET_SPENT, CHECK_FAILED, RESET_FAILED)
WAITS_FOR_A_PERSON = (CHECK_FAILED, RESET_FAILED)  # not tried again while gpud reports the same problems


def drain_reason(unhealthy: list[Problem], mark: str = PLAIN) -> str:
    """Slurm's node reason for the unhealthy problems: "gpud: GPU 2 XID 79 (reboot); GPU 5 ...", with
    a remediation's mark after the prefix: "gpud: reboot needed: GPU 2 ..."."""
    parts = [f"{p.subject}: {p.text}" if p.gpu_index is None else f"{p.subject} {p.text}" for p in unhealthy]
    reason = f"{REASON_PREFIX} " + (f"{mark}: " if mark else "") + "; ".join(dict.fromkeys(parts))
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def mark_of(reason: str | None, unhealthy: list[Problem]) -> str | None:
    """The mark of a reason gpud wrote for these problems (PLAIN for none); None when the reason is not
    gpud's for these problems (someone else's, or gpud's for problems that changed since)."""
    return next((mark for mark in MARKS if reason == drain_reason(unhealthy, mark)), None)


# -- the node as Slurm sees it --------------------------------------------------------------------


class SlurmNode(namedtuple("SlurmNode", "name state reason")):
    """state: State= of scontrol show node ("IDLE", "MIXED+DRAIN", "DOWN+DRAIN+NOT_RESPONDING");
    reason: without the " [user@time]" Slurm appends, None when there is none."""

    __slots__ = ()

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

    @property
    def empty(self) -> bool:
        """Drained with no job left: IDLE+DRAIN (sinfo's "drained"), not draining (MIXED+DRAIN or
        ALLOCATED+DRAIN: jobs run on) nor finishing a job (COMPLETING: its epilog runs). scontrol prints
        the base state and its flags (src/common/slurm_protocol_defs.c node_state_string_complete)."""
        base, *flags = self.state.upper().split("+")
        return base == "IDLE" and "DRAIN" in flags and "COMPLETING" not in flags

    @property
    def reboot_asked(self) -> bool:
        """`scontrol reboot` was asked and not done yet: REBOOT_REQUESTED until slurmctld sends it to
        slurmd (once the node is idle), REBOOT_ISSUED until the node registers again."""
        return bool({"REBOOT_REQUESTED", "REBOOT_ISSUED"} & self.flags)


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

NOTHING, DRAIN, UPDATE, RESUME, LEAVE, REBOOT = "nothing", "drain", "update-reason", "resume", "leave", "reboot"


class Decision(namedtuple("Decision", "action why reason", defaults=(None,))):
    """action: NOTHING, DRAIN, UPDATE, RESUME, LEAVE or REBOOT (scontrol reboot ASAP); reason: the drain
    reason, for DRAIN, UPDATE and REBOOT."""

    __slots__ = ()


def decide(node: SlurmNode, unhealthy: list[Problem]) -> Decision:
    """What to do with the node given gpud's unhealthy problems (degraded ones never drain)."""
    wanted = drain_reason(unhealthy) if unhealthy else None
    if node.drained and not node.drained_by_gpud:
        return Decision(LEAVE, f"node is {node.state}, drained by someone else ({node.reason or 'no reason'}): "
                               "not gpud's to change")
    if node.reboot_asked:
        return Decision(LEAVE, f"node is {node.state}: a reboot is under way; Slurm's next state follows it")
    if node.down:
        if node.drained_by_gpud and wanted and mark_of(node.reason, unhealthy) is None:
            return Decision(UPDATE, f"node is {node.state}, drained by gpud; the reasons changed", wanted)
        return Decision(LEAVE, f"node is {node.state}: a DOWN node is left to Slurm and its operators")
    if wanted is None:
        if node.drained_by_gpud:
            return Decision(RESUME, "every GPU is healthy again; gpud drained the node, so gpud resumes it")
        return Decision(NOTHING, "healthy; nothing to do")
    if not node.drained:
        return Decision(DRAIN, "unhealthy: draining", wanted)
    if mark_of(node.reason, unhealthy) is None:
        return Decision(UPDATE, "still unhealthy and already drained by gpud; the reasons changed", wanted)
    return Decision(NOTHING, "still unhealthy; already drained by gpud for this")


# -- remediation: reset, check and resume a node gpud drained (docs/slurm.md) ------------------------

REQUESTER = "slurm"


def _asked(unhealthy: list[Problem]) -> set[str]:
    """What the problems ask for: a GPU's remedy as gpud decides it (the driver's recovery action over the
    XID catalog's), the node's and other subjects' suggested actions."""
    return {p.remedy for p in unhealthy if p.remedy} | \
        {action for p in unhealthy if p.gpu_index is None for action in p.actions}


# POST /v1/gpus/{id}/remediate's outcomes, as this program names them in its lines
PASSED, FAILED_CHECK, BLOCKED, BUDGET, NEEDS_REBOOT, NEEDS_INSPECTION, FAILED = (
    "passed", "check-failed", "blocked", "budget-spent", "needs-reboot", "needs-inspection", "failed")
# The reason's mark for the outcome that says most of what is left to do, first first.
OUTCOME_MARKS = ((FAILED_CHECK, CHECK_FAILED), (FAILED, RESET_FAILED), (BLOCKED, RESET_BLOCKED),
                 (BUDGET, BUDGET_SPENT))
# The refusals of the route (409, 429) by their error code.
REFUSALS = {"reset-blocked": BLOCKED, "reset-budget-spent": BUDGET, "needs-reboot": NEEDS_REBOOT,
            "needs-inspection": NEEDS_INSPECTION}


class Remediation:
    """One run's remediation of a node gpud drained and no job runs on: reads gpud's policy, resets
    and checks the GPUs that ask for a reset through gpud (which keeps the reset budget, refuses a
    GPU something holds and never forces), and decides what Slurm is told."""

    def __init__(self, client: Client, deadline: float, dry_run: bool, include_infiniband: bool):
        self.client, self.deadline, self.dry_run = client, deadline, dry_run
        self.include_infiniband = include_infiniband

    def policy(self) -> dict | None:
        """gpud's remediation section when it is enabled; None when off, or gpud has none (404: older)."""
        status, view = _gpud_exchange(self.client, "GET", "/v1/remediation", self.deadline, ok_statuses=(404,))
        if status == 404:
            print("remediation: off (this gpud has no GET /v1/remediation)")
            return None
        policy = view.get("policy") if isinstance(view, dict) else None
        if not isinstance(policy, dict) or not isinstance(policy.get("enabled"), bool):
            raise HealthCheckFailed(EXIT_GPUD_ANSWER, "gpud's /v1/remediation has no policy with 'enabled'")
        if not policy["enabled"]:
            print("remediation: off (gpud.yaml remediation.enabled is false)")
            return None
        return policy

    def decide(self, node: SlurmNode, unhealthy: list[Problem]) -> Decision | None:
        """What to do instead of leaving the drain as it is; None: leave it (remediation off, or
        nothing gpud can do for these problems)."""
        policy = self.policy()
        if policy is None:
            return None
        dry_run = self.dry_run or policy.get("dry_run") is True
        asked = _asked(unhealthy)
        if ACTION_INSPECT in asked:
            print("remediation: a device needs its hardware inspected (inspect-hardware): a person's work; "
                  "the node stays drained")
            return None
        if ACTION_REBOOT in asked:
            return self._reboot(node, unhealthy, policy, dry_run)
        gpus = sorted({p.gpu_index for p in unhealthy if p.remedy == ACTION_RESET})
        if not gpus:
            print("remediation: nothing unhealthy asks for a GPU reset: the node stays drained")
            return None
        mark = mark_of(node.reason, unhealthy)
        if mark in WAITS_FOR_A_PERSON:
            print(f"remediation: already tried for these problems ({mark}): the node stays drained")
            return None
        if dry_run:
            for index in gpus:
                print(f"dry run: would POST /v1/gpus/{index}/remediate {{\"requester\": \"{REQUESTER}\"}}, "
                      "and resume the node if every GPU passes its check")
            return Decision(NOTHING, "dry run: the node stays as it is")
        outcomes = {index: self._remediate(index) for index in gpus}
        return self._after(node, outcomes, policy)

    def _remediate(self, index: int) -> str:
        """POST /v1/gpus/{index}/remediate; its outcome, each step said in a line."""
        path = f"/v1/gpus/{index}/remediate"
        print(f"remediation: GPU {index}: reset if gpud's health asks for one, then check (POST {path})")
        try:
            _status, done = _gpud_exchange(self.client, "POST", path, self.deadline, {"requester": REQUESTER})
        except ApiFailure as exc:
            outcome = REFUSALS.get(exc.code, FAILED) if exc.status in (409, 429) else FAILED
            print(f"remediation: GPU {index}: {outcome}: HTTP {exc.status} {_brief(_clean(exc.code))}: "
                  f"{_brief(_clean(exc))}" + _refusal_details(exc.error))
            return outcome
        check = done.get("check") if isinstance(done, dict) else None
        if not isinstance(check, dict) or not isinstance(check.get("passed"), bool):
            print(f"remediation: GPU {index}: {FAILED}: gpud's answer has no check")
            return FAILED
        reset = done.get("reset")
        if isinstance(reset, dict):
            print(f"remediation: GPU {index}: reset GPU {_clean(reset.get('reset', [index]))}: "
                  f"{_brief(_clean(reset.get('output', '')))}")
        else:
            print(f"remediation: GPU {index}: no reset needed")
        problems_text = "; ".join(_clean(problem) for problem in check.get("problems") or [])
        print(f"remediation: GPU {index}: check {_clean(check.get('how', '?'))} "
              f"{'passed' if check['passed'] else 'failed'}" + (f": {_brief(problems_text)}" if problems_text else ""))
        return PASSED if check["passed"] else FAILED_CHECK

    def _after(self, node: SlurmNode, outcomes: dict[int, str], policy: dict) -> Decision:
        """The decision from gpud's health read again after the resets, and their outcomes."""
        unhealthy = [p for p in _read_health(self.client, self.deadline, self.include_infiniband)
                     if p.state == UNHEALTHY]
        for problem in unhealthy[:MAX_PROBLEMS_PRINTED]:
            print(f"gpud: after remediation: {_brief(problem.subject)} unhealthy: {_brief(problem.text)}")
        if not unhealthy:
            return Decision(RESUME, "every GPU passed its check after its reset; gpud drained the node, so gpud "
                                    "resumes it")
        if NEEDS_REBOOT in outcomes.values() or ACTION_REBOOT in _asked(unhealthy):
            return self._reboot(node, unhealthy, policy, dry_run=False)
        mark = next((mark for outcome, mark in OUTCOME_MARKS if outcome in outcomes.values()), PLAIN)
        wanted = drain_reason(unhealthy, mark)
        if node.reason == wanted:
            return Decision(NOTHING, "still unhealthy after the remediation; the reason says so already")
        return Decision(UPDATE, "still unhealthy after the remediation: the node stays drained", wanted)

    def _reboot(self, node: SlurmNode, unhealthy: list[Problem], policy: dict, dry_run: bool) -> Decision:
        wanted = drain_reason(unhealthy, REBOOT_NEEDED)
        if policy.get("slurm_reboot") is True:
            if dry_run:
                print(f"dry run: would run: scontrol reboot ASAP nextstate=RESUME \"reason={wanted}\" {node.name}")
                return Decision(NOTHING, "dry run: the node stays as it is")
            return Decision(REBOOT, "a GPU needs a reboot: Slurm reboots the node (remediation.slurm_reboot), "
                                    "then resumes it", wanted)
        if node.reason == wanted:
            return Decision(NOTHING, "a GPU needs a reboot; the reason says so already (remediation.slurm_reboot "
                                     "is off: a person reboots)")
        return Decision(UPDATE, "a GPU needs a reboot: the node stays drained, its reason says so", wanted)


def _refusal_details(error: dict) -> str:
    """What a refusal carries besides its message: who holds the GPU, when the budget frees up."""
    said = ""
    if isinstance(error.get("retry_after_s"), (int, float)):
        said += f" (a reset is free again in {error['retry_after_s']:.0f} s)"
    blockers = error.get("blockers")
    for blocker in blockers[:8] if isinstance(blockers, list) else []:
        if isinstance(blocker, dict):
            said += f"; blocker: GPU {_clean(blocker.get('gpu'))}: {_brief(_clean(blocker.get('reason', '')))}"
    return said


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
            result = child.run_sync([self.path, *args], timeout_s=remaining, output_cap=MAX_OUTPUT)
        except FileNotFoundError:
            where = self.path if os.sep in self.path else f"{self.path} on PATH"
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol not found: {where}: install Slurm's client commands "
                                                   "(Debian: apt-get install slurm-client), or name it with "
                                                   "--scontrol PATH") from None
        except PermissionError as exc:
            raise HealthCheckFailed(EXIT_SCONTROL, f"cannot run {self.path}: {exc.strerror}") from None
        why = result.failure(remaining, MAX_OUTPUT)
        if why:
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol {' '.join(args)[:200]}: {why}")
        out = result.stdout.decode(errors="replace")
        if result.exit_code != 0:
            said = " ".join((result.stderr.decode(errors="replace") or out).split())[:300]
            raise HealthCheckFailed(EXIT_SCONTROL, f"scontrol {' '.join(args)[:200]} failed (exit "
                                                   f"{result.exit_code}): {said or 'no message'}")
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

    def reboot(self, node: str, reason: str) -> None:
        """`scontrol reboot ASAP nextstate=RESUME reason=... NODE`: slurmctld drains the node, has slurmd
        run the RebootProgram once it is idle, and resumes it when it registers again
        (src/slurmctld/proc_req.c _slurm_rpc_reboot_nodes; scontrol refuses without a RebootProgram)."""
        args = ["reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", node]
        if self.dry_run:
            print(f'dry run: would run: {self.path} reboot ASAP nextstate=RESUME "reason={reason}" {node}')
            return
        self.run(*args)


def _gpud_exchange(client: Client, method: str, path: str, deadline: float, body: object = None,
                   ok_statuses: tuple = ()) -> tuple[int, object]:
    """One exchange with gpud within the check's deadline: a read within GPUD_ANSWER_TIMEOUT_S, a POST
    (a reset and its check) with all the time left. gpud unreachable or answering what cannot be read:
    HealthCheckFailed; an HTTP error of a POST: ApiFailure, for the caller to tell what it means."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise HealthCheckFailed(EXIT_UNREACHABLE, f"no time left for gpud's {path}")
    client.timeout = left if method == "POST" else min(left, GPUD_ANSWER_TIMEOUT_S)  # the exchange's whole
    try:
        return client.request(method, path, body, ok_statuses=ok_statuses)
    except BadAnswer as exc:
        raise HealthCheckFailed(EXIT_GPUD_ANSWER, str(exc)) from None
    except DaemonUnreachable as exc:
        raise HealthCheckFailed(EXIT_UNREACHABLE, str(exc)) from None
    except ApiFailure as exc:
        if method == "POST":
            raise
        raise HealthCheckFailed(EXIT_GPUD_ANSWER, f"gpud answered {path} with HTTP {exc.status}: {exc}") from None


def _read_gpud(client: Client, path: str, deadline: float):
    return _gpud_exchange(client, "GET", path, deadline)[1]


def _read_health(client: Client, deadline: float, include_infiniband: bool) -> list[Problem]:
    """What is not healthy in gpud's /v1/health now (problems)."""
    try:
        return problems(_read_gpud(client, "/v1/health", deadline), include_infiniband)
    except ValueError as exc:
        raise HealthCheckFailed(EXIT_GPUD_ANSWER, f"gpud's /v1/health is not a health document: {exc}") from None


def node_name(args: argparse.Namespace) -> str:
    return args.node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _default_gres_conf() -> str:
    return os.path.join(os.path.dirname(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")), "gres.conf")


def check(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    name = node_name(args)
    client = Client(getattr(args, "socket", None), max_answer_bytes=MAX_GPUD_ANSWER)
    found = _read_health(client, deadline, args.drain_on_infiniband)
    unhealthy = [p for p in found if p.state == UNHEALTHY]
    for problem in found[:MAX_PROBLEMS_PRINTED]:
        print(f"gpud: {_brief(problem.subject)} {problem.state}: {_brief(problem.text)}" +
              ("" if problem.state == UNHEALTHY else " (degraded does not drain)"))
    if len(found) > MAX_PROBLEMS_PRINTED:
        print(f"gpud: and {len(found) - MAX_PROBLEMS_PRINTED} more not healthy (gpud health lists them)")
    scontrol = Scontrol(args.scontrol, deadline, args.dry_run)
    node = scontrol.show_node(name)
    print(f"slurm: node {_brief(node.name)} {_brief(node.state)}" +
          (f", reason: {_brief(node.reason)}" if node.reason else ""))
    decision = decide(node, unhealthy)
    if decision.action in (NOTHING, UPDATE) and unhealthy and node.drained_by_gpud and node.empty:
        remediation = Remediation(client, deadline, args.dry_run, args.drain_on_infiniband)
        decision = remediation.decide(node, unhealthy) or decision
    print(f"decision: {decision.action}: {decision.why}" + (f": {decision.reason}" if decision.reason else ""))
    if decision.action in (DRAIN, UPDATE):
        scontrol.update(node.name, "drain", decision.reason)
    elif decision.action == RESUME:
        scontrol.update(node.name, "resume")
    elif decision.action == REBOOT:
        scontrol.reboot(node.name, decision.reason)
    if decision.action in (DRAIN, UPDATE, RESUME, REBOOT) and not args.dry_run:
        print(f"done: {decision.action} {node.name}")
    if args.prolog:
        return _prolog_verdict(args, client, name, unhealthy, deadline)
    return EXIT_OK


def _prolog_verdict(args: argparse.Namespace, client: Client, name: str, unhealthy: list[Problem],
                    deadline: float) -> int:
    """Refuses the job when one of its GPUs (or the node itself) is unhealthy."""
    job_gpus_text = os.environ.get("SLURM_JOB_GPUS", "")
    wanted: set[int] | None = None
    if job_gpus_text:
        try:
            job_gpus = parse_job_gpus(job_gpus_text)
        except ValueError as exc:
            raise HealthCheckFailed(EXIT_USAGE, str(exc)) from None
        gres_conf = args.gres_conf or _default_gres_conf()
        try:
            with open(gres_conf, encoding="utf-8", errors="replace") as conf:
                minors = gres_gpu_minors(conf.read(), name)
        except OSError as exc:
            minors = []
            print(f"prolog: cannot read {gres_conf} ({exc.strerror}): checking every GPU")
        gpus = _read_gpud(client, "/v1/gpus", deadline)
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
        print(f"gpud: refusing the job on {name}: {_brief(text, 4 * MAX_PRINTED)}", file=sys.stderr)
        return EXIT_PROBLEM
    print("prolog: the job's GPUs are healthy")
    return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-name", help="the Slurm node (default: $SLURMD_NODENAME, else the short hostname)")
    parser.add_argument("--scontrol", default="scontrol", help="the scontrol to run (default: scontrol on PATH)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"for everything together (default {DEFAULT_TIMEOUT_S:g}; slurmd kills a health "
                             "check after 60)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the scontrol update (or reboot) it would run, and the remediation it would ask "
                             "of gpud, instead")
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
