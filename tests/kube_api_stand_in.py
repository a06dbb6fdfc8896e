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
| system:masters may do anything; others by RBAC rules: verbs, apiGroups, resources incl. "nodes/status", "pods/eviction" and "*/status", resourceNames; a ClusterRoleBinding's rules everywhere, a RoleBinding's only in its namespace | apiserver/pkg/authorization/authorizerfactory (privileged groups), pkg/apis/rbac/v1/evaluation_helpers.go, plugin/pkg/auth/authorizer/rbac/rbac.go RuleAllows, VisitRulesFor |
| 403 messages | apiserver/pkg/endpoints/handlers/responsewriters/errors.go forbiddenMessage; apimachinery/pkg/api/errors/errors.go NewForbidden |
| one resourceVersion counter for everything (etcd's revision); a write that changes nothing keeps it and sends no event | apiserver/pkg/storage/etcd3/store.go GuaranteedUpdate (unchanged data is not written) |
| node field selectors: metadata.name, spec.unschedulable; others 400 "field label not supported: X" | pkg/registry/core/node/strategy.go NodeToSelectableFields; pkg/apis/core/v1/conversion.go; apiserver/pkg/endpoints/handlers/get.go ListResource |
| watch: no resourceVersion or "0": ADDED for what exists, then changes; a resourceVersion: the changes after it; an older one than the cache holds: HTTP 200, one ERROR event (410, reason Expired, "too old resource version: R (C)"), end; a newer one: wait 3 s, then ERROR 504 Timeout | apiserver/pkg/storage/cacher/cacher.go Watch (newErrWatcher: "once we have passed authn/authz/admission ... errors must fail with a watch event of type ERROR"), watch_cache.go getAllEventsSinceLocked, waitUntilFreshAndBlock (resourceVersionTooHighRetrySeconds) |
| timeoutSeconds; none: a random time in [min-request-timeout, 2x) (1800 s default) | apiserver/pkg/endpoints/handlers/get.go ListResource |
| bookmarks only when allowWatchBookmarks: each minute and 2 s before the watch's deadline, never ahead of events still queued for the watch (its revision is that of when it was queued: a watch ended next must not skip them); object: an empty Node with only metadata.resourceVersion | apiserver/pkg/storage/cacher/cacher.go defaultBookmarkFrequency, cache_watcher.go nextBookmarkTime |
| PATCH: json-patch, merge-patch, strategic-merge-patch; another type 415 (apply-patch+yaml is real but not modelled: 501) | apiserver/pkg/endpoints/installer.go (supportedTypes), handlers/patch.go PatchResource, handlers/negotiation/errors.go |
| strategic merge: status.conditions and status.addresses merge by `type`, metadata.ownerReferences by `uid`, finalizers and spec.podCIDRs as sets; spec.taints is atomic; `$patch: replace/delete` | k8s.io/api core/v1 types.go patchStrategy/patchMergeKey tags; apimachinery/pkg/util/strategicpatch/patch.go |
| body over 3 MiB: 413 | apiserver/pkg/server/config.go MaxRequestBodyBytes; handlers/rest.go limitedReadBody |
| metadata.resourceVersion in a patch that differs: 409 "the object has been modified"; a different metadata.uid: 422 "field is immutable" (a PATCH carries no UID precondition) | apiserver/pkg/registry/generic/registry/store.go Update (OptimisticLockErrorMsg); apiserver/pkg/registry/rest/update.go BeforeUpdate, validateCommonFields |
| the node resource keeps status, nodes/status keeps spec; both take metadata | pkg/registry/core/node/strategy.go PrepareForUpdate |
| 422 validation: label keys and values, annotations (keys, 256 KiB in all), taints (key, value, effect, unique key+effect), immutable name/uid | apimachinery/pkg/util/validation/validation.go, apimachinery/pkg/api/validation/objectmeta.go, pkg/apis/core/validation/validation.go ValidateNode, ValidateNodeUpdate, validateNodeTaints |
| times stored as RFC 3339 seconds, UTC (metav1.Time), eventTime with microseconds (metav1.MicroTime) | apimachinery/pkg/apis/meta/v1/time.go, micro_time.go MarshalJSON |
| Events: create (name or generateName, AlreadyExists 409, unknown namespace 404), list; validated as core/v1 events are | pkg/apis/core/validation/events.go ValidateEventCreate, legacyValidateEvent; apiserver/pkg/registry/rest/create.go BeforeCreate; plugin/pkg/admission/namespace/lifecycle |
| GET /version (and /version/, the route's own path, which kubernetes_asyncio asks): version.Info of the constructor's server_version (1.34, 1.35, 1.36), readable by every user | apimachinery/pkg/version/types.go Info; apiserver/pkg/endpoints/routes/version.go Install; plugin/pkg/auth/authorizer/rbac/bootstrappolicy system:public-info-viewer |
| /apis/resource.k8s.io/v1: group-qualified messages (`resourceslices.resource.k8s.io "x" not found`, `ResourceSlice.resource.k8s.io "x" is invalid`), RBAC apiGroups matched against the request's group; DELETE of a collection is the verb deletecollection | apimachinery/pkg/api/errors/errors.go (schema.GroupResource, GroupKind String); requestinfo.go NewRequestInfo; evaluation_helpers.go APIGroupMatches |
| ResourceSlice create: generateName + 5 characters of apimachinery's rand alphabet, uid, creationTimestamp, generation 1; AlreadyExists; feature-gated fields dropped (DRADeviceTaints, DRAPartitionableDevices, DRADeviceBindingConditions, DRAConsumableCapacity, DRAListTypeAttributes, DRANodeAllocatableResources: off in 1.34/1.35 by default, the first four on in 1.36; `feature_gates` overrides); a taint's timeAdded defaulted | pkg/registry/resource/resourceslice/strategy.go PrepareForCreate, dropDisabledFields; apiserver/pkg/storage/names SimpleNameGenerator, apimachinery/pkg/util/rand; pkg/apis/resource/v1/defaults.go SetDefaults_DeviceTaint; pkg/features versioned gates (reference/dra.md 5) |
| ResourceSlice update (PUT): name must match the URL (400), resourceVersion precondition (409, none: unconditional), generation + 1 when the spec changed, no write when nothing changed; DELETE returns the deleted object (ReturnDeletedObject), DeleteOptions preconditions (409); DELETE of the collection by field selector answers the list of what went | strategy.go PrepareForUpdate, AllowUnconditionalUpdate; resourceslice/storage/storage.go NewREST; apiserver/pkg/registry/generic/registry/store.go Update, Delete, DeleteCollection; apiserver/pkg/storage/interfaces.go Preconditions.Check |
| ResourceSlice field selectors metadata.name, spec.nodeName, spec.driver (others 400); ResourceClaim metadata.name, metadata.namespace; watches of both as of nodes, bookmarks carry an empty object of the kind | strategy.go toSelectableFields; pkg/apis/resource/v1/conversion.go (field label conversion); generic.AddObjectMetaFieldsSet |
| watch-list (sendInitialEvents=true with allowWatchBookmarks and resourceVersionMatch=NotOlderThan): ADDED for what exists, then a BOOKMARK annotated `k8s.io/initial-events-end: "true"`, then changes; client-go's reflector (NVIDIA's plugin) watches so | apiserver/pkg/storage/cacher/cacher.go, cache_watcher.go (KEP-3157) |
| list `limit`: served whole when resourceVersion=0 (the watch cache ignores it) or when everything fits | apiserver/pkg/storage/cacher/cacher.go GetList |
| ResourceSlice validation (422, paths and messages): metadata.name DNS subdomain; spec.driver required, ≤63, DNS subdomain of its lowercase (uppercase is only a warning); pool.name required, ≤253, "/"-separated DNS subdomains; pool.generation ≥0; pool.resourceSliceCount >0; driver, pool.name, nodeName immutable; exactly one of nodeName/nodeSelector (one term)/allNodes/perDeviceNodeSelection; 1.35+: not both sharedCounters and devices ("only one of `sharedCounters` or `devices` is allowed"; an empty list counts as set, as a non-nil Go slice does); devices ≤128 (1.35+: ≤64 with taints or consumesCounters), a too-long list short-circuits; device name DNS label, unique (Duplicate at spec.devices[i]); attributes+capacity ≤32; attribute and capacity names QualifiedName (C identifier ≤32, optional driver-name domain and "/"); exactly one of int/bool/string/version; string ≤64; version semver 2.0.0 ≤64; requestPolicy only with allowMultipleAllocations, and then validValues or validRange, not both; validValues: default required and among them, sorted, unique, ≤10, none above the capacity's value; validRange: default and min required, min ≤ value, min ≤ default ≤ max ≤ value, min + step ≤ value, default and max whole steps from min; counter values: any quantity (validateDeviceCounter checks none); taints: key a label name, value a label value, effect NoSchedule/NoExecute (+None from 1.35), ≤4 (1.34) / ≤16 (1.35+), unchanged taints not revalidated; 1.34: consumesCounters must name a counter set and counters of this slice's sharedCounters, ≤32 shared counters in all, ≤32 counters consumed a device, ≤1024 in the slice's devices; 1.35+: ≤8 counter sets, ≤32 counters a set, ≤2 consumesCounters a device, ≤32 counters each; set and counter names DNS labels; a consumed set absent from the pool is the scheduler's to find (1.35+), not the server's | pkg/apis/resource/validation/validation.go ValidateResourceSlice(Update), validateResourceSliceSpec, validateResourcePool, validatePoolName, validateDevice, validateDeviceAttribute, validateQualifiedName, validateCIdentifier, validateDeviceTaint, validateCounterSet, validateDeviceCounterConsumption, validateMultiAllocatableDeviceCapacity, validateRequestPolicy, validateRequestPolicyRange, validateRequestPolicyRangeStep, validateSet/validateSlice; pkg/apis/core/validation ValidateCSIDriverName; validation_resourceslice_test.go (1.34 counter cases); staging/src/k8s.io/api/resource/v1/types.go limits |
| a body that does not decode (wrong JSON types, a Quantity that does not parse): 400 "... cannot be handled as a ResourceSlice: ..." | apiserver/pkg/endpoints/handlers/create.go, update.go (transformDecodeError); apimachinery/pkg/api/resource/quantity.go ErrFormatWrong |
| request bodies: no Content-Type is JSON; JSON and protobuf accepted (protobuf decoded by client-go's scheme in ../shared/nvidia-dra-driver/tools/pbdecode, 10 s bound; without that tool, 415 as a server without the codec); others 415 listing application/json, application/yaml, application/vnd.kubernetes.protobuf; answers always JSON | apiserver/pkg/endpoints/handlers/negotiation/negotiate.go NegotiateInputSerializerForMediaType, errors.go NewUnsupportedMediaTypeError |
| ResourceClaims: GET one, list and watch (namespaced and across namespaces); written only by the test's helpers, requests defaulted (allocationMode ExactCount, count 1) | pkg/apis/resource/v1/defaults.go SetDefaults_ExactDeviceRequest; types.go ResourceClaimStatus |
| discovery (/api, /apis, /api/v1, /apis/resource.k8s.io/v1; aggregated or not, as the Accept asks): tests/kube_api_discovery.py; `resource_api=False`: a server without resource.k8s.io (not in discovery, its paths 404) | apiserver/pkg/endpoints/discovery (see that module) |
| Pods: list across namespaces and in one, written only by the test's helpers (`create_pod`, `set_pod_phase`), requests defaulted from limits; field selectors metadata.name, metadata.namespace, spec.nodeName, spec.restartPolicy, spec.schedulerName, spec.serviceAccountName, spec.hostNetwork, status.phase, status.podIP, status.nominatedNodeName (others 400) | pkg/apis/core/v1/defaults.go SetDefaults_Pod (requests from limits); pkg/registry/core/pod/strategy.go ToSelectableFields; pkg/apis/core/v1/conversion.go (the pod field labels) |
| label selectors on lists (not watches): `k=v`, `k==v`, `k!=v`, `k in (..)`, `k notin (..)`, `k`, `!k` | apimachinery/pkg/labels/selector.go Parse, Requirement.Matches |
| list `limit` of nodes and pods as of the other kinds: served whole when everything fits (no continue token) | apiserver/pkg/storage/etcd3/store.go GetList (a page of at most limit; continue only when more remain) |
| GET of one pod (404 `pods "x" not found`); pods carry labels, annotations, ownerReferences, terminationGracePeriodSeconds (default 30) and the kubelet's Ready condition (a Running pod is ready unless the helper says not) | pkg/apis/core/v1/defaults.go SetDefaults_PodSpec; pkg/kubelet/status (the Ready condition) |
| `POST .../pods/NAME/eviction` (policy/v1 or v1beta1 Eviction; RBAC pods/eviction create): body namespace differs 400, name differs 400 "name in URL does not match name in Eviction object", no pod 404; a pod Succeeded, Failed, Pending or terminating is deleted without a look at budgets (a Pending one with its resourceVersion as a precondition); budgets of its namespace whose selector matches its labels (nil: none, {}: all, an invalid one: none): two or more 500 "This pod has more than one PodDisruptionBudget, ..." (a Failure Status without reason); a pod not ready with unhealthyPodEvictionPolicy AlwaysAllow or currentHealthy >= desiredHealthy > 0: deleted, budget untouched; else status.observedGeneration < generation 429 with retryAfterSeconds 10 (Retry-After 10) and the cause "The disruption budget N is still being processed by the server."; disruptionsAllowed < 0 or disruptedPods over 2000 403 `poddisruptionbudget.policy "N" is forbidden: ...`; 0 429 "Cannot evict pod as it would violate the pod's disruption budget." with the cause {reason DisruptionBudget, "The disruption budget N needs D healthy pods and has C currently"} (1.35+: the failed-sync and condition forms first); else disruptionsAllowed - 1 (the DisruptionAllowed condition False at 0) and disruptedPods[pod] = now, written; then the pod gets the DisruptionTarget condition (EvictionByEvictionAPI) and is deleted: 201 {"kind": "Status", "status": "Success", "code": 201}; deleteOptions preconditions (uid, resourceVersion) 409 | pkg/registry/core/pod/storage/eviction.go EvictionREST.Create, canIgnorePDB, shouldEnforceResourceVersion, addConditionAndDeletePod, checkAndDecrement, createTooManyRequestsError, getPodDisruptionBudgets; apiserver handlers/create.go (201 for a Status without code), handlers/finisher/finisher.go (a Failure Status is an error), responsewriters/writers.go ErrorNegotiated (Retry-After); component-helpers apps/poddisruptionbudget UpdateDisruptionAllowedCondition |
| pod deletion: the grace period of deleteOptions, else the pod's terminationGracePeriodSeconds; 0 when not scheduled or terminal, negative 1; 0 removes it; otherwise deletionTimestamp (now + grace) and deletionGracePeriodSeconds are set and the pod stays, listed, until the kubelet's final delete (`finish_pod_termination`, or with `pod_termination_scale` after grace x scale seconds); a terminating pod's grace period may only be shortened | apiserver/pkg/registry/rest/delete.go BeforeDelete; pkg/registry/core/pod/strategy.go CheckGracefulDelete; apiserver/pkg/registry/generic/registry/store.go Delete, updateForGracefulDeletionAndFinalizers |
| PodDisruptionBudgets (policy/v1): GET one, list (namespaced and across namespaces; field selectors metadata.name, metadata.namespace); written by the helpers as `kubectl create` (generation 1, an empty status) and the disruption controller (`set_pdb_status`: observedGeneration, counts, disruptedPods pruned, the DisruptionAllowed condition; `fail_pdb_sync`: failSafe's SyncFailed) | pkg/registry/policy/poddisruptionbudget/strategy.go PrepareForCreate; pkg/controller/disruption/disruption.go updatePdbStatus, buildDisruptedPodMap, failSafe |
| Leases (coordination.k8s.io/v1): GET one, list; create (generateName, AlreadyExists 409, unknown namespace 404); PUT: name differs 400, a missing lease created (201, AllowCreateOnUpdate), no resourceVersion 422 `metadata.resourceVersion: Invalid value: 0: must be specified for an update` (AllowUnconditionalUpdate false), a stale one 409 "the object has been modified; ...", a uid that differs 409; an update changing nothing keeps the resourceVersion; DELETE: Status Success with details (name, group, kind leases, uid), preconditions 409; validated: metadata.name a DNS subdomain, leaseDurationSeconds > 0, leaseTransitions >= 0; a body that does not decode 400 (wrong types, int32 range, acquireTime/renewTime not RFC3339Micro "2006-01-02T15:04:05.000000Z07:00": exactly six fractional digits and a zone, as Python's isoformat() of a datetime without microseconds or zone is not), times written back in UTC | pkg/registry/coordination/lease/strategy.go; pkg/apis/coordination/validation/validation.go ValidateLease, ValidateLeaseSpec; apimachinery/pkg/apis/meta/v1/micro_time.go UnmarshalJSON; apiserver registry/store.go Update, finalizeDelete |
| namespaces: the four the server starts with, and those made by `create_namespace` (NamespaceLifecycle: objects in another are 404 `namespaces "x" not found`) | plugin/pkg/admission/namespace/lifecycle |

Not modelled (answered 501 and recorded): other resources and paths, watching pods, writing pods over HTTP (but for
their eviction), PUT and DELETE of nodes, watching or writing PodDisruptionBudgets over HTTP, watching Leases, a
Lease's gated strategy and preferredHolder, dryRun of an eviction, protobuf bodies of evictions and Leases, server-side
apply, label selectors on watches, PATCH of ResourceSlices, any write of ResourceClaims over HTTP (status updates included), DeviceClasses,
YAML bodies, an Accept of protobuf alone (the real server would answer in protobuf), list
paging, dryRun, fieldValidation=Strict, the `$setElementOrder`, `$retainKeys` and `$deleteFromPrimitiveList`
directives, a non-numeric resourceVersion, watching events. Also not modelled: managedFields, unknown fields
being dropped, Quantity canonical forms ("1024Mi" stays as sent; the syntax is approximated by a regex),
node capacity syntax, ValidateNodeSelector inside a slice's nodeSelector, the rules of gated fields when their
gate is on (bindingConditions, list-typed attributes, nodeAllocatableResourceMappings,
partitionTypeAttribute), DeleteOptions' propagationPolicy/gracePeriodSeconds (nothing to do for a slice or a
lease), the warning header for an uppercase driver name, the eviction's retries on conflicts (nothing runs
concurrently inside the stand-in), pods' metadata.generation (PodObservedGenerationTracking), the MODIFIED
write that precedes a pod's immediate deletion, the disruption controller computing a budget's counts from the
pods itself (the test says them), PodDisruptionBudget validation (the helpers write valid ones). Unverified details are marked so in comments (a QualifiedName
with two "/", a client-set resourceVersion on create, the 1.34 short-circuit of a too-long list, 1.34's request-policy rules taken
to be those of the later source read). Where several validators of
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
from fractions import Fraction
from pathlib import Path
from typing import Any

import trustme
import yaml
from aiohttp import web
from kube_api_discovery import AGGREGATED_CONTENT_TYPE, DISCOVERY_PATHS, aggregated, legacy, wants_aggregated
from kube_http import JSON, JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeHttp

AGENT_USER = "system:serviceaccount:gpud-system:gpud-k8s-agent"
AGENT_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:gpud-system", "system:authenticated")
DRA_USER = "system:serviceaccount:gpud-system:gpud-dra-plugin"
RBAC_USERS = {"agent": AGENT_USER, "dra": DRA_USER}
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
                       "message": message, **({"reason": reason} if reason else {}),
                       **({"details": details} if details else {}), "code": code}
        self.code = code


class Unmodelled(Exception):
    """A request this stand-in does not model: answered 501 and recorded."""


def qualified(resource: str, group: str) -> str:  # schema.GroupResource.String: "resource.group"
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, name: str, group: str = "") -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(resource, group)} "{name}" not found',
                    {"name": name, **({"group": group} if group else {}), "kind": resource})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def conflict(resource: str, name: str, why: str, group: str = "") -> ApiError:  # errors.go NewConflict
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": {why}',
                    {"name": name, **({"group": group} if group else {}), "kind": resource})


def already_exists(resource: str, name: str, group: str = "") -> ApiError:  # errors.go NewAlreadyExists
    return ApiError(409, "AlreadyExists", f'{qualified(resource, group)} "{name}" already exists',
                    {"name": name, **({"group": group} if group else {}), "kind": resource})


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
              "Forbidden": ("FieldValueForbidden", "Forbidden"), "TooLong": ("FieldValueTooLong", "Too long"),
              "TooMany": ("FieldValueTooMany", "Too many"), "TypeInvalid": ("FieldValueTypeInvalid", "Invalid value")}

    def body(self) -> str:
        """ErrorBody: Required, Forbidden and TooLong name no value; strings are quoted (%q)."""
        text = self.CAUSES[self.kind][1]
        if self.kind not in ("Required", "Forbidden", "TooLong"):
            value = self.bad_value
            text += ": " + (json.dumps(value) if isinstance(value, (str, bool)) else str(value))
        return text + (f": {self.detail}" if self.detail else "")

    def cause(self) -> dict:
        return {"reason": self.CAUSES[self.kind][0], "message": self.body(), "field": self.path}


def invalid(kind: str, name: str, errors: list[FieldError], group: str = "") -> ApiError:
    """errors.go NewInvalid: the message joins the distinct errors (ErrorList.ToAggregate); the kind is
    group-qualified (schema.GroupKind.String)."""
    unique = list(dict.fromkeys(errors))
    texts = [f"{e.path}: {e.body()}" for e in unique]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details = {**({"name": name} if name else {}), **({"group": group} if group else {}),
               **({"kind": kind} if kind else {}), "causes": [e.cause() for e in unique]}
    return ApiError(422, "Invalid", f'{qualified(kind, group)} "{name}" is invalid: {joined}', details)


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


# -- resource.k8s.io/v1: ResourceSlices and ResourceClaims -------------------------------------------

RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"
RESOURCE_API_VERSION = f"{RESOURCE_GROUP}/{RESOURCE_VERSION}"
PROTOBUF = "application/vnd.kubernetes.protobuf"
# apiserver/pkg/endpoints/handlers/negotiation: the serializers a built-in resource is served with (CBOR only
# behind the CBORServingAndStorage gate, not modelled), in the order the 415 message lists them
BODY_TYPES = (JSON, "application/yaml", PROTOBUF)
PBDECODE = Path(__file__).resolve().parents[1].parent / "shared/nvidia-dra-driver/tools/pbdecode/pbdecode"
PBDECODE_TIMEOUT_S = 10.0
SERVER_VERSIONS = {"1.34": "v1.34.0", "1.35": "v1.35.0", "1.36": "v1.36.0"}
# pkg/features/kube_features.go, versioned defaults (reference/dra.md sections 5 and 6): alpha (off) in 1.34
# and 1.35, beta (on) in 1.36. DRAListTypeAttributes and DRANodeAllocatableResources are alpha in 1.36.
DRA_GATES = ("DRADeviceTaints", "DRAPartitionableDevices", "DRADeviceBindingConditions", "DRAConsumableCapacity",
             "DRAListTypeAttributes", "DRANodeAllocatableResources")


def default_gates(version: str) -> dict[str, bool]:
    on = version == "1.36"
    return {"DRADeviceTaints": on, "DRAPartitionableDevices": on, "DRADeviceBindingConditions": on,
            "DRAConsumableCapacity": on, "DRAListTypeAttributes": False, "DRANodeAllocatableResources": False}


# staging/src/k8s.io/api/resource/v1/types.go constants
SLICE_MAX_DEVICES = 128  # ResourceSliceMaxDevices
SLICE_MAX_DEVICES_ADVANCED = 64  # ResourceSliceMaxDevicesWithTaintsOrConsumesCounters (1.35+)
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
ATTRIBUTE_MAX_VALUE_LENGTH = 64  # DeviceAttributeMaxValueLength
DEVICE_MAX_ID_LENGTH, DEVICE_MAX_DOMAIN_LENGTH = 32, 63  # DeviceMaxIDLength, DeviceMaxDomainLength
POOL_NAME_MAX_LENGTH = 253  # PoolNameMaxLength
DRIVER_NAME_MAX_LENGTH = 63  # core validation ValidateCSIDriverName
MAX_SHARED_COUNTERS_134 = 32  # ResourceSliceMaxSharedCounters (1.34: counters in all sets of a slice)
MAX_COUNTER_SETS, MAX_COUNTERS_PER_SET = 8, 32  # 1.35+: ResourceSliceMaxCounterSets, ...MaxCountersPerCounterSet
MAX_CONSUMPTIONS_PER_DEVICE = 2  # 1.35+: ResourceSliceMaxDeviceCounterConsumptionsPerDevice
MAX_COUNTERS_PER_CONSUMPTION = 32  # 1.35+: ResourceSliceMaxCountersPerDeviceCounterConsumption
MAX_COUNTERS_PER_DEVICE_134, MAX_DEVICE_COUNTERS_PER_SLICE_134 = 32, 1024  # 1.34: ResourceSliceMaxCountersPerDevice,
# ResourceSliceMaxDeviceCountersPerSlice
REQUEST_POLICY_MAX_OPTIONS = 10  # CapacityRequestPolicyDiscreteMaxOptions ("Must not contain more than 10 entries")
TAINT_EFFECTS_DRA = {"1.34": ("NoExecute", "NoSchedule")}  # validation.go validDeviceTaintEffects, sets.List (sorted)
TAINTS_MAX = {"1.34": 4}  # DeviceTaintsMaxLength; 16 from 1.35

DNS_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # apimachinery validation.go dns1123LabelFmt
DNS_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                 "start and end with an alphanumeric character")
C_IDENTIFIER_FMT = "[A-Za-z_][A-Za-z0-9_]*"  # validation.go cIdentifierFmt
C_IDENTIFIER_MSG = ("a valid C identifier must start with alphabetic character or '_', followed by a string of "
                    "alphanumeric characters or '_'")
# pkg/apis/resource/validation/validation.go semverRe
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
                    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?")
# apimachinery/pkg/api/resource/quantity.go: the expression its parse error names; the real parser is stricter
# (suffixes from a fixed list, one exponent form), approximated by QUANTITY
QUANTITY_ERROR = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)((Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE][+-]?\d+)?")
# apimachinery/pkg/util/rand/rand.go: the alphabet of names.SimpleNameGenerator (no vowels, no 0/1/3)
RAND_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def dns_label_errors(value: str) -> list[str]:  # validation.go IsDNS1123Label
    errors = ["must be no more than 63 characters"] if len(value) > 63 else []
    if not re.fullmatch(DNS_LABEL_FMT, value):
        errors.append(regex_error(DNS_LABEL_MSG, DNS_LABEL_FMT, "my-name", "123-abc"))
    return errors


def driver_name_errors(value: str, at: str) -> list[FieldError]:
    """core validation.go ValidateCSIDriverName (validation.go validateDriverName): the DNS-subdomain check is
    of the lowercased name; uppercase only earns a warning (strategy.go WarningsOnCreate)."""
    errors = [FieldError("Required", at)] if not value else []
    if len(value) > DRIVER_NAME_MAX_LENGTH:
        errors.append(FieldError("TooLong", at, value, f"must have at most {DRIVER_NAME_MAX_LENGTH} bytes"))
    return errors + [FieldError("Invalid", at, value, m) for m in dns_subdomain_errors(value.lower())]


def pool_name_errors(value: str, at: str) -> list[FieldError]:  # validation.go validatePoolName
    if not value:
        return [FieldError("Required", at)]
    errors = [FieldError("TooLong", at, "", f"must have at most {POOL_NAME_MAX_LENGTH} bytes")] \
        if len(value) > POOL_NAME_MAX_LENGTH else []
    for part in value.split("/"):
        errors += [FieldError("Invalid", at, part, m) for m in dns_subdomain_errors(part)]
    return errors


def c_identifier_errors(value: str, at: str) -> list[FieldError]:  # validation.go validateCIdentifier
    errors = [FieldError("TooLong", at, "", f"must have at most {DEVICE_MAX_ID_LENGTH} bytes")] \
        if len(value) > DEVICE_MAX_ID_LENGTH else []
    if not re.fullmatch(C_IDENTIFIER_FMT, value):
        errors.append(FieldError("TypeInvalid", at, value,
                                 regex_error(C_IDENTIFIER_MSG, C_IDENTIFIER_FMT, "my_name", "MY_NAME", "MyName")))
    return errors


def qualified_name_errors_dra(name: str, at: str) -> list[FieldError]:
    """validation.go validateQualifiedName: a C identifier, or a driver-name domain, "/" and a C identifier.
    A name with two or more "/" is checked here as domain + the rest (the source's switch has no case for
    it in the versions read; not verified which error the real server gives)."""
    if not name:
        return [FieldError("Required", at, detail="name required")]
    if "/" not in name:
        return c_identifier_errors(name, at)
    domain, _, ident = name.partition("/")
    errors = [FieldError("Required", at, detail="the domain must not be empty")] if not domain \
        else driver_name_errors(domain, at)
    return errors + ([FieldError("Required", at, detail="the name must not be empty")] if not ident
                     else c_identifier_errors(ident, at))


def node_name_errors(value: str, at: str) -> list[FieldError]:  # validation.go validateNodeName (NameIsDNSSubdomain)
    return [FieldError("Invalid", at, value, m) for m in dns_subdomain_errors(value)]


def too_many(at: str, count: int, limit: int) -> FieldError:  # field.TooMany
    return FieldError("TooMany", at, count, f"must have at most {limit} items")


def decode_error(why: str, kind: str = "ResourceSlice") -> ApiError:
    """handlers/create.go, update.go: a body that does not decode is a BadRequest (transformDecodeError)."""
    return bad_request(f'{kind} in version "{RESOURCE_VERSION}" cannot be handled as a {kind}: {why}')


def check_quantity(value: Any) -> None:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not QUANTITY.fullmatch(str(value)):
        raise decode_error(QUANTITY_ERROR)


QUANTITY_SCALES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": Fraction(1, 10**9),
                   "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1, "k": 10**3, "M": 10**6, "G": 10**9,
                   "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_value(text: Any) -> Fraction:
    """A Quantity's exact value, for Cmp (apimachinery/pkg/api/resource/quantity.go); it has decoded."""
    text = str(text)
    number = re.match(r"[+-]?(\d+(\.\d*)?|\.\d+)", text)
    assert number is not None
    suffix = text[number.end():]
    if suffix[:1] in ("e", "E") and suffix[1:].lstrip("+-").isdigit():
        return Fraction(number.group(0)) * Fraction(10) ** int(suffix[1:])
    return Fraction(number.group(0)) * QUANTITY_SCALES[suffix]


def quantity_int(text: Any) -> int:
    """Quantity.Value(): rounded up to a whole number."""
    value = quantity_value(text)
    return -((-value.numerator) // value.denominator)


def decode_slice(document: Any) -> dict:
    """What decoding into a v1.ResourceSlice refuses (400): wrong JSON types and bad Quantity strings."""
    if not isinstance(document, dict):
        raise decode_error("json: cannot unmarshal into Go value of type v1.ResourceSlice")
    for type_meta, want in (("kind", "ResourceSlice"), ("apiVersion", RESOURCE_API_VERSION)):
        if document.get(type_meta) not in (None, "", want):
            # the real message comes from the codec's GVK check; its wording is not verified here
            raise bad_request(f"the body's {type_meta} {document[type_meta]!r} is not {want!r}")
    obj = copy.deepcopy(document)
    meta, spec = obj.setdefault("metadata", {}), obj.setdefault("spec", {})
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise decode_error("json: cannot unmarshal into Go struct field ResourceSlice.metadata or spec")
    pool = spec.get("pool") or {}
    if not isinstance(pool, dict) or not all(isinstance(pool.get(k, 0), int) and not isinstance(pool.get(k, 0), bool)
                                             for k in ("generation", "resourceSliceCount")):
        raise decode_error("json: cannot unmarshal into Go struct field ResourceSliceSpec.spec.pool of type int64")
    if not isinstance(spec.get("devices") or [], list) or not isinstance(spec.get("sharedCounters") or [], list):
        raise decode_error("json: cannot unmarshal object into Go struct field ResourceSliceSpec.spec.devices")
    for device in spec.get("devices") or []:
        if not isinstance(device, dict) or not isinstance(device.get("attributes") or {}, dict) \
                or not isinstance(device.get("capacity") or {}, dict):
            raise decode_error("json: cannot unmarshal into Go struct field ResourceSliceSpec.spec.devices of type v1.Device")
        for attribute in (device.get("attributes") or {}).values():
            if not isinstance(attribute, dict):
                raise decode_error("json: cannot unmarshal into Go value of type v1.DeviceAttribute")
            for name, kind in (("int", int), ("bool", bool), ("string", str), ("version", str)):
                value = attribute.get(name)
                if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                    raise decode_error(f"json: cannot unmarshal into Go struct field DeviceAttribute.{name}")
        if not isinstance(device.get("allowMultipleAllocations", False), (bool, type(None))):
            raise decode_error("json: cannot unmarshal into Go struct field Device.spec.devices.allowMultipleAllocations "
                               "of type bool")
        for capacity in (device.get("capacity") or {}).values():
            check_quantity(capacity.get("value") if isinstance(capacity, dict) else None)
            policy = capacity.get("requestPolicy")
            if policy is None:
                continue
            value_range = policy.get("validRange") if isinstance(policy, dict) else None
            if not isinstance(policy, dict) or not isinstance(policy.get("validValues") or [], list) \
                    or not isinstance(value_range or {}, dict):
                raise decode_error("json: cannot unmarshal into Go struct field DeviceCapacity.requestPolicy of type "
                                   "v1.CapacityRequestPolicy")
            for quantity in [policy.get("default"), *(policy.get("validValues") or []),
                             *((value_range or {}).get(k) for k in ("min", "max", "step"))]:
                if quantity is not None:
                    check_quantity(quantity)
        for consumption in device.get("consumesCounters") or []:
            for counter in (consumption.get("counters") or {}).values() if isinstance(consumption, dict) else [None]:
                check_quantity(counter.get("value") if isinstance(counter, dict) else None)
        for taint in device.get("taints") or []:
            if not isinstance(taint, dict):
                raise decode_error("json: cannot unmarshal into Go value of type v1.DeviceTaint")
            if taint.get("timeAdded") is not None:
                try:
                    taint["timeAdded"] = go_time(taint["timeAdded"])
                except ValueError as error:
                    raise decode_error(str(error)) from None
    for counter_set in spec.get("sharedCounters") or []:
        for counter in (counter_set.get("counters") or {}).values() if isinstance(counter_set, dict) else [None]:
            check_quantity(counter.get("value") if isinstance(counter, dict) else None)
    return obj


def drop_disabled_fields(slice_: dict, old: dict | None, gates: dict[str, bool]) -> None:
    """resourceslice/strategy.go dropDisabledFields: a field of a disabled gate is dropped on create, and on
    update unless the stored slice already uses it."""
    spec, old_spec = slice_["spec"], (old or {}).get("spec", {})
    devices, old_devices = spec.get("devices") or [], old_spec.get("devices") or []
    if not gates["DRADeviceTaints"] and not any(d.get("taints") for d in old_devices):
        for device in devices:
            device.pop("taints", None)
    partitionable = ("consumesCounters", "nodeName", "nodeSelector", "allNodes")
    if not gates["DRAPartitionableDevices"] and not (
            old_spec.get("sharedCounters") or old_spec.get("perDeviceNodeSelection") is not None
            or any(d.get("consumesCounters") or any(d.get(f) is not None for f in partitionable[1:]) for d in old_devices)):
        spec.pop("sharedCounters", None)
        spec.pop("perDeviceNodeSelection", None)
        for device in devices:
            for name in partitionable:
                device.pop(name, None)
    binding = ("bindingConditions", "bindingFailureConditions", "bindsToNode")
    if not gates["DRADeviceBindingConditions"] and not any(d.get(f) for d in old_devices for f in binding):
        for device in devices:
            for name in binding:
                device.pop(name, None)
    if not gates["DRAConsumableCapacity"] and not any(
            d.get("allowMultipleAllocations") is not None
            or any(c.get("requestPolicy") for c in (d.get("capacity") or {}).values()) for d in old_devices):
        for device in devices:
            device.pop("allowMultipleAllocations", None)
            for capacity in (device.get("capacity") or {}).values():
                capacity.pop("requestPolicy", None)
    if not gates["DRAListTypeAttributes"]:
        for device in devices:
            for attribute in (device.get("attributes") or {}).values():
                for name in ("ints", "bools", "strings", "versions"):
                    attribute.pop(name, None)
    if not gates["DRANodeAllocatableResources"]:
        for device in devices:
            device.pop("nodeAllocatableResourceMappings", None)


def validate_slice(slice_: dict, old: dict | None, version: str) -> list[FieldError]:
    """validation.go ValidateResourceSlice / ValidateResourceSliceUpdate, validateResourceSliceSpec."""
    meta, spec = slice_["metadata"], slice_["spec"]
    errors = []
    if not meta.get("name"):
        errors.append(FieldError("Required", "metadata.name", detail="name or generateName is required"))
    else:  # objectmeta.go ValidateObjectMeta with NameIsDNSSubdomain
        errors += [FieldError("Invalid", "metadata.name", meta["name"], m) for m in dns_subdomain_errors(meta["name"])]
    errors += validate_metadata(meta, old)
    driver, pool = spec.get("driver") or "", spec.get("pool") or {}
    errors += driver_name_errors(driver, "spec.driver")
    errors += pool_name_errors(pool.get("name") or "", "spec.pool.name")
    if (pool.get("resourceSliceCount") or 0) <= 0:
        errors.append(FieldError("Invalid", "spec.pool.resourceSliceCount", pool.get("resourceSliceCount") or 0,
                                 "must be greater than zero"))
    if (pool.get("generation") or 0) < 0:
        errors.append(FieldError("Invalid", "spec.pool.generation", pool["generation"],
                                 "must be greater than or equal to zero"))
    if old is not None:  # apimachinery api/validation ValidateImmutableField
        old_spec = old["spec"]
        for at, new_value, old_value in (("spec.pool.name", pool.get("name"), old_spec["pool"].get("name")),
                                         ("spec.driver", driver, old_spec.get("driver")),
                                         ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName"))):
            if new_value != old_value:
                errors.append(FieldError("Invalid", at, "<nil>" if new_value is None else new_value, "field is immutable"))
    set_fields = []
    if spec.get("nodeName") is not None:
        if spec["nodeName"]:
            set_fields.append("`nodeName`")
            errors += node_name_errors(spec["nodeName"], "spec.nodeName")
        else:
            errors.append(FieldError("Invalid", "spec.nodeName", "", "must be either unset or set to a non-empty string"))
    if spec.get("nodeSelector") is not None:
        set_fields.append("`nodeSelector`")
        # core validation ValidateNodeSelector (requirements' keys, operators, values) is not modelled
        if len(spec["nodeSelector"].get("nodeSelectorTerms") or []) != 1:
            errors.append(FieldError("Invalid", "spec.nodeSelector.nodeSelectorTerms",
                                     json.dumps(spec["nodeSelector"].get("nodeSelectorTerms")),
                                     "must have exactly one node selector term"))
    for flag in ("allNodes", "perDeviceNodeSelection"):
        if spec.get(flag) is not None:
            if spec[flag] is True:
                set_fields.append(f"`{flag}`")
            else:
                errors.append(FieldError("Invalid", f"spec.{flag}", spec[flag], "must be either unset or set to true"))
    one_of = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
    if not set_fields:
        errors.append(FieldError("Required", "spec", detail=one_of))
    elif len(set_fields) > 1:
        errors.append(FieldError("Invalid", "spec", "{" + ", ".join(set_fields) + "}",
                                 one_of + ", but multiple fields are set"))
    devices, counter_sets = spec.get("devices"), spec.get("sharedCounters")
    if version != "1.34" and devices is not None and counter_sets is not None:
        errors.append(FieldError("Invalid", "spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    devices, counter_sets = devices or [], counter_sets or []
    limit = SLICE_MAX_DEVICES
    if version != "1.34" and any(d.get("taints") or d.get("consumesCounters") for d in devices):
        limit = SLICE_MAX_DEVICES_ADVANCED
    if len(devices) > limit:  # validateSet: the size check short-circuits the items' checks
        errors.append(too_many("spec.devices", len(devices), limit))
    else:
        old_devices = {d["name"]: d for d in (old or {}).get("spec", {}).get("devices") or []}
        per_device = spec.get("perDeviceNodeSelection") is True
        for i, device in enumerate(devices):
            errors += validate_device(device, old_devices.get(device.get("name")), f"spec.devices[{i}]", per_device,
                                      counter_sets, version)
        seen = set()
        for i, device in enumerate(devices):
            if device.get("name") in seen:
                errors.append(FieldError("Duplicate", f"spec.devices[{i}]", device.get("name")))
            seen.add(device.get("name"))
        counted = sum(len(c.get("counters") or {}) for d in devices for c in d.get("consumesCounters") or [])
        if version == "1.34" and counted > MAX_DEVICE_COUNTERS_PER_SLICE_134:  # validation_resourceslice_test.go
            errors.append(FieldError("Invalid", "spec.devices", counted, "the total number of counters in devices "
                                     f"must not exceed {MAX_DEVICE_COUNTERS_PER_SLICE_134}"))
    errors += validate_counter_sets(counter_sets, version)
    return errors


def validate_request_policy(capacity: str, policy: dict, at: str) -> list[FieldError]:
    """validation.go validateRequestPolicy, validateValidRequestValues, validateRequestPolicyValidValues,
    validateRequestPolicyRange, validateRequestPolicyRangeStep (KEP-5075; Quantity.String() of a value is
    the text sent here: canonical forms are not modelled)."""
    values, value_range, default = policy.get("validValues") or [], policy.get("validRange"), policy.get("default")
    if values and value_range is not None:
        return [FieldError("Forbidden", at, detail='exactly one policy can be specified, cannot specify "validValues" '
                           'and "validRange" at the same time')]
    maximum = quantity_value(capacity)
    if values:
        if default is None:
            return [FieldError("Required", f"{at}.default", detail="required when validValues is defined")]
        errors = [FieldError("Invalid", f"{at}.validValues[{i + 1}]", values[i + 1], "values must be sorted in "
                             "ascending order") for i in range(len(values) - 1)
                  if quantity_value(values[i]) > quantity_value(values[i + 1])]
        if len(values) > REQUEST_POLICY_MAX_OPTIONS:  # validateSet: the size check short-circuits
            return errors + [too_many(f"{at}.validValues", len(values), REQUEST_POLICY_MAX_OPTIONS),
                             FieldError("Invalid", f"{at}.validValues", default,
                                        "default value is not valid according to the requestPolicy")]
        seen = set()
        for i, option in enumerate(values):
            if quantity_value(option) > maximum:
                errors.append(FieldError("Invalid", f"{at}.validValues[{i}]", option,
                                         f"option is larger than capacity value: {capacity}"))
        for i, option in enumerate(values):  # quantityKey: Value() as a decimal string
            if quantity_int(option) in seen:
                errors.append(FieldError("Duplicate", f"{at}.validValues[{i}]", str(quantity_int(option))))
            seen.add(quantity_int(option))
        if not any(quantity_value(option) == quantity_value(default) for option in values):
            errors.append(FieldError("Invalid", f"{at}.validValues", default,
                                     "default value is not valid according to the requestPolicy"))
        return errors
    if value_range is None:
        return []
    if default is None:
        return [FieldError("Required", f"{at}.default", detail="required when validRange is defined")]
    at = f"{at}.validRange"
    low, high, step = value_range.get("min"), value_range.get("max"), value_range.get("step")
    if low is None:
        return [FieldError("Required", f"{at}.min", detail="required when validRange is defined")]
    errors = []
    if quantity_value(low) > maximum:
        errors.append(FieldError("Invalid", f"{at}.min", low, f"min is larger than capacity value: {capacity}"))
    if quantity_value(default) < quantity_value(low):
        errors.append(FieldError("Invalid", f"{at}.min", default, f"default is less than min: {low}"))
    if high is not None:
        if quantity_value(low) > quantity_value(high):
            errors.append(FieldError("Invalid", f"{at}.max", low, f"min is larger than max: {high}"))
        if quantity_value(high) > maximum:
            errors.append(FieldError("Invalid", f"{at}.max", high, f"max is larger than capacity value: {capacity}"))
        if quantity_value(default) > quantity_value(high):
            errors.append(FieldError("Invalid", f"{at}.max", default, f"default is more than max: {high}"))
    if step is not None:
        if quantity_value(low) + quantity_value(step) > maximum:
            # the real message shows min + step as Quantity.String() writes it; here as a plain number
            added = quantity_value(low) + quantity_value(step)
            errors.append(FieldError("Invalid", f"{at}.step", step, f"one step {added} is larger than capacity "
                                     f"value: {capacity}"))
        for value in [default] + ([high] if high is not None else []):
            stride = quantity_int(step)
            if stride and (quantity_int(value) - quantity_int(low)) % stride != 0:  # a zero step panics there
                errors.append(FieldError("Invalid", f"{at}.step", value,
                                         f"value is not a multiple of a given step ({step}) from ({low})"))
    return errors


def validate_counter_sets(counter_sets: list[dict], version: str) -> list[FieldError]:
    """validation.go: 1.34 validateSharedCounters (names unique, at most 32 counters in all the sets), 1.35+
    validateSet(spec.SharedCounters, ResourceSliceMaxCounterSets, validateCounterSet)."""
    errors, seen = [], set()
    if version != "1.34" and len(counter_sets) > MAX_COUNTER_SETS:
        return [too_many("spec.sharedCounters", len(counter_sets), MAX_COUNTER_SETS)]
    for i, counter_set in enumerate(counter_sets):
        at = f"spec.sharedCounters[{i}]"
        name, counters = counter_set.get("name") or "", counter_set.get("counters") or {}
        errors += [FieldError("Required", f"{at}.name")] if not name else \
            [FieldError("Invalid", f"{at}.name", name, m) for m in dns_label_errors(name)]
        if not counters:
            errors.append(FieldError("Required", f"{at}.counters"))
        elif version != "1.34" and len(counters) > MAX_COUNTERS_PER_SET:
            errors.append(too_many(f"{at}.counters", len(counters), MAX_COUNTERS_PER_SET))
        for key in counters:
            errors += [FieldError("Invalid", f"{at}.counters[{key}]", key, m) for m in dns_label_errors(key)]
    for i, counter_set in enumerate(counter_sets):
        if counter_set.get("name") in seen:
            errors.append(FieldError("Duplicate", f"spec.sharedCounters[{i}]" + (".name" if version == "1.34" else ""),
                                     counter_set.get("name")))
        seen.add(counter_set.get("name"))
    total = sum(len(c.get("counters") or {}) for c in counter_sets)
    if version == "1.34" and total > MAX_SHARED_COUNTERS_134:
        errors.append(FieldError("Invalid", "spec.sharedCounters", total,
                                 f"the total number of shared counters must not exceed {MAX_SHARED_COUNTERS_134}"))
    return errors


def validate_device(device: dict, old: dict | None, at: str, per_device: bool, counter_sets: list[dict],
                    version: str) -> list[FieldError]:
    """validation.go validateDevice."""
    name = device.get("name") or ""
    errors = [FieldError("Invalid", f"{at}.name", name, m) for m in dns_label_errors(name)]
    attributes, capacity = device.get("attributes") or {}, device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(FieldError("Invalid", at, len(attributes) + len(capacity), "the total number of attributes "
                                 f"and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}"))
    for key, attribute in attributes.items():  # validateMap(validateQualifiedName, validateDeviceAttribute)
        where = f"{at}.attributes[{key}]"
        errors += qualified_name_errors_dra(key, where)
        values = [k for k in ("bool", "int", "string", "version") if attribute.get(k) is not None]
        if isinstance(attribute.get("string"), str) and len(attribute["string"]) > ATTRIBUTE_MAX_VALUE_LENGTH:
            errors.append(FieldError("TooLong", f"{where}.string", "", f"must have at most {ATTRIBUTE_MAX_VALUE_LENGTH} bytes"))
        if isinstance(attribute.get("version"), str):
            if not SEMVER.fullmatch(attribute["version"]):
                errors.append(FieldError("Invalid", f"{where}.version", attribute["version"],
                                         "must be a string compatible with semver.org spec 2.0.0"))
            if len(attribute["version"]) > ATTRIBUTE_MAX_VALUE_LENGTH:
                errors.append(FieldError("TooLong", f"{where}.version", "",
                                         f"must have at most {ATTRIBUTE_MAX_VALUE_LENGTH} bytes"))
        if len(values) != 1:  # 1.35 source: Invalid(fldPath, "", ...) for none; the Go struct (%v) for several
            shown = "" if not values else "{" + " ".join(f"{k}:{attribute[k]}" for k in values) + "}"
            errors.append(FieldError("Invalid", where, shown, "exactly one value must be specified"))
    for key, value in capacity.items():
        where = f"{at}.capacity[{key}]"
        errors += qualified_name_errors_dra(key, where)
        if value.get("requestPolicy") is None:
            continue
        if device.get("allowMultipleAllocations") is not True:  # validateSingleAllocatableDeviceCapacity
            errors.append(FieldError("Forbidden", f"{where}.requestPolicy", detail="allowMultipleAllocations must be true"))
        else:  # validateMultiAllocatableDeviceCapacity
            errors += validate_request_policy(value.get("value", "0"), value["requestPolicy"], f"{where}.requestPolicy")
    taints = device.get("taints") or []
    taint_limit = TAINTS_MAX.get(version, 16)
    if old is None or taints != (old.get("taints") or []):  # unchanged taints are not validated again
        if len(taints) > taint_limit:  # validateSlice: the size check short-circuits (1.35 source; assumed in 1.34)
            errors.append(too_many(f"{at}.taints", len(taints), taint_limit))
        else:
            for j, taint in enumerate(taints):
                errors += validate_device_taint(taint, f"{at}.taints[{j}]", version)
    consumptions = device.get("consumesCounters") or []
    if version != "1.34" and len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
        errors.append(too_many(f"{at}.consumesCounters", len(consumptions), MAX_CONSUMPTIONS_PER_DEVICE))
        consumptions = []
    counted = sum(len(c.get("counters") or {}) for c in consumptions)
    if version == "1.34" and counted > MAX_COUNTERS_PER_DEVICE_134:  # validation_resourceslice_test.go (1.34)
        errors.append(FieldError("Invalid", at, counted, "the total number of counters must not exceed "
                                 f"{MAX_COUNTERS_PER_DEVICE_134}"))
    known = {c.get("name"): set(c.get("counters") or {}) for c in counter_sets}
    for j, consumption in enumerate(consumptions):
        where = f"{at}.consumesCounters[{j}]"
        counter_set = consumption.get("counterSet") or ""
        errors += [FieldError("Required", f"{where}.counterSet")] if not counter_set else \
            [FieldError("Invalid", f"{where}.counterSet", counter_set, m) for m in dns_label_errors(counter_set)]
        if not consumption.get("counters"):
            errors.append(FieldError("Required", f"{where}.counters"))
        elif version != "1.34" and len(consumption["counters"]) > MAX_COUNTERS_PER_CONSUMPTION:  # validateMap
            errors.append(too_many(f"{where}.counters", len(consumption["counters"]), MAX_COUNTERS_PER_CONSUMPTION))
        elif version != "1.34":
            for counter in consumption["counters"]:
                errors += [FieldError("Invalid", f"{where}.counters[{counter}]", counter, m)
                           for m in dns_label_errors(counter)]
        if version == "1.34":  # 1.34: the counter sets are in this slice (validation_resourceslice_test.go cases)
            if counter_set not in known:
                errors.append(FieldError("Invalid", f"{where}.counterSet", counter_set,
                                         "must reference a counterSet defined in the ResourceSlice sharedCounters"))
            else:
                for counter in consumption.get("counters") or {}:
                    if counter not in known[counter_set]:
                        errors.append(FieldError("Invalid", f"{where}.counters", counter,
                                                 "must reference a counter defined in the ResourceSlice sharedCounters"))
    selection = [f"`{f}`" for f in ("nodeName", "nodeSelector", "allNodes") if device.get(f) is not None]
    if per_device:
        message = ("exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
                   "`perDeviceNodeSelection` is set to true in the ResourceSlice spec")
        if device.get("nodeName") == "":
            selection.remove("`nodeName`")
            errors.append(FieldError("Invalid", f"{at}.nodeName", "", "must not be empty"))
        elif device.get("nodeName"):
            errors += node_name_errors(device["nodeName"], f"{at}.nodeName")
        if device.get("allNodes") is False:
            selection.remove("`allNodes`")
            errors.append(FieldError("Invalid", f"{at}.allNodes", False, "must be either unset or set to true"))
        if not selection:
            errors.append(FieldError("Required", at, detail=message))
        elif len(selection) > 1:
            errors.append(FieldError("Invalid", at, "{" + ", ".join(selection) + "}", message))
    elif selection:
        errors.append(FieldError("Invalid", at, "<nil>", "`nodeName`, `nodeSelector` and `allNodes` can only be set "
                                 "if `perDeviceNodeSelection` is set to true in the ResourceSlice spec"))
    return errors


def validate_device_taint(taint: dict, at: str, version: str) -> list[FieldError]:
    """validation.go validateDeviceTaint: key a label name, value a label value, effect required and known."""
    key, value, effect = taint.get("key") or "", taint.get("value") or "", taint.get("effect") or ""
    errors = [FieldError("Invalid", f"{at}.key", key, m) for m in qualified_name_errors(key)]
    errors += [FieldError("Invalid", f"{at}.value", value, m) for m in label_value_errors(value)] if value else []
    effects = TAINT_EFFECTS_DRA.get(version, ("NoExecute", "NoSchedule", "None"))
    if not effect:
        errors.append(FieldError("Required", f"{at}.effect"))
    elif effect not in effects:
        errors.append(FieldError("NotSupported", f"{at}.effect", effect,
                                 "supported values: " + ", ".join(json.dumps(e) for e in effects)))
    return errors


def encode_slice(slice_: dict) -> dict:
    """The slice as the server writes it back (encoding/json of v1.ResourceSlice): omitempty fields that are
    empty go, `devices` (no omitempty) is null when empty, as a slice read from etcd's protobuf is."""
    def prune(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: prune(v) for k, v in value.items() if v is not None and v != {} and v != []}
        if isinstance(value, list):
            return [prune(v) for v in value]
        return value

    obj = {"kind": "ResourceSlice", "apiVersion": RESOURCE_API_VERSION, "metadata": prune(slice_["metadata"])}
    spec = prune(slice_["spec"])
    spec.setdefault("driver", "")
    spec["pool"] = {"name": "", "generation": 0, "resourceSliceCount": 0, **spec.get("pool", {})}
    for device in spec.get("devices") or []:  # value-typed fields inside a device are written even when empty
        device.setdefault("name", "")
        for capacity in (device.get("capacity") or {}).values():
            capacity.setdefault("value", "0")
    spec["devices"] = spec.get("devices") or None
    obj["spec"] = spec
    return obj


def slice_fields(slice_: dict) -> dict[str, str]:  # resourceslice/strategy.go toSelectableFields
    return {"metadata.name": slice_["metadata"]["name"], "spec.nodeName": slice_["spec"].get("nodeName") or "",
            "spec.driver": slice_["spec"].get("driver") or ""}


def object_meta_fields(obj: dict) -> dict[str, str]:  # generic.AddObjectMetaFieldsSet, namespaced
    return {"metadata.name": obj["metadata"]["name"], "metadata.namespace": obj["metadata"]["namespace"]}


def empty_slice(resource_version: int) -> dict:
    """A bookmark's object: a zero v1.ResourceSlice with only its resourceVersion (cf. bookmark_object)."""
    return {"kind": "ResourceSlice", "apiVersion": RESOURCE_API_VERSION,
            "metadata": {"resourceVersion": str(resource_version)},
            "spec": {"driver": "", "pool": {"name": "", "generation": 0, "resourceSliceCount": 0}, "devices": None}}


def empty_claim(resource_version: int) -> dict:
    return {"kind": "ResourceClaim", "apiVersion": RESOURCE_API_VERSION,
            "metadata": {"resourceVersion": str(resource_version)}, "spec": {"devices": {}}, "status": {}}


@dataclass(frozen=True)
class Kind:
    """One resource the stand-in serves: its kind, API group and version, scope, field selectors, and what its
    watch bookmarks carry."""
    resource: str
    kind: str
    group: str
    namespaced: bool
    fields: Callable[[dict], dict[str, str]]
    bookmark: Callable[[int], dict]

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"

    def typed(self, obj: dict) -> dict:
        if self.resource == "resourceslices":
            return encode_slice(obj)
        return {"kind": self.kind, "apiVersion": self.api_version, **obj}


def unsupported_field(label: str) -> ApiError:
    return bad_request(f"field label not supported: {label}")


def parse_terms(text: str, labels: tuple[str, ...]) -> list[tuple[str, str, bool]]:
    """fields.ParseSelector, then the resource's field label conversion (pkg/apis/resource/v1/conversion.go
    for resourceslices: metadata.name, spec.nodeName, spec.driver)."""
    terms = []
    for term in filter(None, text.split(",")):
        match = re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", term)
        if not match:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{term}'")
        label, operator, value = match.groups()
        if label not in labels:
            raise unsupported_field(label)
        terms.append((label, value, operator != "!="))
    return terms


NODES = Kind("nodes", "Node", "", False, lambda n: node_fields(n), lambda rv: bookmark_object(rv))
SLICES = Kind("resourceslices", "ResourceSlice", RESOURCE_GROUP, False, slice_fields, empty_slice)
CLAIMS = Kind("resourceclaims", "ResourceClaim", RESOURCE_GROUP, True, object_meta_fields, empty_claim)
RESOURCE_KINDS = {kind.resource: kind for kind in (SLICES, CLAIMS)}
# pkg/apis/core/v1/conversion.go: the field labels a pod list takes (status.podIPs is not modelled)
POD_FIELD_LABELS = ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                    "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
                    "status.nominatedNodeName")


def pod_fields(pod: dict) -> dict[str, str]:
    """pkg/registry/core/pod/strategy.go ToSelectableFields (status.podIP: the first of status.podIPs)."""
    spec, status = pod["spec"], pod.get("status") or {}
    return {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
            "spec.nodeName": spec.get("nodeName", ""), "spec.restartPolicy": spec.get("restartPolicy", ""),
            "spec.schedulerName": spec.get("schedulerName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "spec.hostNetwork": "true" if spec.get("hostNetwork") else "false", "status.phase": status.get("phase", ""),
            "status.podIP": ((status.get("podIPs") or [{}])[0]).get("ip", ""),
            "status.nominatedNodeName": status.get("nominatedNodeName", "")}


PODS = Kind("pods", "Pod", "", True, pod_fields, lambda rv: typed("Pod", {"metadata": {"resourceVersion": str(rv)}}))


def matches(terms: list[tuple[str, str, bool]], kind: Kind, obj: dict) -> bool:
    fields = kind.fields(obj)
    return all((fields[label] == value) == equal for label, value, equal in terms)


# -- policy/v1: PodDisruptionBudgets and the eviction subresource; coordination.k8s.io/v1: Leases ------

POLICY_GROUP, COORDINATION_GROUP = "policy", "coordination.k8s.io"
# the API groups served, each at v1 (policy/v1beta1 is gone since 1.25)
SERVED_GROUPS = (RESOURCE_GROUP, POLICY_GROUP, COORDINATION_GROUP)
EVICTION_VERSIONS = ("policy/v1", "policy/v1beta1")  # pod/storage/eviction.go AcceptsGroupVersion
MAX_DISRUPTED_POD_SIZE = 2000  # eviction.go MaxDisruptedPodSize
EVICTION_REFUSED = "Cannot evict pod as it would violate the pod's disruption budget."  # eviction.go
TWO_BUDGETS = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
# eviction.go: the Status its Create returns; the create handler (apiserver handlers/create.go) sets the code
EVICTED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
PDB_DELETION_TIMEOUT_S = 120.0  # pkg/controller/disruption/disruption.go DeletionTimeout = 2 * time.Minute
DEFAULT_TERMINATION_GRACE_PERIOD_S = 30  # k8s.io/api core/v1 DefaultTerminationGracePeriodSeconds
RFC3339_MICRO = "2006-01-02T15:04:05.000000Z07:00"  # apimachinery meta/v1 micro_time.go RFC3339Micro
INT32_MAX = 2**31 - 1
LEASE_DELETE_OPTIONS = ("gracePeriodSeconds", "preconditions", "propagationPolicy", "orphanDependents")


def json_type(value: Any) -> str:  # encoding/json UnmarshalTypeError's name of a JSON value
    return {bool: "bool", str: "string", list: "array", dict: "object"}.get(type(value), "number")


def micro_time(value: Any, at: str, kind: str) -> str:
    """metav1.MicroTime UnmarshalJSON: time.Parse(RFC3339Micro), which wants exactly six fractional digits
    (Go's ".000000" layout element) and a zone Z or ±hh:mm; MarshalJSON writes it back in UTC. Python's
    isoformat() of a datetime without microseconds or without a zone fails here, as on the real server."""
    if not isinstance(value, str):
        raise decode_error(f"json: cannot unmarshal {json_type(value)} into Go struct field {at} of type string",
                           kind)

    def refused(element: str, layout_element: str) -> ApiError:  # time.ParseError.Error
        return decode_error(f"parsing time {json.dumps(value)} as {json.dumps(RFC3339_MICRO)}: cannot parse "
                            f"{json.dumps(element)} as {json.dumps(layout_element)}", kind)

    head = re.match(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}", value)
    if not head:  # which element Go names for a malformed date or clock is not modelled: the whole value
        raise refused(value, "2006")
    rest = value[head.end():]
    if not re.match(r"\.\d{6}", rest):
        raise refused(rest, ".000000")
    if not re.fullmatch(r"Z|[+-]\d{2}:\d{2}", rest[7:]):
        raise refused(rest[7:], "Z07:00")
    try:
        return go_time(value, micro=True)
    except ValueError:  # a field out of range (month 13): Go's message ("month out of range") not modelled
        raise refused(value, "2006") from None


def decode_lease(document: Any) -> dict:
    """What decoding into a coordination/v1 Lease refuses (400): wrong JSON types, an int32 out of range,
    MicroTimes that do not parse. The gated fields strategy and preferredHolder (CoordinatedLeaderElection)
    are not modelled."""
    if not isinstance(document, dict):
        raise decode_error(f"json: cannot unmarshal {json_type(document)} into Go value of type v1.Lease", "Lease")
    for type_meta, want in (("kind", "Lease"), ("apiVersion", f"{COORDINATION_GROUP}/v1")):
        if document.get(type_meta) not in (None, "", want):  # the codec's GVK check: wording not verified
            raise bad_request(f"the body's {type_meta} {document[type_meta]!r} is not {want!r}")
    lease = copy.deepcopy(document)
    meta, spec = lease.setdefault("metadata", {}), lease.setdefault("spec", {})
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise decode_error("json: cannot unmarshal into Go struct field Lease.metadata or spec", "Lease")
    for mapping in ("labels", "annotations"):
        values = meta.get(mapping) or {}
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            raise decode_error(f"json: cannot unmarshal into Go struct field ObjectMeta.metadata.{mapping} of type "
                               "string", "Lease")
    if spec.get("strategy") is not None or spec.get("preferredHolder") is not None:
        raise Unmodelled("a Lease's strategy or preferredHolder (CoordinatedLeaderElection)")
    holder = spec.get("holderIdentity")
    if holder is not None and not isinstance(holder, str):
        raise decode_error(f"json: cannot unmarshal {json_type(holder)} into Go struct field "
                           "LeaseSpec.spec.holderIdentity of type string", "Lease")
    for name in ("leaseDurationSeconds", "leaseTransitions"):
        number = spec.get(name)
        if number is None:
            continue
        if not isinstance(number, int) or isinstance(number, bool) or not -INT32_MAX - 1 <= number <= INT32_MAX:
            raise decode_error(f"json: cannot unmarshal {json_type(number)} into Go struct field LeaseSpec.spec.{name} "
                               "of type int32", "Lease")
    for name in ("acquireTime", "renewTime"):
        if spec.get(name) is not None:
            spec[name] = micro_time(spec[name], f"LeaseSpec.spec.{name}", "Lease")
    for name in [k for k, v in spec.items() if v is None]:  # pointer fields with omitempty
        del spec[name]
    return lease


def validate_lease(lease: dict, old: dict | None) -> list[FieldError]:
    """pkg/apis/coordination/validation/validation.go ValidateLease / ValidateLeaseUpdate, ValidateLeaseSpec
    (holderIdentity is not validated; renewTime "is a MicroTime and doesn't need further validation")."""
    meta, spec = lease["metadata"], lease["spec"]
    errors = []
    if not meta.get("name"):
        errors.append(FieldError("Required", "metadata.name", detail="name or generateName is required"))
    else:  # ValidateObjectMeta with NameIsDNSSubdomain
        errors += [FieldError("Invalid", "metadata.name", meta["name"], m) for m in dns_subdomain_errors(meta["name"])]
    errors += validate_metadata(meta, old)
    if spec.get("leaseDurationSeconds") is not None and spec["leaseDurationSeconds"] <= 0:
        errors.append(FieldError("Invalid", "spec.leaseDurationSeconds", spec["leaseDurationSeconds"],
                                 "must be greater than 0"))
    if spec.get("leaseTransitions") is not None and spec["leaseTransitions"] < 0:
        errors.append(FieldError("Invalid", "spec.leaseTransitions", spec["leaseTransitions"],
                                 "must be greater than or equal to 0"))
    return errors


def decode_eviction(document: Any) -> dict:
    """What decoding a policy/v1 (or v1beta1) Eviction refuses (400): handlers/create.go transformDecodeError
    for wrong types, and "the API version in the data ... does not match" for a version the subresource
    does not accept (scope.AcceptsGroupVersion)."""
    if not isinstance(document, dict):
        raise decode_error(f"json: cannot unmarshal {json_type(document)} into Go value of type v1.Eviction",
                           "Eviction")
    version = document.get("apiVersion") or "policy/v1"
    if document.get("kind") not in (None, "", "Eviction"):  # the codec's GVK check: wording not verified
        raise bad_request(f"the body's kind {document['kind']!r} is not 'Eviction'")
    if version not in EVICTION_VERSIONS:
        raise bad_request(f"the API version in the data ({version}) does not match the expected API version (policy/v1)")
    eviction = copy.deepcopy(document)
    meta, options = eviction.setdefault("metadata", {}), eviction.get("deleteOptions") or {}
    if not isinstance(meta, dict) or not isinstance(options, dict):
        raise decode_error("json: cannot unmarshal into Go struct field Eviction.metadata or deleteOptions",
                           "Eviction")
    grace = options.get("gracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or isinstance(grace, bool)):
        raise decode_error(f"json: cannot unmarshal {json_type(grace)} into Go struct field "
                           "DeleteOptions.deleteOptions.gracePeriodSeconds of type int64", "Eviction")
    preconditions = options.get("preconditions") or {}
    if not isinstance(preconditions, dict) or not all(isinstance(preconditions.get(k, ""), (str, type(None)))
                                                      for k in ("uid", "resourceVersion")):
        raise decode_error("json: cannot unmarshal into Go struct field DeleteOptions.deleteOptions.preconditions",
                           "Eviction")
    if options.get("dryRun") or options.get("ignoreStoreReadErrorWithClusterBreakingPotential"):
        raise Unmodelled("an eviction's dryRun or ignoreStoreReadErrorWithClusterBreakingPotential")
    eviction["deleteOptions"] = options
    return eviction


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """metav1.LabelSelectorAsSelector(pdb.Spec.Selector) then Matches: a nil selector selects nothing, an
    empty one everything; an invalid one (an operator unknown, values where none belong) matches nothing
    (eviction.go getPodDisruptionBudgets: "This object has an invalid selector, it does not match the pod")."""
    if selector is None:
        return False
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        if operator in ("In", "NotIn") and not values or operator in ("Exists", "DoesNotExist") and values:
            return False
        if operator == "In" and labels.get(key) not in values or operator == "NotIn" and labels.get(key) in values \
                or operator == "Exists" and key not in labels or operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def pod_ready(pod: dict) -> bool:  # pkg/api/v1/pod/util.go IsPodReady: the Ready condition is True
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions") or [])


def set_condition(conditions: list[dict], condition: dict, now: str) -> bool:
    """pkg/api/pod/util.go UpdatePodCondition and apimachinery meta/conditions.go SetStatusCondition: the
    condition replaces the one of its type; lastTransitionTime moves only when the status changes. Whether
    anything changed."""
    old = next((c for c in conditions if c["type"] == condition["type"]), None)
    new = {**condition, "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == condition["status"]
           else now}
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new
    return new != old


def disruption_allowed_condition(status: dict, generation: int, now: str, reason: str | None = None,
                                 message: str = "") -> None:
    """component-helpers apps/poddisruptionbudget/helpers.go UpdateDisruptionAllowedCondition (reasons
    SufficientPods, InsufficientPods), or the disruption controller's failSafe (SyncFailed with its error)."""
    allowed = status["disruptionsAllowed"] > 0 and reason is None
    condition = {"type": "DisruptionAllowed", "status": "True" if allowed else "False",
                 "observedGeneration": generation,
                 "reason": reason or ("SufficientPods" if allowed else "InsufficientPods"), "message": message}
    set_condition(status.setdefault("conditions", []), condition, now)


def disruption_denied_message(pdb: dict, version: str) -> str:
    """eviction.go checkAndDecrement, the DisruptionBudget cause of a budget with no disruption allowed.
    1.34 always says what it needs and has; later releases (kubernetes/kubernetes PR 133097, merged after
    1.34's freeze, read through a port of the 1.35 source: the first release that has it is not verified)
    say first that the budget failed to sync, and give the condition's reason where the counts allow."""
    name, status = pdb["metadata"]["name"], pdb["status"]
    needs = (f"The disruption budget {name} needs {status['desiredHealthy']} healthy pods and has "
             f"{status['currentHealthy']} currently")
    if version == "1.34":
        return needs
    condition = next((c for c in status.get("conditions") or [] if c["type"] == "DisruptionAllowed"), None)
    said = condition is not None and condition["status"] == "False" and condition.get("message")
    if said and condition["reason"] == "SyncFailed":
        return f"The disruption budget {name} does not allow evicting pods currently because it failed sync: " \
               f"{condition['message']}"
    if status["currentHealthy"] <= status["desiredHealthy"]:
        return needs
    if said:
        return f"The disruption budget {name} does not allow evicting pods currently ({condition['reason']}): " \
               f"{condition['message']}"
    return f"The disruption budget {name} does not allow evicting pods currently"


def still_processing(name: str) -> ApiError:  # eviction.go createTooManyRequestsError
    return ApiError(429, "TooManyRequests", EVICTION_REFUSED, {"causes": [{
        "reason": "DisruptionBudget", "message": f"The disruption budget {name} is still being processed by the server."}],
        "retryAfterSeconds": 10})


def with_version_precondition(options: dict, pod: dict) -> dict:  # eviction.go setPreconditionsResourceVersion
    return {**options, "preconditions": {**(options.get("preconditions") or {}),
                                         "resourceVersion": pod["metadata"]["resourceVersion"]}}


def pdb_forbidden(name: str, why: str) -> ApiError:  # errors.NewForbidden(policy.Resource("poddisruptionbudget"), ...)
    return ApiError(403, "Forbidden", f'poddisruptionbudget.policy "{name}" is forbidden: {why}',
                    {"name": name, "group": POLICY_GROUP, "kind": "poddisruptionbudget"})


def empty_namespaced(kind: str, api_version: str) -> Callable[[int], dict]:
    return lambda rv: {"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(rv)}}


PDBS = Kind("poddisruptionbudgets", "PodDisruptionBudget", POLICY_GROUP, True, object_meta_fields,
            empty_namespaced("PodDisruptionBudget", f"{POLICY_GROUP}/v1"))
LEASES = Kind("leases", "Lease", COORDINATION_GROUP, True, object_meta_fields,
              empty_namespaced("Lease", f"{COORDINATION_GROUP}/v1"))


# -- requests --------------------------------------------------------------------------------------

@dataclass
class RequestInfo:
    """requestinfo.go: what the authorizer sees."""
    verb: str
    resource: str = ""
    subresource: str = ""
    name: str = ""
    namespace: str = ""
    api_group: str = ""
    path_named: bool = False  # the path names one object (a list's metadata.name selector does not)

    def forbidden(self, user: str) -> ApiError:
        """responsewriters/errors.go forbiddenMessage + errors.go NewForbidden (group-qualified resource)."""
        shown = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        scope = f'in the namespace "{self.namespace}"' if self.namespace else "at the cluster scope"
        resource = qualified(self.resource, self.api_group)
        what = f'{resource} "{self.name}"' if self.name else resource
        return ApiError(403, "Forbidden",
                        f'{what} is forbidden: User "{user}" cannot {self.verb} resource "{shown}" in API group '
                        f'"{self.api_group}" {scope}',
                        {**({"name": self.name} if self.name else {}),
                         **({"group": self.api_group} if self.api_group else {}), "kind": self.resource})


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


LABEL_REQUIREMENT = re.compile(r"\s*(!?)\s*([A-Za-z0-9][-A-Za-z0-9_./]*)\s*(?:(==|=|!=)\s*([-A-Za-z0-9_.]*)|"
                               r"\s+(in|notin)\s*\(([^)]*)\))?\s*")


def parse_label_selector(text: str) -> list[tuple[str, str, set[str]]]:
    """apimachinery/pkg/labels/selector.go Parse: requirements joined by commas (outside parentheses):
    `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k` (exists), `!k` (does not); otherwise 400."""
    requirements = []
    for term in filter(str.strip, re.split(r",(?![^(]*\))", text)):
        match = LABEL_REQUIREMENT.fullmatch(term)
        if not match or (match.group(1) and (match.group(3) or match.group(5))):
            raise bad_request(f"unable to parse requirement: {term.strip()!r}")
        negated, key, operator, value, set_operator, values = match.groups()
        if operator:
            requirements.append((key, "notin" if operator == "!=" else "in", {value}))
        elif set_operator:
            requirements.append((key, set_operator, {v.strip() for v in values.split(",")}))
        else:
            requirements.append((key, "!" if negated else "exists", set()))
    return requirements


def labels_match(requirements: list[tuple[str, str, set[str]]], labels: dict) -> bool:
    """selector.go Requirement.Matches: `notin` and `!=` also match a missing key."""
    for key, operator, values in requirements:
        present = key in labels
        if operator == "in" and not (present and labels[key] in values) or \
                operator == "notin" and present and labels[key] in values or \
                operator == "exists" and not present or operator == "!" and present:
            return False
    return True


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
    return (("*" in verbs or info.verb in verbs) and ("*" in groups or info.api_group in groups) and resource_ok
            and (not names or info.name in names))


@dataclass
class Watch:
    queue: asyncio.Queue
    terms: list
    bookmarks: bool
    kind: Kind | None = None  # None: nodes
    namespace: str = ""


END, ABORT = object(), object()


@dataclass(frozen=True)
class BookmarkAt:
    """A bookmark queued behind the events before it, carrying the revision of that moment: one sent with the
    revision of when it leaves would overtake events still queued (and lost, were the watch to end next), as
    the cacher's never does (cache_watcher.go: bookmarks and events go through the one input channel)."""

    revision: int


@dataclass
class Faults:
    failures: list = field(default_factory=list)  # [status, count left, match]
    delay_s: float = 0.0


class KubeApiStandIn:
    """The API server at `url` (HTTPS, certificate signed by `ca_file`); `tokens` has "admin" and "agent"."""

    def __init__(self, bookmark_period_s: float = BOOKMARK_PERIOD_S, anonymous_auth: bool = True,
                 min_request_timeout_s: float = MIN_REQUEST_TIMEOUT_S, server_version: str = "1.34",
                 feature_gates: dict[str, bool] | None = None, resource_api: bool = True,
                 pod_termination_scale: float | None = None):
        if server_version not in SERVER_VERSIONS:
            raise ValueError(f"server_version {server_version!r}: one of {', '.join(SERVER_VERSIONS)}")
        unknown = set(feature_gates or {}) - set(DRA_GATES)
        if unknown:
            raise ValueError(f"feature gates not modelled: {sorted(unknown)}")
        self.server_version = server_version
        self.resource_api = resource_api
        self.feature_gates = {**default_gates(server_version), **(feature_gates or {})}
        self.bookmark_period_s = bookmark_period_s
        self.anonymous_auth = anonymous_auth
        self.min_request_timeout_s = min_request_timeout_s
        # No kubelet runs: a gracefully deleted pod stays (terminating) until finish_pod_termination, or, with
        # a scale, until its grace period times the scale has passed (the kubelet's final delete)
        self.pod_termination_scale = pod_termination_scale
        self._dir = Path(tempfile.mkdtemp(prefix="kube-stand-in-", dir="/tmp"))
        self.tokens = {"admin": uuid.uuid4().hex, "agent": uuid.uuid4().hex, "dra": uuid.uuid4().hex}
        self._users = {self.tokens["admin"]: (ADMIN_USER, ADMIN_GROUPS), self.tokens["agent"]: (AGENT_USER, AGENT_GROUPS),
                       self.tokens["dra"]: (DRA_USER, AGENT_GROUPS)}
        self._lock = threading.RLock()
        self._revision = 1
        self._compacted = 0
        self._nodes: dict[str, dict] = {}
        self._events: dict[tuple[str, str], dict] = {}
        self._slices: dict[str, dict] = {}
        self._claims: dict[tuple[str, str], dict] = {}
        self._pods: dict[tuple[str, str], dict] = {}
        self._pdbs: dict[tuple[str, str], dict] = {}
        self._leases: dict[tuple[str, str], dict] = {}
        self._namespaces = set(NAMESPACES)
        self._history: list[tuple[int, str, dict, str]] = []  # (resourceVersion, type, object, resource)
        self._watches: list[Watch] = []
        # user -> (namespace of its RoleBinding, "" for a ClusterRoleBinding; a PolicyRule)
        self._rules: dict[str, list[tuple[str, dict]]] = {AGENT_USER: [], DRA_USER: []}
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

    def set_node_resources(self, name: str, capacity: dict[str, str], allocatable: dict[str, str] | None = None) -> dict:
        """What the kubelet writes to nodes/status when device plugins register (its device manager's
        resources: capacity, and allocatable without the unhealthy devices), as a merge patch of status."""
        body = json.dumps({"status": {"capacity": capacity, "allocatable": allocatable or capacity}}).encode()
        with self._lock:
            return self._patch_node(name, "status", MERGE_PATCH, body)

    def create_namespace(self, name: str) -> None:
        """`kubectl apply -f namespace.yaml`: objects may be created in it (NamespaceLifecycle admission)."""
        with self._lock:
            self._namespaces.add(name)

    def _namespace_exists(self, namespace: str) -> None:
        if namespace not in self._namespaces:  # admission plugin NamespaceLifecycle
            raise not_found("namespaces", namespace)

    def create_pod(self, namespace: str, name: str, node: str | None, containers: list[dict],
                   init_containers: list[dict] | None = None, phase: str = "Running",
                   resource_claims: list[dict] | None = None, labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None, owner_references: list[dict] | None = None,
                   ready: bool | None = None, termination_grace_period_s: int = DEFAULT_TERMINATION_GRACE_PERIOD_S
                   ) -> dict:
        """A Pod as the scheduler (spec.nodeName) and the kubelet (status.phase, the Ready condition: by
        default a Running pod is ready) leave it. A container is {"name", "requests", "limits",
        "restartPolicy"}; SetDefaults_Pod copies a limit with no request into the requests and
        SetDefaults_PodSpec sets terminationGracePeriodSeconds 30 (pkg/apis/core/v1/defaults.go), as the real
        server does on create."""
        def container(spec: dict) -> dict:
            resources = {key: dict(spec[key]) for key in ("requests", "limits") if spec.get(key)}
            for resource, value in resources.get("limits", {}).items():
                resources.setdefault("requests", {}).setdefault(resource, value)
            return {"name": spec["name"], "image": "registry.example/cuda:12", "resources": resources,
                    **({"restartPolicy": spec["restartPolicy"]} if spec.get("restartPolicy") else {})}

        with self._lock:
            assert namespace in self._namespaces and (namespace, name) not in self._pods, (namespace, name)
            spec = {"containers": [container(c) for c in containers], "restartPolicy": "Always",
                    "schedulerName": "default-scheduler", "serviceAccountName": "default",
                    "terminationGracePeriodSeconds": termination_grace_period_s}
            if init_containers:
                spec["initContainers"] = [container(c) for c in init_containers]
            if resource_claims:
                spec["resourceClaims"] = copy.deepcopy(resource_claims)
            if node is not None:
                spec["nodeName"] = node
            created = now_time()
            meta = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()), "creationTimestamp": created}
            for key, value in (("labels", labels), ("annotations", annotations), ("ownerReferences", owner_references)):
                if value:
                    meta[key] = copy.deepcopy(value)
            is_ready = phase == "Running" if ready is None else ready
            status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if is_ready else "False",
                                                      "lastProbeTime": None, "lastTransitionTime": created}]}
            return copy.deepcopy(self._commit({"metadata": meta, "spec": spec, "status": status}, "ADDED", PODS))

    def pod(self, namespace: str, name: str) -> dict | None:
        """The pod as stored (None once it is gone)."""
        with self._lock:
            pod = self._pods.get((namespace, name))
            return None if pod is None else PODS.typed(copy.deepcopy(pod))

    def finish_pod_termination(self, namespace: str, name: str) -> None:
        """What the kubelet does once a terminating pod's containers have stopped: its final DELETE with a
        grace period of 0 (pkg/kubelet/status/status_manager.go), which removes it for good."""
        with self._lock:
            pod = self._pods[(namespace, name)]
            assert pod["metadata"].get("deletionTimestamp"), f"{namespace}/{name} is not terminating"
            self._commit(copy.deepcopy(pod), "DELETED", PODS)

    def create_pdb(self, namespace: str, name: str, match_labels: dict[str, str] | None,
                   disruptions_allowed: int | None = None, *, match_expressions: list[dict] | None = None,
                   min_available: int | str | None = 1, max_unavailable: int | str | None = None,
                   unhealthy_pod_eviction_policy: str | None = None, desired_healthy: int = 1,
                   current_healthy: int | None = None, expected_pods: int | None = None) -> dict:
        """A policy/v1 PodDisruptionBudget as `kubectl create` leaves it: generation 1, an empty status
        (pkg/registry/policy/poddisruptionbudget/strategy.go PrepareForCreate), so that evictions it covers
        are refused 429 until the disruption controller has seen it; with `disruptions_allowed`, the
        controller's first status too (set_pdb_status). match_labels None and no match_expressions: no
        selector (it selects nothing); {}: an empty selector (every pod of the namespace)."""
        with self._lock:
            assert namespace in self._namespaces and (namespace, name) not in self._pdbs, (namespace, name)
            spec: dict[str, Any] = {}
            if max_unavailable is not None:
                spec["maxUnavailable"] = max_unavailable
            elif min_available is not None:
                spec["minAvailable"] = min_available
            if match_labels is not None or match_expressions:
                spec["selector"] = {**({"matchLabels": dict(match_labels)} if match_labels else {}),
                                    **({"matchExpressions": copy.deepcopy(match_expressions)} if match_expressions else {})}
            if unhealthy_pod_eviction_policy is not None:
                spec["unhealthyPodEvictionPolicy"] = unhealthy_pod_eviction_policy
            pdb = {"metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                                "creationTimestamp": now_time(), "generation": 1}, "spec": spec,
                   "status": {"disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0}}
            created = copy.deepcopy(self._commit(pdb, "ADDED", PDBS))
        if disruptions_allowed is None:
            return created
        return self.set_pdb_status(namespace, name, disruptions_allowed, desired_healthy, current_healthy, expected_pods)

    def set_pdb_status(self, namespace: str, name: str, disruptions_allowed: int, desired_healthy: int = 1,
                       current_healthy: int | None = None, expected_pods: int | None = None) -> dict:
        """What the disruption controller writes (pkg/controller/disruption/disruption.go updatePdbStatus):
        observedGeneration, the counts (by default currentHealthy = desiredHealthy + disruptionsAllowed, as
        its trySync computes them, and expectedPods = currentHealthy), disruptedPods without the pods that
        are gone, terminating or past DeletionTimeout (buildDisruptedPodMap), and the DisruptionAllowed
        condition."""
        with self._lock:
            pdb = copy.deepcopy(self._pdbs[(namespace, name)])
            now = datetime.datetime.now(datetime.timezone.utc)
            current = desired_healthy + max(disruptions_allowed, 0) if current_healthy is None else current_healthy
            disrupted = {pod: at for pod, at in (pdb["status"].get("disruptedPods") or {}).items()
                         if (pod_now := self._pods.get((namespace, pod))) is not None
                         and not pod_now["metadata"].get("deletionTimestamp")
                         and (now - datetime.datetime.fromisoformat(at.replace("Z", "+00:00"))).total_seconds()
                         < PDB_DELETION_TIMEOUT_S}
            status = pdb["status"]
            status.update(observedGeneration=pdb["metadata"]["generation"], disruptionsAllowed=disruptions_allowed,
                          currentHealthy=current, desiredHealthy=desired_healthy,
                          expectedPods=current if expected_pods is None else expected_pods)
            status.pop("disruptedPods", None)
            if disrupted:
                status["disruptedPods"] = disrupted
            disruption_allowed_condition(status, status["observedGeneration"], now_time())
            return copy.deepcopy(self._commit(pdb, "MODIFIED", PDBS))

    def fail_pdb_sync(self, namespace: str, name: str, error: str) -> dict:
        """The disruption controller's failSafe (disruption.go) when it cannot compute a budget's status:
        disruptionsAllowed 0 and the DisruptionAllowed condition False, reason SyncFailed, message the
        error; the counts and observedGeneration stay as they were."""
        with self._lock:
            pdb = copy.deepcopy(self._pdbs[(namespace, name)])
            status = pdb["status"]
            status["disruptionsAllowed"] = 0
            disruption_allowed_condition(status, status.get("observedGeneration", 0), now_time(), "SyncFailed", error)
            return copy.deepcopy(self._commit(pdb, "MODIFIED", PDBS))

    def pdb(self, namespace: str, name: str) -> dict:
        with self._lock:
            return PDBS.typed(copy.deepcopy(self._pdbs[(namespace, name)]))

    def lease(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            lease = self._leases.get((namespace, name))
            return None if lease is None else LEASES.typed(copy.deepcopy(lease))

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> dict:
        with self._lock:
            pod = copy.deepcopy(self._pods[(namespace, name)])
            pod["status"]["phase"] = phase
            return copy.deepcopy(self._commit(pod, "MODIFIED", PODS))

    def bind_agent_rbac(self, rules: list[dict], namespaced: dict[str, list[dict]] | None = None) -> None:
        """ClusterRole gpud-k8s-agent with these PolicyRules, bound to the agent's ServiceAccount, and for
        each namespace of `namespaced` a Role there with its rules, bound by a RoleBinding there
        (deploy/kubernetes/rbac.yaml: tests/kube_manifests.py agent_rbac_rules() and agent_role_rules())."""
        self.bind_rbac("agent", rules, namespaced)

    def bind_rbac(self, who: str, rules: list[dict], namespaced: dict[str, list[dict]] | None = None) -> None:
        """A ClusterRole with these PolicyRules bound to `who`'s ServiceAccount ("agent" or "dra"), and the
        Roles of `namespaced` (namespace -> rules) bound in their namespaces, replacing what it was bound to
        before."""
        with self._lock:
            self._rules[RBAC_USERS[who]] = [("", copy.deepcopy(rule)) for rule in rules] + [
                (namespace, copy.deepcopy(rule)) for namespace, role in (namespaced or {}).items() for rule in role]

    @property
    def version(self) -> dict:
        """What GET /version answers (apimachinery/pkg/version/types.go Info)."""
        major, minor = self.server_version.split(".")
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
                "gitVersion": SERVER_VERSIONS[self.server_version], "gitCommit": "0" * 40, "gitTreeState": "clean",
                "buildDate": "2025-08-27T00:00:00Z", "goVersion": "go1.24.6", "compiler": "gc",
                "platform": "linux/amd64"}

    # -- resource.k8s.io ---------------------------------------------------------------------------

    def resource_slices(self, node: str | None = None, driver: str | None = None) -> list[dict]:
        """The ResourceSlices stored, as the server writes them, of one node and/or driver."""
        with self._lock:
            return [encode_slice(copy.deepcopy(s)) for _, s in sorted(self._slices.items())
                    if (node is None or s["spec"].get("nodeName") == node)
                    and (driver is None or s["spec"].get("driver") == driver)]

    def wipe_resource_slices(self, node: str, driver: str | None = None) -> list[dict]:
        """What the kubelet does when a node's plugin goes (or at its start): DELETE of the collection with a
        fieldSelector of the node (and driver), as the admin user, through the HTTP path."""
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver else "")
        status, answer = self.http("admin").request("DELETE", "/apis/resource.k8s.io/v1/resourceslices",
                                                    query={"fieldSelector": selector})
        assert status == 200, (status, answer)
        return answer["items"]

    def create_resource_claim(self, namespace: str, name: str, requests: list[dict], results: list[dict] | None,
                              config: list[dict] | None = None, reserved_for: list[dict] | None = None,
                              node: str | None = None) -> dict:
        """A ResourceClaim as the scheduler leaves it once allocated (status.allocation.devices.results and
        config, nodeSelector of `node`), or unallocated (results None). A request without `exactly` or
        `firstAvailable` is taken as the `exactly` one (allocationMode ExactCount and count 1 defaulted:
        pkg/apis/resource/v1/defaults.go)."""
        with self._lock:
            assert (namespace, name) not in self._claims, (namespace, name)
            claim = {"metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                                  "creationTimestamp": now_time()},
                     "spec": {"devices": {"requests": [self._claim_request(r) for r in requests]}}, "status": {}}
            self._allocate(claim, results, config, reserved_for, node)
            return copy.deepcopy(self._commit(claim, "ADDED", CLAIMS))

    def set_claim_allocation(self, namespace: str, name: str, results: list[dict] | None,
                             config: list[dict] | None = None, reserved_for: list[dict] | None = None,
                             node: str | None = None) -> dict:
        """The claim's status replaced: allocated with these results, or deallocated (results None)."""
        with self._lock:
            claim = copy.deepcopy(self._claims[(namespace, name)])
            claim["status"] = {}
            self._allocate(claim, results, config, reserved_for, node)
            return copy.deepcopy(self._commit(claim, "MODIFIED", CLAIMS))

    def delete_resource_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            self._commit(copy.deepcopy(self._claims[(namespace, name)]), "DELETED", CLAIMS)

    def resource_claim(self, namespace: str, name: str) -> dict:
        with self._lock:
            return CLAIMS.typed(copy.deepcopy(self._claims[(namespace, name)]))

    @staticmethod
    def _claim_request(request: dict) -> dict:
        request = copy.deepcopy(request)
        if "exactly" not in request and "firstAvailable" not in request:
            request = {"name": request.pop("name"), "exactly": request}
        for exact in [request.get("exactly")] + list(request.get("firstAvailable") or []):
            if exact is not None:
                exact.setdefault("allocationMode", "ExactCount")
                if exact["allocationMode"] == "ExactCount":
                    exact.setdefault("count", 1)
        return request

    @staticmethod
    def _allocate(claim: dict, results: list[dict] | None, config: list[dict] | None,
                  reserved_for: list[dict] | None, node: str | None) -> None:
        if results is not None:
            devices = {"results": copy.deepcopy(results), **({"config": copy.deepcopy(config)} if config else {})}
            claim["status"]["allocation"] = {"devices": devices}
            if node is not None:  # the scheduler's selector of a node-local allocation
                claim["status"]["allocation"]["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
        if reserved_for:
            claim["status"]["reservedFor"] = copy.deepcopy(reserved_for)

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
        with self._lock:
            self._broadcast(BookmarkAt(self._revision))

    def end_watches(self) -> None:
        self._broadcast(END)

    def _broadcast(self, item: object) -> None:
        with self._lock:
            for watch in self._watches:
                self._loop.call_soon_threadsafe(watch.queue.put_nowait, item)

    # -- storage -----------------------------------------------------------------------------------

    def _table(self, kind: Kind) -> dict:
        return {"nodes": self._nodes, "resourceslices": self._slices, "resourceclaims": self._claims,
                "pods": self._pods, "poddisruptionbudgets": self._pdbs, "leases": self._leases}[kind.resource]

    @staticmethod
    def _key(kind: Kind, obj: dict) -> Any:
        meta = obj["metadata"]
        return (meta["namespace"], meta["name"]) if kind.namespaced else meta["name"]

    def _commit(self, obj: dict, event: str, kind: Kind = NODES) -> dict:
        """A write: the next revision, stored (or removed: DELETED), in the watch history, sent to each watch
        of that resource."""
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        if event == "DELETED":
            self._table(kind).pop(self._key(kind, obj), None)
        else:
            self._table(kind)[self._key(kind, obj)] = obj
        self._history.append((self._revision, event, copy.deepcopy(obj), kind.resource))
        for watch in self._watches:
            if (watch.kind or NODES) is kind:
                self._loop.call_soon_threadsafe(watch.queue.put_nowait, (event, copy.deepcopy(obj)))
        return kind.typed(obj)

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
        self._namespace_exists(namespace)
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

    def _create_slice(self, document: Any) -> dict:
        """create.go + rest.BeforeCreate (generateName, uid, creationTimestamp) + strategy.go PrepareForCreate
        (generation 1, dropDisabledFields) + ValidateResourceSlice; defaults.go SetDefaults_DeviceTaint."""
        obj = decode_slice(document)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):  # names.SimpleNameGenerator
            meta["name"] = meta["generateName"] + "".join(random.choices(RAND_ALPHABET, k=5))
        for system in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                       "managedFields", "selfLink"):
            meta.pop(system, None)  # FillObjectMetaSystemFields sets them; a client's resourceVersion: not verified
        meta.pop("namespace", None)  # cluster-scoped: rest.BeforeCreate clears it
        for type_meta in ("kind", "apiVersion"):
            obj.pop(type_meta, None)
        self._default_taints(obj)
        drop_disabled_fields(obj, None, self.feature_gates)
        if errors := validate_slice(obj, None, self.server_version):
            raise invalid("ResourceSlice", meta.get("name", ""), errors, RESOURCE_GROUP)
        if meta["name"] in self._slices:
            raise already_exists("resourceslices", meta["name"], RESOURCE_GROUP)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_time(), generation=1)
        return copy.deepcopy(self._commit(obj, "ADDED", SLICES))

    def _update_slice(self, name: str, document: Any) -> dict:
        """update.go + registry/store.go Update (resourceVersion precondition; AllowUnconditionalUpdate) +
        rest.BeforeUpdate + strategy.go PrepareForUpdate (generation + 1 when the spec changed) +
        ValidateResourceSliceUpdate; an update that changes nothing is not written."""
        current = self._slices.get(name)
        obj = decode_slice(document)
        meta = obj["metadata"]
        if meta.get("name") != name:  # rest.go checkName
            raise bad_request(f"the name of the object ({meta.get('name', '')}) does not match the name on the URL ({name})")
        if current is None:  # AllowCreateOnUpdate is false
            raise not_found("resourceslices", name, RESOURCE_GROUP)
        if meta.get("resourceVersion") not in (None, "", current["metadata"]["resourceVersion"]):
            raise conflict("resourceslices", name, OPTIMISTIC_LOCK_ERROR, RESOURCE_GROUP)
        for type_meta in ("kind", "apiVersion"):
            obj.pop(type_meta, None)
        meta.pop("namespace", None)
        meta.pop("managedFields", None)
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]
        meta.setdefault("uid", current["metadata"]["uid"])
        meta["generation"] = current["metadata"]["generation"]
        self._default_taints(obj)
        drop_disabled_fields(obj, current, self.feature_gates)
        if encode_slice(obj)["spec"] != encode_slice(current)["spec"]:
            meta["generation"] = current["metadata"]["generation"] + 1
        if errors := validate_slice(obj, current, self.server_version):
            raise invalid("ResourceSlice", name, errors, RESOURCE_GROUP)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        if encode_slice(obj) == encode_slice(current):
            return SLICES.typed(copy.deepcopy(current))
        return copy.deepcopy(self._commit(obj, "MODIFIED", SLICES))

    def _delete_slice(self, name: str, options: dict) -> dict:
        """registry/store.go Delete with ReturnDeletedObject (resourceslice/storage/storage.go): the object as
        it was stored; the watch's DELETED event carries the deletion's resourceVersion. Preconditions:
        storage/interfaces.go Preconditions.Check."""
        current = self._slices.get(name)
        if current is None:
            raise not_found("resourceslices", name, RESOURCE_GROUP)
        preconditions = options.get("preconditions") or {}
        for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if preconditions.get(key) and preconditions[key] != current["metadata"][key]:
                raise conflict("resourceslices", name, f"Precondition failed: {label} in precondition: "
                               f"{preconditions[key]}, {label} in object meta: {current['metadata'][key]}", RESOURCE_GROUP)
        answer = SLICES.typed(copy.deepcopy(current))
        self._commit(copy.deepcopy(current), "DELETED", SLICES)
        return answer

    @staticmethod
    def _default_taints(obj: dict) -> None:
        for device in obj["spec"].get("devices") or []:
            for taint in device.get("taints") or []:
                if isinstance(taint, dict) and taint.get("timeAdded") is None:
                    taint["timeAdded"] = now_time()

    # -- evictions, pod deletion, leases -------------------------------------------------------------

    def _evict(self, namespace: str, name: str, document: Any) -> dict:
        """pkg/registry/core/pod/storage/eviction.go EvictionREST.Create, after create.go's namespace check.
        A pod that is terminal, Pending or already terminating is deleted without a look at budgets
        (canIgnorePDB); otherwise the one budget selecting it must allow a disruption, which is spent
        (checkAndDecrement), unless the pod is not ready and the budget is healthy enough
        (unhealthyPodEvictionPolicy AlwaysAllow, or currentHealthy >= desiredHealthy > 0), when the pod is
        deleted with its resourceVersion as a precondition instead."""
        eviction = decode_eviction(document)
        meta = eviction["metadata"]
        if meta.get("namespace") not in (None, "", namespace):  # rest.EnsureObjectNamespaceMatchesRequestNamespace
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        self._namespace_exists(namespace)
        if meta.get("name", "") != name:
            raise bad_request("name in URL does not match name in Eviction object")
        options = eviction["deleteOptions"]
        client_version = (options.get("preconditions") or {}).get("resourceVersion")
        pod = self._pods.get((namespace, name))
        if pod is None:
            raise not_found("pods", name)
        phase, terminating = pod["status"].get("phase"), bool(pod["metadata"].get("deletionTimestamp"))
        if phase in ("Succeeded", "Failed", "Pending") or terminating:  # canIgnorePDB
            if phase not in ("Succeeded", "Failed") and not terminating and client_version is None:
                options = with_version_precondition(options, pod)  # shouldEnforceResourceVersion
            self._add_condition_and_delete_pod(pod, options)
            return EVICTED
        budgets = [b for (ns, _), b in sorted(self._pdbs.items())
                   if ns == namespace and selector_matches(b["spec"].get("selector"), pod["metadata"].get("labels") or {})]
        if len(budgets) > 1:  # a Failure Status the handler's finisher turns into an error: no reason
            raise ApiError(500, "", TWO_BUDGETS)
        pinned = False
        if budgets:
            budget, status = budgets[0], budgets[0]["status"]
            pinned = not pod_ready(pod) and (budget["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow" or
                                             status["currentHealthy"] >= status["desiredHealthy"] > 0)
            if not pinned:
                self._check_and_decrement(budget, name)
        if pinned:
            options = with_version_precondition(options, pod)
        try:
            self._add_condition_and_delete_pod(pod, options)
        except ApiError as error:
            if error.code == 409 and pinned and client_version is None:
                raise still_processing(budgets[0]["metadata"]["name"]) from None
            raise
        return EVICTED

    def _check_and_decrement(self, budget: dict, pod_name: str) -> None:
        """eviction.go checkAndDecrement: the budget's status written as its UpdateStatus does."""
        name, status = budget["metadata"]["name"], budget["status"]
        if status.get("observedGeneration", 0) < budget["metadata"]["generation"]:
            raise still_processing(name)
        if status["disruptionsAllowed"] < 0:
            raise pdb_forbidden(name, "pdb disruptions allowed is negative")
        if len(status.get("disruptedPods") or {}) > MAX_DISRUPTED_POD_SIZE:
            raise pdb_forbidden(name, "DisruptedPods map too big - too many evictions not confirmed by PDB controller")
        if status["disruptionsAllowed"] == 0:  # NewTooManyRequests(..., 0): no retryAfterSeconds
            raise ApiError(429, "TooManyRequests", EVICTION_REFUSED, {"causes": [{
                "reason": "DisruptionBudget", "message": disruption_denied_message(budget, self.server_version)}]})
        updated = copy.deepcopy(budget)
        status = updated["status"]
        status["disruptionsAllowed"] -= 1
        if status["disruptionsAllowed"] == 0:
            disruption_allowed_condition(status, status.get("observedGeneration", 0), now_time())
        status.setdefault("disruptedPods", {})[pod_name] = now_time()
        self._commit(updated, "MODIFIED", PDBS)

    def _add_condition_and_delete_pod(self, pod: dict, options: dict) -> None:
        """eviction.go addConditionAndDeletePod: the preconditions checked against the latest pod, the
        DisruptionTarget condition added (an update: a new resourceVersion, which the precondition follows),
        then the pod deleted."""
        meta = pod["metadata"]
        preconditions = options.get("preconditions") or {}
        uid, version = preconditions.get("uid"), preconditions.get("resourceVersion")
        if uid and uid != meta["uid"]:
            raise conflict("Pod", meta["name"], f"the UID in the precondition ({uid}) does not match the UID in record "
                           f"({meta['uid']}). The object might have been deleted and then recreated")
        if version and version != meta["resourceVersion"]:
            raise conflict("Pod", meta["name"], f"the ResourceVersion in the precondition ({version}) does not match the "
                           f"ResourceVersion in record ({meta['resourceVersion']}). The object might have been modified")
        updated = copy.deepcopy(pod)
        if set_condition(updated["status"].setdefault("conditions", []),
                         {"type": "DisruptionTarget", "status": "True", "lastProbeTime": None,
                          "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}, now_time()):
            self._commit(updated, "MODIFIED", PODS)
        self._delete_pod(updated, options.get("gracePeriodSeconds"))

    def _delete_pod(self, pod: dict, grace: int | None) -> None:
        """registry/store.go Delete with rest.BeforeDelete and the pod strategy's CheckGracefulDelete
        (pkg/registry/core/pod/strategy.go): the grace period asked, else the pod's
        terminationGracePeriodSeconds; 0 for a pod not scheduled or already terminal; a negative one is 1.
        A grace period of 0 removes the pod at once; another sets deletionTimestamp (now + grace) and
        deletionGracePeriodSeconds, and the pod stays, terminating, until the kubelet's final delete. A pod
        already terminating may only have its grace period shortened."""
        pod, meta = copy.deepcopy(pod), pod["metadata"]
        if grace is not None and grace < 0:
            grace = 1
        now = datetime.datetime.now(datetime.timezone.utc)
        if meta.get("deletionTimestamp"):
            current = meta.get("deletionGracePeriodSeconds")
            if current and (grace is None or grace >= current):
                return  # graceful deletion pending: nothing changes
            if current:
                at = datetime.datetime.fromisoformat(meta["deletionTimestamp"].replace("Z", "+00:00")) \
                    - datetime.timedelta(seconds=current - grace)
                if at < now:  # never into the past; a graceful one then shortened to 1 s
                    at, grace = now, (1 if grace else 0)
                if grace:
                    self._set_terminating(pod, grace, at)
                    return
            self._commit(pod, "DELETED", PODS)
            return
        period = pod["spec"].get("terminationGracePeriodSeconds", 0) if grace is None else grace
        if not pod["spec"].get("nodeName") or pod["status"].get("phase") in ("Failed", "Succeeded"):
            period = 0
        if period < 0:
            period = 1
        if period == 0:
            self._commit(pod, "DELETED", PODS)
        else:
            self._set_terminating(pod, period, now + datetime.timedelta(seconds=period))

    def _set_terminating(self, pod: dict, grace: int, at: datetime.datetime) -> None:
        meta = pod["metadata"]
        meta["deletionTimestamp"] = go_time(at.isoformat())
        meta["deletionGracePeriodSeconds"] = grace
        self._commit(pod, "MODIFIED", PODS)
        if self.pod_termination_scale is not None:
            key, uid, delay = (meta["namespace"], meta["name"]), meta["uid"], grace * self.pod_termination_scale
            self._loop.call_soon_threadsafe(lambda: self._loop.call_later(delay, self._kubelet_ends, key, uid))

    def _kubelet_ends(self, key: tuple[str, str], uid: str) -> None:
        with self._lock:
            pod = self._pods.get(key)
            if pod is not None and pod["metadata"]["uid"] == uid and pod["metadata"].get("deletionTimestamp"):
                self._commit(copy.deepcopy(pod), "DELETED", PODS)

    def _create_lease(self, namespace: str, document: Any) -> dict:
        """create.go (namespace check, NamespaceLifecycle) + rest.BeforeCreate (generateName, system fields) +
        ValidateLease (422) + the store's AlreadyExists (409)."""
        lease = decode_lease(document)
        meta = lease["metadata"]
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        self._namespace_exists(namespace)
        if not meta.get("name") and meta.get("generateName"):  # names.SimpleNameGenerator
            meta["name"] = meta["generateName"] + "".join(random.choices(RAND_ALPHABET, k=5))
        for system in ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp",
                       "managedFields", "selfLink"):
            meta.pop(system, None)
        meta["namespace"] = namespace
        for type_meta in ("kind", "apiVersion"):
            lease.pop(type_meta, None)
        if errors := validate_lease(lease, None):
            raise invalid("Lease", meta.get("name", ""), errors, COORDINATION_GROUP)
        if (namespace, meta["name"]) in self._leases:
            raise already_exists("leases", meta["name"], COORDINATION_GROUP)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_time())
        return copy.deepcopy(self._commit(lease, "ADDED", LEASES))

    def _update_lease(self, namespace: str, name: str, document: Any) -> tuple[dict, int]:
        """update.go + registry/store.go Update with the lease strategy (pkg/registry/coordination/lease/
        strategy.go): AllowCreateOnUpdate true (a PUT of a missing lease creates it, 201),
        AllowUnconditionalUpdate false (no resourceVersion: 422 "must be specified for an update"), a stale
        one 409; the body's uid a precondition; then rest.BeforeUpdate and ValidateLeaseUpdate; a write that
        changes nothing keeps the resourceVersion."""
        lease = decode_lease(document)
        meta = lease["metadata"]
        if meta.get("name") != name:  # rest.go checkName
            raise bad_request(f"the name of the object ({meta.get('name', '')}) does not match the name on the URL ({name})")
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        current = self._leases.get((namespace, name))
        if current is None:
            return self._create_lease(namespace, document), 201
        if meta.get("uid") and meta["uid"] != current["metadata"]["uid"]:  # storage Preconditions.Check
            raise conflict("leases", name, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object "
                           f"meta: {current['metadata']['uid']}", COORDINATION_GROUP)
        if not meta.get("resourceVersion"):
            raise invalid("leases", name, [FieldError("Invalid", "metadata.resourceVersion", 0,
                                                      "must be specified for an update")], COORDINATION_GROUP)
        if meta["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise conflict("leases", name, OPTIMISTIC_LOCK_ERROR, COORDINATION_GROUP)
        for type_meta in ("kind", "apiVersion"):
            lease.pop(type_meta, None)
        meta["namespace"] = namespace
        meta.pop("managedFields", None)
        meta["creationTimestamp"] = current["metadata"]["creationTimestamp"]  # rest.BeforeUpdate
        meta.setdefault("uid", current["metadata"]["uid"])
        if errors := validate_lease(lease, current):
            raise invalid("Lease", name, errors, COORDINATION_GROUP)
        if lease == current:  # etcd3 store.go GuaranteedUpdate: unchanged, not written
            return LEASES.typed(copy.deepcopy(current)), 200
        return copy.deepcopy(self._commit(lease, "MODIFIED", LEASES)), 200

    def _delete_lease(self, namespace: str, name: str, options: dict) -> dict:
        """registry/store.go Delete without ReturnDeletedObject: finalizeDelete's Status Success with the
        deleted object's name, group, resource and uid; DeleteOptions preconditions (409)."""
        current = self._leases.get((namespace, name))
        if current is None:
            raise not_found("leases", name, COORDINATION_GROUP)
        if set(options) - {"kind", "apiVersion", *LEASE_DELETE_OPTIONS} or options.get("dryRun"):
            raise Unmodelled(f"the delete options {sorted(options)}")
        preconditions = options.get("preconditions") or {}
        for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if preconditions.get(key) and preconditions[key] != current["metadata"][key]:
                raise conflict("leases", name, f"Precondition failed: {label} in precondition: {preconditions[key]}, "
                               f"{label} in object meta: {current['metadata'][key]}", COORDINATION_GROUP)
        self._commit(copy.deepcopy(current), "DELETED", LEASES)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": COORDINATION_GROUP, "kind": "leases", "uid": current["metadata"]["uid"]}}

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
            if request.path in ("/version", "/version/"):  # routes/version.go: ws.Path("/version"), GET "/"
                return self._version(request, record, user)
            discovery = request.path in DISCOVERY_PATHS or legacy(request.path, self.resource_api, "") is not None
            info = None if discovery else self._request_info(request)
            record["verb"] = "get" if discovery else info.verb
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            if discovery:
                return self._discovery(request, record, user, groups)
            self._injected_failure(request)
            self._authorize(user, groups, info)
            return await self._serve(request, info, record)
        except ApiError as error:
            record["status"] = error.code
            # responsewriters/writers.go ErrorNegotiated: Retry-After from the status' retryAfterSeconds
            retry_after = (error.status.get("details") or {}).get("retryAfterSeconds")
            headers = {"Retry-After": str(retry_after)} if retry_after else None
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

    def _version(self, request: web.Request, record: dict, user: str | None) -> web.Response:
        """GET /version: version.Info (apimachinery/pkg/version/types.go); RBAC's system:public-info-viewer
        lets every user, even anonymous, read it."""
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        if request.method != "GET":
            raise Unmodelled(f"{request.method} /version")
        self._injected_failure(request)
        return self._answer(record, self.version)

    def _discovery(self, request: web.Request, record: dict, user: str, groups: tuple) -> web.Response:
        """GET of a discovery path (tests/kube_api_discovery.py): every authenticated user may (RBAC's
        system:discovery), system:anonymous may not."""
        if request.method != "GET":
            raise Unmodelled(f"{request.method} {request.path}")
        if "system:authenticated" not in groups:
            raise ApiError(403, "Forbidden", f'forbidden: User "{user}" cannot get path "{request.path}"')
        self._injected_failure(request)
        record["status"] = 200
        if request.path in DISCOVERY_PATHS and wants_aggregated(request.headers.get("Accept", "")):
            return web.Response(body=json.dumps(aggregated(request.path, self.resource_api)).encode(),
                                headers={"Content-Type": AGGREGATED_CONTENT_TYPE})
        return web.json_response(legacy(request.path, self.resource_api, f"127.0.0.1:{self.port}"))

    def _request_info(self, request: web.Request) -> RequestInfo:
        parts = [p for p in request.path.split("/") if p]
        verb = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(request.method)
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis" and parts[1] in SERVED_GROUPS and parts[2] == "v1":
            group, rest = parts[1], parts[3:]
        else:
            raise Unmodelled(f"{request.method} {request.path}")
        if verb is None or not rest or rest[0] == "watch":
            raise Unmodelled(f"{request.method} {request.path}")
        namespace = ""
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        info = RequestInfo(verb, rest[0], rest[2] if len(rest) > 2 else "", rest[1] if len(rest) > 1 else "", namespace,
                           group, len(rest) > 1)
        if not info.name and verb == "delete":  # requestinfo.go: a collection is deleted as deletecollection
            info.verb = "deletecollection"
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
        """rbac.go VisitRulesFor: a ClusterRoleBinding's rules apply everywhere, a RoleBinding's only to
        requests in its own namespace (never to cluster-scoped ones, nor to lists across namespaces)."""
        if PRIVILEGED_GROUP in groups:
            return
        with self._lock:
            rules = self._rules.get(user, [])
            if not any(rule_allows(rule, info) and namespace in ("", info.namespace) for namespace, rule in rules):
                raise info.forbidden(user)

    async def _serve(self, request: web.Request, info: RequestInfo, record: dict) -> web.StreamResponse:
        accept = request.headers.get("Accept", "")
        if PROTOBUF in accept and not any(t in accept for t in ("json", "*/*")):
            # the real server would answer in protobuf; this one writes JSON only
            raise Unmodelled("an Accept of protobuf alone (answers in protobuf)")
        if info.api_group == RESOURCE_GROUP:
            if not self.resource_api:  # a group the server does not have: its paths are not found
                raise ApiError(404, *INJECTED[404])
            return await self._serve_resource(request, info, record)
        if info.api_group in (POLICY_GROUP, COORDINATION_GROUP):
            return await self._serve_namespaced(request, info, record)
        if info.resource == "pods" and request.method == "GET" and not info.path_named:
            if query_bool(request.query, "watch"):
                raise Unmodelled("watching pods")
            return await self._list_or_watch(request, record, PODS, info.namespace)
        if info.resource == "pods" and info.namespace and info.path_named:
            return await self._serve_pod(request, info, record)
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

    async def _serve_pod(self, request: web.Request, info: RequestInfo, record: dict) -> web.StreamResponse:
        """GET of one pod; POST of its eviction subresource (policy/v1 Eviction: 201, or the eviction's error)."""
        if request.method == "GET" and not info.subresource:
            with self._lock:
                pod = self._pods.get((info.namespace, info.name))
                if pod is None:
                    raise not_found("pods", info.name)
                return self._answer(record, PODS.typed(copy.deepcopy(pod)))
        if request.method == "POST" and info.subresource == "eviction":
            self._refuse_unmodelled_options(request.query)
            document = await self._object_body(request, record, protobuf=False)
            with self._lock:
                return self._answer(record, self._evict(info.namespace, info.name, document), 201)
        raise Unmodelled(f"{request.method} {request.path}")

    async def _serve_namespaced(self, request: web.Request, info: RequestInfo, record: dict) -> web.StreamResponse:
        """policy/v1 PodDisruptionBudgets (GET one, list; written only by the test's helpers) and
        coordination.k8s.io/v1 Leases (GET, list, create, update, delete)."""
        kind = {(POLICY_GROUP, "poddisruptionbudgets"): PDBS, (COORDINATION_GROUP, "leases"): LEASES}.get(
            (info.api_group, info.resource))
        if kind is None or info.subresource or (info.path_named and not info.namespace):
            raise Unmodelled(f"{request.method} {request.path}")
        if request.method == "GET" and info.path_named:
            with self._lock:
                obj = self._table(kind).get((info.namespace, info.name))
                if obj is None:
                    raise not_found(kind.resource, info.name, kind.group)
                return self._answer(record, kind.typed(copy.deepcopy(obj)))
        if request.method == "GET":
            if query_bool(request.query, "watch"):
                raise Unmodelled(f"watching {kind.resource}")
            return await self._list_or_watch(request, record, kind, info.namespace)
        if kind is not LEASES:
            raise Unmodelled(f"{request.method} {request.path} (budgets are written by the test's helpers)")
        self._refuse_unmodelled_options(request.query)
        if request.method == "POST" and info.namespace and not info.path_named:
            document = await self._object_body(request, record, protobuf=False)
            with self._lock:
                return self._answer(record, self._create_lease(info.namespace, document), 201)
        if request.method == "PUT" and info.path_named:
            document = await self._object_body(request, record, protobuf=False)
            with self._lock:
                return self._answer(record, *self._update_lease(info.namespace, info.name, document))
        if request.method == "DELETE" and info.path_named:
            options = await self._delete_options(request, record)
            with self._lock:
                return self._answer(record, self._delete_lease(info.namespace, info.name, options))
        raise Unmodelled(f"{request.method} {request.path}")

    async def _serve_resource(self, request: web.Request, info: RequestInfo, record: dict) -> web.StreamResponse:
        kind = RESOURCE_KINDS.get(info.resource)
        if kind is None or info.subresource or (info.namespace and not kind.namespaced):
            raise Unmodelled(f"{request.method} {request.path}")
        named = bool(info.name) and "fieldSelector" not in request.query
        if request.method == "GET" and named:
            if kind.namespaced and not info.namespace:
                raise Unmodelled(f"{request.method} {request.path}")
            with self._lock:
                obj = self._table(kind).get((info.namespace, info.name) if kind.namespaced else info.name)
                if obj is None:
                    raise not_found(kind.resource, info.name, RESOURCE_GROUP)
                return self._answer(record, kind.typed(copy.deepcopy(obj)))
        if request.method == "GET":
            return await self._list_or_watch(request, record, kind, info.namespace)
        if kind is not SLICES:
            raise Unmodelled(f"{request.method} {request.path} (claims are written by the test's helpers)")
        self._refuse_unmodelled_options(request.query)
        if request.method == "POST" and not info.name:
            document = await self._object_body(request, record)
            with self._lock:
                return self._answer(record, self._create_slice(document), 201)
        if request.method == "PUT" and info.name:
            document = await self._object_body(request, record)
            with self._lock:
                return self._answer(record, self._update_slice(info.name, document))
        if request.method == "DELETE" and named:
            options = await self._delete_options(request, record)
            with self._lock:
                return self._answer(record, self._delete_slice(info.name, options))
        if request.method == "DELETE" and not info.name:
            options = await self._delete_options(request, record)
            terms = parse_terms(request.query.get("fieldSelector", ""), ("metadata.name", "spec.nodeName", "spec.driver"))
            for unmodelled in ("labelSelector", "limit", "continue"):
                if request.query.get(unmodelled):
                    raise Unmodelled(f"the delete-collection option {unmodelled}")
            with self._lock:
                version = str(self._revision)
                chosen = [name for name, s in sorted(self._slices.items()) if matches(terms, SLICES, s)]
                items = [self._delete_slice(name, options) for name in chosen]
            for item in items:
                for type_meta in ("kind", "apiVersion"):
                    item.pop(type_meta, None)
            # registry/store.go DeleteCollection: the list of what it deleted
            return self._answer(record, {"kind": "ResourceSliceList", "apiVersion": RESOURCE_API_VERSION,
                                         "metadata": {"resourceVersion": version}, "items": items})
        raise Unmodelled(f"{request.method} {request.path}")

    async def _object_body(self, request: web.Request, record: dict, protobuf: bool = True) -> Any:
        """negotiation.NegotiateInputSerializer: no Content-Type is JSON; JSON and protobuf are decoded
        (protobuf only of the kinds pbdecode knows: `protobuf`), YAML is not modelled, anything else 415."""
        content_type = self._content_type(request) or JSON
        accepted = BODY_TYPES if PBDECODE.exists() else BODY_TYPES[:2]
        if content_type not in accepted:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           f"accepted media types include: {', '.join(accepted)}")
        if content_type == "application/yaml" or content_type == PROTOBUF and not protobuf:
            raise Unmodelled(f"a {content_type} request body")
        body = await self._read_limited(request)
        record["body"] = body
        if content_type == PROTOBUF:
            return await self._decode_protobuf(body)
        try:
            return json.loads(body)
        except ValueError as error:
            raise decode_error(str(error)) from None

    async def _delete_options(self, request: web.Request, record: dict) -> dict:
        if "gracePeriodSeconds" in request.query or "propagationPolicy" in request.query:
            pass  # a ResourceSlice has no finalizers or graceful deletion: both change nothing here
        if not request.can_read_body:
            return {}
        options = await self._object_body(request, record)
        return options if isinstance(options, dict) else {}

    @staticmethod
    async def _decode_protobuf(body: bytes) -> Any:
        """The protobuf body decoded by client-go's own scheme (tools/pbdecode), in bounded time."""
        process = await asyncio.create_subprocess_exec(str(PBDECODE), stdin=asyncio.subprocess.PIPE,
                                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(body), PBDECODE_TIMEOUT_S)
        except asyncio.TimeoutError:
            process.kill()
            await asyncio.wait_for(process.wait(), 5.0)  # killed: it ends at once
            raise ApiError(500, "InternalError", "Internal error occurred: the stand-in's protobuf decoder "
                           "did not answer in time") from None
        if process.returncode != 0:
            first = (err.decode(errors="replace").strip().splitlines() or ["undecodable"])[0]
            raise bad_request(f"the protobuf body does not decode: {first}")
        return json.loads(out)

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
        return await self._read_limited(request)

    @staticmethod
    async def _read_limited(request: web.Request) -> bytes:
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

    async def _list_or_watch(self, request: web.Request, record: dict, kind: Kind = NODES,
                             namespace: str = "") -> web.StreamResponse:
        query = request.query
        initial_events = query_bool(query, "sendInitialEvents")
        if initial_events and not (query_bool(query, "watch") and query_bool(query, "allowWatchBookmarks")
                                   and query.get("resourceVersionMatch") == "NotOlderThan"):
            raise Unmodelled("sendInitialEvents other than in a watch with bookmarks and resourceVersionMatch=NotOlderThan")
        for unmodelled in ("continue",) + (() if initial_events else ("resourceVersionMatch",)):
            if query.get(unmodelled):
                raise Unmodelled(f"the list option {unmodelled}")
        if query.get("labelSelector") and query_bool(query, "watch"):
            raise Unmodelled("a watch with a labelSelector")
        label_terms = parse_label_selector(query.get("labelSelector", ""))
        limit = query.get("limit", "")
        if limit and not limit.isdigit():
            raise Unmodelled("a limit that is not a number")
        timeout = None
        if "timeoutSeconds" in query:
            try:
                timeout = int(query["timeoutSeconds"])
            except ValueError:
                raise bad_request(f'strconv.ParseInt: parsing "{query["timeoutSeconds"]}": invalid syntax') from None
        if kind is NODES:
            terms = parse_field_selector(query.get("fieldSelector", ""))
        elif kind is PODS:
            terms = parse_terms(query.get("fieldSelector", ""), POD_FIELD_LABELS)
        else:
            labels = ("metadata.name", "metadata.namespace") if kind.namespaced else \
                ("metadata.name", "spec.nodeName", "spec.driver")
            terms = parse_terms(query.get("fieldSelector", ""), labels)
        version = query.get("resourceVersion", "")
        if version and not version.isdigit():
            raise Unmodelled("a non-numeric resourceVersion")
        if not query_bool(query, "watch"):
            with self._lock:
                items = [kind.typed(copy.deepcopy(o)) for _, o in sorted(self._table(kind).items())
                         if matches(terms, kind, o) and (not namespace or o["metadata"].get("namespace") == namespace)
                         and labels_match(label_terms, o["metadata"].get("labels") or {})]
                # the watch cache serves resourceVersion=0 whole, ignoring limit (cacher.go); paging is not modelled
                if limit and version != "0" and len(items) > int(limit):
                    raise Unmodelled("list paging (more items than limit)")
                for item in items:
                    for type_meta in ("kind", "apiVersion"):
                        item.pop(type_meta, None)
                return self._answer(record, {"kind": f"{kind.kind}List", "apiVersion": kind.api_version,
                                             "metadata": {"resourceVersion": str(self._revision)}, "items": items})
        if not timeout:  # get.go: no timeout asked, a random one from the server's minimum
            timeout = self.min_request_timeout_s * (random.random() + 1.0)
        watch = Watch(asyncio.Queue(), terms, query_bool(query, "allowWatchBookmarks"), kind, namespace)
        return await self._watch(request, record, watch, int(version or 0), timeout, initial_events)

    async def _watch(self, request: web.Request, record: dict, watch: Watch, version: int,
                     timeout: float, initial_events: bool = False) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        response.enable_chunked_encoding()
        await response.prepare(request)  # the real server flushes its 200 before any event
        record["status"] = 200
        try:
            kind = watch.kind or NODES
            error = await self._wait_for_revision(version)
            start = self._start_watch(watch, 0 if initial_events else version) if error is None else None
            if error is not None or isinstance(start, ApiError):
                await self._send(response, {"type": "ERROR", "object": (error or start).status})
                return await self._finish(response)
            for event, obj in start:
                await self._send(response, {"type": event, "object": kind.typed(obj)})
            if initial_events:  # KEP-3157 watch-list: a bookmark annotated as the initial events' end
                end = kind.bookmark(self._revision)
                end["metadata"]["annotations"] = {"k8s.io/initial-events-end": "true"}
                await self._send(response, {"type": "BOOKMARK", "object": end})
            next_bookmark = self._next_bookmark(loop.time(), deadline, watch)
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), min(left, next_bookmark - loop.time()))
                except asyncio.TimeoutError:
                    item = None
                    if loop.time() >= next_bookmark:
                        revision = self.revision
                        await asyncio.sleep(0)  # events committed before that revision reach the queue first
                        if watch.queue.empty():
                            item = BookmarkAt(revision)
                            next_bookmark = self._next_bookmark(loop.time(), deadline, watch)
                        else:  # those events go first; the bookmark on a later turn
                            item = watch.queue.get_nowait()
                if item is ABORT:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if item is END:
                    break
                if isinstance(item, BookmarkAt) and watch.bookmarks:
                    await self._send(response, {"type": "BOOKMARK", "object": kind.bookmark(item.revision)})
                elif isinstance(item, tuple) and self._watched(watch, item[1]):
                    await self._send(response, {"type": item[0], "object": kind.typed(item[1])})
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

    @staticmethod
    def _watched(watch: Watch, obj: dict) -> bool:
        return matches(watch.terms, watch.kind or NODES, obj) and \
            (not watch.namespace or obj["metadata"].get("namespace") == watch.namespace)

    def _start_watch(self, watch: Watch, version: int) -> list | ApiError:
        """cacher.go Watch: the initial events, and the watch registered for what follows, atomically."""
        kind = watch.kind or NODES
        with self._lock:
            if version == 0:
                start = [("ADDED", copy.deepcopy(o)) for _, o in sorted(self._table(kind).items())
                         if self._watched(watch, o)]
            elif version < self._compacted:
                return ApiError(410, "Expired", f"too old resource version: {version} ({self._compacted})")
            else:
                start = [(event, copy.deepcopy(o)) for rv, event, o, resource in self._history
                         if rv > version and resource == kind.resource and self._watched(watch, o)]
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
