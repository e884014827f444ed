"""A real Prometheus (Debian package) scraping real exporter processes on loopback."""

from __future__ import annotations

import pytest

from harness import exporter, prometheus

pytestmark = pytest.mark.slow


def test_prometheus_scrapes_every_gpu_of_every_exporter() -> None:
    with (
        exporter("--simulate", "2", "--interval", "0.2") as a,
        exporter("--simulate", "3", "--interval", "0.2") as b,
        prometheus([a.address, b.address]) as prom,
    ):
        prom.wait_for_targets_up(2)
        result = prom.wait_for("count by (instance) (gpu_up == 1)")
        counts = {r["metric"]["instance"]: int(r["value"][1]) for r in result}
        assert counts == {a.address: 2, b.address: 3}
        # The exposition's types survive the trip: a counter can be rated.
        assert prom.wait_for("rate(gpu_energy_joules_total[5s])")
