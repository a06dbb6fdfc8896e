"""gpud's Kubernetes manifests (deploy/kubernetes/): every object is valid for each Kubernetes release
1.30 to 1.35 (kubernetes-validate's strict JSON schemas, generated from each release's OpenAPI; an
unknown field or a wrong type is refused, as `kubectl apply --validate=strict` refuses it), or from the
first release that serves it (DeviceClass resource.k8s.io/v1: 1.34), the node agent's and the DRA
plugin's RBAC is exactly what each needs, the DaemonSets tolerate the agent's own taint and select the
right nodes, the DeviceClasses are NVIDIA's, and the configs they carry load with gpud's own loaders."""

from __future__ import annotations

import copy
import dataclasses
import typing

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

import kube_manifests
from gpud.config import Config, parse_config
from gpud.sharing.config import check_sharing

KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
UNHEALTHY_TAINT = {"key": "nvidia.com/gpu.unhealthy", "effect": "NoSchedule"}
# The keys the node agent's work adds to gpud.yaml (issue 22), which gpud/config.py does not have yet.
NEW_CONFIG_KEYS = {("sharing", "configs_dir"), ("sharing", "default_config"), ("kubernetes", "taint_unhealthy")}


def _validate(document: dict, version: str) -> str:
    """kubernetes-validate against `version`'s strict schemas; the release whose schemas it used.
    kubernetes-validate falls back to the newest release it ships that is not newer than the one asked
    for (utils.validate), so a missing release would quietly check against an older one: the caller
    compares the answer with the release it asked for."""
    return kubernetes_validate.validate(document, f"{version}.0", strict=True)


# -- every manifest is valid for every release ---------------------------------------------------------


def test_manifests_are_there():
    assert set(kube_manifests.manifest_names()) >= {
        "namespace.yaml", "rbac.yaml", "agent-daemonset.yaml", "gpud-daemonset.yaml", "sharing-configs.yaml",
        "gpud-device-plugin.yaml", "gpud-dra-plugin.yaml", "deviceclasses.yaml"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_validate_ships_the_release(version):
    shipped = {major_minor(release) for release in all_versions()}
    assert version in shipped, f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for " \
                               f"Kubernetes {version} (it has {sorted(shipped)}): upgrade it"


@pytest.mark.parametrize(("name", "version"), [
    (name, version) for name in kube_manifests.manifest_names()
    for version in kube_manifests.releases_for(name, KUBERNETES_VERSIONS)])
def test_manifest_validates_strictly(name, version):
    documents = kube_manifests.load(name)
    assert documents, name
    for document in documents:
        # A missing schema (an unknown kind or apiVersion) raises SchemaNotFoundError: a failure too.
        assert _validate(document, version) == version, (name, document["kind"])


def test_only_the_device_classes_need_a_newer_release_and_they_do():
    # Every other manifest is checked against every release; each restriction is one the schemas need.
    assert set(kube_manifests.FIRST_RELEASE) == {kube_manifests.DEVICE_CLASSES}
    assert kube_manifests.releases_for(kube_manifests.DEVICE_CLASSES, KUBERNETES_VERSIONS) == ("1.34", "1.35")
    for document in kube_manifests.load(kube_manifests.DEVICE_CLASSES):
        assert document["apiVersion"] == "resource.k8s.io/v1"
        # 1.33 has no resource.k8s.io/v1 (its DeviceClass is v1beta1 and v1beta2): no schema to check against
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(document, "1.33.0", strict=True)


def _agent_daemonset() -> dict:
    return copy.deepcopy(kube_manifests.find("agent-daemonset.yaml", "DaemonSet", kube_manifests.AGENT))


def _typo_field(daemonset: dict) -> dict:
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFileSystem"] = True  # the field is readOnlyRootFilesystem
    return daemonset


def _wrong_type(daemonset: dict) -> dict:
    daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "30"  # an integer field
    return daemonset


def _string_verbs(_: dict) -> dict:
    role = copy.deepcopy(kube_manifests.find("rbac.yaml", "ClusterRole", kube_manifests.AGENT))
    role["rules"][0]["verbs"] = "get"  # a list of strings
    return role


def _label_not_a_string(_: dict) -> dict:
    # The YAML mistake the manifests avoid by quoting: an unquoted true is a boolean, and a label's
    # value must be a string.
    return yaml.safe_load("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  labels:\n    a: true\n")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("break_it", [_typo_field, _wrong_type, _string_verbs, _label_not_a_string])
def test_the_same_check_refuses_a_broken_manifest(break_it, version):
    broken = break_it(_agent_daemonset())
    with pytest.raises(kubernetes_validate.ValidationError) as refused:
        _validate(broken, version)
    assert refused.value.version == version


# -- RBAC: exactly what the agent needs ----------------------------------------------------------------


def test_agent_rbac_is_exactly_what_it_calls():
    cluster_wide = kube_manifests.agent_rbac_rules()
    namespaced = kube_manifests.agent_role_rules()
    for rule in cluster_wide + [rule for rules in namespaced.values() for rule in rules]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, nonResourceURLs
    granted = kube_manifests.rbac_grants(cluster_wide)
    assert granted == {("", "nodes", "get"), ("", "nodes", "watch"), ("", "nodes", "patch"),
                       ("", "nodes/status", "patch"), ("", "events", "create"),
                       # remediation: the pods of its node, in any namespace, and their eviction
                       ("", "pods", "list"), ("", "pods/eviction", "create")}
    # the remediation slots, in gpud-system only (a Role and its RoleBinding, not a cluster-wide grant)
    assert {namespace: kube_manifests.rbac_grants(rules) for namespace, rules in namespaced.items()} == {
        kube_manifests.NAMESPACE: {("coordination.k8s.io", "leases", verb)
                                   for verb in ("get", "create", "update")}}
    # Spelled out, so that a later edit that adds one shows here too.
    everything = granted | kube_manifests.rbac_grants(namespaced[kube_manifests.NAMESPACE])
    assert not any("*" in item for item in everything)
    assert not any(verb in {"delete", "deletecollection", "escalate", "bind", "impersonate"}
                   for _, _, verb in everything)
    assert not any(verb in {"list", "update"} for _, resource, verb in granted if resource != "pods")
    assert not any(resource in {"secrets", "configmaps", "pods/exec", "pods/status"} for _, resource, _ in everything)


def test_the_binding_gives_the_role_to_the_agents_service_account():
    account = kube_manifests.find("rbac.yaml", "ServiceAccount", kube_manifests.AGENT)
    assert account["metadata"]["namespace"] == kube_manifests.NAMESPACE
    for kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = kube_manifests.find("rbac.yaml", kind, kube_manifests.AGENT)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                      "name": kube_manifests.AGENT}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": kube_manifests.AGENT,
                                        "namespace": kube_manifests.NAMESPACE}]
    # the Role and its binding are in the namespace of the remediation Leases (remediation.lease_namespace's
    # default, gpud-system)
    assert kube_manifests.find("rbac.yaml", "Role", kube_manifests.AGENT)["metadata"]["namespace"] == \
        kube_manifests.find("rbac.yaml", "RoleBinding", kube_manifests.AGENT)["metadata"]["namespace"] == \
        kube_manifests.NAMESPACE
    assert [document["metadata"]["name"] for document in kube_manifests.load("namespace.yaml")] == \
        [kube_manifests.NAMESPACE]


# -- the DaemonSets ------------------------------------------------------------------------------------


def _tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' rule (k8s.io/api core/v1 toleration.go, Toleration.ToleratesTaint): an empty effect
    matches every effect, an empty key (with Exists) every key; Exists matches any value, Equal (the
    default operator) only the same value."""
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("key") and toleration["key"] != taint["key"]:
        return False
    operator = toleration.get("operator", "Equal")
    if operator == "Exists":
        return True
    return operator == "Equal" and toleration.get("value", "") == taint.get("value", "")


def _matches(term: dict, labels: dict[str, str]) -> bool:
    """A nodeSelectorTerm's matchExpressions (all must hold) against a node's labels (the In, NotIn,
    Exists and DoesNotExist operators, as k8s.io/component-helpers scheduling/corev1/nodeaffinity)."""
    for expression in term["matchExpressions"]:
        key, operator = expression["key"], expression["operator"]
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
        if operator == "NotIn" and key in labels and labels[key] in expression["values"]:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def _runs_on(daemonset: dict, labels: dict[str, str]) -> bool:
    """Whether the DaemonSet's required node affinity selects a node with these labels (the terms are
    ORed). Its pod spec has no nodeSelector: the affinity is the whole choice."""
    spec = daemonset["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(_matches(term, labels) for term in terms)


def test_every_daemonset_tolerates_the_agents_unhealthy_taint():
    names = set()
    for daemonset in kube_manifests.daemonsets():
        tolerations = daemonset["spec"]["template"]["spec"]["tolerations"]
        names.add(daemonset["metadata"]["name"])
        assert any(_tolerates(toleration, UNHEALTHY_TAINT) for toleration in tolerations), daemonset["metadata"]
        # and the GPU nodes' common taint, whatever its value and effect
        assert any(_tolerates(toleration, {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"})
                   for toleration in tolerations)
        # no blanket toleration: a node tainted for another reason (here, being drained for maintenance
        # by a NoExecute taint of the operator's) keeps these pods off
        assert not any(_tolerates(toleration, {"key": "example.com/maintenance", "effect": "NoExecute"})
                       for toleration in tolerations)
    assert names == {"gpud-k8s-agent", "gpud", "gpud-device-plugin", "gpud-dra-plugin"}


def test_the_tolerance_check_itself():
    assert _tolerates({"key": "nvidia.com/gpu.unhealthy", "operator": "Exists"}, UNHEALTHY_TAINT)
    assert not _tolerates({"key": "nvidia.com/gpu.unhealthy", "operator": "Exists", "effect": "NoExecute"},
                          UNHEALTHY_TAINT)
    assert not _tolerates({"key": "nvidia.com/gpu", "operator": "Exists"}, UNHEALTHY_TAINT)
    assert not _tolerates({"key": "nvidia.com/gpu.unhealthy", "value": "true"}, UNHEALTHY_TAINT)
    assert _tolerates({"operator": "Exists"}, UNHEALTHY_TAINT)


def test_the_agent_runs_on_gpu_nodes_only():
    agent = _agent_daemonset()
    assert _runs_on(agent, {"nvidia.com/gpu.present": "true"})
    assert _runs_on(agent, {"nvidia.com/gpu.health": "unhealthy"})  # gpud's own label, through NFD
    assert not _runs_on(agent, {"nvidia.com/gpu.present": "false"})
    assert not _runs_on(agent, {"kubernetes.io/os": "linux"})


def test_gpud_in_a_pod_runs_on_gpu_nodes_before_gpud_labels_them():
    gpud = kube_manifests.find("gpud-daemonset.yaml", "DaemonSet", "gpud")
    assert _runs_on(gpud, {"nvidia.com/gpu.present": "true"})
    assert _runs_on(gpud, {"feature.node.kubernetes.io/pci-10de.present": "true"})
    assert _runs_on(gpud, {"feature.node.kubernetes.io/pci-0302_10de.present": "true"})
    assert not _runs_on(gpud, {"feature.node.kubernetes.io/pci-1002.present": "true"})  # another vendor
    assert not _runs_on(gpud, {})


def _containers(daemonset: dict) -> dict[str, dict]:
    return {container["name"]: container for container in daemonset["spec"]["template"]["spec"]["containers"]}


def _mounts(container: dict) -> dict[str, dict]:
    return {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}


def _check_agent_container(container: dict) -> None:
    assert container["command"] == ["gpud"] and container["args"][:3] == ["k8s-agent", "--log-format", "json"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    security = container["securityContext"]
    assert security["runAsUser"] == 0  # gpud's admin by the socket's peer credentials
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert not security.get("privileged")
    assert _mounts(container)["/run/gpud"]["readOnly"] is True
    assert {"requests", "limits"} <= set(container["resources"])
    # No probe: the agent has no endpoint to probe (see the manifests' comments).
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(container)


def test_the_agent_daemonset():
    agent = _agent_daemonset()
    assert agent["metadata"]["namespace"] == kube_manifests.NAMESPACE
    spec = agent["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == kube_manifests.AGENT
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["terminationGracePeriodSeconds"] > 0
    assert not spec.get("hostPID") and not spec.get("hostNetwork") and not spec.get("hostIPC")
    (container,) = spec["containers"]
    _check_agent_container(container)
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes[_mounts(container)["/run/gpud"]["name"]]["hostPath"] == {"path": "/run/gpud", "type": "Directory"}


def test_gpud_in_a_pod():
    gpud = kube_manifests.find("gpud-daemonset.yaml", "DaemonSet", "gpud")
    assert gpud["metadata"]["namespace"] == kube_manifests.NAMESPACE
    spec = gpud["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["hostPID"] is True
    assert spec["priorityClassName"] == "system-node-critical" and spec["terminationGracePeriodSeconds"] > 0
    containers = _containers(gpud)
    assert set(containers) == {"gpud", "device-plugin", "k8s-agent"}
    serve = containers["gpud"]
    assert serve["securityContext"]["privileged"] is True
    assert {variable["name"]: variable["value"] for variable in serve["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
    _check_agent_container(containers["k8s-agent"])

    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    for container in containers.values():  # every mount names a volume of the pod (no schema checks it)
        assert {mount["name"] for mount in container["volumeMounts"]} <= set(volumes), container["name"]
    # The three share the host's socket directory.
    run = {_mounts(container)["/run/gpud"]["name"] for container in containers.values()}
    assert len(run) == 1 and volumes[run.pop()]["hostPath"]["path"] == "/run/gpud"
    host_paths = {volumes[mount["name"]]["hostPath"]["path"]: path for path, mount in _mounts(serve).items()
                  if "hostPath" in volumes[mount["name"]]}
    for path in ("/run/gpud", "/var/lib/gpud", "/etc/cdi", "/etc/kubernetes/node-feature-discovery/features.d"):
        assert host_paths.get(path) == path, path  # each at the host's own path
    plugin_mounts = _mounts(containers["device-plugin"])
    assert volumes[plugin_mounts["/var/lib/kubelet/device-plugins"]["name"]]["hostPath"]["path"] == \
        "/var/lib/kubelet/device-plugins"

    # gpud.yaml comes from gpud-config, at the file `gpud serve --config` names; the named sharing
    # configs from gpud-sharing-configs, at the directory gpud.yaml's sharing.configs_dir names.
    config_path = serve["args"][serve["args"].index("--config") + 1]
    directory, _, file_name = config_path.rpartition("/")
    assert volumes[_mounts(serve)[directory]["name"]]["configMap"]["name"] == "gpud-config"
    assert file_name in kube_manifests.find("gpud-daemonset.yaml", "ConfigMap", "gpud-config")["data"]
    config = yaml.safe_load(kube_manifests.gpud_config_text())
    sharing_mount = _mounts(serve)[config["sharing"]["configs_dir"]]
    assert volumes[sharing_mount["name"]]["configMap"]["name"] == "gpud-sharing-configs"
    assert config["cdi"]["spec_dir"] in host_paths and config["state_dir"] in host_paths
    assert config["api"]["socket"] == "/run/gpud/gpud.sock"

    # Only the agent gets the service account's token.
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == kube_manifests.AGENT
    token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    holders = {name for name, container in containers.items() if token_dir in _mounts(container)}
    assert holders == {"k8s-agent"}
    sources = volumes[_mounts(containers["k8s-agent"])[token_dir]["name"]]["projected"]["sources"]
    assert {"serviceAccountToken", "configMap", "downwardAPI"} == {key for source in sources for key in source}


def test_one_image_built_by_the_containerfile():
    containerfile = (kube_manifests.REPO / "deploy" / "container" / "Containerfile").read_text()
    assert "FROM debian:12-slim" in containerfile and "dist/gpud_*_amd64.deb" in containerfile
    images = {container["image"] for daemonset in kube_manifests.daemonsets()
              for container in daemonset["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1 and images.pop().startswith("gpud:")


# -- the configs the pods carry load with gpud's own loaders -------------------------------------------


def _time_slicing_replicas(name: str, text: str) -> tuple[str, dict[str, int]]:
    config, warnings = check_sharing(text, f"gpud-sharing-configs/{name}")
    assert warnings == [], warnings
    replicas = {resource.name: resource.replicas for resource in config.time_slicing.resources} \
        if config.time_slicing else {}
    assert config.mps is None
    return config.mig_strategy, replicas


def test_every_sharing_config_loads_with_gpuds_loader():
    configs = kube_manifests.sharing_configs()
    loaded = {name: _time_slicing_replicas(name, text) for name, text in configs.items()}
    assert loaded == {
        "no-sharing": ("none", {}),
        "tesla-t4": ("none", {"nvidia.com/gpu": 4}),
        "a100-40gb": ("mixed", {"nvidia.com/mig-1g.5gb": 2, "nvidia.com/mig-2g.10gb": 2,
                                "nvidia.com/mig-3g.20gb": 3, "nvidia.com/mig-7g.40gb": 7}),
        "2080ti-12gb": ("none", {"nvidia.com/gpu": 6}),
    }
    # The default names one of them.
    assert yaml.safe_load(kube_manifests.gpud_config_text())["sharing"]["default_config"] in configs


def _keys(mapping: dict, prefix: tuple = ()) -> set[tuple]:
    keys = set()
    for key, value in mapping.items():
        keys.add(prefix + (key,))
        if isinstance(value, dict):
            keys |= _keys(value, prefix + (key,))
    return keys


def _config_keys(cls: type, prefix: tuple = ()) -> set[tuple]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        keys.add(prefix + (item.name,))
        if dataclasses.is_dataclass(hints[item.name]):
            keys |= _config_keys(hints[item.name], prefix + (item.name,))
    return keys


def test_gpud_config_uses_only_keys_gpud_has_or_the_agent_adds():
    written = _keys(yaml.safe_load(kube_manifests.gpud_config_text()))
    known = _config_keys(Config) | NEW_CONFIG_KEYS | {("kubernetes",)}
    assert written - known == set()


def test_gpud_config_parses_with_gpuds_parser():
    # Fails until gpud/config.py has sharing.configs_dir, sharing.default_config and the kubernetes
    # section (issue 22, written in parallel).
    config = parse_config(kube_manifests.gpud_config_text(), "gpud-config/gpud.yaml")
    assert config.api.socket == "/run/gpud/gpud.sock" and config.cdi.driver_files is False


def test_every_gpud_command_in_the_manifests_is_one_gpud_accepts():
    """Each container's `gpud ...` command line parses with gpud's own parser, as the image would run it."""
    from gpud.cli.parser import build_parser

    commands = [container.get("command", []) + container.get("args", [])
                for daemonset in kube_manifests.daemonsets()
                for container in daemonset["spec"]["template"]["spec"]["containers"]]
    gpud_commands = [argv[1:] for argv in commands if argv[:1] == ["gpud"]]
    assert {argv[0] for argv in gpud_commands} >= {"serve", "device-plugin", "k8s-agent", "dra-plugin"}
    for argv in gpud_commands:
        args = build_parser().parse_args(argv)
        assert callable(args.run), argv


# -- the DRA plugin: its RBAC, its DaemonSet, the DeviceClasses ----------------------------------------


def test_dra_rbac_is_exactly_what_the_plugin_calls():
    rules = kube_manifests.dra_rbac_rules()
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, nonResourceURLs
    assert kube_manifests.rbac_grants(rules) == {
        # its Node's UID, for the slices' owner reference
        ("", "nodes", "get"),
        # its own node's slices (gpud/dra/kube.py: list and watch with field selectors, create,
        # update (replace), delete by name)
        *(("resource.k8s.io", "resourceslices", verb)
          for verb in ("get", "list", "watch", "create", "update", "delete")),
        # the claim the kubelet names in NodePrepareResources
        ("resource.k8s.io", "resourceclaims", "get"),
    }
    granted = kube_manifests.rbac_grants(rules)
    assert not any("*" in item for item in granted)
    assert not any(verb in {"patch", "deletecollection", "escalate", "bind", "impersonate"} for _, _, verb in granted)
    assert not any(resource in {"secrets", "pods", "configmaps", "nodes/status", "resourceclaims/status",
                                "deviceclasses"} for _, resource, _ in granted)


def test_the_dra_binding_gives_its_role_to_the_plugins_service_account_only():
    name, namespace = kube_manifests.DRA_PLUGIN, kube_manifests.NAMESPACE
    account = kube_manifests.find(kube_manifests.DRA_RBAC, "ServiceAccount", name)
    assert account["metadata"]["namespace"] == namespace
    binding = kube_manifests.find(kube_manifests.DRA_RBAC, "ClusterRoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    # and the agent's role is not given to it, nor its role to the agent: rbac.yaml holds the two
    # accounts, roles and bindings and nothing else
    agent_binding = kube_manifests.find("rbac.yaml", "ClusterRoleBinding", kube_manifests.AGENT)
    assert [subject["name"] for subject in agent_binding["subjects"]] == [kube_manifests.AGENT]
    assert sorted((document["kind"], document["metadata"]["name"]) for document in kube_manifests.load("rbac.yaml")) == \
        sorted([(kind, who) for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
                for who in (kube_manifests.AGENT, name)] + [("Role", kube_manifests.AGENT), ("RoleBinding", kube_manifests.AGENT)])


def _dra_daemonset() -> dict:
    return copy.deepcopy(kube_manifests.find("gpud-dra-plugin.yaml", "DaemonSet", kube_manifests.DRA_PLUGIN))


def test_the_dra_plugin_daemonset():
    from gpud.cli.parser import build_parser

    plugin = _dra_daemonset()
    assert plugin["metadata"]["namespace"] == kube_manifests.NAMESPACE
    spec = plugin["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == kube_manifests.DRA_PLUGIN
    assert spec["priorityClassName"] == "system-node-critical" and spec["terminationGracePeriodSeconds"] > 0
    assert not spec.get("hostPID") and not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert "runtimeClassName" not in spec  # no GPU, no NVIDIA library in its container
    assert _runs_on(plugin, {"nvidia.com/gpu.health": "healthy"})  # gpud's own label: where gpud runs
    assert not _runs_on(plugin, {"kubernetes.io/os": "linux"})

    (container,) = spec["containers"]
    assert container["name"] == "dra-plugin"
    assert container["command"] == ["gpud"] and container["args"] == ["dra-plugin", "--log-format", "json"]
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["GPUD_SOCKET"]["value"] == "/run/gpud/gpud.sock"
    security = container["securityContext"]
    assert security["runAsUser"] == 0 and security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert not security.get("privileged")
    assert {"requests", "limits"} <= set(container["resources"])

    # Each place its command uses (its defaults: no flag but the log format) is the host's, at the same path.
    args = build_parser().parse_args(container["args"])
    kubelet, cdi = str(args.kubelet_dir), str(args.cdi_dir)
    assert (kubelet, cdi, args.driver_name) == ("/var/lib/kubelet", "/var/run/cdi", "gpu.nvidia.com")
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = _mounts(container)
    assert {mount["name"] for mount in mounts.values()} <= set(volumes)
    host_paths = {path: volumes[mount["name"]]["hostPath"]["path"] for path, mount in mounts.items()
                  if "hostPath" in volumes[mount["name"]]}
    writable = {f"{kubelet}/plugins_registry", f"{kubelet}/plugins", cdi}
    read_only = {"/run/gpud", f"{kubelet}/pod-resources"}
    assert set(host_paths) == writable | read_only
    assert all(host_paths[path] == path for path in host_paths), host_paths
    assert {path for path in host_paths if not mounts[path].get("readOnly")} == writable
    # the sockets: gpud's (shared as gpud-device-plugin.yaml shares it), the plugin's two (the kubelet's
    # <root>/plugins_registry/<driver>-reg.sock and <root>/plugins/<driver>/dra.sock), the checkpoint's directory
    assert env["GPUD_SOCKET"]["value"].rpartition("/")[0] in host_paths
    assert volumes[mounts["/run/gpud"]["name"]]["hostPath"] == \
        kube_manifests.find("gpud-device-plugin.yaml", "DaemonSet", "gpud-device-plugin")["spec"]["template"][
            "spec"]["volumes"][0]["hostPath"]
    assert not [mount for mount in mounts.values() if mount.get("mountPropagation")]

    # The service account's token, mounted by hand where the plugin's client looks for it.
    assert spec["automountServiceAccountToken"] is False
    token = mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
    assert token["readOnly"] is True
    sources = volumes[token["name"]]["projected"]["sources"]
    assert {"serviceAccountToken", "configMap", "downwardAPI"} == {key for source in sources for key in source}


# NVIDIA's selectors, verbatim (kubernetes-sigs/dra-driver-nvidia-gpu,
# deployments/helm/dra-driver-nvidia-gpu/templates/deviceclass-gpu.yaml and deviceclass-mig.yaml).
NVIDIA_DEVICE_CLASSES = {
    "gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
}


def test_the_device_classes_are_nvidias():
    classes = kube_manifests.device_classes()
    assert set(classes) == set(NVIDIA_DEVICE_CLASSES)
    for name, spec in classes.items():
        assert spec["selectors"] == [{"cel": {"expression": NVIDIA_DEVICE_CLASSES[name]}}], name
        assert "config" not in spec, name
    # Pods' plain nvidia.com/gpu requests, met by whole GPUs (where the DRAExtendedResource gate is on)
    assert classes["gpu.nvidia.com"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes["mig.nvidia.com"]
    # the plugin publishes under the driver the classes select
    from gpud.dra import DEFAULT_DRIVER_NAME
    assert DEFAULT_DRIVER_NAME == "gpu.nvidia.com"
