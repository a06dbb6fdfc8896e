"""The agent's calls to the Kubernetes API, about its own Node only (kubernetes_asyncio).

Fleet scale shapes each call (5,000 nodes, one agent each, one API server): the Node is watched with a
field selector on its name, never listed with the others; a watch resumes from the last resourceVersion
it saw (bookmarks keep that fresh while nothing changes) and is re-read with one GET only when the
server says it is too old (410 Gone); writes are patches of the agent's own keys; a taint change
carries the resourceVersion it was computed from, so a concurrent writer makes it fail with 409
Conflict (then it is recomputed) instead of being overwritten.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import os
import random
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpud.kubernetes import COMPONENT

REQUEST_TIMEOUT_S = 30.0
# A watch asks the server to end it after a random 5 to 10 minutes, as client-go's reflector does
# (tools/cache/reflector.go: minWatchTimeout = 5 min, timeoutSeconds = min * (1 + rand)): the agents
# of a fleet do not all come back at once, and a connection some middlebox dropped silently is
# noticed. The client gives up WATCH_GRACE_S after that.
WATCH_TIMEOUT_S = (300.0, 600.0)
WATCH_GRACE_S = 30.0
# Kubernetes Events: core/v1 Event.message has no limit, events.k8s.io/v1's note is 1 kB
# (pkg/apis/core/validation/events.go, NoteLengthLimit); the agent keeps to the smaller one.
EVENT_MESSAGE_LIMIT = 1024
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeError(Exception):
    """A call the API server refused (status: its HTTP status) or that did not reach it (status None)."""

    def __init__(self, action: str, status: int | None, message: str):
        self.action = action
        self.status = status
        self.message = message
        super().__init__(f"{action}: {message}" if status is None else f"{action}: HTTP {status}: {message}")


def _error(action: str, exc: BaseException) -> KubeError:
    if isinstance(exc, ApiException):
        message = exc.reason or ""
        try:
            status_object = json.loads(exc.body) if exc.body else {}
            message = status_object.get("message") or message
        except (TypeError, ValueError):
            pass
        return KubeError(action, exc.status or None, message)
    return KubeError(action, None, f"{type(exc).__name__}: {exc}".rstrip(": "))


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def api_client(kubeconfig: Path | None) -> k8s.ApiClient:
    """A client as kubectl finds its cluster: --kubeconfig, else $KUBECONFIG, else the service account
    Kubernetes mounts into a pod (KUBERNETES_SERVICE_HOST and /var/run/secrets/kubernetes.io)."""
    configuration = k8s.Configuration()
    path = kubeconfig or (Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else None)
    if path is not None:
        await k8s_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        raise k8s_config.ConfigException("no --kubeconfig, no $KUBECONFIG, and not in a pod (no "
                                         "KUBERNETES_SERVICE_HOST): say which cluster with --kubeconfig")
    return k8s.ApiClient(configuration)


class NodeApi:
    """The calls, each counted by verb (the agent's status and the benchmark report them)."""

    def __init__(self, client: k8s.ApiClient, node_name: str):
        self.client = client
        self.core = k8s.CoreV1Api(client)
        self.node_name = node_name
        self.requests: collections.Counter[str] = collections.Counter()

    async def _call(self, verb: str, action: str, call):
        self.requests[verb] += 1
        try:
            return self.client.sanitize_for_serialization(await call)
        except (ApiException, OSError, asyncio.TimeoutError, ValueError) as exc:
            raise _error(action, exc) from None
        except Exception as exc:  # noqa: BLE001 - the client's transport errors (aiohttp's) share no base
            raise _error(action, exc) from None

    async def read_node(self) -> dict:
        return await self._call("get", f"get node {self.node_name}",
                                self.core.read_node(self.node_name, _request_timeout=REQUEST_TIMEOUT_S))

    async def watch(self, resource_version: str | None) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) of the Node from resource_version on (None: from the most recent, the
        Node first as an ADDED event), bookmarks included, until the server ends the watch.
        KubeError 410: the version is too old."""
        timeout = int(random.uniform(*WATCH_TIMEOUT_S))
        self.requests["watch"] += 1
        action = f"watch node {self.node_name}"
        since = {"resource_version": resource_version} if resource_version is not None else {}
        stream = k8s_watch.Watch().stream(
            self.core.list_node, field_selector=f"metadata.name={self.node_name}", allow_watch_bookmarks=True,
            timeout_seconds=timeout, _request_timeout=timeout + WATCH_GRACE_S, **since)
        try:
            async for event in stream:
                yield event["type"], event["raw_object"]
        except (ApiException, OSError, asyncio.TimeoutError, ValueError) as exc:
            raise _error(action, exc) from None
        except Exception as exc:  # noqa: BLE001 - as in _call
            raise _error(action, exc) from None
        finally:
            await stream.close()

    async def patch_labels(self, labels: dict[str, str | None]) -> dict:
        """Sets (None: removes) these labels and no others: a JSON merge patch merges maps."""
        return await self._call("patch", f"patch labels of node {self.node_name}", self.core.patch_node(
            self.node_name, {"metadata": {"labels": labels}}, _content_type=MERGE_PATCH,
            _request_timeout=REQUEST_TIMEOUT_S))

    async def patch_condition(self, condition: dict) -> dict:
        """Sets one condition of the Node's status, leaving the kubelet's: in a strategic merge patch,
        NodeStatus.conditions merge by `type` (k8s.io/api core/v1 types.go: patchMergeKey=type)."""
        return await self._call("patch", f"patch condition {condition['type']} of node {self.node_name}",
                                self.core.patch_node_status(self.node_name, {"status": {"conditions": [condition]}},
                                                            _content_type=STRATEGIC_MERGE_PATCH,
                                                            _request_timeout=REQUEST_TIMEOUT_S))

    async def replace_taints(self, taints: list[dict], resource_version: str) -> dict:
        """NodeSpec.taints is an atomic list (types.go: no patch merge key), so a change sends the whole
        list, with the resourceVersion it was computed from as a precondition: 409 if it moved on."""
        return await self._call("patch", f"patch taints of node {self.node_name}", self.core.patch_node(
            self.node_name, {"metadata": {"resourceVersion": resource_version}, "spec": {"taints": taints}},
            _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S))

    async def create_event(self, node: dict, event_type: str, reason: str, message: str) -> None:
        """A core/v1 Event on the Node, in namespace default: where events of cluster-scoped objects go
        (client-go tools/record: an involvedObject without namespace records in metav1.NamespaceDefault)
        and where `kubectl describe node` finds them."""
        when = now_rfc3339()
        body = {
            "metadata": {"name": f"{self.node_name}.{secrets.token_hex(8)}", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node_name,
                               "uid": node.get("metadata", {}).get("uid", self.node_name)},
            "type": event_type, "reason": reason, "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": COMPONENT, "host": self.node_name},
            "firstTimestamp": when, "lastTimestamp": when, "count": 1,
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
        }
        await self._call("create", f"create event {reason} on node {self.node_name}",
                         self.core.create_namespaced_event("default", body, _request_timeout=REQUEST_TIMEOUT_S))
