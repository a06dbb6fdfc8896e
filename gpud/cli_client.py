"""The `gpud` subcommands that are clients of the daemon's socket: each takes the parsed arguments and
a Client, prints a table (or the API's JSON with --json) and returns the exit code. Errors are raised
(gpud.client's, or CliError) and reported by gpud.cli.main."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from gpud.cli_output import (EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE, CliError, devices_text, drop_stdout,
                             format_gpu_table, print_json, reasons_text, stdout_reader_gone, table, terminal_columns,
                             warn)
from gpud.client import Client

MIB = 1 << 20


def _quoted(ident: str) -> str:
    return urllib.parse.quote(ident, safe="")


def gpu_ref(text: str) -> int | str:
    """A GPU argument as the API takes it: an index as a number, anything else (a UUID) as text."""
    return int(text) if text.isdigit() else text


# -- node and GPUs -------------------------------------------------------------------------------


def status(args: argparse.Namespace, client: Client) -> int:
    health = client.get("/healthz", ok_statuses=(503,))
    node = client.get("/v1/node")
    gpu_health = client.get("/v1/health")
    unhealthy = [gpu for gpu in gpu_health["gpus"] if _device_problems(gpu)]
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
        for where, state, reasons in _device_problems(gpu):
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


def _device_problems(gpu: dict) -> list[tuple[str, str, list]]:
    """(where, state, reasons) for a GPU and each of its MIG devices that is not healthy."""
    found = [(f"GPU {gpu['index']}", gpu["state"], gpu["reasons"])] if gpu["state"] != "healthy" else []
    return found + [(f"GPU {gpu['index']} MIG {dev.get('profile', dev['uuid'])}", dev["state"], dev["reasons"])
                    for dev in gpu.get("mig_devices", []) if dev["state"] != "healthy"]


def gpus(args: argparse.Namespace, client: Client) -> int:
    document = client.get("/v1/gpus")
    health = client.get("/v1/health")
    if args.json:
        print_json({**document, "health": health})
    else:
        print(format_gpu_table(document["gpus"], health))
    return EXIT_OK


def gpu_show(args: argparse.Namespace, client: Client) -> int:
    gpu = client.get(f"/v1/gpus/{_quoted(args.id)}")
    health = client.get(f"/v1/gpus/{_quoted(args.id)}/health")
    if args.json:
        print_json({**gpu, "health": health})
        return EXIT_OK
    print(format_gpu_table([gpu], {"gpus": [health]}))
    for where, state, reasons in _device_problems(health):
        print(f"{where}: {state} — {reasons_text(reasons)}")
    return EXIT_OK


def gpu_reset(args: argparse.Namespace, client: Client) -> int:
    _status, outcome = client.request("POST", f"/v1/gpus/{_quoted(args.id)}/reset", {"force": args.force})
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


def gpu_processes(args: argparse.Namespace, client: Client) -> int:
    document = client.get(f"/v1/gpus/{_quoted(args.id)}/processes")
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


# -- health, reload, watch -----------------------------------------------------------------------


def health(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/health")
    if args.json:
        print_json(view)
        return EXIT_OK if view["status"] == "healthy" else EXIT_PROBLEM
    print(f"node: {view['status']}")
    node = view.get("node") or {"state": "healthy", "reasons": []}
    rows = [("DEVICE", "STATE", "ACTION (DRIVER)", "REASONS"),
            ("node", node["state"], "-", reasons_text(node["reasons"]))]
    for gpu in view["gpus"]:
        action = f"{gpu.get('suggested_action', 'none')} ({gpu.get('driver_action') or '-'})"
        rows.append((f"GPU {gpu['index']}", gpu["state"], action, reasons_text(gpu["reasons"])))
        for dev in gpu["mig_devices"]:
            rows.append((f"  └ {dev['profile']} gi {dev['gi_id']} ci {dev['ci_id']}", dev["state"], "",
                         reasons_text(dev["reasons"])))
    for subject in view.get("subjects", []):
        rows.append((subject["name"], subject["state"], "-", reasons_text(subject["reasons"])))
    print(table(rows))
    return EXIT_OK if view["status"] == "healthy" else EXIT_PROBLEM


def check(args: argparse.Namespace, client: Client) -> int:
    if args.last:
        run = client.get("/v1/check/last")
    else:
        _status, run = client.request("POST", "/v1/check", {"level": args.level, "force": args.force})
    if args.json:
        print_json(run)
    else:
        print(f"{' '.join(run['command'])}: {run['outcome']}" + (f" — {run['error']}" if run.get("error") else ""))
        rows = [("GPU", "TEST", "RESULT", "INFO")]
        rows += [("-" if test["gpu_index"] is None else str(test["gpu_index"]), test["name"], test["result"],
                  test["info"]) for test in run["tests"] if test["result"] != "pass"]
        if len(rows) > 1:
            print(table(rows))
    return EXIT_OK if run["outcome"] == "pass" else EXIT_PROBLEM


def health_clear(args: argparse.Namespace, client: Client) -> int:
    body = {"kind": args.kind} if args.kind else {}
    _status, device = client.request("POST", f"/v1/health/{_quoted(args.id)}/clear", body)
    if args.json:
        print_json(device)
        return EXIT_OK
    print(f"{device['uuid']}: {device['state']}")
    for reason in device["reasons"]:
        print(f"  still: {reason['kind']} {reason['code']}: {reason['message']}")
    return EXIT_OK


AGENT_STALE_S = 180.0  # the agent reports at least every minute (gpud/kubernetes/agent.py STATUS_HEARTBEAT_S)


def kubernetes(args: argparse.Namespace, client: Client) -> int:
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
    print("requests: " + (", ".join(f"{verb} {count}" for verb, count in sorted((agent.get("requests") or {}).items()))
                          or "none"))
    for what, problem in sorted(problems.items()):
        print(f"problem:  cannot {what}: {problem['why']}")
    return code


def reload(args: argparse.Namespace, client: Client) -> int:
    _status, answer = client.request("POST", "/v1/reload", {})
    if args.json:
        print_json(answer)
    else:
        print(f"reloaded: {answer['status']}")
    return EXIT_OK


class _ReaderGone(Exception):
    """The reader of stdout closed it (`gpud watch | head -1` once head has its line)."""


def _end_when_the_reader_goes() -> None:
    """Where stdout is a pipe, a thread waits for its reader to close it and then interrupts the
    main thread with SIGPIPE, which raises _ReaderGone there: the watch ends at once, even while it
    waits for the next event, rather than at the next write."""
    try:
        if not stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            return
    except (OSError, ValueError):  # stdout closed or not a real file
        return

    def gone(_signum, _frame):
        # once: the kernel's own SIGPIPE on a later write, or the thread's, must not raise again in
        # the clean-up that this one starts
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        raise _ReaderGone

    def wait_for_the_reader() -> None:
        if stdout_reader_gone(wait_s=None):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGPIPE)

    signal.signal(signal.SIGPIPE, gone)
    threading.Thread(target=wait_for_the_reader, name="stdout reader", daemon=True).start()


def watch(args: argparse.Namespace, client: Client) -> int:
    query = urllib.parse.urlencode({key: value for key, value in (("since", args.since), ("epoch", args.epoch),
                                                                   ("types", args.types)) if value is not None})
    epoch, seq = args.epoch, args.since
    _end_when_the_reader_goes()
    events = client.stream(f"/v1/watch?{query}" if query else "/v1/watch", _said_watching(args, client))
    try:
        # closed here, not when the generator is collected: its connection's clean-up then runs where
        # the reader's going is caught
        with contextlib.closing(events):
            for event in events:
                if event.get("epoch") != epoch:  # the first line, or gpud restarted since --since
                    epoch = event.get("epoch")
                    print(f"gpud run {epoch}: resume with --since SEQ --epoch {epoch}", file=sys.stderr, flush=True)
                seq = event.get("seq", seq)
                if event.get("type") == "heartbeat":
                    continue
                if args.json:
                    print(json.dumps(event), flush=True)
                else:
                    print(f"#{event['seq']} {event['type']}: {json.dumps(event.get('data', {}))}", flush=True)
                if event.get("type") == "overflow":
                    raise CliError(EXIT_PROBLEM, "watch-overflow", event.get("data", {}).get("message", "too slow"))
    except KeyboardInterrupt:
        return EXIT_OK
    except (_ReaderGone, BrokenPipeError):
        drop_stdout()
        return EXIT_OK
    # The stream only ends when gpud does; a cut-off chunked stream reads as its end in http.client.
    resume = f" (resume with --since {seq} --epoch {epoch})" if epoch is not None and seq is not None else ""
    raise CliError(EXIT_UNREACHABLE, "daemon-gone", f"gpud on {client.socket_path} went away: the event stream "
                                                    f"ended (gpud stopped, restarted or was killed){resume}")


def _said_watching(args: argparse.Namespace, client: Client):
    """What runs once gpud has accepted the watch: in text, a first line at once (events may be minutes
    apart; `gpud watch | head -1` ends with it); --json prints gpud's events only."""
    def say() -> None:
        if not args.json:
            print(f"# watching gpud on {client.socket_path}: one line per event", flush=True)
    return say


# -- MIG -----------------------------------------------------------------------------------------


def mig_status(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/mig")
    if args.json:
        print_json(view)
        return EXIT_OK if view["in_sync"] else EXIT_PROBLEM
    print(f"layout: {view['layout'] or '(none)'}  state: {view['state']}  in sync: "
          f"{'yes' if view['in_sync'] else 'no'}" + (f"\nerror: {view['error']}" if view["error"] else ""))
    rows = [("GPU", "IN SYNC", "STATE", "DESIRED", "ACTUAL")]
    for gpu in view["gpus"]:
        rows.append((str(gpu["index"]), "yes" if gpu["in_sync"] else "no", gpu["state"] or "-",
                     devices_text(gpu["desired"]), devices_text(gpu["actual"])))
    print(table(rows))
    return EXIT_OK if view["in_sync"] else EXIT_PROBLEM


def mig_layouts(args: argparse.Namespace, client: Client) -> int:
    """What fits this node first, one line per layout (the current one, fitting or not, among them);
    with --all, then the rest with why each does not fit."""
    view = client.get("/v1/mig/layouts")
    if args.json:
        print_json(view)
        return EXIT_OK
    first = [layout for layout in view["layouts"] if layout["fits"] or layout["active"]]
    rest = [layout for layout in view["layouts"] if layout not in first]
    print(f"from {view['source']}: {sum(layout['fits'] for layout in view['layouts'])} of {len(view['layouts'])} "
          "layouts fit this node (* = current)")
    rows = [("  LAYOUT", "FITS", "CHANGES")]
    for layout in first:
        changes = "-" if layout["gpus_changed"] is None else f"{layout['gpus_changed']} GPUs"
        rows.append((("* " if layout["active"] else "  ") + layout["name"], _fits_text(layout),
                     changes + (", needs root" if layout.get("needs_root") else "")))
    print(table(rows))
    for sentence in dict.fromkeys(layout["needs_root"] for layout in first if layout.get("needs_root")):
        print(f"needs root: {sentence}")
    if rest and args.all:
        print("\ndo not fit this node:")
        print(table([("  LAYOUT", "FITS", "WHY NOT"),
                     *((f"  {layout['name']}", _fits_text(layout), layout["reason"] or "") for layout in rest)],
                    terminal_columns()))
    elif rest:
        print(f"{len(rest)} more do not fit this node: gpud mig layouts --all says why")
    of_layouts = {text for layout in view["layouts"] for text in layout["warnings"]}
    shown = [text for layout in first + (rest if args.all else []) for text in layout["warnings"]]
    for text in dict.fromkeys(shown + [text for text in view["warnings"] if text not in of_layouts]):
        warn(text)
    return EXIT_OK


def _fits_text(layout: dict) -> str:
    if layout.get("matching_gpus") == 0:
        return "no GPU"  # its device filters select none of this node's GPUs
    return "yes" if layout["fits"] else "no"


def mig_export(args: argparse.Namespace, client: Client) -> int:
    path = f"/v1/mig/export?{urllib.parse.urlencode({'name': args.name})}" if args.name else "/v1/mig/export"
    _status, text = client.request_text("GET", path)
    _print_text(args, "mig-parted-yaml", text)
    return EXIT_OK


def _print_text(args: argparse.Namespace, text_format: str, text: str) -> None:
    """A route's text (YAML, Prometheus) as it is; with --json, inside a JSON object that says its format."""
    if args.json:
        print_json({"format": text_format, "text": text})
    else:
        print(text, end="")


def mig_apply(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"layout": args.layout, "force": args.force, "dry_run": args.dry_run}
    if args.file is not None:
        body["config"] = _local_text(args.file)
    _status, started = client.request("PUT", "/v1/mig", body)
    if args.dry_run or args.no_wait:
        if args.json:
            print_json(started)
        else:
            _print_plan(started["plan"])
            if started.get("needs_root"):
                print(f"needs root: {started['needs_root']}")
        return EXIT_OK
    if not args.json:
        _print_plan(started["plan"])
    view = _follow_apply(client, quiet=args.json)
    if args.json:
        print_json(view)
    else:
        print(f"layout {view['layout']}: {view['state']}" + (f" — {view['error']}" if view["error"] else ""))
    return EXIT_OK if view["state"] == "success" else EXIT_PROBLEM


def _local_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(EXIT_USAGE, "file-unreadable", f"{path}: {getattr(exc, 'strerror', None) or exc}") from None


def _print_plan(plan: list[dict]) -> None:
    for gpu in plan:
        print(f"GPU {gpu['index']}: keep {gpu['keep']}, destroy {len(gpu['destroy'])}, "
              f"create {', '.join(c['profile'] for c in gpu['create']) or 'nothing'} ({gpu['mutations']} changes)")


def _follow_apply(client: Client, quiet: bool) -> dict:
    """/v1/mig once the apply is over, saying each GPU's state as it changes."""
    shown: dict[int, str] = {}
    while True:
        view = client.get("/v1/mig")
        for gpu in view["gpus"]:
            if gpu["state"] and shown.get(gpu["index"]) != gpu["state"]:
                shown[gpu["index"]] = gpu["state"]
                if not quiet:
                    print(f"GPU {gpu['index']}: {gpu['state']}" + (f" — {gpu['error']}" if gpu["error"] else ""))
        if view["state"] != "applying":
            return view
        time.sleep(0.2)


# -- MPS and sharing -----------------------------------------------------------------------------


def mps_status(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/mps")
    running = all(d["state"] == "running" for d in view["daemons"])
    if args.json:
        print_json(view)
        return EXIT_OK if running or not view["enabled"] else EXIT_PROBLEM
    if not view["enabled"]:
        print("MPS is not enabled (mps.enabled in gpud.yaml)")
        return EXIT_OK
    if view["error"]:
        print(f"error: {view['error']}")
    rows = [("NAME", "STATE", "PID", "RESTARTS", "THREADS %", "PINNED MiB", "DEVICES", "WHY")]
    for daemon in view["daemons"]:
        threads = daemon["active_thread_percentage"]
        rows.append((daemon["name"], daemon["state"], str(daemon["pid"] or "-"), str(daemon["restarts"]),
                     "-" if threads is None else f"{threads:g}",
                     ",".join("-" if m is None else str(m) for m in daemon["pinned_memory_limit_mib"]),
                     ",".join(daemon["devices"]), "" if daemon["state"] == "running" else daemon["last_error"] or ""))
    print(table(rows, terminal_columns()))
    return EXIT_OK if running else EXIT_PROBLEM


def mps_control(args: argparse.Namespace, client: Client) -> int:
    _status, daemon = client.request("POST", f"/v1/mps/{_quoted(args.name)}/{args.action}", {})
    if args.json:
        print_json(daemon)
    else:
        print(f"{daemon['name']}: {daemon['state']}, pid {daemon['pid'] or '-'}, restarts {daemon['restarts']}")
    return EXIT_OK


def mps_env(args: argparse.Namespace, client: Client) -> int:
    limits = {key: value for key, value in (("memory_mib", args.memory_mib), ("threads_percent", args.threads_percent))
              if value is not None}
    query = f"?{urllib.parse.urlencode(limits)}" if limits else ""
    document = client.get(f"/v1/mps/{_quoted(args.name)}/client-env{query}")
    daemon = next(d for d in client.get("/v1/mps")["daemons"] if d["name"] == args.name)
    if daemon["state"] != "running":  # a client of it would fail to connect
        raise CliError(EXIT_PROBLEM, "mps-daemon-not-running", f"MPS daemon {args.name} is {daemon['state']}"
                                                                + (f": {daemon['last_error']}" if daemon["last_error"] else ""))
    if args.json:
        print_json(document)
        return EXIT_OK
    for key, value in document["env"].items():
        print(f"{key}={value}")
    return EXIT_OK


def sharing(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/sharing")
    if args.json:
        print_json(view)
        return EXIT_PROBLEM if view["error"] else EXIT_OK
    print(f"strategy: {view['strategy']}  MIG strategy: {view['mig_strategy']}  from: {view['source'] or '(none)'}")
    print(_config_in_force(view["config"]))
    if view["config"]["problem"]:
        warn(view["config"]["problem"])
    if view["error"]:
        print(f"error: {view['error']}")
    rows = [("RESOURCE", "STRATEGY", "REPLICAS", "COUNT", "HEALTHY")]
    for resource in view["resources"]:
        healthy = sum(d["healthy"] for d in resource["devices"])
        if resource["strategy"] == "gpu-memory":  # gpu_memory's units, not replicas
            replicas = f"{resource['unit_mib']} MiB units"
        else:
            replicas = "mixed" if resource["replicas"] is None else str(resource["replicas"])
        rows.append((resource["name"], resource["strategy"], replicas, str(resource["count"]), str(healthy)))
    print(table(rows))
    for text in view.get("warnings", []):
        warn(text)
    return EXIT_PROBLEM if view["error"] else EXIT_OK


def sharing_allocations(args: argparse.Namespace, client: Client) -> int:
    """gpu_memory's units per device, allocated of allocatable in GiB, as kubectl inspect cgpu shows them."""
    view = client.get("/v1/allocations")
    if args.json:
        print_json(view)
        return EXIT_PROBLEM if view["problems"] else EXIT_OK
    if not view["enabled"]:
        print(f"gpu_memory is not enabled (gpud.yaml gpu_memory.enabled); resource {view['resource']}")
        return EXIT_OK
    reported = "never (the device plugin has not reported)" if view["reported_at"] is None else \
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view["reported_at"]))
    print(f"resource: {view['resource']}  unit: {view['unit_mib']} MiB  reported: {reported}")
    rows = [("DEVICE", "ALLOCATED/TOTAL (GiB)", "PODS")]
    for device in view["devices"]:
        name = f"GPU {device['gpu_index']}" + (f" {device['device']}" if device["mig"] else "")
        pods = len({(h["namespace"], h["pod"]) for h in device["holders"]})
        rows.append((name, f"{_gib(device['allocated_mib'])}/{_gib(device['allocatable_mib'])}", str(pods)))
    node = view["node"]
    rows.append(("node", f"{_gib(node['allocated_mib'])}/{_gib(node['allocatable_mib'])}", str(node["pods"])))
    print(table(rows))
    for problem in view["problems"]:
        warn(problem)
    return EXIT_PROBLEM if view["problems"] else EXIT_OK


def claims(args: argparse.Namespace, client: Client) -> int:
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


def _gib(mib: int) -> str:
    return f"{round(mib / 1024, 1):g}"


def sharing_use(args: argparse.Namespace, client: Client) -> int:
    _status, answer = client.request("PUT", "/v1/sharing/config", {"name": None if args.default else args.name,
                                                                  "reason": args.reason})
    if args.json:
        print_json(answer)
        return EXIT_OK
    print(_config_in_force(answer["config"]))
    if answer["config"]["problem"]:
        warn(answer["config"]["problem"])
    return EXIT_OK


def _config_in_force(config: dict) -> str:
    """"config: NAME (why)", the file where no named config is in force."""
    return f"config: {config['name'] or config['file']} ({config['why']})"


def nfd(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/nfd")
    problem = EXIT_PROBLEM if view["error"] else EXIT_OK
    if args.json:
        print_json(view)
        return problem
    if not view["enabled"]:
        print(f"off (nfd.enabled is false): nothing is written to {view['path']}")
        return EXIT_OK
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view["written_at"])) if view["written_at"] \
        else "not yet"
    print(f"file: {view['path']}  written: {written}  size: {view['bytes']} bytes")
    if view["error"]:
        print(f"error: {view['error']}")
    if view.get("waiting"):
        print(f"not written: {view['waiting']}")
        return EXIT_OK
    print(table([("LABEL", "VALUE"), *sorted(view["labels"].items())]))
    for dropped in view["dropped"]:
        warn(f"left out {dropped['label']}={dropped['value']}: {dropped['reason']}")
    return problem


def cdi(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/cdi")
    if args.json:
        print_json(view)
    elif not view["enabled"]:
        print("CDI spec: off (cdi.enabled is false)")
    else:
        print(f"CDI spec: {view['path']}  kind: {view['kind']}  devices: {len(view['devices'])}")
        for name in view["devices"]:
            print(f"  {view['kind']}={name}")
        for device in view["unavailable"]:
            print(f"  left out: {device['device']}: {device['reason']}")
        if view["error"]:
            print(f"error: {view['error']}")
    return EXIT_PROBLEM if view["error"] else EXIT_OK


def slurm_gres(args: argparse.Namespace, client: Client) -> int:
    view = client.get("/v1/slurm/gres")
    if args.json:
        print_json(view)
    else:
        print(f"Gres={view['node_gres'] or ''}\n" if args.node_line else view["text"] or "", end="")
        for device in view["unavailable"]:
            warn(f"left out {device['device']}: {device['reason']}")
        if view["error"]:
            warn(view["error"])
    return EXIT_PROBLEM if view["error"] else EXIT_OK


def metrics(args: argparse.Namespace, client: Client) -> int:
    _status, text = client.request_text("GET", "/metrics")
    _print_text(args, "prometheus-text", text)
    return EXIT_OK


# -- simulator drills ----------------------------------------------------------------------------


def sim_xid(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "xid", {"xid": args.xid, "gi_id": args.gi, "ci_id": args.ci})


def sim_lost(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "gpu-lost", {"how": args.how})


def sim_recover(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "gpu-recover", {})


def sim_processes(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "processes", {"pids": args.pids})


def sim_ecc(args: argparse.Namespace, client: Client) -> int:
    return _inject(args, client, "ecc", {"double_bit": args.double_bit})


def sim_holders(args: argparse.Namespace, client: Client) -> int:
    if args.release == (args.process is not None or args.pid is not None):
        args.parser.error("give either --release, or --process and --pid")
    return _inject(args, client, "holders", {"release": True} if args.release else
                   {"process": args.process, "pid": args.pid})


def _inject(args: argparse.Namespace, client: Client, what: str, fields: dict) -> int:
    body = {"gpu": gpu_ref(args.gpu), **{key: value for key, value in fields.items() if value is not None}}
    _status, answer = client.request("POST", f"/v1/sim/{what}", body)
    if args.json:
        print_json(answer)
    else:
        details = " ".join(f"{key} {json.dumps(value)}" for key, value in answer.items()
                           if key not in ("injected", "gpu"))
        print(f"simulated {answer['injected']} on GPU {answer['gpu']}" + (f": {details}" if details else ""))
    return EXIT_OK
