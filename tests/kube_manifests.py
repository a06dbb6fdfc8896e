"""gpud's Kubernetes manifests (deploy/kubernetes/) as tests read them: every document of a file, the node
agent's and the DRA plugin's RBAC rules, the DeviceClasses, and the named sharing configs of the ConfigMap
gpud-sharing-configs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import yaml

from helpers import REPO
from kube_api_stand_in import KubeApiStandIn

MANIFESTS = REPO / "deploy" / "kubernetes"
NAMESPACE = "gpud-system"
AGENT = "gpud-k8s-agent"  # the agent's ServiceAccount, ClusterRole, ClusterRoleBinding, Role, RoleBinding, DaemonSet
DRA_PLUGIN = "gpud-dra-plugin"  # the DRA plugin's ServiceAccount, ClusterRole, ClusterRoleBinding and DaemonSet
DRA_RBAC = "rbac.yaml"  # the DRA plugin's ServiceAccount, ClusterRole and ClusterRoleBinding, after the agent's
DEVICE_CLASSES = "deviceclasses.yaml"
# The first Kubernetes release that serves every object of a manifest, where that is not every release
# the tests check: DeviceClass resource.k8s.io/v1 is served from 1.34 (before it, v1beta1/v1beta2 only).
FIRST_RELEASE = {DEVICE_CLASSES: "1.34"}


def manifest_names() -> list[str]:
    """Every manifest file in deploy/kubernetes/ (the .yaml files; not the Containerfile)."""
    return sorted(path.name for path in MANIFESTS.glob("*.yaml"))


def load(name: str) -> list[dict[str, Any]]:
    """All documents of deploy/kubernetes/<name>, in order (empty documents, as kubectl, skipped)."""
    return [document for document in yaml.safe_load_all((MANIFESTS / name).read_text()) if document is not None]


def find(name: str, kind: str, object_name: str) -> dict[str, Any]:
    """The one object of that kind and name in deploy/kubernetes/<name>."""
    found = [document for document in load(name)
             if document.get("kind") == kind and document.get("metadata", {}).get("name") == object_name]
    assert len(found) == 1, f"{name}: {len(found)} {kind} objects named {object_name!r}"
    return found[0]


def agent_rbac_rules() -> list[dict[str, Any]]:
    """The rules of the ClusterRole gpud-k8s-agent (rbac.yaml), which apply in every namespace."""
    return find("rbac.yaml", "ClusterRole", AGENT)["rules"]


def agent_role_rules() -> dict[str, list[dict[str, Any]]]:
    """Namespace -> the rules of the Roles that RoleBindings of rbac.yaml give the agent's ServiceAccount
    there (they apply in that namespace only): bind both with the API stand-in's bind_agent_rbac."""
    documents = load("rbac.yaml")
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["rules"] for d in documents if d["kind"] == "Role"}
    granted: dict[str, list[dict[str, Any]]] = {}
    for binding in (d for d in documents if d["kind"] == "RoleBinding"):
        if {"kind": "ServiceAccount", "name": AGENT, "namespace": NAMESPACE} in binding["subjects"]:
            assert binding["roleRef"]["kind"] == "Role", binding  # a ClusterRole bound in a namespace: not used
            namespace = binding["metadata"]["namespace"]
            granted.setdefault(namespace, []).extend(roles[(namespace, binding["roleRef"]["name"])])
    return granted


@contextlib.contextmanager
def stand_in_as_deployed(namespaces: Iterable[str] = (), nodes: Iterable[str] = ()) -> Iterator[KubeApiStandIn]:
    """The API stand-in with the agent's RBAC as rbac.yaml grants it, these namespaces and these Nodes; on
    leaving, it asserts that no call was one it does not model."""
    with KubeApiStandIn() as stand_in:
        stand_in.bind_agent_rbac(agent_rbac_rules(), agent_role_rules())
        for namespace in namespaces:
            stand_in.create_namespace(namespace)
        for node in nodes:
            stand_in.create_node(node)
        yield stand_in
        assert stand_in.unmodelled == [], "the agent made calls the stand-in does not model"


def dra_rbac_rules() -> list[dict[str, Any]]:
    """The rules of the ClusterRole gpud-dra-plugin (rbac.yaml): what `gpud dra-plugin` may do."""
    return find(DRA_RBAC, "ClusterRole", DRA_PLUGIN)["rules"]


def rbac_grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) for each combination the PolicyRules grant (no resourceNames or
    nonResourceURLs: the caller checks that a rule has no other keys)."""
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def device_classes() -> dict[str, dict[str, Any]]:
    """DeviceClass name -> its spec (deviceclasses.yaml)."""
    return {document["metadata"]["name"]: document["spec"] for document in load(DEVICE_CLASSES)
            if document.get("kind") == "DeviceClass"}


def releases_for(name: str, releases: tuple[str, ...]) -> tuple[str, ...]:
    """Of these Kubernetes releases ("1.34"), those that serve every object of deploy/kubernetes/<name>."""
    first = FIRST_RELEASE.get(name)
    if first is None:
        return releases
    return tuple(release for release in releases if _minor(release) >= _minor(first))


def _minor(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


def sharing_configs() -> dict[str, str]:
    """Config name -> file text, from the ConfigMap gpud-sharing-configs (sharing-configs.yaml)."""
    return dict(find("sharing-configs.yaml", "ConfigMap", "gpud-sharing-configs")["data"])


def gpud_config_text() -> str:
    """The gpud.yaml of the ConfigMap gpud-config (gpud-daemonset.yaml)."""
    return find("gpud-daemonset.yaml", "ConfigMap", "gpud-config")["data"]["gpud.yaml"]


def daemonsets() -> list[dict[str, Any]]:
    """Every DaemonSet of every manifest."""
    return [document for name in manifest_names() for document in load(name) if document.get("kind") == "DaemonSet"]
