"""A Kubernetes API server stand-in for gpud's Kubernetes agent tests, as strict as kube-apiserver.

No kube-apiserver runs in most test environments, so this serves the few calls the agent makes, over
HTTPS, and answers them as the real server does; what it does not model it answers 501 and records in
`unmodelled` (tests assert that stays empty). Each behaviour copies a named place of the real source
(kubernetes/kubernetes; k8s.io/apiserver and k8s.io/apimachinery are its staging/src directories,
written short below as apiserver/ and apimachinery/):

| behaviour | where the real server does it |
|---|---|
| bearer tokens; a bad token: 401 Unauthorized; no token: user system:anonymous (--anonymous-auth defaults to true) | apiserver/pkg/authentication/request/bearertoken, apiserver/pkg/endpoints/filters/authentication.go, pkg/kubeapiserver/options/authentication.go |
| verb of a request: get/list/watch/create/patch/update/delete; a `metadata.name=` field selector names the object | apiserver/pkg/endpoints/request/requestinfo.go NewRequestInfo |
| query booleans: only "0" and any case of "false" are false, anything else true | apimachinery/pkg/runtime/conversion.go Convert_Slice_string_To_bool |
| system:masters may do anything; others by RBAC rules: verbs, apiGroups, resources incl. "nodes/status" and "*/status", resourceNames | apiserver/pkg/authorization/authorizerfactory (privileged groups), pkg/apis/rbac/v1/evaluation_helpers.go, plugin/pkg/auth/authorizer/rbac/rbac.go RuleAllows |
| 403 messages | apiserver/pkg/endpoints/handlers/responsewriters/errors.go forbiddenMessage; apimachinery/pkg/api/errors/errors.go NewForbidden |
| one resourceVersion counter for everything (etcd's revision); a write that changes nothing keeps it and sends no event | apiserver/pkg/storage/etcd3/store.go GuaranteedUpdate (unchanged data is not written) |
| node field selectors: metadata.name, spec.unschedulable; others 400 "field label not supported: X" | pkg/registry/core/node/strategy.go NodeToSelectableFields; pkg/apis/core/v1/conversion.go; apiserver/pkg/endpoints/handlers/get.go ListResource |
| watch: no resourceVersion or "0": ADDED for what exists, then changes; a resourceVersion: the changes after it; an older one than the cache holds: HTTP 200, one ERROR event (410, reason Expired, "too old resource version: R (C)"), end; a newer one: wait 3 s, then ERROR 504 Timeout | apiserver/pkg/storage/cacher/cacher.go Watch (newErrWatcher: "once we have passed authn/authz/admission ... errors must fail with a watch event of type ERROR"), watch_cache.go getAllEventsSinceLocked, waitUntilFreshAndBlock (resourceVersionTooHighRetrySeconds) |
| timeoutSeconds; none: a random time in [min-request-timeout, 2x) (1800 s default) | apiserver/pkg/endpoints/handlers/get.go ListResource |
| bookmarks only when allowWatchBookmarks: each minute and 2 s before the watch's deadline; object: an empty Node with only metadata.resourceVersion | apiserver/pkg/storage/cacher/cacher.go defaultBookmarkFrequency, cache_watcher.go nextBookmarkTime |
| PATCH: json-patch, merge-patch, strategic-merge-patch; another type 415 (apply-patch+yaml is real but not modelled: 501) | apiserver/pkg/endpoints/installer.go (supportedTypes), handlers/patch.go PatchResource, handlers/negotiation/errors.go |
| strategic merge: status.conditions and status.addresses merge by `type`, metadata.ownerReferences by `uid`, finalizers and spec.podCIDRs as sets; spec.taints is atomic; `$patch: replace/delete` | k8s.io/api core/v1 types.go patchStrategy/patchMergeKey tags; apimachinery/pkg/util/strategicpatch/patch.go |
| body over 3 MiB: 413 | apiserver/pkg/server/config.go MaxRequestBodyBytes; handlers/rest.go limitedReadBody |
| metadata.resourceVersion in a patch that differs: 409 "the object has been modified"; a different metadata.uid: 422 "field is immutable" (a PATCH carries no UID precondition) | apiserver/pkg/registry/generic/registry/store.go Update (OptimisticLockErrorMsg); apiserver/pkg/registry/rest/update.go BeforeUpdate, validateCommonFields |
| the node resource keeps status, nodes/status keeps spec; both take metadata | pkg/registry/core/node/strategy.go PrepareForUpdate |
| 422 validation: label keys and values, annotations (keys, 256 KiB in all), taints (key, value, effect, unique key+effect), immutable name/uid | apimachinery/pkg/util/validation/validation.go, apimachinery/pkg/api/validation/objectmeta.go, pkg/apis/core/validation/validation.go ValidateNode, ValidateNodeUpdate, validateNodeTaints |
| times stored as RFC 3339 seconds, UTC (metav1.Time), eventTime with microseconds (metav1.MicroTime) | apimachinery/pkg/apis/meta/v1/time.go, micro_time.go MarshalJSON |
| Events: create (name or generateName, AlreadyExists 409, unknown namespace 404), list; validated as core/v1 events are | pkg/apis/core/validation/events.go ValidateEventCreate, legacyValidateEvent; apiserver/pkg/registry/rest/create.go BeforeCreate; plugin/pkg/admission/namespace/lifecycle |

Not modelled (answered 501 and recorded): other resources and paths, PUT and DELETE, server-side apply,
label selectors, list paging, dryRun, fieldValidation=Strict, the `$setElementOrder`, `$retainKeys` and
`$deleteFromPrimitiveList` directives, a non-numeric resourceVersion, watching events. Also not modelled:
managedFields, unknown fields being dropped, Quantity syntax in capacity. Where several validators of
the real server report the same cause, the real answer may repeat it; this one gives it once.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import json
import random
import re
import shutil
import ssl
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
import yaml
from aiohttp import web
from kube_http import JSON, JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeHttp

AGENT_USER = "system:serviceaccount:gpud-system:gpud-k8s-agent"
AGENT_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:gpud-system", "system:authenticated")
ADMIN_USER, ADMIN_GROUPS = "kubernetes-admin", ("system:masters", "system:authenticated")
ANONYMOUS_USER, ANONYMOUS_GROUPS = "system:anonymous", ("system:unauthenticated",)
PRIVILEGED_GROUP = "system:masters"  # pkg/controlplane/apiserver/options: authorizerfactory.NewPrivilegedGroups

BOOKMARK_PERIOD_S = 60.0  # cacher.go defaultBookmarkFrequency = time.Minute
BOOKMARK_BEFORE_DEADLINE_S = 2.0  # cache_watcher.go nextBookmarkTime: "2s before the deadline"
MIN_REQUEST_TIMEOUT_S = 1800.0  # kube-apiserver --min-request-timeout default
TOO_HIGH_RV_WAIT_S = 3.0  # watch_cache.go waitUntilFreshAndBlock: blockTimeout = 3 * time.Second
MAX_REQUEST_BODY_BYTES = 3 * 1024 * 1024  # apiserver/pkg/server/config.go NewConfig: MaxRequestBodyBytes
TOTAL_ANNOTATION_SIZE_LIMIT_B = 256 * 1024  # apimachinery/pkg/api/validation/objectmeta.go
OPTIMISTIC_LOCK_ERROR = "the object has been modified; please apply your changes to the latest version and try again"
# installer.go: the patch types a built-in resource accepts, in the order the 415 message lists them
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, "application/apply-patch+yaml")
NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")  # created at start by the real server
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")  # validation.go validateTaintEffect

# k8s.io/api core/v1 types.go: lists with a patchMergeKey merge element by element; the rest are atomic
MERGE_KEYS = {("metadata", "ownerReferences"): "uid", ("status", "conditions"): "type",
              ("status", "addresses"): "type"}
PRIMITIVE_MERGE_LISTS = {("metadata", "finalizers"), ("spec", "podCIDRs")}
UNMODELLED_DIRECTIVES = ("$setElementOrder/", "$retainKeys", "$deleteFromPrimitiveList/")

# apimachinery/pkg/util/validation/validation.go
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QUALIFIED_NAME_MSG = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                      "alphanumeric character")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                   "and must start and end with an alphanumeric character")
DNS_SUBDOMAIN_FMT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                     "and must start and end with an alphanumeric character")
RFC3339 = re.compile(r"(\d{4}-\d{2}-\d{2})[Tt](\d{2}:\d{2}:\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")

# reasons and messages of the real constructors (apimachinery/pkg/api/errors/errors.go; the 429 of
# apiserver/pkg/server/filters/priority-and-fairness.go; the 504 of filters/timeout.go)
INJECTED = {
    400: ("BadRequest", "the server rejected our request for an unknown reason"),
    401: ("Unauthorized", "Unauthorized"),
    403: ("Forbidden", "forbidden"),
    404: ("NotFound", "the server could not find the requested resource"),
    409: ("Conflict", "the server reported a conflict"),
    410: ("Expired", "the resourceVersion is too old"),
    413: ("RequestEntityTooLarge", "Request entity too large"),
    422: ("Invalid", "the server rejected our request due to an error in our request"),
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: injected by the stand-in"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "Timeout: request did not complete within requested timeout - context deadline exceeded"),
}


class ApiError(Exception):
    """An answer other than success: a metav1.Status."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, **({"details": details} if details else {}),
                       "code": code}
        self.code = code


class Unmodelled(Exception):
    """A request this stand-in does not model: answered 501 and recorded."""


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def conflict(resource: str, name: str, why: str) -> ApiError:  # errors.go NewConflict
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}',
                    {"name": name, "kind": resource})


# -- field errors, as apimachinery/pkg/util/validation/field/errors.go renders them -----------------

@dataclass(frozen=True)
class FieldError:
    kind: str  # "Invalid", "Required", "NotSupported", "Duplicate", "Forbidden", "TooLong"
    path: str
    bad_value: Any = None
    detail: str = ""

    CAUSES = {"Invalid": ("FieldValueInvalid", "Invalid value"), "Required": ("FieldValueRequired", "Required value"),
              "NotSupported": ("FieldValueNotSupported", "Unsupported value"),
              "Duplicate": ("FieldValueDuplicate", "Duplicate value"),
              "Forbidden": ("FieldValueForbidden", "Forbidden"), "TooLong": ("FieldValueTooLong", "Too long")}

    def body(self) -> str:
        """ErrorBody: Required, Forbidden and TooLong name no value; strings are quoted (%q)."""
        text = self.CAUSES[self.kind][1]
        if self.kind not in ("Required", "Forbidden", "TooLong"):
            text += ": " + (json.dumps(self.bad_value) if isinstance(self.bad_value, str) else str(self.bad_value))
        return text + (f": {self.detail}" if self.detail else "")

    def cause(self) -> dict:
        return {"reason": self.CAUSES[self.kind][0], "message": self.body(), "field": self.path}


def invalid(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    """errors.go NewInvalid: the message joins the distinct errors (ErrorList.ToAggregate)."""
    unique = list(dict.fromkeys(errors))
    texts = [f"{e.path}: {e.body()}" for e in unique]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details = {**({"name": name} if name else {}), **({"kind": kind} if kind else {}),
               "causes": [e.cause() for e in unique]}
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {joined}', details)


def regex_error(message: str, fmt: str, *examples: str) -> str:  # validation.go RegexError
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def dns_subdomain_errors(value: str) -> list[str]:  # validation.go IsDNS1123Subdomain
    errors = ["must be no more than 253 characters"] if len(value) > 253 else []
    if not re.fullmatch(DNS_SUBDOMAIN_FMT, value):
        errors.append(regex_error(DNS_SUBDOMAIN_MSG, DNS_SUBDOMAIN_FMT, "example.com"))
    return errors


def qualified_name_errors(value: str) -> list[str]:  # validation.go IsQualifiedName
    parts = value.split("/")
    if len(parts) > 2:
        return ["a qualified name " + regex_error(QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    errors = []
    if len(parts) == 2:
        prefix = parts[0]
        errors += ["prefix part must be non-empty"] if not prefix else [f"prefix part {m}" for m in dns_subdomain_errors(prefix)]
    name = parts[-1]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if not QUALIFIED_NAME.fullmatch(name):
        errors.append("name part " + regex_error(QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc"))
    return errors


def label_value_errors(value: str) -> list[str]:  # validation.go IsValidLabelValue
    errors = ["must be no more than 63 characters"] if len(value) > 63 else []
    if value and not QUALIFIED_NAME.fullmatch(value):
        errors.append(regex_error(LABEL_VALUE_MSG, f"({QUALIFIED_NAME_FMT})?", "MyValue", "my_value", "12345"))
    return errors


def validate_metadata(meta: dict, old: dict | None) -> list[FieldError]:
    """objectmeta.go ValidateObjectMetaAccessor(Update): labels, annotations, immutable name and uid."""
    errors = []
    for key, value in (meta.get("labels") or {}).items():
        errors += [FieldError("Invalid", "metadata.labels", key, m) for m in qualified_name_errors(key)]
        errors += [FieldError("Invalid", "metadata.labels", value, m) for m in label_value_errors(value)]
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errors += [FieldError("Invalid", "metadata.annotations", key, m) for m in qualified_name_errors(key.lower())]
    if sum(len(k) + len(v) for k, v in annotations.items()) > TOTAL_ANNOTATION_SIZE_LIMIT_B:
        errors.append(FieldError("TooLong", "metadata.annotations", "",
                                 f"must have at most {TOTAL_ANNOTATION_SIZE_LIMIT_B} bytes"))
    for immutable in ("name", "uid") if old else ():
        if meta.get(immutable) != old["metadata"].get(immutable):
            errors.append(FieldError("Invalid", f"metadata.{immutable}", meta.get(immutable) or "", "field is immutable"))
    return errors


def validate_taints(taints: list[dict]) -> list[FieldError]:
    """validation.go validateNodeTaints, called with the path metadata.taints (sic)."""
    errors, seen = [], set()
    for i, taint in enumerate(taints):
        at = f"metadata.taints[{i}]"
        key, value, effect = taint.get("key", ""), taint.get("value", ""), taint.get("effect", "")
        errors += [FieldError("Invalid", f"{at}.key", key, m) for m in qualified_name_errors(key)]
        if messages := label_value_errors(value):
            errors.append(FieldError("Invalid", f"{at}.value", value, ";".join(messages)))
        if not effect:
            errors.append(FieldError("Required", f"{at}.effect"))
        elif effect not in TAINT_EFFECTS:
            errors.append(FieldError("NotSupported", f"{at}.effect", effect,
                                     "supported values: " + ", ".join(json.dumps(e) for e in TAINT_EFFECTS)))
        if (key, effect) in seen:
            go_value = (f'core.Taint{{Key:"{key}", Value:"{value}", Effect:"{effect}", '
                        f'TimeAdded:(*v1.Time)(nil)}}')
            errors.append(FieldError("Duplicate", at, go_value, "taints must be unique by key and effect pair"))
        seen.add((key, effect))
    return errors


def validate_node_update(node: dict, old: dict) -> list[FieldError]:
    """strategy.go ValidateUpdate: the node resource runs ValidateNode and ValidateNodeUpdate, nodes/status
    only ValidateNodeUpdate; both check what the update may change (validation.go ValidateNodeUpdate)."""
    errors = validate_metadata(node["metadata"], old)
    if taints := node["spec"].get("taints"):
        errors += validate_taints(taints)
    changeable = {"taints", "unschedulable"} | {f for f in ("podCIDR", "podCIDRs", "providerID") if not old["spec"].get(f)}
    if {k: v for k, v in node["spec"].items() if k not in changeable} != \
            {k: v for k, v in old["spec"].items() if k not in changeable}:
        errors.append(FieldError("Forbidden", "", detail="node updates may only change labels, taints, or capacity "
                                 "(or configSource, if the DynamicKubeletConfig feature gate is enabled)"))
    return errors


# -- times, as metav1.Time and metav1.MicroTime serialize them --------------------------------------

def go_time(value: Any, micro: bool = False) -> Any:
    """RFC 3339 in UTC, whole seconds (Time) or microseconds (MicroTime); None stays null."""
    if value is None:
        return None
    match = RFC3339.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"parsing time {json.dumps(value)} as \"2006-01-02T15:04:05Z07:00\": cannot parse")
    date, clock, fraction, zone = match.groups()
    zone = "+00:00" if zone in "Zz" else zone
    moment = datetime.datetime.fromisoformat(f"{date}T{clock}{(fraction or '')[:7]}{zone}").astimezone(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def now_time(micro: bool = False) -> str:
    return go_time(datetime.datetime.now(datetime.timezone.utc).isoformat(), micro)


# -- patches ---------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 MergePatch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge(original: Any, patch: dict, path: tuple = ()) -> Any:
    """strategicpatch.StrategicMergeMapPatch for the fields of Node and Event; None: the map is deleted."""
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive is not None:
        raise bad_request(f"Unknown patch type: {directive}, Original map: {patch}")
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith(UNMODELLED_DIRECTIVES):
            raise Unmodelled(f"the strategic merge directive {key}")
        where = path + (key,)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value, where)
            result.pop(key, None) if merged is None else result.__setitem__(key, merged)
        elif isinstance(value, list) and where in MERGE_KEYS:
            result[key] = merge_list_by_key(result.get(key) or [], value, MERGE_KEYS[where], where)
        elif isinstance(value, list) and where in PRIMITIVE_MERGE_LISTS:
            result[key] = list(dict.fromkeys((result.get(key) or []) + value))
        else:
            result[key] = value
    return result


def merge_list_by_key(original: list, patch: list, merge_key: str, path: tuple) -> list:
    """strategicpatch mergeSlice: elements meet by their merge key; `$patch: replace` replaces the list,
    `$patch: delete` removes an element; new elements follow the existing ones."""
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [item for item in patch if not (isinstance(item, dict) and item.get("$patch") == "replace")]
    result = [dict(item) for item in original]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {merge_key}")
        at = next((i for i, existing in enumerate(result) if existing.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del result[at]
            continue
        merged = strategic_merge(result[at] if at is not None else {}, item, path)
        if at is None:
            result.append(merged)
        else:
            result[at] = merged
    return result


def json_pointer(path: str) -> list[str]:
    if path and not path.startswith("/"):
        raise ApiError(422, "Invalid", f"JSON pointer must be empty or start with a \"/\": {path}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def json_patch(document: Any, operations: Any) -> Any:
    """RFC 6902, as evanphx/json-patch applies it (handlers/patch.go: a failed operation is 422)."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    document = copy.deepcopy(document)

    def failed(why: str) -> ApiError:
        return ApiError(422, "Invalid", why)

    def parent_of(path: str) -> tuple[Any, str]:
        parts = json_pointer(path)
        if not parts:
            raise failed(f"doc is missing path: {path}")
        node = document
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else \
                node.get(part) if isinstance(node, dict) else None
            if node is None:
                raise failed(f"doc is missing path: \"{path}\": missing value")
        return node, parts[-1]

    def get(path: str) -> Any:
        container, key = parent_of(path)
        if isinstance(container, dict) and key in container:
            return container[key]
        if isinstance(container, list) and key.isdigit() and int(key) < len(container):
            return container[int(key)]
        raise failed(f"doc is missing key: {path}")

    def remove(path: str) -> Any:
        value = get(path)
        container, key = parent_of(path)
        del container[int(key) if isinstance(container, list) else key]
        return value

    def add(path: str, value: Any) -> None:
        container, key = parent_of(path)
        if isinstance(container, dict):
            container[key] = value
        elif isinstance(container, list) and (key == "-" or (key.isdigit() and int(key) <= len(container))):
            container.insert(len(container) if key == "-" else int(key), value)
        else:
            raise failed(f"add operation does not apply: doc is missing path: \"{path}\"")

    for operation in operations:
        op, path = operation.get("op"), operation.get("path", "")
        if op == "add":
            add(path, operation.get("value"))
        elif op == "remove":
            remove(path)
        elif op == "replace":
            get(path)
            remove(path)
            add(path, operation.get("value"))
        elif op == "move":
            add(path, remove(operation.get("from", "")))
        elif op == "copy":
            add(path, copy.deepcopy(get(operation.get("from", ""))))
        elif op == "test":
            if get(path) != operation.get("value"):
                raise failed(f"testing value {path} failed: test failed")
        else:
            raise bad_request(f"Unexpected kind: {op}")
    return document


def apply_patch(content_type: str, current: dict, body: bytes) -> dict:
    try:
        patch = json.loads(body)
    except ValueError as error:  # patch.go: an undecodable patch is a BadRequest
        raise bad_request(f"error decoding patch: {error}") from None
    if content_type == JSON_PATCH:
        return json_patch(current, patch)
    if not isinstance(patch, dict):
        raise bad_request("json: cannot unmarshal array into Go value of type map[string]interface {}")
    return merge_patch(current, patch) if content_type == MERGE_PATCH else strategic_merge(current, patch) or {}


# -- objects ---------------------------------------------------------------------------------------

def decode_node(document: Any, raw: bytes) -> dict:
    """What decoding into a v1.Node rejects (patch.go: 422 on field "patch"), and what encoding omits
    (omitempty) or normalizes (metav1.Time), so that equal nodes compare equal."""
    def refuse(why: str) -> ApiError:
        return invalid("", "", [FieldError("Invalid", "patch", raw.decode(errors="replace"), why)])

    if not isinstance(document, dict):
        raise refuse("cannot decode the patched object into a Node")
    node = copy.deepcopy(document)
    meta, spec, status = (node.setdefault(part, {}) for part in ("metadata", "spec", "status"))
    if not all(isinstance(part, dict) for part in (meta, spec, status)):
        raise refuse("metadata, spec and status must be objects")
    for mapping in ("labels", "annotations"):
        values = meta.get(mapping) or {}
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            raise refuse(f"json: cannot unmarshal into Go struct field ObjectMeta.metadata.{mapping} of type string")
    try:
        meta["creationTimestamp"] = go_time(meta.get("creationTimestamp"))
        for taint in spec.get("taints") or []:
            if not isinstance(taint, dict):
                raise ValueError("json: cannot unmarshal into Go struct field NodeSpec.spec.taints of type v1.Taint")
            if "timeAdded" in taint:
                taint["timeAdded"] = go_time(taint["timeAdded"])
        for condition in status.get("conditions") or []:
            if not isinstance(condition, dict):
                raise ValueError("json: cannot unmarshal into Go struct field NodeStatus.status.conditions")
            for moment in ("lastHeartbeatTime", "lastTransitionTime"):
                if moment in condition:
                    condition[moment] = go_time(condition[moment])
    except ValueError as error:
        raise refuse(str(error)) from None
    for part, names in ((meta, ("labels", "annotations", "finalizers", "ownerReferences")),
                        (spec, ("taints", "podCIDRs", "unschedulable")),
                        (status, ("conditions", "addresses", "capacity", "allocatable"))):
        for name in names:
            if not part.get(name) and name in part:
                del part[name]
    return node


def kubelet_node(name: str, labels: dict | None, uid: str, created: str) -> dict:
    """A Node as the kubelet registers it and its first status update leaves it."""
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    return {
        "metadata": {"name": name, "uid": uid, "creationTimestamp": created,
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", **(labels or {})}},
        "spec": {},
        "status": {
            "capacity": dict(resources), "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": created,
                            "lastTransitionTime": created, "reason": "KubeletReady",
                            "message": "kubelet is posting ready status"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.2"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "6.1.0",
                         "osImage": "Debian GNU/Linux 12 (bookworm)", "containerRuntimeVersion": "containerd://1.7.24",
                         "kubeletVersion": "v1.33.0", "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64"},
        },
    }


def typed(kind: str, obj: dict) -> dict:
    return {"kind": kind, "apiVersion": "v1", **obj}


def bookmark_object(resource_version: int) -> dict:
    """cacher.go: the bookmark carries c.newFunc() with only its resourceVersion set: a zero v1.Node as
    encoding/json writes it (structs are never omitted)."""
    info = dict.fromkeys(("machineID", "systemUUID", "bootID", "kernelVersion", "osImage", "containerRuntimeVersion",
                          "kubeletVersion", "kubeProxyVersion", "operatingSystem", "architecture"), "")
    return typed("Node", {"metadata": {"resourceVersion": str(resource_version)}, "spec": {},
                          "status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}, "nodeInfo": info}})


def validate_event(event: dict, namespace: str) -> list[FieldError]:
    """events.go legacyValidateEvent (core/v1 requests get no stricter checks), then BeforeCreate's
    ValidateObjectMeta."""
    errors = []
    involved = event.get("involvedObject") or {}
    involved_namespace = involved.get("namespace", "")
    if not event.get("eventTime"):
        wrong = namespace not in ("", "default") if not involved_namespace else namespace != involved_namespace
    else:
        wrong = not involved_namespace and namespace not in ("default", "kube-system")
        if not event.get("reportingController"):
            errors.append(FieldError("Required", "reportingController"))
        errors += [FieldError("Invalid", "reportingController", event.get("reportingController", ""), m)
                   for m in qualified_name_errors(event.get("reportingController", ""))]
        for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
            if not event.get(name):
                errors.append(FieldError("Required", name))
            if len(event.get(name) or "") > limit:
                errors.append(FieldError("Invalid", name, "", f"can have at most {limit} characters"))
        if len(event.get("message") or "") > 1024:
            errors.append(FieldError("Invalid", "message", "", "can have at most 1024 characters"))
    if wrong:
        errors.append(FieldError("Invalid", "involvedObject.namespace", involved_namespace, "does not match event.namespace"))
    meta = event["metadata"]
    if not meta.get("name"):
        errors.append(FieldError("Required", "metadata.name", detail="name or generateName is required"))
    elif meta["name"] in (".", "..") or "/" in meta["name"] or "%" in meta["name"]:
        errors.append(FieldError("Invalid", "metadata.name", meta["name"], "may not contain '/' or '%'"))
    return errors + validate_metadata(meta, None)


# -- requests --------------------------------------------------------------------------------------

@dataclass
class RequestInfo:
    """requestinfo.go: what the authorizer sees."""
    verb: str
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""

    def forbidden(self, user: str) -> ApiError:
        """responsewriters/errors.go forbiddenMessage + errors.go NewForbidden."""
        shown = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        scope = f'in the namespace "{self.namespace}"' if self.namespace else "at the cluster scope"
        what = f'{self.resource} "{self.name}"' if self.name else self.resource
        return ApiError(403, "Forbidden",
                        f'{what} is forbidden: User "{user}" cannot {self.verb} resource "{shown}" in API group "" {scope}',
                        {**({"name": self.name} if self.name else {}), "kind": self.resource})


def query_bool(query: dict, key: str) -> bool:
    """conversion.go Convert_Slice_string_To_bool."""
    return key in query and query[key] != "0" and query[key].lower() != "false"


def parse_field_selector(text: str) -> list[tuple[str, str, bool]]:
    """fields.ParseSelector, then the node field labels (conversion.go: metadata.name, spec.unschedulable)."""
    terms = []
    for term in filter(None, text.split(",")):
        match = re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", term)
        if not match:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        label, operator, value = match.groups()
        if label not in ("metadata.name", "spec.unschedulable"):
            raise bad_request(f"field label not supported: {label}")
        terms.append((label, value, operator != "!="))
    return terms


def node_fields(node: dict) -> dict[str, str]:  # strategy.go NodeToSelectableFields
    return {"metadata.name": node["metadata"]["name"],
            "spec.unschedulable": "true" if node["spec"].get("unschedulable") else "false"}


def selected(terms: list[tuple[str, str, bool]], node: dict) -> bool:
    fields = node_fields(node)
    return all((fields[label] == value) == equal for label, value, equal in terms)


def rule_allows(rule: dict, info: RequestInfo) -> bool:
    """rbac.go RuleAllows with evaluation_helpers.go VerbMatches, APIGroupMatches, ResourceMatches,
    ResourceNameMatches."""
    combined = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
    verbs, groups = rule.get("verbs") or [], rule.get("apiGroups") or []
    resources, names = rule.get("resources") or [], rule.get("resourceNames") or []
    resource_ok = any(r in ("*", combined) or (info.subresource and r == f"*/{info.subresource}") for r in resources)
    return (("*" in verbs or info.verb in verbs) and ("*" in groups or "" in groups) and resource_ok
            and (not names or info.name in names))


@dataclass
class Watch:
    queue: asyncio.Queue
    terms: list
    bookmarks: bool


END, ABORT, BOOKMARK = object(), object(), object()


@dataclass
class Faults:
    failures: list = field(default_factory=list)  # [status, count left, match]
    delay_s: float = 0.0


class KubeApiStandIn:
    """The API server at `url` (HTTPS, certificate signed by `ca_file`); `tokens` has "admin" and "agent"."""

    def __init__(self, bookmark_period_s: float = BOOKMARK_PERIOD_S, anonymous_auth: bool = True,
                 min_request_timeout_s: float = MIN_REQUEST_TIMEOUT_S):
        self.bookmark_period_s = bookmark_period_s
        self.anonymous_auth = anonymous_auth
        self.min_request_timeout_s = min_request_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="kube-stand-in-", dir="/tmp"))
        self.tokens = {"admin": uuid.uuid4().hex, "agent": uuid.uuid4().hex}
        self._users = {self.tokens["admin"]: (ADMIN_USER, ADMIN_GROUPS), self.tokens["agent"]: (AGENT_USER, AGENT_GROUPS)}
        self._lock = threading.RLock()
        self._revision = 1
        self._compacted = 0
        self._nodes: dict[str, dict] = {}
        self._events: dict[tuple[str, str], dict] = {}
        self._history: list[tuple[int, str, dict]] = []  # (resourceVersion, type, node)
        self._watches: list[Watch] = []
        self._agent_rules: list[dict] = []
        self._requests: list[dict] = []
        self._unmodelled: list[str] = []
        self._faults = Faults()
        ca = trustme.CA()
        self.ca_file = self._dir / "ca.crt"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(self._ssl)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api-stand-in", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = self._call(self._start())
        self.url = f"https://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------------

    def _call(self, coroutine, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _start(self) -> int:
        app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES * 2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        await self._site.start()
        return self._runner.addresses[0][1]

    async def _listen(self) -> None:
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._ssl)
        await self._site.start()

    async def _unlisten(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None
        for watch in list(self._watches):
            watch.queue.put_nowait(ABORT)
        for connection in self._runner.server.connections:
            if connection.transport is not None:
                connection.transport.abort()

    def __enter__(self) -> KubeApiStandIn:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._unlisten())
            self._call(self._runner.cleanup())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def down(self) -> None:
        """No listener (connection refused); open connections and watches broken."""
        self._call(self._unlisten())

    def up(self) -> None:
        self._call(self._listen())

    # -- clients -----------------------------------------------------------------------------------

    def http(self, user: str | None) -> KubeHttp:
        """A client as `user` ("admin", "agent"; None: no token at all)."""
        return KubeHttp(self.url, self.ca_file, None if user is None else self.tokens[user])

    def kubeconfig(self, user: str) -> Path:
        path = self._dir / f"kubeconfig-{user}"
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "stand-in", "cluster": {
                "server": self.url,
                "certificate-authority-data": base64.b64encode(self.ca_file.read_bytes()).decode()}}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": user, "context": {"cluster": "stand-in", "user": user}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # -- setup and records -------------------------------------------------------------------------

    def create_node(self, name: str, labels: dict | None = None) -> dict:
        with self._lock:
            assert name not in self._nodes, name
            node = decode_node(kubelet_node(name, labels, str(uuid.uuid4()), now_time()), b"")
            return copy.deepcopy(self._commit(node, "ADDED"))

    def node(self, name: str) -> dict:
        with self._lock:
            return typed("Node", copy.deepcopy(self._nodes[name]))

    def events(self, namespace: str = "default") -> list[dict]:
        with self._lock:
            return [typed("Event", copy.deepcopy(e)) for (ns, _), e in sorted(self._events.items()) if ns == namespace]

    def label(self, name: str, key: str, value: str | None) -> dict:
        """`kubectl label --overwrite`: a merge patch of metadata.labels, through the PATCH path."""
        body = json.dumps({"metadata": {"labels": {key: value}}}).encode()
        with self._lock:
            return self._patch_node(name, "", MERGE_PATCH, body)

    def bind_agent_rbac(self, rules: list[dict]) -> None:
        """ClusterRole gpud-k8s-agent with these PolicyRules, bound to the agent's ServiceAccount."""
        with self._lock:
            self._agent_rules = copy.deepcopy(rules)

    @property
    def requests(self) -> list[dict]:
        with self._lock:
            return list(self._requests)

    @property
    def unmodelled(self) -> list[str]:
        with self._lock:
            return list(self._unmodelled)

    # -- faults ------------------------------------------------------------------------------------

    def fail_next(self, status: int, count: int = 1, match: Callable[[str, str], bool] | None = None) -> None:
        with self._lock:
            self._faults.failures.append([status, count, match])

    def delay(self, seconds: float) -> None:
        self._faults.delay_s = seconds

    @property
    def revision(self) -> int:
        """The newest resourceVersion (etcd's revision), what a bookmark carries."""
        with self._lock:
            return self._revision

    def compact(self) -> None:
        """Every resourceVersion before now is gone from the watch cache."""
        with self._lock:
            self._compacted = self._revision
            self._history.clear()

    def send_bookmarks(self) -> None:
        self._broadcast(BOOKMARK)

    def end_watches(self) -> None:
        self._broadcast(END)

    def _broadcast(self, item: object) -> None:
        with self._lock:
            for watch in self._watches:
                self._loop.call_soon_threadsafe(watch.queue.put_nowait, item)

    # -- storage -----------------------------------------------------------------------------------

    def _commit(self, node: dict, kind: str) -> dict:
        """A write: the next revision, stored, in the watch history, sent to each watch."""
        self._revision += 1
        node["metadata"]["resourceVersion"] = str(self._revision)
        self._nodes[node["metadata"]["name"]] = node
        self._history.append((self._revision, kind, copy.deepcopy(node)))
        for watch in self._watches:
            self._loop.call_soon_threadsafe(watch.queue.put_nowait, (kind, copy.deepcopy(node)))
        return typed("Node", node)

    def _patch_node(self, name: str, subresource: str, content_type: str, body: bytes) -> dict:
        current = self._nodes.get(name)
        if current is None:
            raise not_found("nodes", name)
        patched = decode_node(apply_patch(content_type, copy.deepcopy(current), body), body)
        meta = patched["metadata"]
        if meta.get("name") != name:  # patch.go checkName
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        if meta.get("resourceVersion") not in (None, "", current["metadata"]["resourceVersion"]):
            raise conflict("nodes", name, OPTIMISTIC_LOCK_ERROR)
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]  # update.go BeforeUpdate
        meta.setdefault("uid", current["metadata"]["uid"])
        kept = "spec" if subresource == "status" else "status"  # strategy.go PrepareForUpdate
        patched[kept] = copy.deepcopy(current[kept])
        if errors := validate_node_update(patched, current):
            raise invalid("Node", name, errors)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        if patched == current:  # etcd3 store.go GuaranteedUpdate: unchanged, not written
            return typed("Node", copy.deepcopy(current))
        return copy.deepcopy(self._commit(patched, "MODIFIED"))

    def _create_event(self, namespace: str, body: bytes) -> dict:
        try:
            event = json.loads(body)
        except ValueError as error:
            raise bad_request(f"error decoding the event: {error}") from None
        if not isinstance(event, dict) or not isinstance(event.get("metadata", {}), dict):
            raise bad_request("the request body is not an Event")
        meta = event.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:  # rest.EnsureObjectNamespaceMatchesRequestNamespace
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if namespace not in NAMESPACES:  # admission plugin NamespaceLifecycle
            raise not_found("namespaces", namespace)
        meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):  # create.go BeforeCreate: names.SimpleNameGenerator
            meta["name"] = meta["generateName"] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        try:
            for moment in ("firstTimestamp", "lastTimestamp"):
                event[moment] = go_time(event.get(moment))
            event["eventTime"] = go_time(event.get("eventTime"), micro=True)
        except ValueError as error:
            raise invalid("Event", meta.get("name", ""), [FieldError("Invalid", "patch", "", str(error))]) from None
        if errors := validate_event(event, namespace):
            raise invalid("Event", meta.get("name", ""), errors)
        if (namespace, meta["name"]) in self._events:
            raise ApiError(409, "AlreadyExists", f'events "{meta["name"]}" already exists',
                           {"name": meta["name"], "kind": "events"})
        self._revision += 1
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(self._revision), creationTimestamp=now_time())
        for type_meta in ("kind", "apiVersion"):
            event.pop(type_meta, None)
        self._events[(namespace, meta["name"])] = event
        return typed("Event", copy.deepcopy(event))

    # -- HTTP --------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = {"user": None, "verb": None, "method": request.method, "path": request.path,
                  "query": dict(request.query), "content_type": request.headers.get("Content-Type"), "status": None}
        with self._lock:
            self._requests.append(record)
        if self._faults.delay_s:
            await asyncio.sleep(self._faults.delay_s)  # fixed time: the delay() fault is a slow server
        try:
            user, groups = self._authenticate(request)
            record["user"] = user
            info = self._request_info(request)
            record["verb"] = info.verb
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            self._injected_failure(request)
            self._authorize(user, groups, info)
            return await self._serve(request, info, record)
        except ApiError as error:
            record["status"] = error.code
            headers = {"Retry-After": "1"} if error.code == 429 else None
            return web.json_response(error.status, status=error.code, headers=headers)
        except Unmodelled as what:
            with self._lock:
                self._unmodelled.append(f"{request.method} {request.path_qs}: {what}")
            record["status"] = 501
            return web.json_response(ApiError(501, "NotImplemented", f"the stand-in does not model {what}").status,
                                     status=501)

    def _authenticate(self, request: web.Request) -> tuple[str | None, tuple]:
        header = request.headers.get("Authorization", "")
        if not header:
            return (ANONYMOUS_USER, ANONYMOUS_GROUPS) if self.anonymous_auth else (None, ())
        scheme, _, token = header.partition(" ")
        return self._users.get(token.strip(), (None, ())) if scheme.lower() == "bearer" else (None, ())

    def _request_info(self, request: web.Request) -> RequestInfo:
        parts = [p for p in request.path.split("/") if p]
        verb = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(request.method)
        if parts[:2] != ["api", "v1"] or verb is None or len(parts) < 3 or parts[2] == "watch":
            raise Unmodelled(f"{request.method} {request.path}")
        rest, namespace = parts[2:], ""
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        info = RequestInfo(verb, rest[0], rest[2] if len(rest) > 2 else "", rest[1] if len(rest) > 1 else "", namespace)
        if not info.name and verb == "get":  # requestinfo.go: a collection is listed or watched
            info.verb = "watch" if query_bool(request.query, "watch") else "list"
            match = re.fullmatch(r"metadata\.name==?([^,]*)", request.query.get("fieldSelector", ""))
            if match and match.group(1) and "/" not in match.group(1) and "%" not in match.group(1):
                info.name = match.group(1)
        return info

    def _injected_failure(self, request: web.Request) -> None:
        with self._lock:
            for failure in self._faults.failures:
                status, count, match = failure
                if count > 0 and (match is None or match(request.method, request.path)):
                    failure[1] -= 1
                    reason, message = INJECTED.get(status, ("Unknown", f"injected failure {status}"))
                    details = {"retryAfterSeconds": 1} if status in (429, 504) else None
                    raise ApiError(status, reason, message, details)

    def _authorize(self, user: str, groups: tuple, info: RequestInfo) -> None:
        if PRIVILEGED_GROUP in groups:
            return
        with self._lock:
            rules = self._agent_rules if user == AGENT_USER else []
            if not any(rule_allows(rule, info) for rule in rules):
                raise info.forbidden(user)

    async def _serve(self, request: web.Request, info: RequestInfo, record: dict) -> web.StreamResponse:
        route = (request.method, info.resource, info.namespace != "", bool(info.name), info.subresource)
        if route[:2] == ("POST", "events") and info.namespace and not info.name:
            body = await self._body(request, (JSON,))
            with self._lock:
                created = self._create_event(info.namespace, body)
            return self._answer(record, created, 201)
        if route == ("GET", "events", True, False, ""):
            if query_bool(request.query, "watch"):
                raise Unmodelled("watching events")
            with self._lock:
                items = [copy.deepcopy(e) for (ns, _), e in sorted(self._events.items()) if ns == info.namespace]
                return self._answer(record, {"kind": "EventList", "apiVersion": "v1",
                                             "metadata": {"resourceVersion": str(self._revision)}, "items": items})
        if info.resource != "nodes" or info.namespace or info.subresource not in ("", "status"):
            raise Unmodelled(f"{request.method} {request.path}")
        if request.method == "GET" and info.name and "fieldSelector" not in request.query:
            with self._lock:
                if info.name not in self._nodes:
                    raise not_found("nodes", info.name)
                return self._answer(record, typed("Node", copy.deepcopy(self._nodes[info.name])))
        if request.method == "GET" and not info.subresource:
            return await self._list_or_watch(request, record)
        if request.method == "PATCH":
            self._refuse_unmodelled_options(request.query)
            body = await self._body(request, PATCH_TYPES)
            with self._lock:
                return self._answer(record, self._patch_node(info.name, info.subresource, self._content_type(request), body))
        raise Unmodelled(f"{request.method} {request.path}")

    @staticmethod
    def _content_type(request: web.Request) -> str:
        return request.headers.get("Content-Type", "").split(";")[0].strip()

    async def _body(self, request: web.Request, accepted: tuple[str, ...]) -> bytes:
        """patch.go: the content type is checked first (415), then the body read with its limit (413)."""
        content_type = self._content_type(request)
        if content_type == "application/apply-patch+yaml":
            raise Unmodelled("server-side apply")
        if accepted != (JSON,) and content_type not in accepted:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           f"accepted media types include: {', '.join(accepted)}")
        if accepted == (JSON,) and content_type not in (JSON, ""):
            raise Unmodelled(f"a {content_type} request body")
        body = bytearray()
        while chunk := await request.content.read(MAX_REQUEST_BODY_BYTES + 1 - len(body)):
            body += chunk
            if len(body) > MAX_REQUEST_BODY_BYTES:
                raise ApiError(413, "RequestEntityTooLarge", f"Request entity too large: limit is {MAX_REQUEST_BODY_BYTES}")
        return bytes(body)

    @staticmethod
    def _refuse_unmodelled_options(query) -> None:
        if "dryRun" in query or query.get("fieldValidation", "").lower() == "strict":
            raise Unmodelled("dryRun or fieldValidation=Strict")

    @staticmethod
    def _answer(record: dict, document: dict, status: int = 200) -> web.Response:
        record["status"] = status
        return web.json_response(document, status=status)

    async def _list_or_watch(self, request: web.Request, record: dict) -> web.StreamResponse:
        query = request.query
        for unmodelled in ("labelSelector", "limit", "continue", "resourceVersionMatch", "sendInitialEvents"):
            if query.get(unmodelled):
                raise Unmodelled(f"the list option {unmodelled}")
        timeout = None
        if "timeoutSeconds" in query:
            try:
                timeout = int(query["timeoutSeconds"])
            except ValueError:
                raise bad_request(f'strconv.ParseInt: parsing "{query["timeoutSeconds"]}": invalid syntax') from None
        terms = parse_field_selector(query.get("fieldSelector", ""))
        version = query.get("resourceVersion", "")
        if version and not version.isdigit():
            raise Unmodelled("a non-numeric resourceVersion")
        if not query_bool(query, "watch"):
            with self._lock:
                items = [copy.deepcopy(n) for _, n in sorted(self._nodes.items()) if selected(terms, n)]
                return self._answer(record, {"kind": "NodeList", "apiVersion": "v1",
                                             "metadata": {"resourceVersion": str(self._revision)}, "items": items})
        if not timeout:  # get.go: no timeout asked, a random one from the server's minimum
            timeout = self.min_request_timeout_s * (random.random() + 1.0)
        return await self._watch(request, record, Watch(asyncio.Queue(), terms, query_bool(query, "allowWatchBookmarks")),
                                 int(version or 0), timeout)

    async def _watch(self, request: web.Request, record: dict, watch: Watch, version: int,
                     timeout: float) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        response.enable_chunked_encoding()
        await response.prepare(request)  # the real server flushes its 200 before any event
        record["status"] = 200
        try:
            error = await self._wait_for_revision(version)
            start = self._start_watch(watch, version) if error is None else None
            if error is not None or isinstance(start, ApiError):
                await self._send(response, {"type": "ERROR", "object": (error or start).status})
                return await self._finish(response)
            for kind, node in start:
                await self._send(response, {"type": kind, "object": typed("Node", node)})
            next_bookmark = self._next_bookmark(loop.time(), deadline, watch)
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), min(left, next_bookmark - loop.time()))
                except asyncio.TimeoutError:
                    item = BOOKMARK if loop.time() >= next_bookmark else None
                    if item is BOOKMARK:
                        next_bookmark = self._next_bookmark(loop.time(), deadline, watch)
                if item is ABORT:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if item is END:
                    break
                if item is BOOKMARK and watch.bookmarks:
                    await self._send(response, {"type": "BOOKMARK", "object": bookmark_object(self._revision)})
                elif isinstance(item, tuple) and selected(watch.terms, item[1]):
                    await self._send(response, {"type": item[0], "object": typed("Node", item[1])})
            return await self._finish(response)
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        finally:
            with self._lock:
                if watch in self._watches:
                    self._watches.remove(watch)

    async def _wait_for_revision(self, version: int) -> ApiError | None:
        """watch_cache.go waitUntilFreshAndBlock: a resourceVersion newer than the cache's is waited for
        3 s, then refused (storage.NewTooLargeResourceVersionError)."""
        deadline = asyncio.get_running_loop().time() + TOO_HIGH_RV_WAIT_S
        while self._revision < version:
            if asyncio.get_running_loop().time() > deadline:
                return ApiError(504, "Timeout", f"Too large resource version: {version}, current: {self._revision}",
                                {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                                 "retryAfterSeconds": 1})
            await asyncio.sleep(0.05)
        return None

    def _start_watch(self, watch: Watch, version: int) -> list | ApiError:
        """cacher.go Watch: the initial events, and the watch registered for what follows, atomically."""
        with self._lock:
            if version == 0:
                start = [("ADDED", copy.deepcopy(n)) for _, n in sorted(self._nodes.items()) if selected(watch.terms, n)]
            elif version < self._compacted:
                return ApiError(410, "Expired", f"too old resource version: {version} ({self._compacted})")
            else:
                start = [(kind, copy.deepcopy(n)) for rv, kind, n in self._history
                         if rv > version and selected(watch.terms, n)]
            self._watches.append(watch)
            return start

    def _next_bookmark(self, now: float, deadline: float, watch: Watch) -> float:
        """cache_watcher.go nextBookmarkTime: a period from now, or 2 s before the deadline if sooner;
        none once that is past (and none for a watch that did not ask for bookmarks)."""
        at = min(now + self.bookmark_period_s, deadline - BOOKMARK_BEFORE_DEADLINE_S)
        return at if watch.bookmarks and at > now else float("inf")

    @staticmethod
    async def _send(response: web.StreamResponse, event: dict) -> None:
        await response.write(json.dumps(event).encode() + b"\n")

    @staticmethod
    async def _finish(response: web.StreamResponse) -> web.StreamResponse:
        await response.write_eof()
        return response
