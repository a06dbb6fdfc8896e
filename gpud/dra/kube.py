"""The DRA plugin's calls to the Kubernetes API (kubernetes_asyncio), each counted by verb: its Node (the
slices' owner), its own ResourceSlices (watched with field selectors on node and driver, never listed
with the fleet's), the ResourceClaims the kubelet names, and the server's version (which slice form and
taint effects it takes). Bodies and answers stay JSON documents: the generated models would drop fields
a newer server adds."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import AsyncIterator
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch as k8s_watch

from gpud.kubernetes.node_api import REQUEST_TIMEOUT_S, WATCH_GRACE_S, WATCH_TIMEOUT_S, KubeError, _error

# One object is at most about 1.5 MiB (etcd's default request limit), and this node's slices are a few: an
# answer beyond this is no sane server's, and is not read into memory.
MAX_ANSWER_BYTES = 16 << 20
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
        """The answer's JSON document; KubeError for any status but 2xx, or no answer."""
        self.requests[verb] += 1
        try:
            response = await call
            status = response.status
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    response.close()
                    raise KubeError(action, status, f"the answer is over {MAX_ANSWER_BYTES} bytes: not read")
            response.release()
        except KubeError:
            raise
        except Exception as exc:  # noqa: BLE001 - aiohttp's and the client's errors share no base
            raise _error(action, exc) from None
        try:
            document = json.loads(body) if body else {}
        except ValueError:
            document = {}
        if not 200 <= status <= 299:
            message = document.get("message") if isinstance(document, dict) else None
            raise KubeError(action, status, message or bytes(body[:200]).decode(errors="replace"))
        return document

    async def server_minor(self) -> int:
        """The API server's minor version (GET /version): "34", "35+", as a number."""
        document = await self._raw("get", "get the server version",
                                   self.version_api.get_code(_preload_content=False,
                                                             _request_timeout=REQUEST_TIMEOUT_S))
        digits = "".join(ch for ch in str(document.get("minor", "")) if ch.isdigit())
        return int(digits) if digits else DEFAULT_SERVER_MINOR

    async def read_node(self) -> dict:
        return await self._raw("get", f"get node {self.node_name}", self.core.read_node(
            self.node_name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))

    async def read_claim(self, namespace: str, name: str) -> dict:
        return await self._raw("get", f"get resourceclaim {namespace}/{name}", self.resource.read_namespaced_resource_claim(
            name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))

    async def list_slices(self) -> dict:
        return await self._raw("list", "list own resourceslices", self.resource.list_resource_slice(
            field_selector=self.slice_selector, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))

    async def create_slice(self, body: dict) -> dict:
        return await self._raw("create", "create resourceslice", self.resource.create_resource_slice(
            body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))

    async def update_slice(self, body: dict) -> dict:
        name = body["metadata"]["name"]
        return await self._raw("update", f"update resourceslice {name}", self.resource.replace_resource_slice(
            name, body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))

    async def delete_slice(self, name: str) -> None:
        try:
            await self._raw("delete", f"delete resourceslice {name}", self.resource.delete_resource_slice(
                name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))
        except KubeError as exc:
            if exc.status != 404:  # gone already (the kubelet's wipe): what was wanted
                raise

    async def watch_slices(self, resource_version: str) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) of the node's own slices after resource_version, bookmarks included, until
        the server ends the watch (after a random 5 to 10 minutes, as client-go's reflector asks).
        KubeError 410: the version is too old."""
        timeout = int(random.uniform(*WATCH_TIMEOUT_S))
        self.requests["watch"] += 1
        stream = k8s_watch.Watch().stream(
            self.resource.list_resource_slice, field_selector=self.slice_selector, allow_watch_bookmarks=True,
            resource_version=resource_version, timeout_seconds=timeout, _request_timeout=timeout + WATCH_GRACE_S)
        try:
            async for event in stream:
                if event["type"] == "ERROR":
                    status: Any = event["raw_object"]
                    raise KubeError("watch own resourceslices", status.get("code"), status.get("message", ""))
                yield event["type"], event["raw_object"]
        except KubeError:
            raise
        except (asyncio.TimeoutError, OSError, ValueError) as exc:
            raise _error("watch own resourceslices", exc) from None
        except Exception as exc:  # noqa: BLE001 - as in _raw
            raise _error("watch own resourceslices", exc) from None
        finally:
            await stream.close()
