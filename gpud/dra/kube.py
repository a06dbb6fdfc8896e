"""The DRA plugin's calls to the Kubernetes API (kubernetes_asyncio), each counted by verb: its Node (the
slices' owner), its own ResourceSlices (watched with field selectors on node and driver, never listed
with the fleet's), the ResourceClaims the kubelet names, and the server's version (which slice form and
taint effects it takes). Bodies and answers stay JSON documents: the generated models would drop fields
a newer server adds. Every answer and every watch event is read by size (MAX_ANSWER_BYTES) and parsed
with its nesting bounded (gpud.base.bounded_json): whatever the server sends, a KubeError says what was
wrong with it."""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import AsyncIterator

from kubernetes_asyncio import client as k8s

from gpud.base import bounded_json
from gpud.kubernetes.node_api import (REQUEST_TIMEOUT_S, WATCH_GRACE_S, WATCH_IDLE_S, WATCH_TIMEOUT_S, KubeError,
                                     _error)

# One object is at most about 1.5 MiB (etcd's default request limit), and this node's slices are a few: an
# answer, or one watch event, beyond this is no sane server's, and is not read into memory.
MAX_ANSWER_BYTES = 16 << 20
# The watch event types client-go's decoder accepts (client-go rest/watch/decoder.go Decode: any other is
# "got invalid watch event type").
WATCH_EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
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
        """The answer's JSON object; KubeError for any status but 2xx, no answer, or one that is no JSON
        object (too large, too deep, not JSON)."""
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
        if not 200 <= status <= 299:
            raise KubeError(action, status, _status_message(body))
        try:
            return _json_object(body, f"the answer to {action}")
        except ValueError as exc:
            raise KubeError(action, status, str(exc)) from None

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
        KubeError 410: the version is too old; KubeError with no status: an event over MAX_ANSWER_BYTES,
        not JSON, nested too deep, or not a watch event of a slice, or none for WATCH_IDLE_S."""
        timeout = int(random.uniform(*WATCH_TIMEOUT_S))
        self.requests["watch"] += 1
        action = "watch own resourceslices"
        try:
            response = await self.resource.list_resource_slice(
                field_selector=self.slice_selector, allow_watch_bookmarks=True, resource_version=resource_version,
                timeout_seconds=timeout, watch=True, _preload_content=False, _request_timeout=timeout + WATCH_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - as in _raw
            raise _error(action, exc) from None
        try:
            if not 200 <= response.status <= 299:  # refused before the watch began: a Status, as any answer
                body = await response.content.read(MAX_ANSWER_BYTES)
                raise KubeError(action, response.status, _status_message(body))
            lines = _lines(response, action)
            while True:  # as the agent's watch: one silent, or trickling bytes that make no event, is dropped
                try:
                    line = await asyncio.wait_for(anext(lines), WATCH_IDLE_S)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise KubeError(action, None, f"no event nor bookmark in {WATCH_IDLE_S:g} s: the watch is "
                                                  "dropped and made again") from None
                yield _watch_event(line, action)
        except KubeError:
            raise
        except Exception as exc:  # noqa: BLE001 - as in _raw
            raise _error(action, exc) from None
        finally:
            response.close()


async def _lines(response, action: str) -> AsyncIterator[bytes]:
    """The non-blank lines of a watch answer (the API server ends each event with a newline), none longer
    than MAX_ANSWER_BYTES: a longer one is a KubeError once that much is read, not a line kept growing.
    Each chunk is searched once, so a line sent a byte at a time costs no more than one sent whole."""
    pending = bytearray()
    async for chunk in response.content.iter_any():
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            if pending.strip():
                yield bytes(pending)
            pending.clear()
            start = end + 1
        pending += chunk[start:]
        if len(pending) > MAX_ANSWER_BYTES:
            raise KubeError(action, None, f"a watch event is over {MAX_ANSWER_BYTES} bytes: not read")
    if pending.strip():
        yield bytes(pending)


def _watch_event(line: bytes, action: str) -> tuple[str, dict]:
    """(type, object) of one event, checked as client-go's decoder checks it (a known type, an object),
    and as slices.py reads it (an object with metadata; a named one unless a bookmark)."""
    try:
        event = _json_object(line, "a watch event")
    except ValueError as exc:
        raise KubeError(action, None, str(exc)) from None
    kind, obj = event.get("type"), event.get("object")
    if kind not in WATCH_EVENT_TYPES or not isinstance(obj, dict):
        raise KubeError(action, None, f"a watch event of type {str(kind)[:40]!r} with no object: not a watch event")
    if kind == "ERROR":  # a Status: 410 Expired when the version is too old
        code = obj.get("code")
        raise KubeError(action, code if isinstance(code, int) else None, str(obj.get("message", ""))[:1000])
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict) or kind != "BOOKMARK" and not isinstance(metadata.get("name"), str):
        raise KubeError(action, None, f"a {kind} watch event's object has no metadata.name: not a ResourceSlice")
    return kind, obj


def _json_object(raw: bytes | bytearray, what: str) -> dict:
    """raw as a JSON object (bounded_json's nesting bound); ValueError naming `what` otherwise."""
    document = bounded_json.loads(bytes(raw), what=what)
    if not isinstance(document, dict):
        raise ValueError(f"{what} is a JSON {type(document).__name__}, not an object")
    return document


def _status_message(body: bytes | bytearray) -> str:
    """What a refusal's body says: its Status's message, else its first 200 bytes as text."""
    try:
        message = _json_object(body, "the refusal").get("message")
    except ValueError:
        message = None
    return message if isinstance(message, str) and message else bytes(body[:200]).decode(errors="replace")
