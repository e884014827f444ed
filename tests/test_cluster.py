"""Choosing across hosts, from synthetic Prometheus API answers (no server, no network)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from conftest import build_stack
from fleets import (
    A100,
    GIB,
    NOW,
    by_url,
    claimed,
    exporter_series,
    fake_fetch,
    fixed_claimer,
    fleet_of,
    fleet_queries,
    gpu,
    host_results,
    scraped,
    series,
    uuid,
)
from gpu_exporter import client
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import filters_of, parse_cluster_args
from gpu_exporter.client import Choice
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.fleet.inventory import Fleet, Host
from gpu_exporter.fleet.placing import ClaimRefused, ClusterChoice, choose_fleet, place
from gpu_exporter.fleet.ranking import rank_fleet
from gpu_exporter.fleet.reading import PrometheusReader, parse_full
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.cluster import ClusterService
from harness import ROOT

# -- parsing -----------------------------------------------------------------------------------


def test_series_become_the_same_gpu_samples_choose_ranks() -> None:
    results = host_results(
        {
            "n1:9400": [
                *gpu("n1:9400", 0, free_gib=10, util=0.9, procs=2),
                *gpu("n1:9400", 1, leased=True),
                *gpu("n1:9400", 2, up=False),
            ]
        }
    )
    for sample in results["values"]:  # Prometheus' NaN
        if (
            sample["metric"]["__name__"] == "gpu_utilization_ratio"
            and sample["metric"]["gpu"] == "1"
        ):
            sample["value"][1] = "NaN"
    results["values"] += gpu("n1:9400", 0, uuid="MIG-1234")  # MIG devices are not whole cards
    (host,) = fleet_of(results).hosts
    assert host.url == "http://n1:9400" and host.name == "n1" and host.problem is None
    g0, g1, g2 = host.gpus
    assert (g0.index, g0.uuid, g0.up, g0.name) == (0, uuid("n1:9400", 0), True, A100)
    assert g0.memory_free_bytes == 10 * GIB and g0.memory_total_bytes == 80 * GIB
    assert g0.utilization_ratio == 0.9 and g0.compute_processes == 2
    assert g0.pci_bus_id == "00000000:00:00.0"
    assert g1.utilization_ratio is None  # NaN is absent, never 0
    assert host.leased == (g1.uuid,)
    assert not g2.up and g2.error == "gpu_up 0" and g2.memory_free_bytes is None
    assert host.age_seconds == pytest.approx(2.0)


def test_the_exporter_url_comes_from_the_instance_or_the_scrape_configs_label() -> None:
    label = {"gpu_exporter_url": "https://node2.lab:9443"}
    results = host_results({"node1:9400": gpu("node1:9400", 0)})
    results["values"] += exporter_series("node2", **label) + gpu("node2", 0, **label)
    results["scraped"].append(scraped("node2", **label))
    hosts = by_url(fleet_of(results))
    assert set(hosts) == {"http://node1:9400", "https://node2.lab:9443"}
    assert hosts["https://node2.lab:9443"].name == "node2.lab"
    assert hosts["https://node2.lab:9443"].instance == "node2"
    assert hosts["https://node2.lab:9443"].problem is None


def test_stale_figures_are_never_used_even_when_they_look_best() -> None:
    results = host_results({"old:9400": gpu("old:9400", 0, free_gib=79)}, scraped_ago=300)
    results["values"] += exporter_series("ok:9400") + gpu("ok:9400", 0, free_gib=5)
    results["scraped"].append(scraped("ok:9400", 1))
    # Scraped recently, but the exporter's own sampler stopped 200 s before that scrape.
    results["values"] += exporter_series("stuck:9400", sampled_ago=205) + gpu("stuck:9400", 0)
    results["scraped"].append(scraped("stuck:9400", 5))
    # No scrape timestamp at all: the age is unknown, so the figures are not trusted either.
    results["values"] += exporter_series("unknown:9400") + gpu("unknown:9400", 0)
    fleet = fleet_of(results)
    hosts = by_url(fleet)
    assert hosts["http://old:9400"].problem == "figures are 300 s old (max_age 60 s)"
    assert "last sample was 200 s old" in (hosts["http://stuck:9400"].problem or "")
    assert "unknown" in (hosts["http://unknown:9400"].problem or "")
    ranking = rank_fleet(fleet, 1, Filters())
    assert [c.host.url for c in ranking.candidates] == ["http://ok:9400"]
    assert {h.url for h, _ in ranking.passed_over} == {
        "http://old:9400",
        "http://stuck:9400",
        "http://unknown:9400",
    }
    # A larger bound accepts the old host, and then it wins.
    relaxed = parse_full(results, NOW, 400)
    assert rank_fleet(relaxed, 1, Filters()).candidates[0].host.url == "http://old:9400"


def test_down_targets_and_nvml_down_hosts_are_passed_over_with_the_reason() -> None:
    results = host_results({"ok:9400": gpu("ok:9400", 0)})
    results["values"] += exporter_series("nonvml:9400", nvml_up=0)
    results["scraped"].append(scraped("nonvml:9400"))
    results["down"] = [
        {"metric": {"__name__": "up", "instance": "gone:9400", "job": "gpu"}, "value": [NOW, "0"]},
        {"metric": {"__name__": "up", "instance": "db:9100", "job": "node"}, "value": [NOW, "0"]},
    ]
    # Still has figures (remote data has no staleness markers), but its last scrape failed.
    results["values"] += exporter_series("failing:9400") + gpu("failing:9400", 0)
    results["scraped"].append(scraped("failing:9400"))
    results["down"].append(
        {
            "metric": {"__name__": "up", "instance": "failing:9400", "job": "gpu"},
            "value": [NOW, "0"],
        }
    )
    hosts = by_url(fleet_of(results))
    assert set(hosts) == {
        "http://ok:9400",
        "http://nonvml:9400",
        "http://gone:9400",
        "http://failing:9400",
    }
    assert "target down" in (hosts["http://failing:9400"].problem or "")
    assert "target down" in (hosts["http://gone:9400"].problem or "")
    assert "NVML is down" in (hosts["http://nonvml:9400"].problem or "")


# -- ranking -----------------------------------------------------------------------------------


def test_all_n_gpus_come_from_one_host_whose_weakest_pick_is_best() -> None:
    results = host_results(
        {
            "a:9400": gpu("a:9400", 0, free_gib=79) + gpu("a:9400", 1, free_gib=10),
            "b:9400": gpu("b:9400", 0, free_gib=60) + gpu("b:9400", 1, free_gib=60),
            "c:9400": gpu("c:9400", 0, free_gib=79, util=0.95),
        }
    )
    fleet = fleet_of(results)
    two = rank_fleet(fleet, 2, Filters())
    assert [c.host.url for c in two.candidates] == ["http://b:9400", "http://a:9400"]
    assert [h.url for h, _ in two.passed_over] == ["http://c:9400"]
    assert "1 of 1 GPU qualifies, 2 requested" in two.passed_over[0][1]
    one = rank_fleet(fleet, 1, Filters())
    # 79 GiB idle beats 79 GiB busy (same free GiB, lower utilization) and 60 GiB.
    assert [c.host.url for c in one.candidates] == [
        "http://a:9400",
        "http://c:9400",
        "http://b:9400",
    ]
    busy_ok = rank_fleet(fleet, 1, filters_of(max_util=0.5, min_free=70 * GIB))
    assert [c.host.url for c in busy_ok.candidates] == ["http://a:9400"]
    assert [g.index for g in busy_ok.candidates[0].qualified] == [0]


def test_leased_and_down_gpus_do_not_qualify() -> None:
    results = host_results(
        {"a:9400": gpu("a:9400", 0, leased=True) + gpu("a:9400", 1, up=False) + gpu("a:9400", 2)}
    )
    (candidate,) = rank_fleet(fleet_of(results), 1, Filters()).candidates
    assert [g.index for g in candidate.qualified] == [2]
    (passed,) = rank_fleet(fleet_of(results), 2, Filters()).passed_over
    assert "leased (at the last scrape)" in passed[1] and "down: gpu_up 0" in passed[1]


def test_cards_the_kubelet_allocated_to_pods_are_passed_over_as_on_the_host() -> None:
    pod = {"namespace": "ml", "pod": "train-0", "container": "main"}
    ids = {"gpu": "0", "uuid": uuid("a:9400", 0)}
    results = host_results({"a:9400": gpu("a:9400", 0) + gpu("a:9400", 1, util=0.5)})
    results["values"].append(series("gpu_pod_info", 1, "a:9400", **ids, **pod))
    assert "gpu_pod_info" in fleet_queries(Filters(), "free", None)["values"]
    fleet = fleet_of(results)
    (candidate,) = rank_fleet(fleet, 1, Filters()).candidates
    assert [g.index for g in candidate.qualified] == [1]  # the better card is the pod's
    (passed,) = rank_fleet(fleet, 2, Filters()).passed_over
    assert "gpu 0: allocated to pod ml/train-0" in passed[1]
    # Past 500 exporters the store leaves them out: the packed series' rule.
    rules = (ROOT / "deploy" / "prometheus" / "gpu-exporter.fleet.rules.yml").read_text()
    assert "unless on(instance, job, uuid) gpu_pod_info" in rules


def test_idle_for_uses_the_worst_figure_of_the_window() -> None:
    results = host_results({"a:9400": gpu("a:9400", 0) + gpu("a:9400", 1) + gpu("a:9400", 2)})
    ids = {i: {"gpu": str(i), "uuid": uuid("a:9400", i)} for i in range(3)}

    def worst(field: str, value: float, i: int | None = None) -> dict[str, Any]:
        labels = {"fleet_field": field, **(ids[i] if i is not None else {})}
        return {
            "metric": {"instance": "a:9400", "job": "gpu", **labels},
            "value": [NOW, str(value)],
        }

    results["window"] = [
        worst("oldest", NOW - 299),  # history back to 1 s after the window's start: covered
        worst("up", 1, 0),
        worst("up", 1, 1),
        worst("up", 0, 2),  # down at some point in the window
        worst("utilization_ratio", 0.0, 0),
        worst("utilization_ratio", 0.8, 1),  # busy at some point
        worst("utilization_ratio", 0.0, 2),
    ]
    fleet = fleet_of(results, idle_for_seconds=300)
    ranking = rank_fleet(fleet, 1, filters_of(max_util=0.1))
    assert [g.index for g in ranking.candidates[0].qualified] == [0]
    reasons = rank_fleet(fleet, 3, filters_of(max_util=0.1)).passed_over[0][1]
    assert "gpu 1: within the last 300 s: utilization 0.80 > max_util 0.10" in reasons
    assert "gpu 2: within the last 300 s: down" in reasons
    # History that does not reach back far enough proves nothing.
    results["window"][0] = worst("oldest", NOW - 100)
    short = rank_fleet(fleet_of(results, idle_for_seconds=300), 1, filters_of(max_util=0.1))
    assert not short.candidates
    assert "only 160 s of history for idle_for 300 s" in short.passed_over[0][1]


def test_queries_ask_only_for_what_the_choice_needs() -> None:
    plain = fleet_queries(Filters(), "free", None)
    assert set(plain) == {"values", "scraped", "down"}
    assert "gpu_compute_processes" not in plain["values"]
    assert "gpu_power_draw_watts" not in plain["values"]
    assert "gpu_info" not in plain["values"]  # the biggest series, only when needed
    assert "gpu_info" in fleet_queries(Filters(model="A100"), "free", None)["values"]
    assert "gpu_info" in fleet_queries(Filters(exclude=("3b:00.0",)), "free", None)["values"]
    full = fleet_queries(filters_of(max_procs=0, max_util=0.1), "power", 300)
    assert "gpu_compute_processes" in full["values"] and "gpu_power_limit_watts" in full["values"]
    assert "max_over_time(gpu_utilization_ratio[300s])" in full["window"]
    assert "max_over_time(gpu_compute_processes[300s])" in full["window"]
    assert "min_over_time(gpu_memory_free_bytes" not in full["window"]
    narrowed = fleet_queries(filters_of(max_util=0.1), "free", 300, 'job="shared"')
    assert narrowed["values"].endswith('", job="shared"}')
    assert narrowed["scraped"].endswith('gpu_exporter_last_sample_timestamp_seconds{job="shared"})')
    assert 'max_over_time(gpu_utilization_ratio{job="shared"}[300s])' in narrowed["window"]
    with pytest.raises(ValueError, match="label matchers"):
        fleet_queries(Filters(), "free", None, 'job="x"} or vector(1) or up{a="b"')


# -- claiming ----------------------------------------------------------------------------------


def test_a_refusing_host_is_passed_over_and_the_next_one_claimed() -> None:
    results = host_results(
        {
            "a:9400": gpu("a:9400", 0) + gpu("a:9400", 1),
            "b:9400": gpu("b:9400", 0, free_gib=50) + gpu("b:9400", 1, free_gib=50),
        }
    )
    calls: list[tuple[str, int, tuple[str, ...]]] = []

    def claim(host: Host, n: int, include: tuple[str, ...]) -> Choice:
        calls.append((host.url, n, include))
        if host.url == "http://a:9400":
            raise ClaimRefused("0 of 2 GPUs qualify")
        return claimed(host, n, include)

    placements, passed = place(
        rank_fleet(fleet_of(results), 2, Filters()),
        2,
        spread=False,
        claim=claim,
        release=client.release,
    )
    assert [c[0] for c in calls] == ["http://a:9400", "http://b:9400"]
    assert calls[1][1:] == (2, (uuid("b:9400", 1), uuid("b:9400", 0)))  # best first
    assert [(p.host, p.lease_id) for p in placements] == [("b", "lease-b:9400")]
    assert [(h.url, why) for h, why in passed] == [
        ("http://a:9400", "refused: 0 of 2 GPUs qualify")
    ]


def test_spread_fills_the_best_host_first_and_gives_back_a_partial_claim() -> None:
    results = host_results(
        {
            "a:9400": gpu("a:9400", 0) + gpu("a:9400", 1),
            "b:9400": gpu("b:9400", 0, free_gib=40),
        }
    )
    ranking = rank_fleet(fleet_of(results), 3, Filters(), spread=True)
    placements, _ = place(ranking, 3, spread=True, claim=claimed, release=client.release)
    assert [(p.host, len(p.uuids)) for p in placements] == [("a", 2), ("b", 1)]
    no_lease = [Choice(("GPU-x",), (0,), None, None, "http://a:9400")]

    def partial(host: Host, n: int, include: tuple[str, ...]) -> Choice:
        if host.url == "http://b:9400":
            raise ClaimRefused(f"cannot reach {host.url}: connection refused")
        return no_lease.pop()

    placements, passed = place(ranking, 3, spread=True, claim=partial, release=client.release)
    assert placements == [] and "connection refused" in passed[-1][1]


def test_choose_fleet_end_to_end_over_a_synthetic_prometheus() -> None:
    results = host_results({"a:9400": gpu("a:9400", 0), "b:9400": gpu("b:9400", 0, util=0.5)})
    result = choose_fleet(
        {"n": "1", "max_util": "10%", "format": "env"},
        prometheus="prom:9090",
        fetch=fake_fetch({"prometheus": results}),
        claimer=fixed_claimer,
        release=client.release,
        wall_clock=lambda: NOW,
    )
    assert result.source == "prometheus" and not result.notes
    assert result.text("env") == (
        "export GPU_HOST=a GPU_EXPORTER_URL=http://a:9400 CUDA_DEVICE_ORDER=PCI_BUS_ID "
        f"CUDA_VISIBLE_DEVICES={uuid('a:9400', 0)} GPU_LEASE=lease-a:9400\n"
    )
    assert result.text("uuid") == f"a {uuid('a:9400', 0)}\n"
    assert result.to_json()["passed_over"][0]["url"] == "http://b:9400"
    with pytest.raises(ApiError) as info:
        choose_fleet(
            {"n": "3"},
            prometheus="prom:9090",
            fetch=fake_fetch({"prometheus": results}),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )
    assert info.value.status == 503 and info.value.code == "not_enough_gpus"
    assert "http://a:9400: 1 of 1 GPU qualifies, 3 requested" in info.value.message


def test_without_prometheus_the_named_hosts_are_asked_directly() -> None:
    def snapshot(free_gib: int, up: bool = True) -> dict[str, Any]:
        gpus = [
            {"index": 0, "uuid": "GPU-0", "up": up, "memory_free_bytes": free_gib * GIB},
            {"index": 1, "uuid": "GPU-1", "up": True, "memory_free_bytes": free_gib * GIB},
        ]
        return {"nvml_up": True, "snapshot_age_seconds": 0.5, "gpus": gpus}

    answers = {
        "http://a:9400/gpus": snapshot(20),
        "http://a:9400/leases": {"leases": []},
        "http://b:9401/gpus": snapshot(70),
        "http://b:9401/leases": {"leases": [{"id": "x", "gpus": ["GPU-1"]}]},
    }
    args = {"n": "2", "idle_for": "5m"}
    passed_on: list[Mapping[str, str]] = []

    def claimer(raw: Mapping[str, str], req: Any, fleet: Fleet, timeout: float) -> Any:
        passed_on.append(raw)
        assert not fleet.window_checked  # so idle_for goes to the host, which has the history
        return claimed

    result = choose_fleet(
        args,
        prometheus="http://prom:9090",
        hosts=["a", "b:9401", "c"],
        fetch=fake_fetch(answers),
        claimer=claimer,
        release=client.release,
        wall_clock=lambda: NOW,
    )
    assert result.source == "hosts" and result.placements[0].url == "http://a:9400"
    assert "cannot reach prom:9090" in result.notes[0]
    passed = {url: why for _, url, why in result.passed_over}
    assert "leased" in passed["http://b:9401"]  # b's GPU-1 is held
    assert "connection refused" in passed["http://c:9400"]
    with pytest.raises(ApiError) as info:
        choose_fleet(
            args,
            prometheus="http://prom:9090",
            fetch=fake_fetch(answers),
            claimer=fixed_claimer,
            release=client.release,
        )
    assert (info.value.status, info.value.code) == (503, "prometheus_unavailable")


def test_the_claim_rechecks_the_point_filters_on_the_host() -> None:
    args = {"n": "2", "max_util": "10%", "idle_for": "5m", "lease": "10m", "model": "A100"}
    req = parse_cluster_args(args)
    seen: dict[str, Any] = {}

    def fake_choose(n: int, url: str, **kwargs: Any) -> Choice:
        seen.update(kwargs, n=n, url=url)
        return claimed(Host(url, "h"), n, kwargs["include"])

    fleet = Fleet((), "prometheus", NOW, window_checked=True)
    claim = http_claimer(args, req, fleet, 5.0, choose_on_host=fake_choose)
    claim(Host("http://h:9400", "h"), 2, ("GPU-a", "GPU-b"))
    assert seen["include"] == ("GPU-a", "GPU-b") and seen["n"] == 2
    assert (seen["max_util"], seen["model"], seen["lease"]) == ("10%", "A100", "10m")
    assert "idle_for" not in seen  # judged from Prometheus' longer history instead


def test_cluster_parameters_are_checked_like_choose_parameters() -> None:
    assert parse_cluster_args({"n": "2", "spread": "true", "max_age": "2m"}).max_age_seconds == 120
    for args, param in [
        ({"spread": "2"}, "spread"),
        ({"max_age": "0"}, "max_age"),
        ({"spread": "1", "format": "env"}, "format"),
        ({"n": "0"}, "n"),
        ({"hosts": "a"}, "hosts"),  # not a server parameter: the server asks only Prometheus
    ]:
        with pytest.raises(ApiError) as info:
            parse_cluster_args(args)
        assert info.value.status == 400 and info.value.param == param


def test_cluster_choice_text_formats() -> None:
    a = Choice(("GPU-a", "GPU-b"), (0, 3), "l1", NOW, "http://n1:9400", host="n1")
    b = Choice(("GPU-c",), (1,), "l2", NOW, "http://n2:9400", host="n2")
    spread = ClusterChoice((a, b), "prometheus", spread=True, n=3)
    assert spread.text("uuid") == "n1 GPU-a,GPU-b\nn2 GPU-c\n"
    assert spread.text("index") == "n1 0,3\nn2 1\n"
    with pytest.raises(ValueError, match="one host"):
        spread.text("env")
    assert a.env()["GPU_HOST"] == "n1" and a.env()["GPU_EXPORTER_URL"] == "http://n1:9400"


def test_wait_reads_the_fleet_again_until_gpus_qualify() -> None:
    busy = host_results({"a:9400": gpu("a:9400", 0, util=0.9)})
    idle = host_results({"a:9400": gpu("a:9400", 0)})
    answers: dict[str, Any] = {"prometheus": busy}
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds
        answers["prometheus"] = idle  # the job on GPU 0 has ended meanwhile

    result = choose_fleet(
        {"n": "1", "max_util": "0.1", "wait": "1m"},
        prometheus="prom:9090",
        fetch=fake_fetch(answers),
        claimer=fixed_claimer,
        release=client.release,
        wall_clock=lambda: NOW,
        monotonic=lambda: now[0],
        sleep=sleep,
    )
    assert result.placements[0].url == "http://a:9400" and slept == [5.0]
    answers["prometheus"] = busy
    with pytest.raises(ApiError, match=r"utilization 0\.90 > max_util 0\.10"):
        choose_fleet(
            {"n": "1", "max_util": "0.1", "wait": "12s"},
            prometheus="prom:9090",
            fetch=fake_fetch({"prometheus": busy}),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
            monotonic=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["choose", "--spread"], "need --prometheus or --hosts"),
        (["choose", "--max-age", "2m"], "need --prometheus or --hosts"),
        (["choose", "--selector", 'job="x"'], "need --prometheus or --hosts"),
        (["choose", "--prometheus", "p:9090", "--selector", "job=x"], "label matchers"),
        (["choose", "--prometheus", "p:9090", "--url", "h:9400"], "not both"),
        (["choose", "--hosts", "a", "--spread", "--format", "env"], "not with --spread"),
        (["run", "--hosts", "a", "--url", "h:9400", "--", "true"], "not both"),
    ],
)
def test_the_command_line_refuses_contradictory_fleet_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpu_exporter.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_json_answer_keeps_to_the_openapi_schema() -> None:
    import jsonschema

    from gpu_exporter.web.openapi import document

    results = host_results({"a:9400": gpu("a:9400", 0), "b:9400": gpu("b:9400", 0, util=0.5)})
    result = choose_fleet(
        {"n": "1", "max_util": "10%"},
        prometheus="prom:9090",
        fetch=fake_fetch({"prometheus": results}),
        claimer=fixed_claimer,
        release=client.release,
        wall_clock=lambda: NOW,
    )
    schema = document()["components"]["schemas"]["Placements"]
    jsonschema.validate(result.to_json(), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**result.to_json(), "placements": [{"host": "a"}]}, schema)


def test_serve_refuses_a_selector_that_is_not_label_matchers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gpu_exporter.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--prometheus-url", "p:9090", "--prometheus-selector", "up or vector(1)"])
    assert info.value.code == 2
    assert "--prometheus-selector: expected label matchers" in capsys.readouterr().err


def test_the_removed_fleet_rule_prefix_flag_is_refused_clearly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recorded view is gone: the packed series are read wherever the store has them."""
    from gpu_exporter.cli import main

    for argv in (["serve"], ["choose", "--prometheus", "p:9090"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--fleet-rule-prefix", "gpu_fleet"])
        assert info.value.code == 2
        assert "unrecognized arguments: --fleet-rule-prefix" in capsys.readouterr().err


# -- /cluster/choose waits as /choose does -------------------------------------------------


def cluster_stack(**config: Any) -> Any:
    """An exporter serving /cluster/choose over a fleet where no GPU qualifies (all busy)."""
    s = build_stack(lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic), **config)
    busy = host_results({"a:9400": gpu("a:9400", 0, util=0.9)})
    s.daemon.services.cluster = ClusterService(
        PrometheusReader("prom:9090", fetch=fake_fetch({"prometheus": busy})),
        fixed_claimer,
        client.release,
    )
    return s


def test_cluster_waiters_take_the_same_slots_as_choose_waiters() -> None:
    s = cluster_stack(max_waiters=0)
    resp = s.client.get("/cluster/choose?n=1&max_util=10%&wait=6s&format=json")
    assert resp.status_code == 503
    assert resp.get_json()["error"]["code"] == "too_many_waiters"
    assert s.daemon.rejections.counts() == {"too_many_waiters": 1}
    assert s.daemon.services.waiters.active == 0


def test_shutdown_ends_a_waiting_cluster_choice_at_once() -> None:
    s = cluster_stack()
    answers: list[Any] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            s.client.get("/cluster/choose?n=1&max_util=10%&wait=1m&format=json")
        )
    )
    waiter.start()
    deadline = time.monotonic() + 10
    while s.daemon.services.waiters.active == 0:  # it waits for GPUs, holding a slot
        assert time.monotonic() < deadline, "the cluster choice never started waiting"
        time.sleep(0.01)
    stopped_at = time.monotonic()
    s.daemon.stopping.set()
    waiter.join(10)
    assert time.monotonic() - stopped_at < 1.0
    assert answers[0].status_code == 503
    assert answers[0].get_json()["error"]["code"] == "shutting_down"
    assert s.daemon.services.waiters.active == 0


# -- SM activity (GPM) across the fleet ---------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"


def gpm_fleet() -> dict[str, list[dict[str, Any]]]:
    """g: an H100 whose kernels keep utilization at 30 % while its SMs are 5 % active, and an
    A100 (no GPM) at 20 %; u: an A100 at 15 %."""
    return host_results(
        {
            "g:9400": gpu("g:9400", 0, util=0.3, sm_active=0.05, model=H100)
            + gpu("g:9400", 1, util=0.2),
            "u:9400": gpu("u:9400", 0, util=0.15),
        }
    )


def test_sm_activity_is_gpms_where_a_card_has_it_and_utilization_where_not() -> None:
    fleet = fleet_of(gpm_fleet())
    g, u = by_url(fleet)["http://g:9400"], by_url(fleet)["http://u:9400"]
    assert [x.sm_active_ratio for x in g.gpus] == [0.05, None]  # absent, never 0
    assert u.gpus[0].sm_active_ratio is None

    def picks(filters: Filters, sort: str = "free", n: int = 1) -> list[tuple[str, int]]:
        ranking = rank_fleet(fleet, n, filters, sort=sort, spread=True)
        return [(c.host.name, x.index) for c in ranking.candidates for x in c.qualified]

    # By utilization none is at most 10 %; by SM activity the H100 is.
    assert picks(filters_of(max_util=0.1)) == []
    assert picks(filters_of(max_sm_active=0.1)) == [("g", 0)]
    # The A100s are judged by their utilization: g's (20 %) fails 18 %, u's (15 %) passes.
    assert sorted(picks(filters_of(max_sm_active=0.18))) == [("g", 0), ("u", 0)]
    refused = rank_fleet(fleet, 2, filters_of(max_sm_active=0.18)).passed_over
    assert (
        "gpu 1: utilization (no GPM) 0.20 > max_sm_active 0.18"
        in dict((h.name, why) for h, why in refused)["g"]
    )
    # Least busy first: by utilization u's A100, by SM activity g's H100.
    assert picks(Filters(), "util")[0] == ("u", 0)
    assert picks(Filters(), "sm_active")[0] == ("g", 0)
    (pair,) = rank_fleet(fleet, 2, Filters(), sort="sm_active").candidates
    assert [x.index for x in pair.qualified] == [0, 1]


def test_sm_activity_is_asked_only_when_the_choice_needs_it() -> None:
    assert "gpu_sm_active_ratio" not in fleet_queries(Filters(), "util", 300)["values"]
    assert "gpu_sm_active_ratio" not in fleet_queries(Filters(), "free", None)["values"]
    for filters, sort in [(filters_of(max_sm_active=0.2), "free"), (Filters(), "sm_active")]:
        values = fleet_queries(filters, sort, None)["values"]
        assert "gpu_sm_active_ratio" in values and "gpu_utilization_ratio" in values
    window = fleet_queries(filters_of(max_sm_active=0.2), "free", 300, 'job="a"')["window"]
    # The worst of each over the window: SM activity, and utilization for the cards without GPM.
    assert (
        'max_over_time(gpu_sm_active_ratio{job="a"}[300s]), "fleet_field", "sm_active_ratio"'
        in window
    )
    assert (
        'max_over_time(gpu_utilization_ratio{job="a"}[300s]), "fleet_field", "utilization_ratio"'
        in window
    )
    assert window.count("gpu_utilization_ratio") == 1  # with max_util too, asked once
    both = fleet_queries(filters_of(max_sm_active=0.2, max_util=0.5), "free", 300)
    assert both["window"].count("gpu_utilization_ratio") == 1


def test_idle_for_judges_sm_activity_and_the_fallback_by_their_worst_in_the_window() -> None:
    results = gpm_fleet()
    ids = {
        (i, n): {"instance": i, "job": "gpu", "gpu": str(n), "uuid": uuid(i, n)}
        for i, n in (("g:9400", 0), ("g:9400", 1), ("u:9400", 0))
    }

    def worst(field: str, value: float, key: tuple[str, int]) -> dict[str, Any]:
        return {"metric": {**ids[key], "fleet_field": field}, "value": [NOW, str(value)]}

    results["window"] = [
        *(
            {
                "metric": {"instance": i, "job": "gpu", "fleet_field": "oldest"},
                "value": [NOW, NOW - 299],
            }
            for i in ("g:9400", "u:9400")
        ),
        *(worst("up", 1, key) for key in ids),
        worst("sm_active_ratio", 0.4, ("g:9400", 0)),  # its SMs were busy a minute ago
        worst("utilization_ratio", 0.5, ("g:9400", 0)),
        worst("utilization_ratio", 0.2, ("g:9400", 1)),
        worst("utilization_ratio", 0.6, ("u:9400", 0)),  # busy a minute ago: no GPM, judged by it
    ]
    fleet = fleet_of(results, idle_for_seconds=300)
    ranking = rank_fleet(fleet, 1, filters_of(max_sm_active=0.3))
    assert [(c.host.name, [x.index for x in c.qualified]) for c in ranking.candidates] == [
        ("g", [1])
    ]
    why = {h.name: r for h, r in rank_fleet(fleet, 2, filters_of(max_sm_active=0.3)).passed_over}
    assert "gpu 0: within the last 300 s: SM activity 0.40 > max_sm_active 0.30" in why["g"]
    assert "within the last 300 s: utilization (no GPM) 0.60 > max_sm_active 0.30" in why["u"]


def test_the_fleet_takes_max_sm_active_and_the_chosen_host_checks_it_again() -> None:
    args = {"n": "1", "max_sm_active": "10%", "sort": "sm_active", "lease": "0"}
    assert parse_cluster_args(args).choose.filters.get("max_sm_active") == 0.1
    seen: dict[str, Any] = {}

    def fake_choose(n: int, url: str, **kwargs: Any) -> Choice:
        seen.update(kwargs)
        return claimed(Host(url, "h"), n, kwargs["include"])

    result = choose_fleet(
        args,
        prometheus="prom:9090",
        fetch=fake_fetch({"prometheus": gpm_fleet()}),
        claimer=lambda *a: http_claimer(*a, choose_on_host=fake_choose),
        release=client.release,
        wall_clock=lambda: NOW,
    )
    assert [(p.url, p.uuids) for p in result.placements] == [
        ("http://g:9400", (uuid("g:9400", 0),))
    ]
    assert (seen["max_sm_active"], seen["sort"]) == ("10%", "sm_active")
    assert result.to_json()["filters"]["max_sm_active"]["value"] == 0.1


def test_the_named_hosts_carry_sm_activity_from_their_gpus_answer() -> None:
    def snapshot(*gpus: tuple[float, float | None]) -> dict[str, Any]:
        return {
            "nvml_up": True,
            "snapshot_age_seconds": 0.5,
            "gpus": [
                {"index": i, "uuid": f"GPU-{i}", "up": True, "memory_free_bytes": 70 * GIB,
                 "utilization_ratio": util, "sm_active_ratio": sm}
                for i, (util, sm) in enumerate(gpus)
            ],
        }  # fmt: skip

    answers = {
        "http://g:9400/gpus": snapshot((0.3, 0.05), (0.2, None)),
        "http://g:9400/leases": {"leases": []},
        "http://u:9400/gpus": snapshot((0.15, None)),
        "http://u:9400/leases": {"leases": []},
    }

    def chosen(**args: str) -> list[tuple[str, tuple[str, ...]]]:
        result = choose_fleet(
            {"lease": "0", "spread": "1", **args},
            hosts=["g", "u"],
            fetch=fake_fetch(answers),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )
        return [(p.url, p.uuids) for p in result.placements]

    assert chosen(n="1", max_sm_active="10%") == [("http://g:9400", ("GPU-0",))]
    assert chosen(n="1", sort="util") == [("http://u:9400", ("GPU-0",))]
    assert chosen(n="1", sort="sm_active") == [("http://g:9400", ("GPU-0",))]
    assert sorted(chosen(n="2", max_sm_active="18%")) == [  # g's GPU 1: 20 %, no GPM
        ("http://g:9400", ("GPU-0",)),
        ("http://u:9400", ("GPU-0",)),
    ]
