"""The alert rules gpud ships (deploy/prometheus/gpud-alerts.yaml): `promtool check rules` finds them clean,
their promtool unit tests (gpud-alerts.test.yaml) fire and resolve every alert, every alert says where,
what and how bad and links its section of docs/alerts.md, every series they read is one a simulated gpud
writes, and the Prometheus Operator's form of them (deploy/kubernetes/prometheus-operator/) is the same
rules. The gpud_* series added for them are checked on that simulated gpud."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, sim_config, start_daemon, stop_daemon, until_async
from prometheus_server import tool

from gpud.mig.status import ApplyState
from gpud.mig.view import apply_state_family

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "gpud-alerts.yaml"
UNIT_TESTS = PROMETHEUS_DIR / "gpud-alerts.test.yaml"
OPERATOR_RULE = REPO / "deploy" / "kubernetes" / "prometheus-operator" / "gpud-prometheusrule.yaml"
ALERTS_DOC = REPO / "docs" / "alerts.md"
METRICS_DOC = REPO / "docs" / "metrics.md"
RUNBOOK = "https://example.org/gpud/docs/alerts.md#"  # as the rules file says: example.org until shipped
SEVERITIES = {"critical", "warning"}
# Series Prometheus writes itself for every target (prometheus.io/docs/concepts/jobs_instances/,
# "Automatically generated labels and time series"), not gpud.
PROMETHEUS_SERIES = {"up"}
# PromQL words that are no series (prometheus/prometheus promql/parser/lex.go: key, and its functions).
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                "offset", "atan2", "inf", "nan"}


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def alerts() -> list[dict]:
    return [rule for group in rules()["groups"] for rule in group["rules"] if "alert" in rule]


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects: label matchers, strings, durations and the label
    lists of by/without/on/ignoring/group_* taken out, what is left is a name unless a call or a keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)
    return {name for name in names if name.lower() not in PROMQL_WORDS}


def test_series_in_reads_names_and_leaves_out_the_rest():
    assert series_in('sum without (xid) (increase(A_TOTAL{xid="79", x=~"a|b"}[10m])) > 10') == {"A_TOTAL"}
    assert series_in('time() - b_seconds > 180 and on(hostname) c == 1 unless absent(up{job="gpud"})') == \
        {"b_seconds", "c", "up"}
    assert series_in("max by (gpu, UUID) (d) / ignoring(x) group_left(y) e offset 5m") == {"d", "e"}


# -- promtool ---------------------------------------------------------------------------------------------


def promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_finds_the_rules_clean():
    checked = promtool("check", "rules", "--lint=all", "--lint-fatal", RULES.name)
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0 and f"SUCCESS: {len(alerts())} rules found" in output, output
    assert "WARNING" not in output.upper(), output


def test_promtool_unit_tests_pass():
    tested = promtool("test", "rules", UNIT_TESTS.name)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_the_unit_tests_catch_a_changed_rule(tmp_path):
    """The unit tests check what the rules do: an alert that waits longer no longer fires when they say."""
    changed = RULES.read_text().replace("        for: 1m\n", "        for: 4m\n", 1)
    assert changed != RULES.read_text()
    (tmp_path / RULES.name).write_text(changed)
    shutil.copy(UNIT_TESTS, tmp_path)
    tested = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert tested.returncode == 1 and "FAILED" in tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_resolves_it():
    fired, resolved = set(), set()
    for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        checks = sorted(group.get("alert_rule_test", []), key=lambda check: _minutes(check["eval_time"]))
        for index, check in enumerate(checks):
            if check["exp_alerts"]:
                fired.add(check["alertname"])
                assert all(alert["exp_annotations"] and alert["exp_labels"] for alert in check["exp_alerts"])
            elif any(earlier["alertname"] == check["alertname"] and earlier["exp_alerts"] for earlier in checks[:index]):
                resolved.add(check["alertname"])  # nothing expected after it fired: it resolved
    names = {alert["alert"] for alert in alerts()}
    assert names - fired == set(), "alerts no unit test fires"
    assert names - resolved == set(), "alerts no unit test resolves after firing"


def _minutes(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(value) * {"s": 1 / 60, "m": 1, "h": 60}[unit]


# -- what each alert says -----------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_has_a_severity_a_summary_a_description_and_its_section():
    sections = {github_anchor(line[3:]) for line in ALERTS_DOC.read_text().splitlines() if line.startswith("## ")}
    for alert in alerts():
        name, annotations = alert["alert"], alert["annotations"]
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["runbook_url"] == RUNBOOK + name.lower() and name.lower() in sections, name
        where = "{{ $labels.hostname }}" if "hostname" in _label_names(alert) else "{{ $labels.instance }}"
        if name != "GpudTargetsAbsent":  # absent() has no target to name
            assert where in annotations["summary"] and where in annotations["description"], name


def _label_names(alert: dict) -> set[str]:
    return set(re.findall(r"\$labels\.(\w+)", alert["annotations"]["summary"]))


def test_every_alert_on_a_gpu_names_the_gpu_and_its_uuid(scrape):
    gpu_series = {name for name, labels in scrape["labels"].items() if "UUID" in labels}
    for alert in alerts():
        if series_in(alert["expr"]) & gpu_series:
            for text in (alert["annotations"]["summary"], alert["annotations"]["description"]):
                assert "{{ $labels.gpu }}" in text and "{{ $labels.UUID }}" in text, alert["alert"]


def test_every_section_of_the_alerts_doc_is_an_alert():
    names = {alert["alert"].lower() for alert in alerts()}
    sections = {github_anchor(line[3:]) for line in ALERTS_DOC.read_text().splitlines() if line.startswith("## ")}
    assert sections - names <= {"loading-the-rules"}


# -- the series they read ------------------------------------------------------------------------------------


def documented_series() -> set[str]:
    """The series docs/metrics.md's tables say gpud writes (a row whose gpud column is not **no**)."""
    names = set()
    for line in METRICS_DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and not any(cell.startswith("**no**") for cell in cells[1:]):
            names.update(re.findall(r"^`([A-Za-z_:][\w:]*)`$", cells[0]))
    return names


@pytest.fixture(scope="module")
def scrape() -> dict:
    """A simulated H100 node after an XID 79 on GPU 1, a report of the k8s agent, and a CDI spec directory
    gpud cannot make: the families of its /metrics, and the label names of each."""
    tmp = Path(tempfile.mkdtemp(prefix="gpa", dir="/tmp"))
    try:
        return asyncio.run(_scrape(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _scrape(tmp: Path) -> dict:
    (tmp / "not-a-directory").write_text("")
    config = sim_config(tmp, "H100-SXM5-80GB:2").with_overrides(
        **{"cdi.spec_dir": str(tmp / "not-a-directory" / "cdi")})
    node = await start_daemon(config)
    try:
        before = await _metrics(node)
        await node.post("/v1/sim/xid", {"gpu": 1, "xid": 79})
        reported_at = time.time()
        async with node.http.put("http://localhost/v1/kubernetes/agent", json={"node": "node-1"}) as response:
            assert response.status == 200
        text = await until_async(lambda: _settled_metrics(node), timeout=10,
                                 what="XID 79 counted, the CDI spec's write failed")
    finally:
        await stop_daemon(node)
    labels: dict[str, set[str]] = {}
    for name, label_text in re.findall(r"^([A-Za-z_:][\w:]*)\{([^}]*)\}", text, re.M):
        labels.setdefault(name, set()).update(re.findall(r'(\w+)="', label_text))
    return {"before": before, "text": text, "families": re.findall(r"^# TYPE (\S+) ", text, re.M),
            "labels": labels, "reported_at": reported_at}


async def _metrics(node) -> str:
    async with node.http.get("http://localhost/metrics") as response:
        return await response.text()


async def _settled_metrics(node) -> str | None:
    """The text once the XID is counted and the CDI spec's first write failed (after its debounce)."""
    text = await _metrics(node)
    return text if 'xid="79"' in text and sample(text, "gpud_file_write_failing", file="cdi") == 1 else None


def test_every_series_the_rules_read_is_one_gpud_writes(scrape):
    read = {name for alert in alerts() for name in series_in(alert["expr"])} - PROMETHEUS_SERIES
    assert read, "no series found in the rules"
    # written by this simulated gpud, or documented as written where it applies
    assert read - set(scrape["families"]) - documented_series() == set()


def test_each_family_is_written_once(scrape):
    """gpud_file_write_failing comes from three components: one family, as the text format wants."""
    assert len(scrape["families"]) == len(set(scrape["families"]))
    assert scrape["text"].count("# TYPE gpud_file_write_failing ") == 1


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_suggested_action_of_each_gpu_is_a_series(scrape):
    text = scrape["text"]
    assert sample(scrape["before"], "gpud_gpu_suggested_action", gpu="1", action="none") == 0
    assert sample(text, "gpud_gpu_suggested_action", gpu="1", action="reboot") == 4  # XID 79: reboot (catalog)
    assert sample(text, "gpud_gpu_suggested_action", gpu="0", action="none") == 0
    assert sample(text, "gpud_gpu_suggested_action", gpu="1", action="none") is None  # one series per GPU


def test_the_k8s_agents_last_report_is_a_series_once_it_reported(scrape):
    assert "gpud_kubernetes_agent_last_report_timestamp_seconds{" not in scrape["before"]
    reported = sample(scrape["text"], "gpud_kubernetes_agent_last_report_timestamp_seconds")
    assert abs(reported - scrape["reported_at"]) < 5


def test_a_file_gpud_cannot_write_is_a_series(scrape):
    assert sample(scrape["text"], "gpud_file_write_failing", file="cdi") == 1
    assert sample(scrape["text"], "gpud_file_write_failing", file="nfd") == 0
    assert sample(scrape["text"], "gpud_file_write_failing", file="slurm-gres") is None  # no gres.conf kept


@pytest.mark.parametrize("state", list(ApplyState))
def test_the_mig_applys_state_is_a_state_set(state):
    (family,) = apply_state_family({"state": state.value})
    assert {sample.labels["state"]: sample.value for sample in family.samples} == \
        {other.value: 1 if other == state else 0 for other in ApplyState}


def test_the_mig_applys_state_is_written(scrape):
    states = {state.value: sample(scrape["text"], "gpud_mig_apply_state", state=state.value) for state in ApplyState}
    assert sorted(states.values()) == [0] * (len(states) - 1) + [1], states


# -- the Prometheus Operator's form ---------------------------------------------------------------------------


def prometheus_rule_manifest() -> str:
    """deploy/kubernetes/prometheus-operator/gpud-prometheusrule.yaml as it must read: the rules file's
    groups in a PrometheusRule (monitoring.coreos.com/v1, prometheus-operator's
    pkg/apis/monitoring/v1/prometheusrule_types.go: spec.groups are Prometheus's rule groups)."""
    manifest = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": "gpud-alerts", "namespace": "gpud-system",
                             "labels": {"app.kubernetes.io/name": "gpud", "app.kubernetes.io/component": "alerts"}},
                "spec": {"groups": rules()["groups"]}}
    return ("# Generated from deploy/prometheus/gpud-alerts.yaml (PYTHONPATH=. python tests/test_alert_rules.py --write);\n"
            "# tests/test_alert_rules.py fails when the two differ. Needs the Prometheus Operator's CRDs: not in\n"
            "# deploy/kubernetes/ itself, so `kubectl apply -f deploy/kubernetes/` works without them.\n"
            "# A Prometheus selects it by its ruleSelector: add the label that one matches.\n"
            + yaml.safe_dump(manifest, sort_keys=False, width=120, allow_unicode=True))


def test_the_prometheus_operator_rule_is_the_rules_file():
    assert OPERATOR_RULE.read_text() == prometheus_rule_manifest(), \
        "deploy/prometheus/gpud-alerts.yaml changed: run PYTHONPATH=. python tests/test_alert_rules.py --write"
    assert yaml.safe_load(OPERATOR_RULE.read_text())["spec"]["groups"] == rules()["groups"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    OPERATOR_RULE.parent.mkdir(exist_ok=True)
    OPERATOR_RULE.write_text(prometheus_rule_manifest())
