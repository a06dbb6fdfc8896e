"""Who a process belongs to, from the text of /proc/<pid>/cgroup (cgroups(7)).

Each line is "hierarchy-ID:controllers:path"; cgroup v2 has the one line "0::path", cgroup v1 a line
per hierarchy (systemd's own is "N:name=systemd:path"), hybrid systems both. Container managers name
the cgroup of a container after its ID, as the public layouts below show:
- podman: "machine.slice/libpod-<id>.scope" (systemd cgroup manager; rootless under
  user@<uid>.service, sometimes with a "/container" child), "/libpod_parent/libpod-<id>" (cgroupfs);
  its monitor conmon sits in "libpod-conmon-<id>.scope" or "/libpod_parent/conmon" and is not the container;
- docker: "system.slice/docker-<id>.scope" (systemd), "/docker/<id>" (cgroupfs);
- Kubernetes: "kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/<runtime>-<id>.scope"
  (systemd driver: pod UID with "_" for "-", runtime "cri-containerd", "crio" or "docker"), cgroup
  v1 with the systemd driver may write "<pod slice>:cri-containerd:<id>", and "/kubepods/<qos>/pod<uid>/<id>"
  (cgroupfs driver; CRI-O names it "crio-<id>");
- systemd: "system.slice/<name>.service", "user.slice/user-<uid>.slice/session-<n>.scope",
  "user.slice/user-<uid>.slice/user@<uid>.service/app.slice/<name>.service", "init.scope".
The container found deepest in the path wins (a container inside a container, as kind's nodes are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ID = r"([0-9a-f]{64})"
# Path components naming a container, with the runtime each belongs to.
_CONTAINER_COMPONENTS = (
    (re.compile(rf"^libpod-{_ID}(?:\.scope)?$"), "podman"),
    (re.compile(rf"^docker-{_ID}\.scope$"), "docker"),
    (re.compile(rf"^cri-containerd-{_ID}\.scope$"), "containerd"),
    (re.compile(rf"^crio-{_ID}(?:\.scope)?$"), "cri-o"),
)
# cgroup v1 with the systemd driver: "<slice>:<runtime prefix>:<id>" in one component.
_V1_SYSTEMD_FORM = re.compile(rf"^[^:]+\.slice:(cri-containerd|crio|docker):{_ID}$")
_V1_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_BARE_ID = re.compile(rf"^{_ID}$")
_POD = re.compile(r"^(?:[a-z]+-)*pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_]"
                  r"[0-9a-f]{12}|[0-9a-f]{32})(?:\.slice)?$")
_UNIT = re.compile(r"^[^/]+\.(?:service|scope)$")


@dataclass(frozen=True)
class Owner:
    """kind: "container", "systemd" (a unit, no container), "other" (a cgroup that names neither, such as
    the root cgroup), or "unknown" (the process is gone, or its cgroup file could not be read)."""

    kind: str
    container_runtime: str | None = None  # "podman", "docker", "containerd", "cri-o"
    container_id: str | None = None  # the runtime's full 64-hex ID
    pod_uid: str | None = None  # the Kubernetes pod, with dashes
    systemd_unit: str | None = None  # "foo.service", "session-3.scope", "init.scope" (not for containers)
    systemd_slice: str | None = None  # the slice above the unit: "system.slice", "user-1000.slice"
    cgroup: str | None = None  # the path the owner was read from

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


UNKNOWN = Owner("unknown")


def owner_of(cgroup_text: str) -> Owner:
    """The owner a /proc/<pid>/cgroup text names; UNKNOWN for text that is not such a file."""
    paths = _paths(cgroup_text)
    if not paths:
        return UNKNOWN
    for path in paths:  # a container named on any hierarchy (v1 controllers may differ)
        container = _container(path)
        if container is not None:
            return container
    return _unit(paths[0])


def _paths(cgroup_text: str) -> list[str]:
    """The cgroup paths of the text, the unified (v2) one first, then systemd's v1 one, then the others."""
    unified, systemd, others = [], [], []
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified.append(path)
        elif controllers == "name=systemd":
            systemd.append(path)
        else:
            others.append(path)
    # A hybrid system's unified line stays "/" when systemd does not manage it: skip that one.
    paths = [p for p in unified if p != "/"] + systemd + others
    return paths or unified


def _container(path: str) -> Owner | None:
    components = [c for c in path.split("/") if c]
    for depth in range(len(components) - 1, -1, -1):
        found = _container_at(components, depth)
        if found is not None:
            runtime, container_id = found
            return Owner("container", runtime, container_id, _pod_uid(components[:depth + 1]), cgroup=path)
    return None


def _container_at(components: list[str], depth: int) -> tuple[str, str] | None:
    component = components[depth]
    for pattern, runtime in _CONTAINER_COMPONENTS:
        match = pattern.match(component)
        if match:
            return runtime, match.group(1)
    match = _V1_SYSTEMD_FORM.match(component)
    if match:
        return _V1_RUNTIMES[match.group(1)], match.group(2)
    if _BARE_ID.match(component) and depth > 0:
        parent = components[depth - 1]
        if parent == "docker":
            return "docker", component
        if _POD.match(parent):
            # The cgroupfs driver of Kubernetes: CRI-O writes crio-<id>, and dockershim left in
            # Kubernetes 1.24, so a bare ID in a pod is containerd's.
            return "containerd", component
    return None


def _pod_uid(components: list[str]) -> str | None:
    for component in reversed(components):
        match = _POD.match(component.split(":", 1)[0])  # v1 systemd form: the pod slice before ":"
        if match:
            return match.group(1).replace("_", "-")  # a static pod's UID is 32 hex digits, no dashes
    return None


def _unit(path: str) -> Owner:
    components = [c for c in path.split("/") if c]
    for depth in range(len(components) - 1, -1, -1):
        if _UNIT.match(components[depth]):
            slices = [c for c in components[:depth] if c.endswith(".slice")]
            return Owner("systemd", systemd_unit=components[depth], systemd_slice=slices[-1] if slices else None,
                         cgroup=path)
    return Owner("other", cgroup=path)
