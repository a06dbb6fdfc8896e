"""gpud's Kubernetes manifests (deploy/kubernetes/) as tests read them: every document of a file, the node
agent's RBAC rules, and the named sharing configs of the ConfigMap gpud-sharing-configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from helpers import REPO

MANIFESTS = REPO / "deploy" / "kubernetes"
NAMESPACE = "gpud-system"
AGENT = "gpud-k8s-agent"  # the agent's ServiceAccount, ClusterRole, ClusterRoleBinding and DaemonSet


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
    """The rules of the ClusterRole gpud-k8s-agent (rbac.yaml)."""
    return find("rbac.yaml", "ClusterRole", AGENT)["rules"]


def sharing_configs() -> dict[str, str]:
    """Config name -> file text, from the ConfigMap gpud-sharing-configs (sharing-configs.yaml)."""
    return dict(find("sharing-configs.yaml", "ConfigMap", "gpud-sharing-configs")["data"])


def gpud_config_text() -> str:
    """The gpud.yaml of the ConfigMap gpud-config (gpud-daemonset.yaml)."""
    return find("gpud-daemonset.yaml", "ConfigMap", "gpud-config")["data"]["gpud.yaml"]


def daemonsets() -> list[dict[str, Any]]:
    """Every DaemonSet of every manifest."""
    return [document for name in manifest_names() for document in load(name) if document.get("kind") == "DaemonSet"]
