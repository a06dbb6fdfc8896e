"""`gpud config validate` reports every error of a file, with the values as written; `gpud sharing validate`
and `gpud mig validate` check each entry of a Kubernetes ConfigMap and refuse other Kubernetes objects,
saying what they are."""

from __future__ import annotations

import json
import textwrap

import pytest
from helpers import REPO, cli

from gpud.config import ConfigError, parse_config

SHARING_CONFIGMAP = REPO / "deploy" / "kubernetes" / "sharing-configs.yaml"


# -- gpud config validate ---------------------------------------------------------------------------


def test_every_error_of_a_config_file_is_reported_with_its_line_and_key(tmp_path):
    path = tmp_path / "gpud.yaml"
    path.write_text(textwrap.dedent("""\
        api:
          idle_timeout_s: 150000
          colour: red
        log:
          level: loud
        health:
          check_interval_s: 0
        mps:
          pinned_memory_limit_mib: 10
          pinned_memory_limit_percent: 10
        """))
    done = cli("config", "validate", str(path))
    assert done.returncode == 2 and done.stdout == "", done
    said = done.stderr
    for wanted in (f"{path}, line 2, key 'api.idle_timeout_s': must be between 0.1 and 3600; got 150000\n",
                   f"{path}, line 3, key 'api.colour': unknown key",
                   f"{path}, line 5, key 'log.level': must be one of debug, info, warning, error; got 'loud'",
                   f"{path}, line 7, key 'health.check_interval_s': must be between 0.5 and 3600; got 0\n"):
        assert wanted in said, said
    assert "4 errors" in said and "150000.0" not in said, said
    as_json = cli("config", "validate", "--json", str(path))
    error = json.loads(as_json.stderr)["error"]
    assert as_json.returncode == 2 and error["code"] == "config-invalid" and len(error["errors"]) == 4, as_json


def test_a_single_error_reads_as_before_and_an_int_is_shown_as_written():
    with pytest.raises(ConfigError) as raised:
        parse_config("health:\n  check_interval_s: 150000\n", "x.yaml")
    assert str(raised.value) == ("x.yaml, line 2, key 'health.check_interval_s': must be between 0.5 and 3600; "
                                 "got 150000")
    assert (raised.value.key, raised.value.line) == ("health.check_interval_s", 2)


def test_consistency_errors_are_all_reported_once_the_keys_are_right():
    text = ("api:\n  max_connections: 10\n  admin_reserved_connections: 20\n"
            "nvml:\n  init_retry_initial_s: 10\n  init_retry_max_s: 1\n")
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "x.yaml")
    keys = [error.key for error in raised.value.errors]
    assert keys == ["api.admin_reserved_connections", "nvml.init_retry_initial_s"], str(raised.value)


# -- ConfigMaps and other Kubernetes objects --------------------------------------------------------


def test_a_sharing_configmap_is_validated_entry_by_entry():
    done = cli("sharing", "validate", str(SHARING_CONFIGMAP))
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{SHARING_CONFIGMAP}: ConfigMap gpud-sharing-configs, 4 entries, each a sharing config")
    assert "  no-sharing: valid, strategy none, MIG strategy none" in lines
    assert "  a100-40gb: valid, strategy time-slicing, MIG strategy mixed" in lines
    assert "unknown key" not in done.stderr, done.stderr
    as_json = json.loads(cli("sharing", "validate", "--json", str(SHARING_CONFIGMAP)).stdout)
    assert (as_json["kind"], as_json["name"], as_json["valid"]) == ("ConfigMap", "gpud-sharing-configs", True)
    assert [entry["name"] for entry in as_json["entries"]] == ["no-sharing", "tesla-t4", "a100-40gb", "2080ti-12gb"]
    assert all(entry["valid"] and entry["error"] is None for entry in as_json["entries"])


def test_a_bad_entry_is_named_and_a_yaml_error_has_its_line_in_the_file(tmp_path):
    path = tmp_path / "cm.yaml"
    path.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: sharing
        data:
          good: |
            version: v1
          bad: |
            version: v1
            sharing:
              timeSlicing:
                resources:
                - name: nvidia.com/gpu
                  replicas: -1
          typo: |
            version: v1
            flagz: {}
          broken: |
            version: v1
            flags: {migStrategy: [}
        """))
    broken_line = path.read_text().splitlines().index("    flags: {migStrategy: [}") + 1
    done = cli("sharing", "validate", str(path))
    assert done.returncode == 2, done
    lines = done.stdout.splitlines()
    assert lines[0] == f"{path}: ConfigMap sharing, 4 entries, each a sharing config"
    assert lines[1:] == ["  good: valid, strategy none, MIG strategy none", "  bad: invalid",
                         "  typo: valid, strategy none, MIG strategy none", "  broken: invalid"]
    assert f"{path} (ConfigMap entry bad): key 'sharing.timeSlicing.resources[0].replicas'" in done.stderr
    assert f"{path} (ConfigMap entry broken): line {broken_line}: invalid YAML" in done.stderr, done.stderr
    assert "warning: typo: flagz: unknown key" in done.stderr, done.stderr
    assert "2 of 4 entries invalid" in done.stderr
    strict = cli("sharing", "validate", "--strict", "--json", str(path))
    assert strict.returncode == 2 and strict.stdout == ""
    entries = json.loads(strict.stderr)["error"]["entries"]
    assert [(e["name"], e["valid"]) for e in entries] == [("good", True), ("bad", False), ("typo", True),
                                                          ("broken", False)]
    assert entries[2]["warnings"] and entries[1]["error"].startswith(f"{path} (ConfigMap entry bad): key ")


def test_strict_refuses_a_configmap_whose_entries_have_warnings(tmp_path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n  typo: |\n    version: v1\n"
                    "    flagz: {}\n")
    assert cli("sharing", "validate", str(path)).returncode == 0
    strict = cli("sharing", "validate", "--strict", str(path))
    assert strict.returncode == 2 and "1 warning (--strict)" in strict.stderr, strict


@pytest.mark.parametrize("data, wanted", [
    ("", "has no entries under data"),
    ("data:\n  one: 3\n", "one: invalid"),
])
def test_an_empty_configmap_or_one_whose_entry_is_not_text_is_invalid(tmp_path, data, wanted):
    path = tmp_path / "cm.yaml"
    path.write_text(f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n{data}")
    done = cli("sharing", "validate", str(path))
    assert done.returncode == 2 and wanted in done.stdout + done.stderr, done


@pytest.mark.parametrize("text, kind", [
    ("apiVersion: v1\nkind: List\nitems: []\n", "a Kubernetes List (v1)"),
    ("apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec: {}\n", "a Kubernetes Pod (v1) named p"),
    ("apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: gpud\n", "a Kubernetes DaemonSet (apps/v1) named gpud"),
])
@pytest.mark.parametrize("command, what", [("sharing", "a sharing config"), ("mig", "a MIG layouts file")])
def test_other_kubernetes_objects_are_refused_saying_what_they_are(tmp_path, text, kind, command, what):
    path = tmp_path / "object.yaml"
    path.write_text(text)
    done = cli(command, "validate", str(path))
    assert done.returncode == 2 and done.stdout == "", done
    assert f"{path}: {kind}, not {what}" in done.stderr, done.stderr


def test_the_gpu_operators_mig_parted_configmap_is_validated(tmp_path):
    """The GPU operator's default-mig-parted-config (NVIDIA/gpu-operator assets/state-mig-manager/
    0400_configmap.yaml) holds mig-parted's file under data: config.yaml, which mig-manager mounts and reads."""
    path = tmp_path / "mig.yaml"
    path.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: default-mig-parted-config
        data:
          config.yaml: |
            version: v1
            mig-configs:
              all-disabled:
                - devices: all
                  mig-enabled: false
              all-1g.5gb:
                - devices: all
                  mig-enabled: true
                  mig-devices:
                    "1g.5gb": 7
        """))
    done = cli("mig", "validate", str(path))
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == [f"{path}: ConfigMap default-mig-parted-config, 1 entry, each a MIG layouts "
                                        "file",
                                        "  config.yaml: valid, 2 layouts: all-disabled, all-1g.5gb"]
    path.write_text(path.read_text().replace('"1g.5gb": 7', '"1g.5gb": x'))
    bad = cli("mig", "validate", str(path))
    assert bad.returncode == 2 and f"{path} (ConfigMap entry config.yaml): layout 'all-1g.5gb'" in bad.stderr, bad


def test_a_manifest_of_several_objects_is_refused_saying_what_it_is():
    rbac = REPO / "deploy" / "kubernetes" / "rbac.yaml"
    done = cli("sharing", "validate", str(rbac))
    assert done.returncode == 2 and "a Kubernetes manifest of" in done.stderr and "not a sharing config" in done.stderr
