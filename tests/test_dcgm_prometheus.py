"""dcgm-exporter's dashboard and its users' queries against a real Prometheus scraping
gpu-exporter with ``--metric-names`` (tests/dcgmusage.py says where each query comes from).

One exporter serves the fleet scenario (MIG, a lost GPU, Xids, ECC …) with ``both``, so its
DCGM values can be compared with its own names from the same scrape, and ``--kubernetes``
against a fake kubelet (a pod holds a card, another a MIG device); a second serves ``dcgm``
alone, so the dashboard's ``$instance`` has two hosts.
"""

from __future__ import annotations

import re
import time

import pytest

import dcgmusage
import promql
from fakekubelet import fake_kubelet
from gpu_exporter.simulate import Scenario, SimulatedNvml
from harness import exporter, prometheus

pytestmark = pytest.mark.slow


def grafana(expr: str, instances: str) -> str:
    """What Grafana sends with "All" selected in both variables."""
    return expr.replace("$instance", instances).replace("$gpu", ".*")


def by_uuid(result: list[dict[str, object]], label: str) -> dict[str, float]:
    return {r["metric"][label]: float(r["value"][1]) for r in result}  # type: ignore[index]


def test_dcgm_exporters_dashboard_and_queries_on_gpu_exporter() -> None:
    scenario = str(promql.FLEET_SCENARIO)
    sim = SimulatedNvml.of(Scenario.from_argument(scenario), clock=time.monotonic).gpus
    pods = [
        ("ml", "train", [("trainer", [("nvidia.com/gpu", [sim[1].uuid])])]),
        ("ml", "infer", [("server", [("nvidia.com/mig-2g.20gb", [sim[4].mig_uuid(1)])])]),
    ]
    with (
        fake_kubelet(pods) as kubelet,
        exporter(
            *("--simulate", scenario, "--interval", "0.5", "--metric-names", "both"),
            *(f"--kubernetes={kubelet.socket_path}", "--kubernetes.poll-interval", "0.5"),
            env={"NODE_NAME": "node-a"},
        ) as a,
        exporter(
            *("--simulate", "2", "--interval", "0.5", "--metric-names", "dcgm"),
            env={"NODE_NAME": "node-b"},
        ) as b,
        prometheus([a.address, b.address]) as prom,
    ):
        prom.wait_for_targets_up(2)
        # Grafana's regex of the selected values, escaped for a PromQL string.
        instances = "|".join(re.escape(x).replace("\\", "\\\\") for x in (a.address, b.address))
        # The template variables list both hosts, and their GPUs.
        for variable, name in dcgmusage.DASHBOARD_VARIABLES.items():
            result = prom.wait_for(f"group by ({variable}) ({name})")
            values = {r["metric"][variable] for r in result}
            if variable == "instance":
                assert values == {a.address, b.address}
            else:
                assert {"0", "1"} <= values
        panels = {
            title: grafana(expr, instances)
            for title, expr in dcgmusage.DASHBOARD_PANELS.items()
            if title not in dcgmusage.PANELS_WAITING
        }
        assert prom.without_data(panels | dcgmusage.USER_QUERIES) == {}
        # A panel whose name waits for its gpu-exporter value has no data yet: when the value
        # is wired, this fails until PANELS_WAITING and NOT_SERVED lose it.
        for title, name in dcgmusage.PANELS_WAITING.items():
            assert name in dcgmusage.NOT_SERVED
            assert not prom.query(grafana(dcgmusage.DASHBOARD_PANELS[title], instances)), title
        # Per host under either label name: the two hosts.
        for label in dcgmusage.HOSTNAME_LABELS:
            hosts = prom.query(f"group by ({label}) (DCGM_FI_DEV_GPU_TEMP)")
            assert {r["metric"][label] for r in hosts} == {"node-a", "node-b"}
        # The values are gpu-exporter's own, converted (same scrape, same snapshot).
        only_a = f'instance="{a.address}"'
        for name, ours in dcgmusage.CONVERSIONS.items():
            theirs = prom.query(f'{name}{{{only_a}, GPU_I_ID=""}}')
            own = prom.query(
                f'label_replace(({ours}) and on(instance, uuid) gpu_up{{{only_a}, uuid=~"GPU-.*"}}, '
                '"UUID", "$1", "uuid", "(.*)")'
            )
            assert theirs, name
            expected = by_uuid(own, "UUID")
            assert by_uuid(theirs, "UUID") == pytest.approx(expected, rel=1e-9, abs=1e-9), name
        # A MIG device's memory, with its instance labels and its parent's UUID.
        mig = prom.query(f'DCGM_FI_DEV_FB_USED{{{only_a}, GPU_I_ID!=""}}')
        assert mig and all(r["metric"]["UUID"].startswith("GPU-") for r in mig)
        assert all(r["metric"]["GPU_I_PROFILE"] for r in mig)
        # dcgm-exporter's pod labels on the devices the kubelet gave to containers, and
        # gone from the next scrape once the pods are.
        held = prom.wait_for(f'DCGM_FI_DEV_FB_USED{{{only_a}, namespace="ml"}}')
        labels = {(r["metric"]["pod"], r["metric"]["container"], r["metric"]["gpu"]) for r in held}
        assert labels == {("train", "trainer", "1"), ("infer", "server", "4")}
        assert next(r for r in held if r["metric"]["pod"] == "infer")["metric"]["GPU_I_ID"]
        kubelet.pods = []
        deadline = time.monotonic() + 20
        while prom.query(f'DCGM_FI_DEV_GPU_TEMP{{{only_a}, pod!=""}}'):
            assert time.monotonic() < deadline, "pod labels outlived their pods"
            time.sleep(0.5)
        assert prom.query(f'DCGM_FI_DEV_GPU_TEMP{{{only_a}, gpu="1"}}')
        # dcgm mode alone: none of the families a DCGM name replaced.
        assert not prom.query(f'gpu_memory_used_bytes{{instance="{b.address}"}}')
        assert prom.query(f'gpu_up{{instance="{b.address}"}}')
