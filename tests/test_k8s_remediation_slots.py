"""The remediation slots (gpud/kubernetes/leases.py) against the API stand-in's Leases (their
compare-and-swap as the real server answers it): at most N holders, a holder renews, a dead holder's slot
is taken only after a whole lease duration unrenewed on the taker's clock, a released slot is free at
once, and pools are apart; and the loop's state read back from the Node's annotation, which anyone who
may edit the Node can write."""

from __future__ import annotations

import asyncio
import json

import pytest
from kube_manifests import stand_in_as_deployed

from gpud.kubernetes.leases import LeaseSlots, pool_part
from gpud.kubernetes.node_api import NodeApi, api_client

NAMESPACE = "gpud-system"


@pytest.fixture
def kube():
    with stand_in_as_deployed([NAMESPACE]) as api:
        yield api


async def slots_of(kube, nodes: list[str], pool: str = "cluster", slots: int = 1, duration_s: int = 1):
    client = await api_client(kube.kubeconfig("agent"))
    return client, [LeaseSlots(NodeApi(client, node), NAMESPACE, pool, slots, duration_s) for node in nodes]


async def test_one_slot_one_holder_a_dead_holder_loses_it_after_a_whole_duration_and_a_release_frees_it(kube):
    client, (a, b, c) = await slots_of(kube, ["node-a", "node-b", "node-c"])
    async with client:
        assert await a.take_a_slot() == "gpud-remediation-cluster-0"
        assert await b.take_a_slot() is None  # held, and first seen now: not expired on b's clock
        assert await a.renew("gpud-remediation-cluster-0")
        await asyncio.sleep(0.6)  # fixed time: within the 1 s lease, b saw a renewal
        assert await b.take_a_slot() is None
        await asyncio.sleep(1.2)  # fixed time: a (dead now) renews no more for longer than the lease
        assert await b.take_a_slot() == "gpud-remediation-cluster-0"
        lease = kube.lease(NAMESPACE, "gpud-remediation-cluster-0")
        assert lease["spec"]["holderIdentity"] == "node-b" and lease["spec"]["leaseTransitions"] == 1
        assert not await a.renew("gpud-remediation-cluster-0")  # a came back: the slot is b's now
        await b.release("gpud-remediation-cluster-0")
        assert await c.take_a_slot() == "gpud-remediation-cluster-0"  # free at once, no wait


async def test_two_nodes_taking_one_slot_together_get_it_once(kube):
    client, nodes = await slots_of(kube, [f"node-{i}" for i in range(6)], slots=2, duration_s=60)
    async with client:
        taken = await asyncio.gather(*(node.take_a_slot() for node in nodes))
        held = [name for name in taken if name is not None]
        assert sorted(held) == ["gpud-remediation-cluster-0", "gpud-remediation-cluster-1"], taken


async def test_pools_are_apart_and_any_label_value_makes_a_lease_name(kube):
    client, (a,) = await slots_of(kube, ["node-a"], pool="a100")
    client2, (b,) = await slots_of(kube, ["node-b"], pool="H100_SXM.80GB")
    async with client, client2:
        assert await a.take_a_slot() == "gpud-remediation-a100-0"
        assert (await b.take_a_slot()).startswith("gpud-remediation-h")  # a digest: capitals and '_' are no DNS name
    assert pool_part("H100_SXM.80GB") != pool_part("h100-sxm-80gb")


def test_only_a_state_the_agent_wrote_is_resumed_from_the_annotation():
    from gpud.kubernetes.remediation import state_from_annotation

    written = {"step": "draining", "gpus": [{"index": 0, "uuid": "GPU-a"}], "why": "GPU 0: XID 95", "since": 1.0,
               "step_since": 2.0, "lease": "gpud-remediation-cluster-0", "detail": None, "passed": [],
               "drain_since": 2.0}
    assert state_from_annotation(json.dumps(written)) == written
    for hostile in ("", "not json", "[" * 100_000, json.dumps([written]), json.dumps({**written, "step": "rm -rf"}),
                    json.dumps({**written, "why": None}), json.dumps({**written, "gpus": [{"uuid": 7, "index": 0}]}),
                    json.dumps({**written, "passed": [{}]}), json.dumps({**written, "drain_since": "soon"}),
                    json.dumps({k: v for k, v in written.items() if k != "since"})):
        assert state_from_annotation(hostile) is None, hostile[:80]


async def test_a_dry_run_holds_no_state_while_it_asks_which_pods_are_in_the_way():
    """The health loop reads the remediation's state at any await (condition, holds_taint): a dry run that
    set a partial state while it listed pods once had the node tainted, or the health loop fail on it."""
    from types import SimpleNamespace

    from gpud.kubernetes.health import Verdict
    from gpud.kubernetes.remediation import Remediation

    listing, release = asyncio.Event(), asyncio.Event()

    async def list_pods() -> list[dict]:
        listing.set()
        await asyncio.wait_for(release.wait(), 10)
        return []

    async def gpud(method: str, path: str, *args) -> dict:
        return {"pods": []}

    async def event(*args) -> None:
        pass

    api = SimpleNamespace(list_pods=list_pods, node_name="node-a")
    agent = SimpleNamespace(api=api, node={"metadata": {}}, node_name="node-a", _gpud=gpud, _event=event,
                            _note=lambda *args, **kwargs: None)
    remediation = Remediation(agent)
    remediation.policy = {"enabled": True, "dry_run": True}
    dry_run = asyncio.create_task(remediation._dry_run([{"index": 0, "uuid": "GPU-a", "action": "reset-gpu",
                                                          "why": "XID 95"}], []))
    await asyncio.wait_for(listing.wait(), 10)
    healthy = Verdict("True", "GPUsHealthy", "", taint=False)
    assert not remediation.holds_taint() and remediation.condition(healthy) == healthy
    release.set()
    await dry_run
    assert remediation.state is None
