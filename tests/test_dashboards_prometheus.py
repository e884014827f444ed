"""The dashboards and rules against a real Prometheus scraping two simulated exporters.

Both exporters serve gpu_exporter/simulate/scenarios/fleet.toml (a saturated GPU, a throttled one, a GPU
that falls off the bus, ECC errors, Xids, idle and changing cards, a failing NVML call);
Prometheus loads the shipped rules.
Every panel, annotation and template-variable query must return data, and the alert
expressions must select exactly the simulated GPUs they are about. The first exporter runs
with ``--kubernetes`` against a fake kubelet (tests/fakekubelet.py), whose pods hold a whole
card, a card time-sliced by two pods and a MIG device, so the pod panels have data.
"""

from __future__ import annotations

import time

import pytest

import promql
from fakekubelet import fake_kubelet
from gpu_exporter.simulate import Scenario, SimulatedNvml
from harness import exporter, get, prometheus

pytestmark = pytest.mark.slow


def substitute(expr: str, instance: str) -> str:
    """What Grafana sends: variables filled in as for "All" (or the one host)."""
    return (
        expr.replace("$instance", instance)
        .replace("$gpu", ".*")
        .replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("$__interval", "15s")
    )


def test_every_dashboard_query_returns_data_and_alerts_select_the_right_gpus() -> None:
    scenario = str(promql.FLEET_SCENARIO)
    sim = SimulatedNvml.of(Scenario.from_argument(scenario), clock=time.monotonic).gpus
    pods = [
        ("ml", "train", [("trainer", [("nvidia.com/gpu", [sim[1].uuid])])]),
        ("team-a", "nb1", [("jupyter", [("nvidia.com/gpu", [sim[5].uuid + "::0"])])]),
        ("team-b", "nb2", [("jupyter", [("nvidia.com/gpu", [sim[5].uuid + "::1"])])]),
        ("ml", "infer", [("server", [("nvidia.com/mig-2g.20gb", [sim[4].mig_uuid(1)])])]),
        ("default", "web", [("nginx", [])]),
    ]
    with (
        fake_kubelet(pods) as kubelet,
        exporter(
            *("--simulate", scenario, "--interval", "0.5"),
            *(f"--kubernetes={kubelet.socket_path}", "--kubernetes.poll-interval", "0.5"),
        ) as a,
        exporter("--simulate", scenario, "--interval", "0.5") as b,
    ):
        # A lease (gpu_leased 1, /choose counted) on one host; not on GPU 7, which is lost
        # two seconds after start (and its lease released with it).
        status, body = get(a.base + "/choose?n=1&lease=10m&owner=dash&format=index&exclude=7")
        assert status == 200, body
        leased_gpu = body.strip()
        # A memory lease (issue 16) on another card: the memory-lease panel has data.
        status, body = get(a.base + "/choose?mem=4GiB&lease=10m&owner=dash&format=index&exclude=7")
        assert status == 200, body
        shared_gpu = body.strip()
        assert shared_gpu != leased_gpu
        with prometheus(
            [a.address, b.address], rule_files=[promql.RULES], job="gpu-exporter"
        ) as prom:
            prom.wait_for_targets_up(2)

            # -- template variables: label_values(selector, label) ----------------------------
            for board, name, selector, label in promql.variable_queries():
                values = prom.api(
                    f"label/{label}/values", **{"match[]": substitute(selector, ".*")}
                )
                if label == "instance":
                    assert set(values) >= {a.address, b.address}, (board, name, values)
                else:
                    values = prom.api(
                        f"label/{label}/values", **{"match[]": substitute(selector, a.address)}
                    )
                    assert sorted(values, key=int) == [str(i) for i in range(8)], (board, name)

            # -- every panel and annotation query ----------------------------------------------
            queries = {}
            for q in [*promql.panel_queries(), *promql.annotation_queries()]:
                host = a.address if q.where.startswith("gpu-host.json") else ".*"
                queries[q.where] = substitute(q.expr, host)
            no_data = prom.without_data(queries, timeout=45)
            assert no_data == {}, "queries without data:\n" + "\n".join(
                f"  {where}: {expr}" for where, expr in no_data.items()
            )

            # -- GPU memory by namespace/pod: each pod of host a, the time-sliced card's two
            # pods each with the card's memory, the MIG device's pod with the device's --------
            panel = next(
                q.expr for q in promql.panel_queries() if "GPU memory by namespace/pod" in q.where
            )
            by_pod = {
                (r["metric"]["namespace"], r["metric"]["pod"]): float(r["value"][1])
                for r in prom.wait_for(substitute(panel, a.address))
            }
            assert set(by_pod) == {
                ("ml", "train"),
                ("team-a", "nb1"),
                ("team-b", "nb2"),
                ("ml", "infer"),
            }
            card = f'instance="{a.address}", uuid="{sim[5].uuid}"'
            each_the_cards = prom.query(  # one evaluation: both pods have the card's memory
                f"count(sum by (pod) (gpu_pod_info{{{card}}} * on(instance, uuid) group_left "
                f"gpu_memory_used_bytes) == scalar(gpu_memory_used_bytes{{{card}}}))"
            )
            assert float(each_the_cards[0]["value"][1]) == 2
            assert prom.query(f'gpu_pod_info{{instance="{b.address}"}}') == []  # no --kubernetes

            # -- alert expressions select exactly the GPUs they are about ---------------------
            alerts = promql.alerts()

            def selected(alert: str) -> set[tuple[str, str]]:
                result = prom.wait_for(alerts[alert]["expr"], timeout=20)
                return {(r["metric"]["instance"], r["metric"]["gpu"]) for r in result}

            saturated = {(a.address, "0"), (b.address, "0")}
            assert selected("GpuMemorySaturated") == saturated
            assert selected("GpuUtilizationSaturated") == saturated
            assert selected("GpuDown") == {(a.address, "7"), (b.address, "7")}
            # The forgotten notebook: GPU 2, an H100 with 60 % of its memory held, SMs idle.
            assert selected("GpuMemoryHeldIdle") == {(a.address, "2"), (b.address, "2")}
            down = prom.query(alerts["GpuDown"]["expr"])
            assert {r["metric"].get("reason") for r in down} == {"lost"}
            quiet_alerts = (
                "GpuExporterNvmlDown",
                "GpuExporterStale",
                "GpuExporterTargetDown",
                "GpuExporterCannotSaveLeases",
                "GpuExporterGpusWithheld",
            )
            for quiet in quiet_alerts:
                assert prom.query(alerts[quiet]["expr"]) == [], quiet
            # The rules are loaded and evaluated: the saturation alert is pending (for: 10m).
            pending = prom.wait_for('ALERTS{alertname="GpuMemorySaturated"}', timeout=20)
            assert {(r["metric"]["instance"], r["metric"]["gpu"]) for r in pending} == saturated
            assert {r["metric"]["alertstate"] for r in pending} == {"pending"}

            # -- recording rules agree with the simulator ----------------------------------------
            leased = prom.wait_for(f'instance:gpu_leased:sum{{instance="{a.address}"}}')
            assert float(leased[0]["value"][1]) == 2.0  # one card whole, one shared
            assert prom.query(f'gpu_leased{{instance="{a.address}", gpu="{leased_gpu}"}} == 1')
            assert prom.query(f'gpu_leased{{instance="{a.address}", gpu="{shared_gpu}"}} == 1')
            reserved = prom.query(f'gpu_memory_leased_bytes{{instance="{a.address}"}}')
            assert [(r["metric"]["gpu"], float(r["value"][1])) for r in reserved] == [
                (shared_gpu, 4.0 * 2**30)
            ]
            assert prom.query(alerts["GpuLeaseMemoryOverrun"]["expr"]) == []
            counts = prom.query("instance:gpu_count:sum")
            assert {float(r["value"][1]) for r in counts} == {8.0}
            up = prom.query("instance:gpu_up:sum")
            assert {float(r["value"][1]) for r in up} == {7.0}
            # GPU 4 is split into two MIG devices: extra series, but no extra whole cards, and
            # not a free card. On host b the free whole cards (what /choose hands out under
            # the shipped defaults: at most 50 % busy and 50 % of memory used) are GPU 5 (half
            # its memory held by an invisible process, idle) and the lightly loaded GPU 6;
            # GPUs 1 and 3 come and go with their loads; 0 is saturated, 2 held by a forgotten
            # notebook and 7 lost.
            mig = prom.query("gpu_mig_info")
            assert sorted((r["metric"]["instance"], r["metric"]["gpu"]) for r in mig) == sorted(
                [(a.address, "4"), (a.address, "4"), (b.address, "4"), (b.address, "4")]
            )
            assert len(prom.query(f'gpu_up{{instance="{b.address}"}}')) == 10  # 8 cards + 2 MIG
            cards = prom.query(f'gpu:gpu_free:bool{{instance="{b.address}"}}')
            free = {r["metric"]["gpu"] for r in cards if float(r["value"][1]) == 1}
            assert {"5", "6"} <= free and not free & {"0", "2", "4", "7"}, free
            assert len(cards) == 7  # every whole card but the one in MIG mode: 1 or 0
            total = prom.query(f'instance:gpu_free:sum{{instance="{b.address}"}}')
            assert 2 <= float(total[0]["value"][1]) <= 4
