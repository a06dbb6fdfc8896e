"""gpud.yaml's remediation section (issue 40): its defaults, and each value the loop would misread refused
with its key and line, as every other section's."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

from gpud.config import ConfigError, RemediationConfig, parse_config


def test_the_defaults_are_off_and_as_documented():
    assert parse_config("remediation:\n").remediation == RemediationConfig()
    policy = RemediationConfig()
    assert (policy.enabled, policy.dry_run, policy.evict, policy.grace_period_s, policy.max_nodes) == \
        (False, False, "gpu", None, 1)
    assert policy.opt_out_annotation == "nvidia.com/gpu.remediation-opt-out"
    assert (policy.lease_namespace, policy.lease_duration_s, policy.reboot_marker, policy.reboot_sentinel) == \
        ("gpud-system", 60, "none", "/var/run/reboot-required")


def test_good_values_are_read():
    policy = parse_config("remediation:\n  enabled: true\n  evict: node\n  grace_period_s: 0\n  max_nodes: 3\n"
                          "  pool_label: cloud.example.com/pool\n  lease_namespace: gpu-ops\n"
                          "  reboot_marker: kured\n  drain_timeout_s: 60\n").remediation
    assert (policy.enabled, policy.evict, policy.grace_period_s, policy.max_nodes) == (True, "node", 0, 3)
    assert (policy.pool_label, policy.lease_namespace, policy.reboot_marker) == \
        ("cloud.example.com/pool", "gpu-ops", "kured")


@pytest.mark.parametrize("line, key, words", [
    ("enabled: yes-please", "enabled", "expected true or false"),
    ("evict: pods", "evict", "one of gpu, node"),
    ("grace_period_s: -1", "grace_period_s", "between"),
    ("grace_period_s: 86401", "grace_period_s", "between"),
    ("grace_period_s: 1.5", "grace_period_s", "expected an integer"),
    ("drain_timeout_s: 4", "drain_timeout_s", "between"),
    ("max_nodes: 0", "max_nodes", "between"),
    ("max_nodes: true", "max_nodes", "expected an integer"),
    ("lease_duration_s: 9", "lease_duration_s", "between"),
    ("opt_out_annotation: nvidia.com/gpu/opt-out", "opt_out_annotation", "at most one '/'"),
    ("opt_out_annotation: -starts-with-a-dash", "opt_out_annotation", "not 1-63"),
    ("opt_out_annotation: Upper.Example.com/x", "opt_out_annotation", "DNS subdomain"),
    (f"pool_label: {'p' * 64}", "pool_label", "not 1-63"),
    ("pool_label: /pool", "pool_label", "non-empty prefix"),
    ("lease_namespace: GPU-System", "lease_namespace", "not a DNS label"),
    (f"lease_namespace: {'n' * 64}", "lease_namespace", "not a DNS label"),
    ("lease_namespace: gpud.system", "lease_namespace", "not a DNS label"),
    ("reboot_marker: reboot", "reboot_marker", "one of none, annotation, kured"),
    ("reboot_sentinel: var/run/reboot-required", "reboot_sentinel", "absolute path"),
    ("slurm_reboot: 1", "slurm_reboot", "expected true or false"),
    ("evicts: gpu", "evicts", "unknown key"),
])
def test_bad_values_name_the_key_and_line(line, key, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(f"log:\n  level: info\nremediation:\n  {line}\n", "gpud.yaml")
    assert (caught.value.key, caught.value.line) == (f"remediation.{key}", 4), str(caught.value)
    assert words in str(caught.value)


def test_config_validate_reports_every_bad_key_with_its_line(tmp_path):
    path = tmp_path / "gpud.yaml"
    path.write_text("remediation:\n  enabled: true\n  max_nodes: 0\n  lease_namespace: Gpud\n")
    result = subprocess.run([sys.executable, "-m", "gpud", "config", "validate", str(path)], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2, result
    assert "line 3, key 'remediation.max_nodes'" in result.stderr
    assert "line 4, key 'remediation.lease_namespace'" in result.stderr
