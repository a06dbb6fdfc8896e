"""gpud's alert rules and dashboards on the real thing: Debian's Prometheus scrapes a simulated HGX H100
(MIG devices on GPU 0, NVIDIA's MPS control daemons where nvidia-cuda-mps is installed) over TCP every
second, with deploy/prometheus/gpud-alerts.yaml loaded; an XID 79 injected through the simulator fires
GpuXid79FallenOffTheBus within its `for:` and resolves when the rule says; every panel query of every
dashboard in deploy/grafana/ answers series on a node that has what the panels show (a recent driver, MIG on
one GPU, MPS, an XID, a process, a lost GPU, a pod's device and a DRA claim through the kubelet stand-in's
PodResources server)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
import urllib.parse

import pytest
import yaml
from helpers import MPS_CONTROL, REPO, kill_mps_under, mig_config, start_daemon, stop_daemon, until_async
from kubelet_stand_in import Kubelet, PreparedDevice
from prometheus_server import PrometheusServer, free_port
from test_pod_labels import allocate, hold, published

pytestmark = pytest.mark.slow
RULES = REPO / "deploy" / "prometheus" / "gpud-alerts.yaml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
INTERVAL_S = 1.0  # scrape and rule evaluation
XID_WINDOW_S = 300  # DCGM_EXP_XID_ERRORS_COUNT's window (gpud/health/xid_counter.py XID_WINDOW_MS)
XID79_ALERT = "GpuXid79FallenOffTheBus"
# Grafana's interval variables, as 1m (enough samples at a 1 s scrape); any other variable matches all.
INTERVAL_VARIABLES = re.compile(r"\$\{?__(?:rate_interval|interval|range)\}?")
VARIABLE = re.compile(r"\$\{[^}]+\}|\$[A-Za-z_]\w*|\[\[[^\]]+\]\]")


def rule(name: str) -> dict:
    return next(rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
                if rule.get("alert") == name)


def seconds(duration: str | None) -> float:
    if not duration:
        return 0.0
    return sum(int(value) * {"s": 1, "m": 60, "h": 3600}[unit] for value, unit in re.findall(r"(\d+)([smh])", duration))


@pytest.fixture
async def monitored(short_tmp):
    """A simulated HGX H100 scraped by a Prometheus with the rules; MIG on GPU 0, MPS daemons."""
    address = f"127.0.0.1:{free_port()}"
    config = mig_config(short_tmp, "hgx-h100", default_layout="all-balanced").with_overrides(
        **{"metrics.listen": address, "mps.enabled": MPS_CONTROL is not None, "mps.pipe_root": str(short_tmp / "mps"),
           "mps.log_root": str(short_tmp / "mpslog")})
    node = await start_daemon(config)
    try:
        async with PrometheusServer(short_tmp, [address], rule_files=(RULES,), interval_s=INTERVAL_S) as prometheus:
            await prometheus.answer("/api/v1/targets", lambda data: [t for t in data["activeTargets"]
                                                                     if t["health"] == "up"])
            await prometheus.answer("/api/v1/rules", lambda data: [r for g in data["groups"] for r in g["rules"]
                                                                   if r["name"] == XID79_ALERT])
            yield node, prometheus
    finally:
        await stop_daemon(node)
        kill_mps_under(short_tmp)  # MPS outlives gpud by design


async def firing(prometheus: PrometheusServer, name: str) -> list[dict]:
    data = await prometheus.answer("/api/v1/alerts", lambda data: data)
    return [alert for alert in data["alerts"] if alert["labels"]["alertname"] == name and alert["state"] == "firing"]


async def test_an_xid_79_fires_its_alert_within_its_for_and_it_resolves_after_the_window(monitored):
    node, prometheus = monitored
    xid79 = rule(XID79_ALERT)
    # the time a sample takes to be scraped and evaluated, and the health loop to count the XID, on a busy machine
    delivery_s = 2 * INTERVAL_S + 8
    _, gpus = await node.get("/v1/gpus")
    gpu1 = next(gpu for gpu in gpus["gpus"] if gpu["index"] == 1)
    assert await firing(prometheus, XID79_ALERT) == []
    injected = time.monotonic()
    assert (await node.post("/v1/sim/xid", {"gpu": 1, "xid": 79}))[0] == 200
    (alert,) = await until_async(lambda: firing(prometheus, XID79_ALERT), timeout=seconds(xid79.get("for")) + delivery_s,
                                 what=f"{XID79_ALERT} firing", interval=0.2)
    fired_after = time.monotonic() - injected
    print(f"{XID79_ALERT} fired {fired_after:.1f} s after the XID (its for: {xid79.get('for', '0s')})")
    labels = alert["labels"]
    assert (labels["gpu"], labels["UUID"], labels["xid"], labels["severity"]) == ("1", gpu1["uuid"], "79", "critical")
    assert f"GPU 1 ({gpu1['uuid']}) on {labels['hostname']}" in alert["annotations"]["summary"]
    assert alert["annotations"]["runbook_url"].endswith("#" + XID79_ALERT.lower())
    # it resolves once the 5-minute window holds no XID 79: not before, and soon after
    resolved = await until_async(lambda: _resolved(prometheus), timeout=XID_WINDOW_S + 2 * delivery_s,
                                 what=f"{XID79_ALERT} resolved", interval=1.0)
    resolved_after = time.monotonic() - injected
    print(f"{XID79_ALERT} resolved {resolved_after:.1f} s after the XID (the window: {XID_WINDOW_S} s)")
    assert resolved and XID_WINDOW_S - delivery_s <= resolved_after <= XID_WINDOW_S + 2 * delivery_s


async def _resolved(prometheus: PrometheusServer) -> bool:
    return await firing(prometheus, XID79_ALERT) == []


# -- every dashboard panel answers series -----------------------------------------------------------


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' panels included."""
    queries = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))  # a collapsed row keeps its panels inside
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((panel.get("title", "(untitled)"), target["expr"]))

    walk(dashboard.get("panels", []))
    return queries


def substituted(expr: str) -> str:
    """Grafana's variables as a checker sees them: intervals 1m, every other variable `.*`."""
    return VARIABLE.sub(".*", INTERVAL_VARIABLES.sub("1m", expr))


def test_substitution_of_grafanas_variables():
    assert substituted('rate(x{hostname=~"$hostname",gpu=~"${gpu}"}[$__rate_interval])') == \
        'rate(x{hostname=~".*",gpu=~".*"}[1m])'
    assert substituted("sum(y[${__interval}]) by (z) > [[threshold]]") == "sum(y[1m]) by (z) > .*"


# GPU 0 in MIG mode, the others whole: the whole-GPU utilisation panels and the MIG panels both have series
IB_PORT_DOWN = REPO / "tests" / "fixtures" / "infiniband" / "down" / "sys" / "class" / "infiniband"
PANEL_LAYOUTS = """version: v1
mig-configs:
  dashboards:
    - devices: [0]
      mig-enabled: true
      mig-devices: {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}
    - devices: [1, 2, 3, 4, 5, 6, 7]
      mig-enabled: false
"""


@pytest.fixture
async def everything_shown(short_tmp):
    """A simulated HGX H100 on a driver with the recovery action (R565+), scraped by a Prometheus: MIG on GPU 0,
    MPS, an XID 13 on GPU 2, a process on GPU 1, GPU 3 allocated to a pod by the device plugin path, GPU 4 to a
    DRA claim, GPU 7 lost, an InfiniBand port down (a captured sysfs tree in the simulator's sysfs); process
    series and Kubernetes labels on the TCP listener."""
    shutil.copytree(IB_PORT_DOWN, short_tmp / "sim.json.sysfs" / "class" / "infiniband")
    address = f"127.0.0.1:{free_port()}"
    directory = short_tmp / "kubelet" / "device-plugins"
    directory.mkdir(parents=True)
    kubelet = Kubelet(directory)
    config = mig_config(short_tmp, "hgx-h100", PANEL_LAYOUTS, default_layout="dashboards").with_overrides(
        **{"sim_driver": "570.124.06", "metrics.listen": address, "metrics.listen_process_series": True,
           "metrics.listen_pod_labels": True, "metrics.pod_resources_socket": str(kubelet.pod_resources_socket),
           "metrics.pod_resources_refresh_s": 1.0, "health.check_interval_s": 0.5, "health.profiling_interval_s": 1.0,
           "mps.enabled": MPS_CONTROL is not None, "mps.pipe_root": str(short_tmp / "mps"),
           "mps.log_root": str(short_tmp / "mpslog")})
    node = await start_daemon(config)
    try:
        _, gpus = await node.get("/v1/gpus")
        await until_async(lambda: _mig_devices(node), what="GPU 0's MIG devices")
        _, gpus = await node.get("/v1/gpus")
        uuid = {gpu["index"]: gpu["uuid"] for gpu in gpus["gpus"]}
        assert (await node.post("/v1/sim/xid", {"gpu": 2, "xid": 13}))[0] == 200
        assert (await node.post("/v1/sim/processes", {"gpu": 1, "pids": [os.getpid()]}))[0] == 200
        allocate(kubelet, ("ml", "train", "main"), "nvidia.com/gpu", [uuid[3]])
        await hold(node, "3333-cccc", "infer-gpu", [uuid[4]])
        kubelet.prepare_claim(("ml", "infer", "main"), "infer-gpu",
                              [PreparedDevice("gpu.nvidia.com", "node-a", published(gpus, uuid[4]))])
        assert (await node.post("/v1/sim/gpu-lost", {"gpu": 7}))[0] == 200
        async with PrometheusServer(short_tmp, [address], rule_files=(RULES,), interval_s=INTERVAL_S) as prometheus:
            await prometheus.answer("/api/v1/targets", lambda data: [t for t in data["activeTargets"]
                                                                     if t["health"] == "up"])
            yield node, prometheus
    finally:
        await stop_daemon(node)
        kubelet.stop()
        kill_mps_under(short_tmp)  # MPS outlives gpud by design


async def _mig_devices(node) -> bool:
    _, gpus = await node.get("/v1/gpus")
    return len(gpus["gpus"][0]["mig"]["devices"]) == 4


@pytest.mark.skipif(not DASHBOARDS, reason="no dashboard in deploy/grafana/ yet (deploy/grafana/dashboards.py "
                                           "writes them)")
async def test_every_dashboard_panel_query_answers_series(everything_shown):
    node, prometheus = everything_shown
    # the labels and the profiling series come with the reader's and GPM's next passes, then two scrapes for rates
    for query in ("DCGM_EXP_XID_ERRORS_TOTAL", "gpud_health > 0", 'gpud_gpu_health{dra_claim_name!=""}', 'DCGM_FI_PROF_SM_ACTIVE',
                  'gpud_gpu_health{pod="train"}', "gpud_process_gpu_memory_used_bytes"):
        await prometheus.answer(f"/api/v1/query?query={urllib.parse.quote(query)}", lambda data: data["result"])
    await asyncio.sleep(3 * INTERVAL_S)  # fixed time: a rate over 1m needs two scrapes after the XID
    empty = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        queries = panel_queries(dashboard)
        assert queries, f"{path.name}: no panel queries"
        for title, expr in queries:
            answer = await prometheus.query(substituted(expr))
            assert answer["status"] == "success", f"{path.name}, panel {title!r}: {expr}: {answer}"
            if not answer["data"]["result"]:
                empty.append(f"{path.name}, panel {title!r}: {expr}")
    assert empty == [], "panels without series:\n" + "\n".join(empty)
