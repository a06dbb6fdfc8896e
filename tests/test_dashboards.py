"""deploy/grafana: the dashboards are what deploy/grafana/dashboards.py builds with Grafana's
grafana-foundation-sdk, their queries parse as PromQL (Debian's promtool) and name only series and labels
a simulated gpud really writes, every template variable is used and only inside a regex matcher, and the
JSON reads back through the SDK's model of Grafana's dashboard schema unchanged.

The end-to-end check that every panel returns series from a real Prometheus is
tests/test_monitoring_e2e.py's; `dashboard_targets()` and `promql()` below are what it needs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import MPS_CONTROL, REPO, GpudProcess, kill_mps_under, need

GRAFANA = REPO / "deploy" / "grafana"
SDK_MISSING = importlib.util.find_spec("grafana_foundation_sdk") is None
# The template variables' stand-ins when a query is run or parsed outside Grafana (p37 contract).
VARIABLE = re.compile(r'(\w+)=~"\$(\w+)"')
RATE_INTERVAL = "$__rate_interval"
# Labels the simulated nodes here do not write: Prometheus's own target labels, and the Kubernetes labels
# from the kubelet's PodResources API (dcgm-exporter's names: its internal/pkg/transformation/kubernetes.go).
TARGET_LABELS = {"job", "instance"}
KUBERNETES_LABELS = {"pod", "namespace", "container", "dra_claim_name", "dra_claim_namespace", "dra_driver_name",
                     "dra_pool_name", "dra_device_name", "dra_mig_profile", "dra_mig_device_uuid"}
# A compute process's owner, where it has one: the container or systemd unit it runs in (docs/metrics.md,
# "gpud's own series"); the test's own process, standing in for one, has neither.
OWNER_LABELS = {"container_runtime", "container_id", "pod_uid", "systemd_unit"}
# DCGM's profiling fields, which gpud writes from NVML's GPM on Hopper and later GPUs (docs/metrics.md).
PROFILING = {f"DCGM_FI_PROF_{name}" for name in (
    "GR_ENGINE_ACTIVE", "SM_ACTIVE", "SM_OCCUPANCY", "PIPE_TENSOR_ACTIVE", "DRAM_ACTIVE", "PIPE_FP64_ACTIVE",
    "PIPE_FP32_ACTIVE", "PIPE_FP16_ACTIVE", "PCIE_TX_BYTES", "PCIE_RX_BYTES", "NVLINK_TX_BYTES", "NVLINK_RX_BYTES")}
# What each Grafana unit may show: the series' own unit (docs/metrics.md), scaled where the query scales it.
UNITS = {"percent": r"DCGM_FI_DEV_\w+_UTIL", "percentunit": r"DCGM_FI_PROF_\w+_(ACTIVE|OCCUPANCY)|FB_USED\b.*/",
         "Bps": r"DCGM_FI_PROF_\w+_BYTES", "bytes": r"(FB_USED|FB_FREE)\b.*\* 1048576|_bytes\b",
         "watt": r"POWER_USAGE", "celsius": r"_TEMP\b", "hertz": r"_CLOCK\b.*\* 1000000",
         "MiBs": r"NVLINK_BANDWIDTH_TOTAL", "cps": r"rate\(\w+(_TOTAL|_COUNTER)\b"}


def dashboards_module():
    spec = importlib.util.spec_from_file_location("gpud_grafana_dashboards", GRAFANA / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def need_sdk() -> None:
    need(not SDK_MISSING, "grafana-foundation-sdk is not installed (pip install -e '.[test]')")


def committed() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(GRAFANA.glob("*.json"))}


def dashboard_targets(board: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of a dashboard, rows' nested panels included."""
    panels = [p for top in board["panels"] for p in (top, *top.get("panels", []))]
    return [(panel, target) for panel in panels for target in panel.get("targets", [])]


def promql(expr: str) -> str:
    """A panel's query as Prometheus takes it: each variable's regex matches anything, and
    $__rate_interval is a minute (four scrapes at Prometheus's default 15 s)."""
    return VARIABLE.sub(r'\1=~".*"', expr).replace(RATE_INTERVAL, "1m")


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression reads: identifiers that are neither functions, aggregation
    keywords, label names inside braces or grouping lists, nor numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings first: they may hold anything
    text = re.sub(r"\{[^}]*\}", "", text)  # matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    names = set(re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)\b(?!\s*\()", text))
    return names - {"bool", "or", "and", "unless", "offset", "inf", "nan"}


def label_names(expr: str, legend: str) -> set[str]:
    matchers = {name for body in re.findall(r"\{([^}]*)\}", expr) for name in re.findall(r"(\w+)\s*[=!]~?", body)}
    groups = {name.strip() for body in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                                                  expr) for name in body.split(",") if name.strip()}
    return matchers | groups | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed (apt-get install prometheus)")
    return path


# -- what the repository holds -------------------------------------------------------------------


def test_the_committed_json_is_what_dashboards_py_builds():
    need_sdk()
    built = dashboards_module().render()
    assert sorted(built) == sorted(committed()) == ["gpud-fleet.json", "gpud-node.json"]
    for name, text in built.items():
        assert (GRAFANA / name).read_text() == text, f"{name} is stale: run python deploy/grafana/dashboards.py"


def test_check_names_a_stale_file_and_writing_mends_it(tmp_path, capsys):
    need_sdk()
    module = dashboards_module()
    for name in module.DASHBOARDS:
        shutil.copy(GRAFANA / name, tmp_path / name)
    module.HERE = tmp_path
    assert module.main(["--check"]) == 0
    board = json.loads((tmp_path / "gpud-node.json").read_text())
    board["panels"][1]["targets"][0]["expr"] = "hand_edited"
    (tmp_path / "gpud-node.json").write_text(json.dumps(board))
    (tmp_path / "gpud-fleet.json").unlink()
    assert module.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "gpud-node.json differs" in err and "gpud-fleet.json differs" in err
    assert module.main([]) == 0 and module.main(["--check"]) == 0
    assert (tmp_path / "gpud-node.json").read_text() == (GRAFANA / "gpud-node.json").read_text()


def test_the_json_reads_back_through_the_sdks_dashboard_model_unchanged():
    """The SDK's models are generated from Grafana's dashboard schema: a field it does not know, or of
    another type, would not come back as it went in."""
    need_sdk()
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard
    register_default_plugins()
    for name, board in committed().items():
        again = json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))
        assert again == board, name


@pytest.mark.parametrize("name", ["gpud-node.json", "gpud-fleet.json"])
def test_the_dashboards_shape(name):
    board = committed()[name]
    assert board["uid"] == name.removesuffix(".json") and 8 <= len(board["uid"]) <= 40  # Grafana: uid 8-40
    assert "gpud" in board["tags"] and board["title"].startswith("gpud / ")
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        where = f"{name}: {panel['title']}"
        assert panel["description"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), where
        assert all(t["expr"] and t["datasource"] == panel["datasource"] for t in targets), where
        unit = panel["fieldConfig"]["defaults"]["unit"]
        if unit != "none":
            assert unit in UNITS and all(re.search(UNITS[unit], t["expr"]) for t in targets), (where, unit)
        assert 0 < panel["gridPos"]["w"] <= 24 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
    cells = [(x, y) for p in board["panels"] for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]
    assert len(cells) == len(set(cells)), "panels overlap"


def test_series_in_dcgms_units_get_their_unit():
    """Any panel reading a ratio, a byte rate, a utilisation, a temperature or a power shows it in that unit."""
    for name, board in committed().items():
        for panel, target in dashboard_targets(board):
            names = metric_names(target["expr"])
            unit = panel["fieldConfig"]["defaults"]["unit"]
            if names & {n for n in PROFILING if not n.endswith("_BYTES")}:
                assert unit == "percentunit", (name, panel["title"])
            if names & {n for n in PROFILING if n.endswith("_BYTES")}:
                assert unit == "Bps", (name, panel["title"])


@pytest.mark.parametrize("name", ["gpud-node.json", "gpud-fleet.json"])
def test_every_variable_is_used_and_only_in_regex_matchers(name):
    board = committed()[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {v["name"] for v in variables.values() if v["type"] == "query"} >= {"hostname"}
    texts = [t["expr"] for _, t in dashboard_targets(board)] + [v["query"] for v in variables.values()
                                                                if v["type"] == "query"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert any(f"${variable['name']}" in text for text in texts if text != variable["query"]), variable["name"]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    for text in texts:
        placeholders = set(re.findall(r"\$\{?(\w+)", text))
        assert placeholders <= set(variables) | {"__rate_interval"}, text
        rest = VARIABLE.sub("", text).replace(f"[{RATE_INTERVAL}]", "")
        assert "$" not in rest, f"a variable outside a regex matcher or a range: {text}"


# -- the queries parse, and read what gpud writes -------------------------------------------------


def all_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, and each query variable's series selector."""
    queries = []
    for name, board in committed().items():
        for panel, target in dashboard_targets(board):
            queries.append((f"{name} / {panel['id']} {panel['title']} / {target['refId']}", promql(target["expr"])))
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                # Grafana's label_values(selector, label): the selector is PromQL
                selector = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"])
                assert selector, variable["query"]
                queries.append((f"{name} / ${variable['name']}", promql(selector.group(1))))
    return queries


def promtool_rejects(tmp: Path, queries: list[tuple[str, str]]) -> str:
    """promtool's complaints, empty when every query parses: each one is a rule of its own group, named
    after where it comes from, so a complaint says which query it is."""
    groups = [{"name": where, "rules": [{"record": "dashboard:query", "expr": expr}]} for where, expr in queries]
    path = tmp / "queries.yaml"
    path.write_text(json.dumps({"groups": groups}))  # JSON is YAML
    done = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_every_query_parses_as_promql(tmp_path):
    queries = all_queries()
    assert len(queries) > 40
    assert promtool_rejects(tmp_path, queries) == ""


def test_promtool_does_reject_what_does_not_parse(tmp_path):
    """The check above is a parse: promtool refuses broken PromQL, and says which query."""
    complaint = promtool_rejects(tmp_path, [("fine", "up"), ("broken one", 'sum by (gpu (DCGM_FI_DEV_GPU_UTIL{a="b"})')])
    assert "broken one" in complaint and "fine" not in complaint.replace("broken one", "")
    assert promtool_rejects(tmp_path, [("unclosed", 'rate(DCGM_EXP_XID_ERRORS_TOTAL{hostname=~".*"}')])
    assert promtool_rejects(tmp_path, [("a variable left in", 'gpud_gpu_health{gpu=~$gpu}')])


def test_metric_names_finds_the_series_and_nothing_else():
    expr = ('sum by (namespace, pod) (max by (namespace, pod, UUID) (DCGM_FI_DEV_FB_USED{pod!="", a=~"x"})) * 1048576 '
            '/ on (job, instance) group_left (hostname) group by (job, instance) (gpud_http_requests_total) '
            'or vector(0) > bool 1e3 + rate(DCGM_EXP_XID_ERRORS_TOTAL[1m])')
    assert metric_names(expr) == {"DCGM_FI_DEV_FB_USED", "gpud_http_requests_total", "DCGM_EXP_XID_ERRORS_TOTAL"}
    assert label_names(expr, "GPU {{gpu}}") == {"namespace", "pod", "UUID", "a", "job", "instance", "hostname", "gpu"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# One GPU in MIG mode with four instances and one whole GPU, so both kinds of series are written.
LAYOUTS = """version: v1
mig-configs:
  dashboard:
    - devices: [0]
      mig-enabled: true
      mig-devices: {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}
    - devices: [1]
      mig-enabled: false
"""


class Node:
    """A simulated gpud serving metrics.listen, as Prometheus scrapes it (process series included)."""

    def __init__(self, preset: str, driver: str, mig: bool, mps: bool):
        self.dir = Path(tempfile.mkdtemp(prefix="gdb", dir="/tmp"))  # short: MPS pipes are Unix sockets
        self.address = f"127.0.0.1:{free_port()}"
        (self.dir / "layouts.yaml").write_text(LAYOUTS)
        lines = ["metrics:", f"  listen: {self.address}", "  listen_process_series: true",
                 "health:", "  check_interval_s: 0.5", "  profiling_interval_s: 1",
                 "mig:", f"  layouts_file: {self.dir / 'layouts.yaml'}"] + (["  default_layout: dashboard"] if mig else [])
        if mps:
            lines += ["mps:", "  enabled: true", f"  pipe_root: {self.dir / 'mps'}", f"  log_root: {self.dir / 'log'}"]
        (self.dir / "gpud.yaml").write_text("\n".join(lines) + "\n")
        self.gpud = GpudProcess(self.dir, "--simulate", preset, "--sim-driver", driver,
                                "--sim-state", str(self.dir / "sim.json"), "--config", str(self.dir / "gpud.yaml"))

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=10) as response:
            return response.read().decode()

    def close(self) -> None:
        try:
            self.gpud.stop()
        finally:
            kill_mps_under(self.dir)  # MPS outlives gpud by design
            shutil.rmtree(self.dir, ignore_errors=True)


def scraped_until(node: Node, ready, what: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = node.scrape()
        if ready(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"no scrape with {what} in {timeout} s; the last:\n{text}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def scrapes() -> dict[str, str]:
    """What Prometheus scrapes from an HGX H100 node (a recent driver, one GPU in MIG mode, MPS on every
    device, an XID, a compute process) and from an A100 node as it comes."""
    need(MPS_CONTROL is not None, "nvidia-cuda-mps-control is not installed (apt-get install nvidia-cuda-mps)")
    h100 = Node("H100-SXM5-80GB:2", "570.124.06", mig=True, mps=True)
    a100 = Node("A100-SXM4-40GB:2", "550.90.07", mig=False, mps=False)
    try:
        h100.gpud.wait_healthy(60)
        a100.gpud.wait_healthy(60)
        h100.gpud.client.request("POST", "/v1/sim/xid", {"gpu": 1, "xid": 13})
        h100.gpud.client.request("POST", "/v1/sim/processes", {"gpu": 1, "pids": [os.getpid()]})
        # DCGM's profiling fields come once GPM has two samples, a profiling interval apart
        return {"H100": scraped_until(h100, lambda t: t.count("gpud_mps_daemon_up{") == 5
                                      and "gpud_process_gpu_memory_used_bytes{" in t and 'xid="13"' in t
                                      and 'GPU_I_PROFILE="3g.40gb"' in t and "DCGM_FI_PROF_SM_ACTIVE{" in t,
                                      "MIG, MPS, the XID, the process and the profiling series"),
                "A100": scraped_until(a100, lambda t: t.count("DCGM_FI_DEV_GPU_TEMP{") == 2, "both GPUs' readings")}
    finally:
        h100.close()
        a100.close()


def written(texts: dict[str, str]) -> tuple[set[str], set[str]]:
    """The metric names (families, and a histogram's _bucket/_sum/_count) and label names in scrapes."""
    names, labels = set(), set()
    for text in texts.values():
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):
            names |= {family} | ({family + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set())
        for body in re.findall(r"^[\w:]+\{(.*)\} ", text, re.M):
            labels |= set(re.findall(r'(\w+)="(?:[^"\\]|\\.)*"', body))
    return names, labels


def test_every_query_reads_only_series_and_labels_gpud_writes(scrapes):
    names, labels = written(scrapes)
    assert PROFILING | {"DCGM_FI_DEV_FB_USED", "gpud_gpu_health", "gpud_mps_daemon_up"} <= names
    assert {"GPU_I_ID", "mig_uuid", "daemon", "xid", "action", "pid", "subject", "state"} <= labels
    unknown_names, unknown_labels = {}, {}
    for name, board in committed().items():
        for panel, target in dashboard_targets(board):
            where = f"{name} / {panel['title']} / {target['refId']}"
            for metric in metric_names(target["expr"]) - names:
                unknown_names.setdefault(metric, []).append(where)
            for label in label_names(target["expr"], target.get("legendFormat", "")) - labels - TARGET_LABELS \
                    - KUBERNETES_LABELS - OWNER_LABELS:
                unknown_labels.setdefault(label, []).append(where)
    assert not unknown_names, f"series no simulated node writes: {unknown_names}"
    assert not unknown_labels, f"labels no simulated node writes: {unknown_labels}"


def test_the_node_dashboard_covers_what_an_operator_looks_at():
    board = committed()["gpud-node.json"]
    used = set().union(*(metric_names(t["expr"]) for _, t in dashboard_targets(board)))
    assert PROFILING <= used
    assert {"gpud_gpu_health", "gpud_gpu_suggested_action", "gpud_gpu_recovery_action", "gpud_gpu_lost",
            "gpud_mig_apply_state", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
            "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "gpud_mig_in_sync",
            "gpud_mps_daemon_up", "gpud_device_compute_processes", "DCGM_EXP_XID_ERRORS_TOTAL",
            "DCGM_FI_DEV_XID_ERRORS"} <= used
    pods = [t["expr"] for _, t in dashboard_targets(board) if 'pod!=""' in t["expr"]]
    assert pods and all("namespace" in expr for expr in pods)
    assert any('dra_claim_name!=""' in t["expr"] for _, t in dashboard_targets(board))


def test_ci_installs_the_sdk():
    """CI installs the test extra (scripts/test-all): the SDK is in it, pinned, as the JSON depends on it."""
    assert re.search(r'"grafana-foundation-sdk==[^"]+"', (REPO / "pyproject.toml").read_text())
    assert "-e '.[test]'" in (REPO / "scripts" / "test-all").read_text()
