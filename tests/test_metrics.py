"""GET /metrics reads collectors: one that fails leaves its samples out, not the scrape."""

from __future__ import annotations

from gpud.api.metrics import MetricsRoute
from gpud.samples import Family


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
    route = MetricsRoute({"mps": Failing(), "mig": Working()})
    text = route.render()
    assert 'gpud_mig_in_sync{hostname="node-1"} 1\n' in text  # the others still answer
    assert "gpud_mps_daemon_up" not in text
    assert 'gpud_collector_errors_total{collector="mps"} 1\n' in text
    assert 'gpud_collector_errors_total{collector="mig"} 0\n' in text
    assert 'gpud_collector_errors_total{collector="mps"} 2\n' in route.render()  # a counter across scrapes


def test_the_text_format():
    text = MetricsRoute({"mig": Working()}).render()
    assert text.startswith("# HELP gpud_mig_in_sync 1 when every GPU has the desired MIG layout.\n"
                           "# TYPE gpud_mig_in_sync gauge\n"
                           'gpud_mig_in_sync{hostname="node-1"} 1\n')
    assert text.endswith("\n") and not text.endswith("\n\n")
