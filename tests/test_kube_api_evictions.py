"""The calls gpud's remediation makes of the Kubernetes API, as the stand-in (tests/kube_api_stand_in.py)
answers them: the eviction subresource with its PodDisruptionBudget rules (201, 429, 500, 403, 404, 400),
pods terminating for their grace period, PodDisruptionBudgets and Leases, with the agent's RBAC of
deploy/kubernetes/rbac.yaml (and refused what it does not grant), over HTTP and through kubernetes_asyncio's
own calls (the ones the agent makes). Each answer is the real server's, as the stand-in cites its source."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest
from kube_api_stand_in import AGENT_USER, KubeApiStandIn
from kube_http import KubeHttp
from kube_manifests import NAMESPACE, agent_rbac_rules, stand_in_as_deployed

GPU = [{"name": "main", "limits": {"nvidia.com/gpu": "1"}}]
APP = {"app": "train"}
EVICTED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
REFUSED = "Cannot evict pod as it would violate the pod's disruption budget."
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture
def kube_api():
    with stand_in_as_deployed([NAMESPACE]) as stand_in:
        yield stand_in


def eviction(name: str, namespace: str = "default", **delete_options) -> dict:
    return {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
            **({"deleteOptions": delete_options} if delete_options else {})}


def evict(http: KubeHttp, name: str, namespace: str = "default", body: object = None, **delete_options):
    return http.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/eviction",
                        eviction(name, namespace, **delete_options) if body is None else body)


def pod_path(name: str, namespace: str = "default") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def lease(name: str, holder: str = "node-a", version: str | None = None, **spec) -> dict:
    meta = {"name": name, **({"resourceVersion": version} if version else {})}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 60, **spec}}


# -- RBAC: exactly what rbac.yaml grants the agent ----------------------------------------------------


def test_the_agent_may_list_pods_evict_them_and_use_leases_in_its_namespace_only(kube_api):
    kube_api.create_pod("default", "p", "node-a", GPU)
    agent = kube_api.http("agent")
    assert agent.get("/api/v1/pods", fieldSelector="spec.nodeName=node-a")["items"][0]["metadata"]["name"] == "p"
    assert agent.request("POST", LEASES, lease("slot-0"))[0] == 201
    assert agent.get(f"{LEASES}/slot-0")["spec"]["holderIdentity"] == "node-a"

    refused = {
        ("GET", pod_path("p")):  # it lists its node's pods again at each look: it reads none by name
            f'pods "p" is forbidden: User "{AGENT_USER}" cannot get resource "pods" in API group "" in the '
            'namespace "default"',
        ("GET", LEASES):  # it reads its slots by their names
            f'leases.coordination.k8s.io is forbidden: User "{AGENT_USER}" cannot list resource "leases" in API '
            f'group "coordination.k8s.io" in the namespace "{NAMESPACE}"',
        ("DELETE", pod_path("p")): f'pods "p" is forbidden: User "{AGENT_USER}" cannot delete resource "pods" in API '
                                   'group "" in the namespace "default"',
        ("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/x"):
            f'leases.coordination.k8s.io "x" is forbidden: User "{AGENT_USER}" cannot get resource "leases" in API '
            'group "coordination.k8s.io" in the namespace "default"',
        ("GET", "/apis/coordination.k8s.io/v1/leases"):  # a Role's grant is not one across namespaces
            f'leases.coordination.k8s.io is forbidden: User "{AGENT_USER}" cannot list resource "leases" in API group '
            '"coordination.k8s.io" at the cluster scope',
        ("DELETE", f"{LEASES}/slot-0"):
            f'leases.coordination.k8s.io "slot-0" is forbidden: User "{AGENT_USER}" cannot delete resource "leases" '
            f'in API group "coordination.k8s.io" in the namespace "{NAMESPACE}"',
        ("GET", "/apis/policy/v1/namespaces/default/poddisruptionbudgets"):
            f'poddisruptionbudgets.policy is forbidden: User "{AGENT_USER}" cannot list resource '
            '"poddisruptionbudgets" in API group "policy" in the namespace "default"',
    }
    for (method, path), message in refused.items():
        status, answer = agent.request(method, path)
        assert (status, answer["reason"], answer["message"]) == (403, "Forbidden", message), (method, path)
    assert evict(agent, "p") == (201, EVICTED)

    kube_api.bind_agent_rbac(agent_rbac_rules())  # the ClusterRole alone: no lease anywhere
    assert agent.request("GET", f"{LEASES}/slot-0")[0] == 403
    kube_api.bind_agent_rbac([])
    status, answer = evict(agent, "p")
    assert (status, answer["message"]) == (403, f'pods "p" is forbidden: User "{AGENT_USER}" cannot create resource '
                                                '"pods/eviction" in API group "" in the namespace "default"')


# -- evictions ------------------------------------------------------------------------------------------


def test_an_evicted_pod_terminates_for_its_grace_period_and_stays_listed_until_the_kubelet_ends_it(kube_api):
    kube_api.create_pod("default", "p", "node-a", GPU)
    admin = kube_api.http("admin")
    before = time.time()
    assert evict(admin, "p") == (201, EVICTED)
    pod = admin.get(pod_path("p"))
    meta = pod["metadata"]
    assert meta["deletionGracePeriodSeconds"] == 30  # terminationGracePeriodSeconds, defaulted
    deadline = datetime.datetime.fromisoformat(meta["deletionTimestamp"].replace("Z", "+00:00")).timestamp()
    assert before + 29 <= deadline <= time.time() + 31
    target = next(c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert (target["status"], target["reason"], target["message"]) == ("True", "EvictionByEvictionAPI",
                                                                      "Eviction API: evicting")
    assert [p["metadata"]["name"] for p in admin.get("/api/v1/pods")["items"]] == ["p"]  # still listed
    version = meta["resourceVersion"]
    assert evict(admin, "p") == (201, EVICTED)  # terminating: deleted again, which changes nothing
    assert admin.get(pod_path("p"))["metadata"]["resourceVersion"] == version
    kube_api.finish_pod_termination("default", "p")
    status, answer = admin.request("GET", pod_path("p"))
    assert (status, answer["reason"], answer["message"]) == (404, "NotFound", 'pods "p" not found')
    assert admin.get("/api/v1/pods")["items"] == []


def test_the_grace_period_asked_the_pods_own_and_the_pods_deleted_at_once(kube_api):
    admin = kube_api.http("admin")
    kube_api.create_pod("default", "asked", "node-a", GPU)
    kube_api.create_pod("default", "own", "node-a", GPU, termination_grace_period_s=7)
    kube_api.create_pod("default", "negative", "node-a", GPU)
    kube_api.create_pod("default", "now", "node-a", GPU)
    kube_api.create_pod("default", "unscheduled", None, GPU, phase="Pending")
    kube_api.create_pod("default", "done", "node-a", GPU, phase="Succeeded")
    assert evict(admin, "asked", gracePeriodSeconds=5)[0] == 201
    assert evict(admin, "own")[0] == 201
    assert evict(admin, "negative", gracePeriodSeconds=-3)[0] == 201  # a negative grace period is 1 s
    assert evict(admin, "now", gracePeriodSeconds=0)[0] == 201
    assert evict(admin, "unscheduled", gracePeriodSeconds=60)[0] == 201  # not on a node: at once
    assert evict(admin, "done")[0] == 201  # terminal: at once
    assert {name: kube_api.pod("default", name)["metadata"]["deletionGracePeriodSeconds"]
            for name in ("asked", "own", "negative")} == {"asked": 5, "own": 7, "negative": 1}
    assert [kube_api.pod("default", name) for name in ("now", "unscheduled", "done")] == [None, None, None]
    # a terminating pod's grace period may be shortened, never lengthened
    assert evict(admin, "own", gracePeriodSeconds=60)[0] == 201
    assert kube_api.pod("default", "own")["metadata"]["deletionGracePeriodSeconds"] == 7
    assert evict(admin, "own", gracePeriodSeconds=2)[0] == 201
    assert kube_api.pod("default", "own")["metadata"]["deletionGracePeriodSeconds"] == 2
    assert evict(admin, "own", gracePeriodSeconds=0)[0] == 201
    assert kube_api.pod("default", "own") is None


def test_with_a_kubelet_a_terminating_pod_leaves_after_its_scaled_grace_period():
    with KubeApiStandIn(pod_termination_scale=0.01) as api:
        api.create_pod("default", "p", "node-a", GPU, termination_grace_period_s=20)
        assert evict(api.http("admin"), "p")[0] == 201
        assert api.pod("default", "p")["metadata"]["deletionGracePeriodSeconds"] == 20
        deadline = time.monotonic() + 10
        while api.pod("default", "p") is not None and time.monotonic() < deadline:
            time.sleep(0.02)  # fixed time: polls the stand-in's timer of 0.2 s
        assert api.pod("default", "p") is None


def test_a_budget_with_no_disruption_allowed_refuses_429_until_the_controller_allows_one(kube_api):
    admin = kube_api.http("admin")
    for name in ("a", "b"):
        kube_api.create_pod("default", name, "node-a", GPU, labels=APP)
    kube_api.create_pdb("default", "train", APP, disruptions_allowed=0, desired_healthy=2)
    status, answer = evict(admin, "a")
    assert (status, answer) == (429, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": REFUSED,
        "reason": "TooManyRequests", "code": 429,
        "details": {"causes": [{"reason": "DisruptionBudget",
                                "message": "The disruption budget train needs 2 healthy pods and has 2 currently"}]}})
    assert "deletionTimestamp" not in kube_api.pod("default", "a")["metadata"]  # nothing done

    kube_api.set_pdb_status("default", "train", disruptions_allowed=1, desired_healthy=2)
    assert evict(admin, "a") == (201, EVICTED)
    budget = admin.get("/apis/policy/v1/namespaces/default/poddisruptionbudgets/train")
    assert budget["kind"] == "PodDisruptionBudget" and budget["apiVersion"] == "policy/v1"
    assert budget["status"]["disruptionsAllowed"] == 0 and set(budget["status"]["disruptedPods"]) == {"a"}
    condition = next(c for c in budget["status"]["conditions"] if c["type"] == "DisruptionAllowed")
    assert (condition["status"], condition["reason"]) == ("False", "InsufficientPods")
    assert evict(admin, "b")[0] == 429  # the one disruption is spent
    # the controller, seeing a terminate: it drops a terminating pod from disruptedPods
    assert "disruptedPods" not in kube_api.set_pdb_status("default", "train", 0, 2, 1)["status"]
    listed = admin.get("/apis/policy/v1/poddisruptionbudgets")  # across namespaces
    assert [b["metadata"]["name"] for b in listed["items"]] == ["train"] and listed["kind"] == "PodDisruptionBudgetList"


def test_a_budget_the_controller_has_not_seen_yet_refuses_with_retry_after_10(kube_api):
    kube_api.create_pod("default", "a", "node-a", GPU, labels=APP)
    kube_api.create_pdb("default", "train", APP)  # generation 1, observedGeneration 0
    assert evict(kube_api.http("admin"), "a") == (429, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": REFUSED,
        "reason": "TooManyRequests", "code": 429,
        "details": {"causes": [{"reason": "DisruptionBudget",
                                "message": "The disruption budget train is still being processed by the server."}],
                    "retryAfterSeconds": 10}})


def test_retry_after_header_follows_the_status(kube_api):
    import http.client
    import json
    import ssl

    kube_api.create_pod("default", "a", "node-a", GPU, labels=APP)
    kube_api.create_pdb("default", "unseen", APP)
    context = ssl.create_default_context(cafile=str(kube_api.ca_file))
    headers = {"Authorization": f"Bearer {kube_api.tokens['admin']}", "Content-Type": "application/json"}
    connection = http.client.HTTPSConnection("127.0.0.1", kube_api.port, context=context, timeout=10)
    connection.request("POST", pod_path("a") + "/eviction", json.dumps(eviction("a")), headers)
    response = connection.getresponse()
    assert (response.status, response.getheader("Retry-After")) == (429, "10")
    response.read()
    kube_api.set_pdb_status("default", "unseen", 0)
    connection.request("POST", pod_path("a") + "/eviction", json.dumps(eviction("a")), headers)
    response = connection.getresponse()
    assert (response.status, response.getheader("Retry-After")) == (429, None)  # retryAfterSeconds 0: none
    response.read()
    connection.close()


def test_two_budgets_500_a_negative_budget_403(kube_api):
    admin = kube_api.http("admin")
    kube_api.create_pod("default", "a", "node-a", GPU, labels={**APP, "tier": "gpu"})
    kube_api.create_pdb("default", "one", APP, disruptions_allowed=1)
    kube_api.create_pdb("default", "two", {"tier": "gpu"}, disruptions_allowed=1)
    assert evict(admin, "a") == (500, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        "code": 500})
    kube_api.create_pod("default", "b", "node-a", GPU, labels={"app": "negative"})
    kube_api.create_pdb("default", "negative", {"app": "negative"}, disruptions_allowed=-1)
    assert evict(admin, "b") == (403, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'poddisruptionbudget.policy "negative" is forbidden: pdb disruptions allowed is negative',
        "reason": "Forbidden", "details": {"name": "negative", "group": "policy", "kind": "poddisruptionbudget"},
        "code": 403})


def test_which_budgets_cover_a_pod(kube_api):
    admin = kube_api.http("admin")
    kube_api.create_pod("default", "a", "node-a", GPU, labels=APP)
    kube_api.create_pod("kube-system", "b", "node-a", GPU, labels=APP)
    kube_api.create_pdb("default", "nothing", None, disruptions_allowed=0)  # no selector: selects no pod
    kube_api.create_pdb("default", "other", {"app": "serve"}, disruptions_allowed=0)
    kube_api.create_pdb("default", "in", None, disruptions_allowed=0,
                        match_expressions=[{"key": "app", "operator": "In", "values": ["x"]}])
    assert evict(admin, "a")[0] == 201
    kube_api.create_pdb("kube-system", "everything", {}, disruptions_allowed=0)  # an empty selector: every pod
    assert evict(admin, "b", namespace="kube-system")[0] == 429


def test_a_pod_that_is_not_ready_is_evicted_while_its_budget_is_healthy(kube_api):
    admin = kube_api.http("admin")
    kube_api.create_pod("default", "unready", "node-a", GPU, labels=APP, ready=False)
    kube_api.create_pdb("default", "train", APP, disruptions_allowed=0, desired_healthy=2, current_healthy=2)
    assert evict(admin, "unready")[0] == 201  # currentHealthy >= desiredHealthy > 0: deleted, budget untouched
    assert kube_api.pdb("default", "train")["status"]["disruptionsAllowed"] == 0
    assert "disruptedPods" not in kube_api.pdb("default", "train")["status"]
    kube_api.create_pod("default", "short", "node-a", GPU, labels={"app": "short"}, ready=False)
    kube_api.create_pdb("default", "short", {"app": "short"}, disruptions_allowed=0, desired_healthy=2,
                        current_healthy=1)
    assert evict(admin, "short")[0] == 429
    kube_api.create_pod("default", "always", "node-a", GPU, labels={"app": "always"}, ready=False)
    kube_api.create_pdb("default", "always", {"app": "always"}, disruptions_allowed=0, desired_healthy=2,
                        current_healthy=0, unhealthy_pod_eviction_policy="AlwaysAllow")
    assert evict(admin, "always")[0] == 201


def test_a_pending_pod_and_a_finished_one_ignore_their_budget(kube_api):
    admin = kube_api.http("admin")
    kube_api.create_pod("default", "pending", "node-a", GPU, labels=APP, phase="Pending")
    kube_api.create_pod("default", "failed", "node-a", GPU, labels=APP, phase="Failed")
    kube_api.create_pdb("default", "train", APP, disruptions_allowed=0)
    assert evict(admin, "pending")[0] == 201 and evict(admin, "failed")[0] == 201
    assert kube_api.pod("default", "pending")["metadata"]["deletionGracePeriodSeconds"] == 30
    assert kube_api.pod("default", "failed") is None


def test_later_releases_say_when_the_budget_failed_to_sync():
    for version, message in (("1.34", "The disruption budget train needs 1 healthy pods and has 2 currently"),
                             ("1.35", "The disruption budget train does not allow evicting pods currently because "
                                      "it failed sync: found no controllers for pod \"a\"")):
        with KubeApiStandIn(server_version=version) as api:
            api.create_pod("default", "a", "node-a", GPU, labels=APP)
            api.create_pdb("default", "train", APP, disruptions_allowed=1)
            api.fail_pdb_sync("default", "train", 'found no controllers for pod "a"')
            status, answer = evict(api.http("admin"), "a")
            assert (status, answer["details"]["causes"][0]["message"]) == (429, message), version


@pytest.mark.parametrize(("body", "status", "message"), [
    (eviction("other"), 400, "name in URL does not match name in Eviction object"),
    ({**eviction("p"), "metadata": {"name": "p", "namespace": "kube-system"}}, 400,
     "the namespace of the provided object does not match the namespace sent on the request"),
    ({**eviction("p"), "apiVersion": "v1"}, 400,
     "the API version in the data (v1) does not match the expected API version (policy/v1)"),
    (eviction("p", gracePeriodSeconds="30"), 400,
     'Eviction in version "v1" cannot be handled as a Eviction: json: cannot unmarshal string into Go struct field '
     'DeleteOptions.deleteOptions.gracePeriodSeconds of type int64'),
    (["p"], 400, 'Eviction in version "v1" cannot be handled as a Eviction: json: cannot unmarshal array into Go '
                 'value of type v1.Eviction'),
    (eviction("p", preconditions={"uid": "not-its-uid"}), 409, None),
])
def test_a_bad_eviction_is_refused_and_nothing_is_done(kube_api, body, status, message):
    kube_api.create_pod("default", "p", "node-a", GPU)
    answer_status, answer = evict(kube_api.http("admin"), "p", body=body)
    assert answer_status == status and answer["code"] == status
    if message is not None:
        assert answer["message"] == message
    else:
        uid = kube_api.pod("default", "p")["metadata"]["uid"]
        assert answer["message"] == (f'Operation cannot be fulfilled on Pod "p": the UID in the precondition '
                                     f'(not-its-uid) does not match the UID in record ({uid}). The object might have '
                                     'been deleted and then recreated')
    assert "deletionTimestamp" not in kube_api.pod("default", "p")["metadata"]


def test_evicting_what_is_not_there(kube_api):
    admin = kube_api.http("admin")
    status, answer = evict(admin, "ghost")
    assert (status, answer["reason"], answer["message"]) == (404, "NotFound", 'pods "ghost" not found')
    status, answer = evict(admin, "ghost", namespace="nowhere")
    assert (status, answer["message"]) == (404, 'namespaces "nowhere" not found')
    status, _ = admin.request("POST", pod_path("ghost") + "/eviction", b"{not json")
    assert status == 400


# -- Leases ------------------------------------------------------------------------------------------


def test_leases_compare_and_swap(kube_api):
    agent = kube_api.http("agent")
    status, created = agent.request("POST", LEASES, lease("slot-0", acquireTime="2026-01-02T03:04:05.123456+02:00"))
    assert status == 201 and created["kind"] == "Lease" and created["apiVersion"] == "coordination.k8s.io/v1"
    assert created["spec"]["acquireTime"] == "2026-01-02T01:04:05.123456Z"  # MicroTime, written in UTC
    assert created["metadata"]["namespace"] == NAMESPACE and created["metadata"]["uid"]
    version = created["metadata"]["resourceVersion"]

    status, answer = agent.request("POST", LEASES, lease("slot-0", holder="node-b"))
    assert (status, answer["reason"], answer["message"]) == (
        409, "AlreadyExists", 'leases.coordination.k8s.io "slot-0" already exists')

    status, renewed = agent.put(f"{LEASES}/slot-0", lease("slot-0", version=version, leaseTransitions=1))
    assert status == 200 and renewed["metadata"]["resourceVersion"] != version
    assert renewed["metadata"]["uid"] == created["metadata"]["uid"]
    assert renewed["metadata"]["creationTimestamp"] == created["metadata"]["creationTimestamp"]
    status, answer = agent.put(f"{LEASES}/slot-0", lease("slot-0", holder="node-b", version=version))
    assert (status, answer["reason"], answer["message"]) == (
        409, "Conflict", 'Operation cannot be fulfilled on leases.coordination.k8s.io "slot-0": the object has been '
                         'modified; please apply your changes to the latest version and try again')
    status, answer = agent.put(f"{LEASES}/slot-0", lease("slot-0", holder="node-b"))  # no resourceVersion
    assert (status, answer["reason"], answer["message"]) == (
        422, "Invalid", 'leases.coordination.k8s.io "slot-0" is invalid: metadata.resourceVersion: Invalid value: 0: '
                        'must be specified for an update')
    same = renewed["metadata"]["resourceVersion"]
    status, unchanged = agent.put(f"{LEASES}/slot-0", {**renewed})
    assert status == 200 and unchanged["metadata"]["resourceVersion"] == same  # nothing changed, nothing written
    assert agent.get(f"{LEASES}/slot-0")["spec"]["holderIdentity"] == "node-a"

    status, answer = agent.put(f"{LEASES}/slot-1", lease("slot-1"))  # AllowCreateOnUpdate
    assert status == 201 and answer["metadata"]["name"] == "slot-1"
    slot_1_uid = answer["metadata"]["uid"]
    admin = kube_api.http("admin")  # the agent lists no Leases (rbac.yaml): the list as another client sees it
    listed = admin.get(LEASES)
    assert [item["metadata"]["name"] for item in listed["items"]] == ["slot-0", "slot-1"]
    assert admin.get(LEASES, fieldSelector="metadata.name=slot-1")["items"][0]["metadata"]["name"] == "slot-1"

    status, answer = admin.delete(f"{LEASES}/slot-1")
    assert (status, answer) == (200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": {"name": "slot-1", "group": "coordination.k8s.io", "kind": "leases",
                                                  "uid": slot_1_uid}})
    status, answer = agent.request("GET", f"{LEASES}/slot-1")
    assert (status, answer["message"]) == (404, 'leases.coordination.k8s.io "slot-1" not found')


@pytest.mark.parametrize(("body", "status", "message"), [
    (lease("slot", leaseDurationSeconds=0), 422,
     'Lease.coordination.k8s.io "slot" is invalid: spec.leaseDurationSeconds: Invalid value: 0: must be greater '
     'than 0'),
    (lease("slot", leaseTransitions=-1), 422,
     'Lease.coordination.k8s.io "slot" is invalid: spec.leaseTransitions: Invalid value: -1: must be greater than or '
     'equal to 0'),
    (lease("Slot_0"), 422, None),
    (lease("slot", renewTime="2026-01-02T03:04:05+00:00"), 400,  # isoformat() of a datetime without microseconds
     'Lease in version "v1" cannot be handled as a Lease: parsing time "2026-01-02T03:04:05+00:00" as '
     '"2006-01-02T15:04:05.000000Z07:00": cannot parse "+00:00" as ".000000"'),
    (lease("slot", renewTime="2026-01-02T03:04:05.123456"), 400,  # isoformat() of a naive datetime
     'Lease in version "v1" cannot be handled as a Lease: parsing time "2026-01-02T03:04:05.123456" as '
     '"2006-01-02T15:04:05.000000Z07:00": cannot parse "" as "Z07:00"'),
    (lease("slot", leaseDurationSeconds="60"), 400,
     'Lease in version "v1" cannot be handled as a Lease: json: cannot unmarshal string into Go struct field '
     'LeaseSpec.spec.leaseDurationSeconds of type int32'),
    (lease("slot", leaseDurationSeconds=2**31), 400,
     'Lease in version "v1" cannot be handled as a Lease: json: cannot unmarshal number into Go struct field '
     'LeaseSpec.spec.leaseDurationSeconds of type int32'),
])
def test_a_bad_lease_is_refused(kube_api, body, status, message):
    answer_status, answer = kube_api.http("agent").request("POST", LEASES, body)
    assert (answer_status, answer["code"]) == (status, status)
    if message is not None:
        assert answer["message"] == message
    else:
        assert answer["details"]["causes"][0]["field"] == "metadata.name"
    assert kube_api.lease(NAMESPACE, body["metadata"]["name"]) is None


def test_a_lease_in_a_namespace_that_does_not_exist(kube_api):
    status, answer = kube_api.http("admin").request(
        "POST", "/apis/coordination.k8s.io/v1/namespaces/nowhere/leases", lease("slot"))
    assert (status, answer["message"]) == (404, 'namespaces "nowhere" not found')


# -- kubernetes_asyncio's own calls, as the agent makes them -------------------------------------------


def test_the_agents_client_calls(kube_api):
    from kubernetes_asyncio import client as k8s
    from kubernetes_asyncio.client.exceptions import ApiException

    from gpud.kubernetes.node_api import api_client

    kube_api.create_pod("default", "a", "node-a", GPU, labels=APP)
    kube_api.create_pod("kube-system", "b", "node-a", GPU)
    kube_api.create_pod("default", "elsewhere", "node-b", GPU)
    kube_api.create_pdb("default", "train", APP, disruptions_allowed=0)

    async def calls() -> None:
        api = await api_client(kube_api.kubeconfig("agent"))
        async with api:
            core, coordination = k8s.CoreV1Api(api), k8s.CoordinationV1Api(api)
            pods = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a")
            assert sorted((p.metadata.namespace, p.metadata.name) for p in pods.items) == [("default", "a"),
                                                                                          ("kube-system", "b")]
            body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="a", namespace="default"),
                                  delete_options=k8s.V1DeleteOptions(grace_period_seconds=10))
            with pytest.raises(ApiException) as refused:
                await core.create_namespaced_pod_eviction("a", "default", body)
            assert refused.value.status == 429 and "disruption budget" in refused.value.body
            kube_api.set_pdb_status("default", "train", 1)
            await core.create_namespaced_pod_eviction("a", "default", body)
            listed = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a")  # as the agent looks
            evicted = next(p for p in listed.items if (p.metadata.namespace, p.metadata.name) == ("default", "a"))
            assert evicted.metadata.deletion_grace_period_seconds == 10
            await core.create_namespaced_pod_eviction(
                "b", "kube-system", k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name="b", namespace="kube-system")))

            with pytest.raises(ApiException) as missing:
                await coordination.read_namespaced_lease("slot-0", NAMESPACE)
            assert missing.value.status == 404
            now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=123456)
            spec = k8s.V1LeaseSpec(holder_identity="node-a", lease_duration_seconds=60, acquire_time=now,
                                   renew_time=now, lease_transitions=0)
            created = await coordination.create_namespaced_lease(
                NAMESPACE, k8s.V1Lease(metadata=k8s.V1ObjectMeta(name="slot-0"), spec=spec))
            assert created.spec.renew_time == now and created.spec.holder_identity == "node-a"
            read = await coordination.read_namespaced_lease("slot-0", NAMESPACE)
            read.spec.renew_time = now + datetime.timedelta(seconds=10)
            renewed = await coordination.replace_namespaced_lease("slot-0", NAMESPACE, read)
            assert renewed.metadata.resource_version != read.metadata.resource_version
            with pytest.raises(ApiException) as stale:  # the version read before the renewal
                await coordination.replace_namespaced_lease("slot-0", NAMESPACE, read)
            assert stale.value.status == 409
            with pytest.raises(ApiException) as whole_seconds:  # a datetime without microseconds
                read.metadata.resource_version = renewed.metadata.resource_version
                read.spec.renew_time = now.replace(microsecond=0)
                await coordination.replace_namespaced_lease("slot-0", NAMESPACE, read)
            assert whole_seconds.value.status == 400

    asyncio.run(calls())
    assert kube_api.pod("kube-system", "b")["metadata"]["deletionGracePeriodSeconds"] == 30
    assert kube_api.pod("default", "elsewhere").get("metadata", {}).get("deletionTimestamp") is None
