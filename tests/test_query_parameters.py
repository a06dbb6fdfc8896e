"""A query parameter a route does not take is refused with 400 naming it, before the route acts
(issue 38, defect 8): `PUT /v1/mig?dry_run=true` used to apply the layout."""

from __future__ import annotations

import re

import pytest
from helpers import mig_config, start_daemon, stop_daemon

from gpud.api.server import load_openapi, query_parameters


@pytest.fixture
async def node(short_tmp):
    running = await start_daemon(mig_config(short_tmp, "dgx-a100"))
    yield running
    await stop_daemon(running)


async def test_a_dry_run_spelled_as_a_query_parameter_is_refused_and_changes_nothing(node):
    async with node.http.put("http://localhost/v1/mig?dry_run=true", json={"layout": "all-1g.5gb"}) as response:
        status, body = response.status, await response.json()
    assert status == 400, body
    assert body["error"]["code"] == "unknown-query-parameter"
    assert "'dry_run'" in body["error"]["message"] and "it takes wait" in body["error"]["message"]
    _, listing = await node.get("/v1/gpus")
    assert all(gpu["mig"]["devices"] == [] for gpu in listing["gpus"])
    _, mig = await node.get("/v1/mig")
    assert mig.get("desired") in (None, {}) or mig["desired"].get("layout") != "all-1g.5gb", mig


def _concrete(route: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda m: "0" if m.group(0) == "{id}" else "x", route)


async def test_every_route_refuses_a_parameter_it_does_not_take(node):
    refused = []
    for (route, method), known in query_parameters(load_openapi()).items():
        async with node.http.request(method, f"http://localhost{_concrete(route)}?bogus=1&{'&'.join(known)}",
                                     json={}) as response:
            body = await response.json()
        assert response.status == 400, (method, route, body)
        assert body["error"]["code"] == "unknown-query-parameter", (method, route, body)
        assert "'bogus'" in body["error"]["message"] and route in body["error"]["message"]
        refused.append((method, route))
    assert len(refused) > 40  # every route the document lists


async def test_head_is_checked_as_get_and_known_parameters_still_work(node):
    async with node.http.head("http://localhost/v1/gpus?verbose=1") as response:
        assert response.status == 400
    async with node.http.get("http://localhost/v1/mig/export?name=current") as response:
        assert response.status == 200, await response.text()
    status, body = await node.get("/v1/gpus")
    assert status == 200
    status, body = await node.get("/no/such/route?x=1")
    assert status == 404  # the catch-all answers as before: the path, not the query, is wrong


async def test_many_and_long_unknown_names_are_named_briefly(node):
    query = "&".join(f"{'n' * 500}{i}=1" for i in range(50))
    status, body = await node.get(f"/v1/gpus?{query}")
    assert status == 400
    assert len(body["error"]["message"]) < 1200
