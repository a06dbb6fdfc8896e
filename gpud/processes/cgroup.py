"""Who a process belongs to, from the text of /proc/<pid>/cgroup (cgroups(7)) and the owners of the
cgroup directories that text names.

Each line is "hierarchy-ID:controllers:path"; cgroup v2 has the one line "0::path", cgroup v1 a line
per hierarchy (systemd's own is "N:name=systemd:path"), hybrid systems both.

A name in a cgroup path is only as good as whoever made the directory. Root (systemd, the container
runtimes, kubelet) makes the directories down to a unit; systemd hands a subtree to a user by
chowning its top (Delegate=, systemd.io/CGROUP_DELEGATION): user@<uid>.service for every user, any
service with Delegate= and User=, and crun gives a user-namespaced container's cgroup to the
container's root. Below that top the user names cgroups as they like, "docker-<id>.scope" too. So
only the part of the path root made is read: the directories down to the first one that is not
root's and writable by root only (that one's name was still root's to choose), never below it, and
never below a user@<uid>.service, whose subtree is that user's whatever the directories say. A
directory that cannot be looked at (the process is gone, a hierarchy is not mounted where the
cgroup filesystem is given) ends the part that is read too.

In that part, a container is believed only where its runtime puts containers (each rule is relative
to the cgroup root the runtime sees: the host's, or the cgroup of the container it runs in):
- podman: "machine.slice/libpod-<id>.scope", or in a pod's "machine.slice/machine-libpod_pod_<pod>.slice"
  (systemd cgroup manager; podman's default cgroup parent, libpod/runtime_pod_linux.go), and
  "libpod_parent/libpod-<id>" or "libpod_parent/<pod>/libpod-<id>" (cgroupfs manager,
  CgroupfsDefaultCgroupParent). Its monitor conmon ("libpod-conmon-<id>.scope", "libpod_parent/conmon")
  is not the container. Rootless podman's containers are under the user's user@<uid>.service: that
  user's, reported as that unit;
- docker: "system.slice/docker-<id>.scope" (systemd driver) and "docker/<id>" (cgroupfs): dockerd's
  default --cgroup-parent for each driver (docs.docker.com, dockerd reference);
- Kubernetes (kubelet's pkg/kubelet/cm: QoS cgroups "burstable", "besteffort", guaranteed pods in
  kubepods itself, pod cgroups "pod<uid>"; the systemd driver writes each level as a slice named by
  the path joined with "-", uid "-" as "_", under kubelet's --cgroup-root if given, so
  "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice", or with kind's
  --cgroup-root=/kubelet "kubelet.slice/kubelet-kubepods.slice/..."): a container is a direct child
  of its pod, "cri-containerd-<id>.scope", "crio-<id>.scope" or "docker-<id>.scope" (systemd driver),
  "<id>" (containerd) or "crio-<id>" (cgroupfs driver); cgroup v1 with the systemd driver may write
  "<pod slice>:cri-containerd:<id>" in one component. CRI-O's conmon ("crio-conmon-<id>.scope") is
  not a container;
- systemd: "system.slice/<name>.service", "user.slice/user-<uid>.slice/session-<n>.scope", "init.scope".
The container found deepest wins (a container inside a container, as kind's nodes are). A process in
no container is described by the deepest unit of the part root made.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

CGROUPFS = Path("/sys/fs/cgroup")

_ID = r"([0-9a-f]{64})"
_UID = r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})"
_QOS = ("burstable", "besteffort")
_PODMAN_SCOPE = re.compile(rf"^libpod-{_ID}\.scope$")
_PODMAN_CGROUPFS = re.compile(rf"^libpod-{_ID}$")
_PODMAN_POD_SLICE = re.compile(r"^machine-libpod_pod_[0-9a-f]{64}\.slice$")
_DOCKER_SCOPE = re.compile(rf"^docker-{_ID}\.scope$")
_BARE_ID = re.compile(rf"^{_ID}$")
# Containers of a pod: the component's pattern, the runtime, and the kubelet cgroup driver it goes with.
_POD_CONTAINERS = (
    (re.compile(rf"^cri-containerd-{_ID}\.scope$"), "containerd", "systemd"),
    (re.compile(rf"^crio-{_ID}\.scope$"), "cri-o", "systemd"),
    (_DOCKER_SCOPE, "docker", "systemd"),
    (re.compile(rf"^crio-{_ID}$"), "cri-o", "cgroupfs"),
    # dockershim left in Kubernetes 1.24, so a bare ID in a pod is containerd's
    (_BARE_ID, "containerd", "cgroupfs"),
)
# cgroup v1 with the systemd driver: "<pod slice>:<runtime prefix>:<id>" in one component.
_V1_SYSTEMD_FORM = re.compile(rf"^([^:/]+\.slice):(cri-containerd|crio|docker):{_ID}$")
_V1_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_POD_SLICE = re.compile(rf"^((?:[a-z0-9_]+-)*kubepods(?:-(?:burstable|besteffort))?)-pod{_UID}\.slice$")
_POD_DIR = re.compile(rf"^pod{_UID}$")
_USER_MANAGER = re.compile(r"^user@(\d+)\.service$")
_UNIT = re.compile(r"^[^/]+\.(?:service|scope)$")


@dataclass(frozen=True)
class Owner:
    """kind: "container", "systemd" (a unit, no container), "other" (a cgroup that names neither, such as
    the root cgroup), or "unknown" (the process is gone, or its cgroup file could not be read)."""

    kind: str
    container_runtime: str | None = None  # "podman", "docker", "containerd", "cri-o"
    container_id: str | None = None  # the runtime's full 64-hex ID
    pod_uid: str | None = None  # the Kubernetes pod, with dashes
    systemd_unit: str | None = None  # "foo.service", "user@1000.service", "init.scope" (not for containers)
    systemd_slice: str | None = None  # the slice above the unit: "system.slice", "user-1000.slice"
    cgroup: str | None = None  # the path the owner was read from

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


UNKNOWN = Owner("unknown")


def owner_of(cgroup_text: str, cgroupfs: Path = CGROUPFS) -> Owner:
    """The owner a /proc/<pid>/cgroup text names, read from the part of each path that root made in
    the cgroup filesystem mounted at `cgroupfs`; UNKNOWN for text that is not such a file."""
    paths = _paths(cgroup_text, cgroupfs)
    if not paths:
        return UNKNOWN
    root_made = [(path, _root_made(hierarchy, path)) for hierarchy, path in paths]
    for path, components in root_made:  # a container named on any hierarchy (v1 controllers may differ)
        container = _container(components, path)
        if container is not None:
            return container
    return _unit(*root_made[0])


def _paths(cgroup_text: str, cgroupfs: Path) -> list[tuple[Path, str]]:
    """The (hierarchy's mount, cgroup path) pairs of the text, the unified (v2) one first, then
    systemd's v1 one, then the others."""
    unified, systemd, others = [], [], []
    # v2 alone is mounted at the top; a hybrid system mounts it at "unified" (systemd's layout).
    v2_mount = cgroupfs if (cgroupfs / "cgroup.controllers").exists() else cgroupfs / "unified"
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified.append((v2_mount, path))
        elif controllers == "name=systemd":
            systemd.append((cgroupfs / "systemd", path))
        elif controllers and "/" not in controllers and controllers not in (".", ".."):
            # v1 hierarchies are mounted at their controller list ("cpu,cpuacct"), named ones at their name
            others.append((cgroupfs / controllers.removeprefix("name="), path))
    # A hybrid system's unified line stays "/" when systemd does not manage it: skip that one.
    paths = [p for p in unified if p[1] != "/"] + systemd + others
    return paths or unified


def _root_made(hierarchy: Path, path: str) -> list[str]:
    """The leading components of `path` whose names root chose: down to the first directory that is
    not root's alone (included: its parent, root's, named it), or a user's service manager (its
    subtree is delegated to the user), or the last directory that can be looked at."""
    components = [c for c in path.split("/") if c]
    made: list[str] = []
    directory = hierarchy
    try:
        if not _roots_alone(os.lstat(directory)):
            return made
        for component in components:
            if component in (".", ".."):
                break
            directory = directory / component
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                break
            made.append(component)
            if not _roots_alone(info) or _is_user_manager(made):
                break
    except OSError:  # gone since, or not there: what was seen so far is all that is known
        pass
    return made


def _roots_alone(info: os.stat_result) -> bool:
    return info.st_uid == 0 and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _is_user_manager(components: list[str]) -> bool:
    """"user-<uid>.slice/user@<uid>.service": systemd delegates it to the user (user@.service has
    Delegate=yes), so what lies below is the user's even where its directories are root's."""
    match = _USER_MANAGER.match(components[-1])
    return match is not None and len(components) >= 2 and components[-2] == f"user-{match.group(1)}.slice"


def _container(components: list[str], path: str) -> Owner | None:
    found, base = None, 0
    for depth, component in enumerate(components):
        at = _container_at(components[base:depth], component)
        if at is not None:
            runtime, container_id, pod_uid = at
            found = Owner("container", runtime, container_id, pod_uid, cgroup=path)
            # a runtime inside the container sees its cgroup as the root (crun may put the
            # container's processes in a "container" child of it)
            base = depth + 2 if components[depth + 1:depth + 2] == ["container"] else depth + 1
    return found


def _container_at(above: list[str], component: str) -> tuple[str, str, str | None] | None:
    """(runtime, container ID, pod UID) where `component`, under the components `above` (from the
    cgroup root its runtime sees), is where a runtime puts a container; else None."""
    match = _PODMAN_SCOPE.match(component)
    if match and above[:1] == ["machine.slice"] and (
            len(above) == 1 or (len(above) == 2 and _PODMAN_POD_SLICE.match(above[1]))):
        return "podman", match.group(1), None
    match = _PODMAN_CGROUPFS.match(component)
    if match and above[:1] == ["libpod_parent"] and (len(above) == 1 or (len(above) == 2 and _BARE_ID.match(above[1]))):
        return "podman", match.group(1), None
    match = _DOCKER_SCOPE.match(component)
    if match and above == ["system.slice"]:
        return "docker", match.group(1), None
    match = _BARE_ID.match(component)
    if match and above == ["docker"]:
        return "docker", match.group(1), None
    match = _V1_SYSTEMD_FORM.match(component)
    if match:
        pod = _POD_SLICE.match(match.group(1))
        if pod:
            return _V1_RUNTIMES[match.group(2)], match.group(3), _uid(pod.group(2))
    for pattern, runtime, driver in _POD_CONTAINERS:
        match = pattern.match(component)
        if match:
            pod_uid = _kubelet_pod(above, driver)
            if pod_uid is not None:
                return runtime, match.group(1), pod_uid
    return None


def _kubelet_pod(above: list[str], driver: str) -> str | None:
    """The pod's UID where `above` ends in a pod cgroup kubelet makes with that cgroup driver."""
    if not above:
        return None
    if driver == "systemd":
        pod = _POD_SLICE.match(above[-1])
        if pod is None:
            return None
        # each slice is in the slice its name extends: kubepods-burstable-pod<uid>.slice in
        # kubepods-burstable.slice in kubepods.slice
        stem = pod.group(1)
        parents = [f"{stem}.slice"]
        if stem.endswith(_QOS):
            parents.insert(0, f"{stem.rsplit('-', 1)[0]}.slice")
        return _uid(pod.group(2)) if above[-1 - len(parents):-1] == parents else None
    pod = _POD_DIR.match(above[-1])
    if pod is None:
        return None
    parents = above[:-1]
    if parents[-1:] == ["kubepods"] or (parents[-2:-1] == ["kubepods"] and parents[-1] in _QOS):
        return _uid(pod.group(1))
    return None


def _uid(pod_uid: str) -> str:
    return pod_uid.replace("_", "-")  # a static pod's UID is 32 hex digits, no dashes


def _unit(path: str, components: list[str]) -> Owner:
    for depth in range(len(components) - 1, -1, -1):
        if _UNIT.match(components[depth]):
            slices = [c for c in components[:depth] if c.endswith(".slice")]
            return Owner("systemd", systemd_unit=components[depth], systemd_slice=slices[-1] if slices else None,
                         cgroup=path)
    return Owner("other", cgroup=path)
