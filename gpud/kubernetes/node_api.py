"""The agent's calls to the Kubernetes API, about its own Node only (kubernetes_asyncio), and the bounded
reading of every answer that it and the DRA plugin (gpud/dra/kube.py) share.

Fleet scale shapes each call (5,000 nodes, one agent each, one API server): the Node is watched with a
field selector on its name, never listed with the others; a watch resumes from the last resourceVersion
it saw (bookmarks keep that fresh while nothing changes) and is re-read with one GET only when the
server says it is too old (410 Gone); writes are patches of the agent's own keys; a taint change
carries the resourceVersion it was computed from, so a concurrent writer makes it fail with 409
Conflict (then it is recomputed) instead of being overwritten.

Bodies and answers stay JSON documents: the generated models would drop fields a newer server adds. Every
answer and every watch event is read by size (MAX_ANSWER_BYTES) and parsed with its nesting bounded
(gpud.base.bounded_json): whatever the server sends, a KubeError says what was wrong with it.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import os
import random
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from gpud.base import bounded_json
from gpud.base.loops import within
from gpud.base.safefs import check_trusted_file
from gpud.base.yamlfile import at_line, load_yaml, read_yaml_text
from gpud.kubernetes import COMPONENT

REQUEST_TIMEOUT_S = 30.0
# A call's keywords: its answer left unread for read_answer, and the whole call (the body read included:
# aiohttp's ClientTimeout total) within REQUEST_TIMEOUT_S.
RAW_CALL = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT_S}
# A watch asks the server to end it after a random 5 to 10 minutes, as client-go's reflector does
# (tools/cache/reflector.go: minWatchTimeout = 5 min, timeoutSeconds = min * (1 + rand)): the agents
# of a fleet do not all come back at once, and a connection some middlebox dropped silently is
# noticed. The client gives up WATCH_GRACE_S after that.
WATCH_TIMEOUT_S = (300.0, 600.0)
WATCH_GRACE_S = 30.0
# A watch with bookmarks hears from the server every minute while nothing changes (the watch cache
# sends each watcher a bookmark each minute: k8s.io/apiserver cacher.go defaultBookmarkFrequency). A watch
# silent for longer, or trickling bytes that never make an event, is dropped and made again rather
# than held until its timeout. One event is one line of at most aiohttp's read buffer limit (a
# longer one is an error, ValueError "Line is too long"): a Node is some tens of KiB.
WATCH_IDLE_S = 150.0
# One object is at most about 1.5 MiB (etcd's default request limit), a Node's annotations alone up to
# 256 KiB (k8s.io/apimachinery pkg/api/validation/objectmeta.go TotalAnnotationSizeLimitB), and the
# answers read are a node's own objects: an answer, or one watch event, beyond this is no sane server's,
# and is not read into memory.
MAX_ANSWER_BYTES = 16 << 20
# The watch event types client-go's decoder accepts (client-go rest/watch/decoder.go Decode: any other is
# "got invalid watch event type").
WATCH_EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
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
            status_object = bounded_json.loads(exc.body, what="the API server's error") if exc.body else {}
            message = status_object.get("message") or message
        except (TypeError, ValueError, AttributeError):
            pass
        return KubeError(action, exc.status or None, message)
    return KubeError(action, None, f"{type(exc).__name__}: {exc}".rstrip(": "))


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def api_client(kubeconfig: Path | None) -> k8s.ApiClient:
    """A client as kubectl finds its cluster: --kubeconfig, else $KUBECONFIG, else the service account
    Kubernetes mounts into a pod (KUBERNETES_SERVICE_HOST and /var/run/secrets/kubernetes.io)."""
    configuration = k8s.Configuration()
    path = str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG") or None  # a list as kubectl takes
    if path is not None:
        await asyncio.to_thread(check_kubeconfig, path)
        await k8s_config.load_kube_config(config_file=str(path), client_configuration=configuration)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=configuration)
    else:
        raise k8s_config.ConfigException("no --kubeconfig, no $KUBECONFIG, and not in a pod (no "
                                         "KUBERNETES_SERVICE_HOST): say which cluster with --kubeconfig")
    return k8s.ApiClient(configuration)


# A kubeconfig's keys that name files, relative to its own directory (client-go clientcmd/loader.go
# ResolveLocalPaths; kubernetes_asyncio config/kube_config.py joins them to the file's directory).
_CLUSTER_FILES = ("certificate-authority",)
_USER_FILES = ("client-certificate", "client-key", "tokenFile")


def check_kubeconfig(path: Path | str) -> None:
    """Raises UnsafePath unless each kubeconfig (a list as $KUBECONFIG gives, split as kubectl does),
    each file its clusters and users name, and each credential program it would run (an exec plugin,
    a gcp auth-provider's cmd-path) is a file only root or gpud's user controls (safefs's rules for
    gpud's own files). Another user who can write any of them points the agent at an API server of
    their choosing, whose answers steer MIG and sharing; one who can write a plugin runs code as the
    agent. Every entry is checked, not only the current context's. ValueError when a file is not a
    kubeconfig gpud can read."""
    parts = [part for part in str(path).split(os.pathsep) if part]
    for part in parts:
        if len(parts) == 1 or os.path.exists(part):  # kubectl skips a listed file that is missing
            _check_one_kubeconfig(Path(part))


def _check_one_kubeconfig(path: Path) -> None:
    check_trusted_file(path, "the kubeconfig")

    def fail(reason: str, line: int | None) -> Exception:
        return ValueError(at_line(str(path), line, reason))

    document = load_yaml(read_yaml_text(path, fail), fail) or {}
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not a kubeconfig: a YAML mapping is expected")
    base = path.parent
    for section, inner, keys in (("clusters", "cluster", _CLUSTER_FILES), ("users", "user", _USER_FILES)):
        for entry in document.get(section) or []:
            named = entry.get(inner) if isinstance(entry, dict) else None
            if not isinstance(named, dict):
                continue
            for key in keys:
                if isinstance(named.get(key), str) and named[key]:
                    check_trusted_file(base / named[key], f"the kubeconfig's {key}")
            if inner == "user":
                _check_programs(named)


def _check_programs(user: dict) -> None:
    """The programs kubernetes_asyncio runs for a user's credentials: an exec plugin (looked up on
    PATH, the plugin's own env's PATH first) and a gcp auth-provider's cmd-path."""
    plugin = user.get("exec")
    if isinstance(plugin, dict) and isinstance(plugin.get("command"), str) and plugin["command"]:
        env = {item.get("name"): item.get("value") for item in plugin.get("env") or [] if isinstance(item, dict)}
        search = env.get("PATH") if isinstance(env.get("PATH"), str) else os.environ.get("PATH", os.defpath)
        command = shutil.which(plugin["command"], path=search)
        if command is not None:
            check_trusted_file(Path(command), "the kubeconfig's exec credential plugin")
    provider = user.get("auth-provider")
    config = provider.get("config") if isinstance(provider, dict) else None
    if isinstance(config, dict) and isinstance(config.get("cmd-path"), str) and config["cmd-path"]:
        command = shutil.which(config["cmd-path"])
        if command is not None:
            check_trusted_file(Path(command), "the kubeconfig's auth-provider cmd-path")


async def read_answer(action: str, call) -> dict:
    """The answer's JSON object (`call` made with _preload_content=False); KubeError for any status but
    2xx, no answer, or one that is no JSON object (too large, too deep, not JSON)."""
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


async def watch_events(action: str, call) -> AsyncIterator[tuple[str, dict]]:
    """(event type, object) of a watch (`call` made with watch=True, _preload_content=False), bookmarks
    included, until the server ends it. KubeError 410: the version is too old; KubeError with no status:
    an event over MAX_ANSWER_BYTES, not JSON, nested too deep, or not a watch event of a named object, or
    none for WATCH_IDLE_S."""
    try:
        response = await call
    except Exception as exc:  # noqa: BLE001 - as in read_answer
        raise _error(action, exc) from None
    try:
        if not 200 <= response.status <= 299:  # refused before the watch began: a Status, as any answer
            body = await response.content.read(MAX_ANSWER_BYTES)
            raise KubeError(action, response.status, _status_message(body))
        lines = _lines(response, action)
        while True:  # one silent, or trickling bytes that make no event, is dropped
            try:
                line = await within(anext(lines), WATCH_IDLE_S)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise KubeError(action, None, f"no event nor bookmark in {WATCH_IDLE_S:g} s: the watch is "
                                              "dropped and made again") from None
            yield _watch_event(line, action)
    except KubeError:
        raise
    except Exception as exc:  # noqa: BLE001 - as in read_answer
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
    and as the watchers read it (an object with metadata; a named one unless a bookmark)."""
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
        raise KubeError(action, None, f"a {kind} watch event's object has no metadata.name: not an object watched")
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


class NodeApi:
    """The calls, each counted by verb (the agent's status and the benchmark report them)."""

    def __init__(self, client: k8s.ApiClient, node_name: str):
        self.client = client
        self.core = k8s.CoreV1Api(client)
        self.coordination = k8s.CoordinationV1Api(client)
        self.node_name = node_name
        self.requests: collections.Counter[str] = collections.Counter()

    async def _call(self, verb: str, action: str, call) -> dict:
        """`call` (made with _preload_content=False) counted by verb, and its answer read by read_answer."""
        self.requests[verb] += 1
        return await read_answer(action, call)

    async def read_node(self) -> dict:
        return await self._call("get", f"get node {self.node_name}", self.core.read_node(self.node_name, **RAW_CALL))

    async def watch(self, resource_version: str | None) -> AsyncIterator[tuple[str, dict]]:
        """(event type, object) of the Node from resource_version on (None: from the most recent, the
        Node first as an ADDED event), bookmarks included, until the server ends the watch.
        KubeError 410: the version is too old."""
        timeout = int(random.uniform(*WATCH_TIMEOUT_S))
        self.requests["watch"] += 1
        action = f"watch node {self.node_name}"
        since = {"resource_version": resource_version} if resource_version is not None else {}
        async for event in watch_events(action, self.core.list_node(
                field_selector=f"metadata.name={self.node_name}", allow_watch_bookmarks=True, watch=True,
                timeout_seconds=timeout, _preload_content=False, _request_timeout=timeout + WATCH_GRACE_S, **since)):
            yield event

    async def patch_labels(self, labels: dict[str, str | None]) -> dict:
        """Sets (None: removes) these labels and no others: a JSON merge patch merges maps."""
        return await self._call("patch", f"patch labels of node {self.node_name}", self.core.patch_node(
            self.node_name, {"metadata": {"labels": labels}}, _content_type=MERGE_PATCH, **RAW_CALL))

    async def patch_condition(self, condition: dict) -> dict:
        """Sets one condition of the Node's status, leaving the kubelet's: in a strategic merge patch,
        NodeStatus.conditions merge by `type` (k8s.io/api core/v1 types.go: patchMergeKey=type)."""
        return await self._call("patch", f"patch condition {condition['type']} of node {self.node_name}",
                                self.core.patch_node_status(self.node_name, {"status": {"conditions": [condition]}},
                                                            _content_type=STRATEGIC_MERGE_PATCH, **RAW_CALL))

    async def replace_taints(self, taints: list[dict], resource_version: str) -> dict:
        """NodeSpec.taints is an atomic list (types.go: no patch merge key), so a change sends the whole
        list, with the resourceVersion it was computed from as a precondition: 409 if it moved on."""
        return await self._call("patch", f"patch taints of node {self.node_name}", self.core.patch_node(
            self.node_name, {"metadata": {"resourceVersion": resource_version}, "spec": {"taints": taints}},
            _content_type=MERGE_PATCH, **RAW_CALL))

    async def patch_annotations(self, annotations: dict[str, str | None]) -> dict:
        """Sets (None: removes) these annotations and no others, as patch_labels does labels."""
        return await self._call("patch", f"patch annotations of node {self.node_name}", self.core.patch_node(
            self.node_name, {"metadata": {"annotations": annotations}}, _content_type=MERGE_PATCH, **RAW_CALL))

    async def list_pods(self) -> list[dict]:
        """The pods bound to this node, in every namespace: a field selector, never the cluster's pods."""
        listed = await self._call("list", f"list pods of node {self.node_name}", self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}", **RAW_CALL))
        return listed.get("items") or []

    async def evict(self, namespace: str, name: str, grace_period_s: int | None) -> None:
        """The Eviction API (policy/v1), which keeps PodDisruptionBudgets: KubeError 429 while one forbids it
        (k8s.io/kubernetes pkg/registry/core/pod/storage/eviction.go)."""
        options = k8s.V1DeleteOptions(grace_period_seconds=grace_period_s) if grace_period_s is not None else None
        body = k8s.V1Eviction(api_version="policy/v1", kind="Eviction", delete_options=options,
                              metadata=k8s.V1ObjectMeta(name=name, namespace=namespace))
        await self._call("create", f"evict pod {namespace}/{name}", self.core.create_namespaced_pod_eviction(
            name, namespace, body, **RAW_CALL))

    async def read_lease(self, namespace: str, name: str) -> dict:
        return await self._call("get", f"get lease {namespace}/{name}", self.coordination.read_namespaced_lease(
            name, namespace, **RAW_CALL))

    async def create_lease(self, namespace: str, lease: dict) -> dict:
        return await self._call("create", f"create lease {namespace}/{lease['metadata']['name']}",
                                self.coordination.create_namespaced_lease(namespace, lease, **RAW_CALL))

    async def replace_lease(self, namespace: str, lease: dict) -> dict:
        """An update carrying the resourceVersion it read: 409 when another holder wrote it meanwhile (the
        compare-and-swap client-go's resourcelock.LeaseLock relies on)."""
        return await self._call("update", f"update lease {namespace}/{lease['metadata']['name']}",
                                self.coordination.replace_namespaced_lease(lease["metadata"]["name"], namespace, lease,
                                                                           **RAW_CALL))

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
                         self.core.create_namespaced_event("default", body, **RAW_CALL))
