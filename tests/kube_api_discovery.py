"""The API stand-in's discovery documents (tests/kube_api_stand_in.py): what kube-apiserver answers at /api,
/apis and /api/v1, /apis/<group>/<version>, for the resources the stand-in serves, in both forms clients ask:

| behaviour | where the real server does it |
|---|---|
| /api and /apis in the aggregated form (apidiscovery.k8s.io/v2 APIGroupDiscoveryList, Content-Type carrying g, v and as) when the Accept asks for it (client-go's AcceptV2 or AcceptV2NoPeer first), else the unaggregated APIVersions / APIGroupList | kubernetes/apiserver pkg/endpoints/discovery/aggregated/wrapper.go WrappedHandler.ServeHTTP, negotiation.go IsAggregatedDiscoveryGVK; legacy.go (APIVersions, versions ["v1"]); root.go (APIGroupList); client-go discovery/discovery_client.go downloadLegacy, downloadAPIs, ContentTypeIsGVK |
| /api/v1 and /apis/<group>/v1: APIResourceList (name, singularName, namespaced, kind, verbs, shortNames, categories; subresources as `nodes/status`; `pods/eviction` with group policy, version v1, kind Eviction and the one verb create) | apiserver pkg/endpoints/discovery/version.go; pkg/endpoints/installer.go (a subresource whose storage names another GroupVersionKind: rest.GroupVersionKindProvider, as pod/storage/eviction.go does) |
| discovery paths are readable by every authenticated user, not by system:anonymous: 403 `forbidden: User "system:anonymous" cannot get path "/api"` | kubernetes plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go (ClusterRole system:discovery, bound to system:authenticated); apiserver pkg/endpoints/handlers/responsewriters/errors.go forbiddenMessage (a non-resource request) |

Only the resources the stand-in serves are listed (nodes, pods, events; resourceslices and resourceclaims;
poddisruptionbudgets; leases), as a server whose other APIs are off would list them; resource.k8s.io only in
v1, and not at all for a stand-in made with `resource_api=False` (a cluster older than 1.32, or with the group
disabled); policy and coordination.k8s.io in v1, their one served version since 1.25 and 1.19.
"""

from __future__ import annotations

RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"
POLICY_GROUP, COORDINATION_GROUP = "policy", "coordination.k8s.io"
AGGREGATED_GVK = {"g": "apidiscovery.k8s.io", "v": "v2", "as": "APIGroupDiscoveryList"}
AGGREGATED_CONTENT_TYPE = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
DISCOVERY_PATHS = ("/api", "/apis")
ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]

# (resource, singular, kind, namespaced, shortNames, categories, subresources): as `kubectl api-resources`
# lists them from a 1.34 server (the types' registries: pkg/registry/core/node, pod, event;
# pkg/registry/resource/resourceslice, resourceclaim; pkg/registry/policy/poddisruptionbudget;
# pkg/registry/coordination/lease; shortNames and categories from their storage.go). A subresource is
# "status" (the resource's own kind, get/patch/update) or (name, group, version, kind, verbs).
EVICTION = ("eviction", POLICY_GROUP, "v1", "Eviction", ["create"])
CORE = (("nodes", "node", "Node", False, ["no"], [], ["status"]),
        ("pods", "pod", "Pod", True, ["po"], ["all"], ["status", EVICTION]),
        ("events", "event", "Event", True, ["ev"], [], []))
RESOURCE = (("resourceslices", "resourceslice", "ResourceSlice", False, [], [], []),
            ("resourceclaims", "resourceclaim", "ResourceClaim", True, [], [], ["status"]))
POLICY = (("poddisruptionbudgets", "poddisruptionbudget", "PodDisruptionBudget", True, ["pdb"], [], ["status"]),)
COORDINATION = (("leases", "lease", "Lease", True, [], [], []),)


def wants_aggregated(accept: str) -> bool:
    """negotiation.NegotiateMediaTypeOptions over the Accept's clauses in order: the first that the server
    can serve decides; the aggregated form only when that clause names its g, v and as."""
    for clause in accept.split(","):
        media, *params = [part.strip() for part in clause.split(";")]
        options = dict(param.partition("=")[::2] for param in params)
        if media in ("application/json", "application/*", "*/*"):
            return all(options.get(key) == value for key, value in AGGREGATED_GVK.items())
    return False


def _groups(resource_api: bool) -> list[tuple[str, str, tuple]]:
    return [("", "v1", CORE)] + ([(RESOURCE_GROUP, RESOURCE_VERSION, RESOURCE)] if resource_api else []) + \
        [(POLICY_GROUP, "v1", POLICY), (COORDINATION_GROUP, "v1", COORDINATION)]


def _subresource(sub: str | tuple, group: str, version: str, kind: str) -> tuple[str, str, str, str, list[str]]:
    """(name, group, version, kind, verbs) of a subresource: "status" is the resource's own kind."""
    return (sub, group, version, kind, STATUS_VERBS) if isinstance(sub, str) else sub


def aggregated(path: str, resource_api: bool) -> dict:
    """apidiscovery.k8s.io/v2 APIGroupDiscoveryList: /api has the core group (name ""), /apis the others."""
    items = []
    for group, version, resources in _groups(resource_api):
        if (group == "") != (path == "/api"):
            continue
        entries = [{"resource": name, "responseKind": {"group": group, "version": version, "kind": kind},
                    "scope": "Namespaced" if namespaced else "Cluster", "singularResource": singular,
                    "verbs": ALL_VERBS, **({"shortNames": short} if short else {}),
                    **({"categories": categories} if categories else {}),
                    **({"subresources": [
                        {"subresource": name, "verbs": verbs,
                         "responseKind": {"group": sub_group, "version": sub_version, "kind": sub_kind}}
                        for name, sub_group, sub_version, sub_kind, verbs in
                        (_subresource(sub, group, version, kind) for sub in subresources)]} if subresources else {})}
                   for name, singular, kind, namespaced, short, categories, subresources in resources]
        items.append({"metadata": {"name": group, "creationTimestamp": None},
                      "versions": [{"version": version, "resources": entries, "freshness": "Current"}]})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items}


def legacy(path: str, resource_api: bool, server_address: str) -> dict | None:
    """The unaggregated documents: APIVersions at /api, APIGroupList at /apis, an APIResourceList at each
    group version; None for a path that is none of them."""
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]}
    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": group, "versions": [{"groupVersion": f"{group}/{version}", "version": version}],
             "preferredVersion": {"groupVersion": f"{group}/{version}", "version": version}}
            for group, version, _ in _groups(resource_api) if group]}
    for group, version, resources in _groups(resource_api):
        if path == (f"/apis/{group}/{version}" if group else "/api/v1"):
            listed = []
            for name, singular, kind, namespaced, short, categories, subresources in resources:
                listed.append({"name": name, "singularName": singular, "namespaced": namespaced, "kind": kind,
                               "verbs": ALL_VERBS, **({"shortNames": short} if short else {}),
                               **({"categories": categories} if categories else {})})
                for sub in subresources:
                    sub_name, sub_group, sub_version, sub_kind, verbs = _subresource(sub, group, version, kind)
                    elsewhere = (sub_group, sub_version) != (group, version)
                    other = {"group": sub_group, "version": sub_version} if elsewhere else {}
                    listed.append({"name": f"{name}/{sub_name}", "singularName": "", "namespaced": namespaced,
                                   **other, "kind": sub_kind, "verbs": verbs})
            return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}".lstrip("/"),
                    "resources": listed}
    return None
