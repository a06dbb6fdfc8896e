"""Dynamic MIG through DRA, property-based, on simulated HGX H100 and DGX A100 nodes whose GPUs are all dynamic:
claims for every MIG profile the GPUs offer and for whole GPUs, allocated by the scheduler's structured
allocator from what the plugin publishes, prepared and unprepared in random order (with gpud killed between
steps now and then). After every step the GPUs' instances are exactly the union of the prepared claims, at
their allocated placements; no instance's UUID or process changes while its claim is prepared; gpud's records
and the plugin's checkpoint agree (tests/dynamic_node.py). 250 sequences a node, 500 in all."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from dynamic_node import DynamicNode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SEQUENCES_PER_NODE = 250
# (what, which): what < 55 prepares a claim for choice `which`, < 98 unprepares prepared claim `which`, else
# gpud is killed (SIGKILL) and started again: 2 in 100 steps, each restart costs a second or two
STEP = st.tuples(st.integers(0, 99), st.integers(0, 63))
SEQUENCE = st.lists(STEP, min_size=1, max_size=8)


@pytest.fixture(scope="module", params=["hgx-h100", "dgx-a100"])
def node(request):
    tmp = Path(tempfile.mkdtemp(prefix="dd", dir="/tmp"))  # short: socket paths hold 108 bytes
    running = DynamicNode(tmp, request.param)
    running.choices = [None, *running.profiles()]  # None: a whole GPU
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@settings(max_examples=SEQUENCES_PER_NODE, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=SEQUENCE)
def test_the_gpus_instances_are_always_the_prepared_claims(node, steps):
    for uid in sorted(node.claims):  # a new sequence starts from an empty node
        node.unprepare(uid)
    node.agreement()
    for what, which in steps:
        if what < 55:
            claim = node.claim(node.choices[which % len(node.choices)])
            if claim is not None:  # unschedulable: the scheduler would not bind the pod here
                node.prepare(claim)
        elif what < 98:
            if node.claims:
                node.unprepare(sorted(node.claims)[which % len(node.claims)])
        else:
            node.restart_gpud()
        node.agreement()
