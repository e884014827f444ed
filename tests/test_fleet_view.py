"""The recorded fleet view (deploy/prometheus/gpu-exporter.fleet.rules.yml): one query, the
same fleet, the same choices and refusals as the raw series; the raw series when it is absent.

Canned answers here; tests/test_cluster_prometheus.py runs both paths against a real
Prometheus with the rules loaded (and the fallback against VictoriaMetrics without them).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from test_cluster import NOW, exporter_series, fixed_claimer, fleet_of, gpu, host_results, scraped

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleetview import FIELDS, from_view, view_query
from gpu_exporter.choose.params import ApiError
from gpu_exporter.client.fleet import choose_fleet

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


def to_view(results: Mapping[str, Any], prefix: str = "gpu_fleet") -> list[dict[str, Any]]:
    """What the shipped rules record for these raw answers (every target's `up` is 1 unless
    the `down` answer says 0)."""
    view = []
    for sample in results["values"]:
        labels = dict(sample["metric"])
        field = FIELDS[labels.pop("__name__")]
        kind = "host" if "uuid" not in labels else "gpu"
        view.append(
            {**sample, "metric": {"__name__": f"{prefix}:{kind}", "field": field, **labels}}
        )
    for sample in results["scraped"]:
        labels = {"__name__": f"{prefix}:host", "field": "scraped_at", **sample["metric"]}
        view.append({**sample, "metric": labels})
        view.append({"metric": {**labels, "field": "target_up"}, "value": [NOW, "1"]})
    for sample in results["down"]:
        labels = {k: v for k, v in sample["metric"].items() if k != "__name__"}
        labels = {"__name__": f"{prefix}:host", "field": "target_up", **labels}
        view.append({**sample, "metric": labels})
    return view


def mixed_fleet() -> dict[str, Any]:
    """Fresh, leased, busy, down GPUs; a stale host, an NVML-down host and a dead target."""
    results = host_results(
        {
            "a:9400": [
                *gpu("a:9400", 0),
                *gpu("a:9400", 1, leased=True),
                *gpu("a:9400", 2, up=False),
            ],
            "b:9400": [*gpu("b:9400", 0, util=0.9, procs=2), *gpu("b:9400", 1, free_gib=20)],
            "stale:9400": gpu("stale:9400", 0),
        }
    )
    results["scraped"] = [s for s in results["scraped"] if s["metric"]["instance"] != "stale:9400"]
    results["scraped"].append(scraped("stale:9400", ago=400))
    results["values"] += exporter_series("sick:9400", nvml_up=0) + gpu("sick:9400", 0)
    results["scraped"].append(scraped("sick:9400"))
    results["down"] = [
        {"metric": {"__name__": "up", "instance": "dead:9400", "job": "gpu"}, "value": [NOW, "0"]}
    ]
    return results


def test_the_view_gives_the_same_fleet_as_the_raw_series() -> None:
    raw = mixed_fleet()
    view = to_view(raw)
    assert fleet_of(from_view(copy.deepcopy(view))) == fleet_of(raw)
    problems = {h.instance: h.problem for h in fleet_of(from_view(view)).hosts if h.problem}
    assert set(problems) == {"stale:9400", "sick:9400", "dead:9400"}


def test_the_view_query_asks_only_for_the_fields_the_choice_needs() -> None:
    plain = view_query("gpu_fleet", Filters(), "free")
    assert "info" not in plain and "compute_processes" not in plain
    assert plain.startswith('{__name__=~"gpu_fleet:gpu|gpu_fleet:host"')
    picky = view_query("lab:fleet", Filters(model="A100", max_procs=0), "power", 'pool="x"')
    for field in ("info", "compute_processes", "power_draw_watts", "target_up", "scraped_at"):
        assert field in picky
    assert picky.endswith(', pool="x"}') and "lab:fleet:gpu" in picky
    with pytest.raises(ValueError, match="metric name prefix"):
        view_query('x"} or vector(1', Filters(), "free")


def view_fetch(view: list[dict[str, Any]], raw: Mapping[str, Any], asked: list[str]) -> Any:
    """A store answering the view query from ``view`` and the raw queries from ``raw``."""

    def fetch(url: str, timeout: float) -> Any:
        expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        asked.append(expr)
        if expr.startswith("gpu_fleet:host{"):  # the first read: the exporters' scrape times
            result = [s for s in copy.deepcopy(view) if s["metric"]["field"] == "scraped_at"]
        elif "gpu_fleet:gpu" in expr:
            result = copy.deepcopy(view)
        elif "label_replace" in expr:
            result = []
        elif expr.startswith("{__name__"):
            result = raw["values"]
        elif expr.startswith("timestamp("):
            result = raw["scraped"]
        else:
            result = raw["down"]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    return fetch


def choose(args: dict[str, str], fetch: Any, prefix: str) -> Any:
    return choose_fleet(
        args,
        prometheus="prom:9090",
        rule_prefix=prefix,
        fetch=fetch,
        claimer=fixed_claimer,
        wall_clock=lambda: NOW,
    )


def test_with_the_view_one_choice_is_two_small_queries_and_the_same_choice() -> None:
    raw = mixed_fleet()
    asked: list[str] = []
    with_view = choose(
        {"n": "1", "max_util": "10%"}, view_fetch(to_view(raw), raw, asked), "gpu_fleet"
    )
    # The scrape times first (they size the fleet: every series, or only the GPUs that pass,
    # docs/cluster.md), then one query for the rest.
    assert len(asked) == 2 and "gpu_fleet:host" in asked[0] and "gpu_fleet:gpu" in asked[1]
    without: list[str] = []
    plain = choose({"n": "1", "max_util": "10%"}, view_fetch([], raw, without), "")
    assert len(without) == 3  # scraped, then values and down
    assert with_view.to_json() == plain.to_json()
    assert with_view.placements[0].url == "http://a:9400"


def test_the_same_refusal_with_and_without_the_view() -> None:
    raw = mixed_fleet()
    messages = []
    for prefix, view in (("gpu_fleet", to_view(raw)), ("", [])):
        with pytest.raises(ApiError) as info:
            choose({"n": "3"}, view_fetch(view, raw, []), prefix)
        assert info.value.status == 503 and info.value.code == "not_enough_gpus"
        messages.append(info.value.message)
    assert messages[0] == messages[1]
    assert "http://dead:9400: target down" in messages[0]


def test_without_the_rules_the_raw_series_are_read() -> None:
    raw = mixed_fleet()
    asked: list[str] = []
    result = choose({"n": "1", "max_util": "10%"}, view_fetch([], raw, asked), "gpu_fleet")
    assert "gpu_fleet:host" in asked[0] and len(asked) == 4  # the view, then the raw three
    assert result.placements[0].url == "http://a:9400"


def test_idle_for_reads_the_window_from_the_raw_series_alongside_the_view() -> None:
    raw = mixed_fleet()
    asked: list[str] = []
    with pytest.raises(ApiError, match="idle_for"):
        choose({"n": "1", "idle_for": "5m"}, view_fetch(to_view(raw), raw, asked), "gpu_fleet")
    assert len(asked) == 3 and any("min_over_time(gpu_up" in q for q in asked)


def test_a_prefix_that_is_not_a_metric_name_is_refused() -> None:
    with pytest.raises(ApiError) as info:
        choose({"n": "1"}, view_fetch([], mixed_fleet(), []), 'gpu"} or vector(1')
    assert info.value.status == 400 and info.value.param == "fleet_rule_prefix"


def test_serve_refuses_a_bad_prefix_and_choose_one_without_prometheus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gpu_exporter.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--prometheus-url", "p:9090", "--fleet-rule-prefix", "a b"])
    assert info.value.code == 2
    assert "--fleet-rule-prefix: expected a metric name prefix" in capsys.readouterr().err
    assert main(["choose", "--fleet-rule-prefix", "gpu_fleet"]) != 0
    assert "--fleet-rule-prefix" in capsys.readouterr().err


def test_promtool_unit_tests_of_the_fleet_rules_pass() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    out = subprocess.run(
        [promtool, "test", "rules", "gpu-exporter.fleet.rules.test.yml"],
        cwd=RULES,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_serve_hands_the_prefix_to_cluster_choose() -> None:
    from conftest import build_stack
    from gpu_exporter.simulate import SimulatedNvml

    s = build_stack(
        lambda c: SimulatedNvml.with_gpus(1, clock=c.monotonic),
        prometheus_url="http://prom:9090",
        fleet_rule_prefix="gpu_fleet",
    )
    cluster = s.daemon.services.cluster
    assert cluster is not None and cluster.rule_prefix == "gpu_fleet"


def test_the_fleet_is_decoded_and_parsed_with_the_cyclic_gc_paused_then_restored() -> None:
    import gc

    from gpu_exporter.client.fleetread import gc_paused

    raw = mixed_fleet()
    seen: list[bool] = []
    answer = view_fetch([], raw, [])

    def fetch(url: str, timeout: float) -> Any:
        seen.append(gc.isenabled())
        return answer(url, timeout)

    assert gc.isenabled()
    choose({"n": "1", "max_util": "10%"}, fetch, "")
    assert seen == [False, False, False] and gc.isenabled()
    with gc_paused():  # overlapping reads share the pause; the last one out restores it
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
