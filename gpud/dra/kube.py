"""The DRA plugin's calls to the Kubernetes API (kubernetes_asyncio), each counted by verb: its Node (the
slices' owner), its own ResourceSlices (watched with field selectors on node and driver, never listed
with the fleet's), the ResourceClaims the kubelet names, and the server's version (which slice form and
taint effects it takes). Every answer and every watch event is read as the agent's are
(gpud.kubernetes.node_api read_answer and watch_events: by size, with its nesting bounded, as a JSON
document, never the generated models, which would drop fields a newer server adds)."""

from __future__ import annotations

import collections
import random
from collections.abc import AsyncIterator

from kubernetes_asyncio import client as k8s

from gpud.kubernetes.node_api import (RAW_CALL, WATCH_GRACE_S, WATCH_TIMEOUT_S, KubeError, read_answer,
                                      watch_events)

DEFAULT_SERVER_MINOR = 34  # resource.k8s.io/v1 is GA from 1.34: an older server has no v1 to talk to


class DraApi:
    def __init__(self, client: k8s.ApiClient, node_name: str, driver: str):
        self.client = client
        self.core = k8s.CoreV1Api(client)
        self.resource = k8s.ResourceV1Api(client)
        self.version_api = k8s.VersionApi(client)
        self.node_name = node_name
        self.driver = driver
        self.requests: collections.Counter[str] = collections.Counter()
        self.slice_selector = f"spec.nodeName={node_name},spec.driver={driver}"

    async def _raw(self, verb: str, action: str, call) -> dict:
        """`call` (made with RAW_CALL) counted by verb, and its answer read by read_answer."""
        self.requests[verb] += 1
        return await read_answer(action, call)

    async def server_minor(self) -> int:
        """The API server's minor version (GET /version): "34", "35+", as a number."""
        document = await self._raw("get", "get the server version",
                                   self.version_api.get_code(**RAW_CALL))
        digits = "".join(ch for ch in str(document.get("minor", "")) if ch.isdigit())
        return int(digits) if digits else DEFAULT_SERVER_MINOR

    async def read_node(self) -> dict:
        return await self._raw("get", f"get node {self.node_name}", self.core.read_node(self.node_name, **RAW_CALL))

    async def read_claim(self, namespace: str, name: str) -> dict:
        return await self._raw("get", f"get resourceclaim {namespace}/{name}",
                               self.resource.read_namespaced_resource_claim(name, namespace, **RAW_CALL))

    async def list_slices(self) -> dict:
        return await self._raw("list", "list own resourceslices", self.resource.list_resource_slice(
            field_selector=self.slice_selector, **RAW_CALL))

    async def create_slice(self, body: dict) -> dict:
        return await self._raw("create", "create resourceslice", self.resource.create_resource_slice(body, **RAW_CALL))

    async def update_slice(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        return await self._raw("update", f"update resourceslice {name}", self.resource.replace_resource_slice(
            name, body, **RAW_CALL))

    async def delete_slice(self, name: str) -> None:
        try:
            await self._raw("delete", f"delete resourceslice {name}", self.resource.delete_resource_slice(name, **RAW_CALL))
        except KubeError as exc:
            if exc.status != 404:  # gone already (the kubelet's wipe): what was wanted
                raise

    async def watch_slices(self, resource_version: str) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) of the node's own slices after resource_version, bookmarks included, until
        the server ends the watch (after a random 5 to 10 minutes, as client-go's reflector asks).
        KubeError 410: the version is too old; KubeError with no status: an event over MAX_ANSWER_BYTES,
        not JSON, nested too deep, or not a watch event of a slice, or none for WATCH_IDLE_S."""
        timeout = int(random.uniform(*WATCH_TIMEOUT_S))
        self.requests["watch"] += 1
        async for event in watch_events("watch own resourceslices", self.resource.list_resource_slice(
                field_selector=self.slice_selector, allow_watch_bookmarks=True, resource_version=resource_version,
                timeout_seconds=timeout, watch=True, _preload_content=False,
                _request_timeout=timeout + WATCH_GRACE_S)):
            yield event
