"""GET /metrics reads collectors: one that fails leaves its samples out, not the scrape."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gpud.api.metrics import MetricsRoute
from gpud.base.samples import Family


class Working:
    def collect(self):
        family = Family("gpud_mig_in_sync", "1 when every GPU has the desired MIG layout.", "gauge")
        family.add({"hostname": "node-1"}, 1)
        yield family


class Failing:
    """Yields a family, then fails: nothing it yielded is written."""

    def collect(self):
        family = Family("gpud_mps_daemon_up", "1 when the MPS control daemon runs.", "gauge")
        family.add({"daemon": "gpu-0", "hostname": "node-1"}, 1)
        yield family
        raise KeyError("a daemon went away mid-scrape")


def test_a_failing_collector_leaves_its_samples_out_and_is_counted():
    route = MetricsRoute(lambda: {"mps": Failing(), "mig": Working()})
    text = route.render()
    assert 'gpud_mig_in_sync{hostname="node-1"} 1\n' in text  # the others still answer
    assert "gpud_mps_daemon_up" not in text
    assert 'gpud_collector_errors_total{collector="mps"} 1\n' in text
    assert 'gpud_collector_errors_total{collector="mig"} 0\n' in text
    assert 'gpud_collector_errors_total{collector="mps"} 2\n' in route.render()  # a counter across scrapes


def test_the_text_format():
    text = MetricsRoute(lambda: {"mig": Working()}).render()
    assert text.startswith("# HELP gpud_mig_in_sync 1 when every GPU has the desired MIG layout.\n"
                           "# TYPE gpud_mig_in_sync gauge\n"
                           'gpud_mig_in_sync{hostname="node-1"} 1\n')
    assert text.endswith("\n") and not text.endswith("\n\n")


class Counting:
    """A collector that counts how often it is read."""

    def __init__(self):
        self.reads = 0

    def collect(self):
        self.reads += 1
        family = Family("gpud_mig_in_sync", "1 when every GPU has the desired MIG layout.", "gauge")
        family.add({"hostname": "node-1"}, self.reads)
        yield family


# Guards issue 20 item 4: /metrics was rendered again for every request (3-5 ms with 56 MIG devices),
# so 64 readers held gpud's core. Now 50 concurrent requests over a real socket read the collectors
# once; a change the daemon reports, or the max age, makes the next request render again.
async def test_concurrent_scrapes_share_one_render_until_the_data_changes(short_tmp):
    collector, generation = Counting(), [0]
    route = MetricsRoute(lambda: {"mig": collector}, changes=lambda: generation[0], max_age_s=3600)
    app = web.Application()
    route.register(app)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(short_tmp / "m.sock")).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(short_tmp / "m.sock"))) as http:
            async def scrape() -> str:
                async with http.get("http://localhost/metrics") as response:
                    return await response.text()
            texts = await asyncio.gather(*(scrape() for _ in range(50)))
            assert collector.reads == 1 and route.renders == 1 and len(set(texts)) == 1
            generation[0] += 1  # the collectors' data changed
            assert 'gpud_mig_in_sync{hostname="node-1"} 2\n' in await scrape()
            route.max_age_s = 0.0  # too old at once
            await scrape()
            assert collector.reads == 3
    finally:
        await runner.cleanup()
