"""The fleet at scale (gpu_exporter.choose.fleetsieve): the store keeps only the GPUs that pass
the filters; the chooser ranks those and gets the same choice as from every series.

Canned answers here, computed from the raw series the way the sieve query computes them;
tests/test_cluster_prometheus.py runs the real queries against Prometheus and VictoriaMetrics.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Mapping
from typing import Any

import pytest
from test_cluster import NOW, exporter_series, fixed_claimer, fleet_of, gpu, host_results, scraped
from test_fleet_view import mixed_fleet

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleet import rank_fleet
from gpu_exporter.choose.fleetsieve import (
    DETAIL_UP_TO_HOSTS,
    Names,
    parse_sieve,
    problems_query,
    reasons_query,
    reasons_text,
    sievable,
    sieve_query,
    unpack,
)
from gpu_exporter.choose.params import ApiError
from gpu_exporter.client.fleet import choose_fleet

GIB = 2**30


def figures(results: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(instance, uuid) → {labels, metric name → value} from raw ``values``."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for sample in results["values"]:
        labels = sample["metric"]
        if "uuid" not in labels:
            continue
        entry = out.setdefault((labels["instance"], labels["uuid"]), {"labels": labels})
        entry[labels["__name__"]] = float(sample["value"][1])
    return out


def sieved(results: Mapping[str, Any], filters: Filters) -> list[dict[str, Any]]:
    """What sieve_query answers over these raw series (no defaulted filters here)."""
    out = []
    for entry in figures(results).values():
        free, util = entry.get("gpu_memory_free_bytes"), entry.get("gpu_utilization_ratio")
        if free is None or util is None or entry.get("gpu_up") != 1:
            continue
        if entry.get("gpu_leased") == 1 or entry["labels"]["uuid"].startswith("MIG-"):
            continue
        if filters.min_free_bytes is not None and free < filters.min_free_bytes:
            continue
        if filters.max_util_ratio is not None and util > filters.max_util_ratio:
            continue
        procs = entry.get("gpu_compute_processes")
        if filters.max_procs is not None and (procs is None or procs > filters.max_procs):
            continue
        labels = {k: v for k, v in entry["labels"].items() if k != "__name__"}
        out.append({"metric": labels, "value": [NOW, repr(math.floor(free / GIB) + util / 2)]})
    return out


def problems(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What problems_query answers: NVML down, stuck samplers, failed scrapes."""
    scraped_at = {s["metric"]["instance"]: float(s["value"][1]) for s in results["scraped"]}
    out = []
    for sample in results["values"]:
        labels = sample["metric"]
        value = float(sample["value"][1])
        target = {"instance": labels["instance"], "job": labels["job"]}
        if labels["__name__"] == "gpu_exporter_nvml_up" and value == 0:
            out.append({"metric": {**target, "fleet_problem": "nvml_down"}, "value": [NOW, "0"]})
        if labels["__name__"] == "gpu_exporter_last_sample_timestamp_seconds":
            lag = scraped_at.get(labels["instance"], value) - value
            if lag > 60:
                problem = {**target, "fleet_problem": "stuck"}
                out.append({"metric": problem, "value": [NOW, str(lag)]})
    for sample in results["down"]:
        labels = {**sample["metric"], "fleet_problem": "target_down"}
        out.append({"metric": labels, "value": [NOW, "0"]})
    return out


def sieve_answers(results: Mapping[str, Any], filters: Filters) -> dict[str, Any]:
    return {
        "hosts": results["scraped"],
        "sieve": sieved(results, filters),
        "problems": problems(results),
    }


def test_the_sieve_query_joins_the_filters_in_the_store() -> None:
    filters = Filters(min_free_bytes=40 * GIB, max_util_ratio=0.1, max_procs=0, model="A100")
    raw = sieve_query(Names(), filters)
    assert raw.startswith('floor((gpu_memory_free_bytes{uuid!~"MIG-.*"} >= 42949672960)')
    assert "+ ignoring(field) ((gpu_utilization_ratio" in raw  # keeps gpu, gpu_exporter_url
    assert 'unless on(instance, job, uuid) (gpu_leased{uuid!~"MIG-.*"} == 1)' in raw
    assert 'and on(instance, job, uuid) (gpu_compute_processes{uuid!~"MIG-.*"} <= 0)' in raw
    assert 'gpu_info{uuid!~"MIG-.*", name=~"(?i).*A100.*"}' in raw
    view = sieve_query(Names("gpu_fleet", 'pool="a"'), filters)
    assert 'gpu_fleet:gpu{field="memory_free_bytes", uuid!~"MIG-.*", pool="a"}' in view
    assert "gpu_memory_free_bytes" not in view
    # A defaulted filter lets an unknown figure pass, as rejection_reasons does.
    defaulted = sieve_query(Names(), Filters(max_procs=0, defaulted=("max_procs",)))
    assert 'unless on(instance, job, uuid) (gpu_compute_processes{uuid!~"MIG-.*"} > 0)' in defaulted
    assert "down" in problems_query(Names(), 60) and "> 60" in problems_query(Names(), 60)
    with pytest.raises(ValueError, match="label matchers"):
        Names("", 'x"} or vector(1')
    assert 'fleet_reason", "min_free"' in reasons_query(Names(), filters)


def test_only_what_the_store_can_filter_is_sieved() -> None:
    assert sievable(Filters(max_util_ratio=0.5), "free", None)
    assert sievable(Filters(), "pack", None) and sievable(Filters(), "util", None)
    assert not sievable(Filters(), "free", 300)  # idle_for: the window is per GPU
    assert not sievable(Filters(exclude=("0",)), "free", None)
    assert not sievable(Filters(), "power", None) and not sievable(Filters(), "free_ratio", None)


def test_unpacking_gives_whole_gib_and_utilization() -> None:
    for free_gib, util in ((79, 0.0), (40, 0.05), (8, 0.97), (0, 1.0), (4095, 0.333333)):
        assert unpack(free_gib + util / 2) == (free_gib, util)


@pytest.mark.parametrize(
    ("n", "filters", "spread"),
    [
        (1, Filters(), False),
        (2, Filters(), False),
        (1, Filters(max_util_ratio=0.1), False),
        (2, Filters(min_free_bytes=30 * GIB, max_procs=0), False),
        (3, Filters(max_util_ratio=0.5), True),
    ],
)
def test_a_sieved_fleet_ranks_as_every_series_does(n: int, filters: Filters, spread: bool) -> None:
    results = mixed_fleet()
    results["values"] += [
        *exporter_series("c:9400"),
        *gpu("c:9400", 0, free_gib=79, util=0.05),
        *gpu("c:9400", 1, free_gib=79.5, util=0.0),
        *gpu("c:9400", 2, free_gib=60),
    ]
    results["scraped"].append(scraped("c:9400"))
    results["values"] += exporter_series("stuck:9400", sampled_ago=205) + gpu("stuck:9400", 0)
    results["scraped"].append(scraped("stuck:9400", 5))
    full = rank_fleet(fleet_of(results), n, filters, spread=spread)
    fleet = parse_sieve(sieve_answers(results, filters), evaluated_at=NOW, max_age_seconds=60)
    assert fleet.sieved
    quick = rank_fleet(fleet, n, filters, spread=spread)
    assert [(c.host.url, [g.uuid for g in c.qualified]) for c in quick.candidates] == [
        (c.host.url, [g.uuid for g in c.qualified]) for c in full.candidates
    ]
    # The same hosts passed over; the problems said the same way.
    problems_full = {h.url: why for h, why in full.passed_over if h.problem}
    assert {h.url: why for h, why in quick.passed_over if h.problem} == problems_full
    assert {h.url for h, _ in quick.passed_over} == {h.url for h, _ in full.passed_over}
    assert "target down" in problems_full["http://dead:9400"]
    assert "last sample was 200 s old" in problems_full["http://stuck:9400"]


def sieve_fetch(results: Mapping[str, Any], asked: list[str]) -> Any:
    """A store answering the sieve's queries from canned raw series."""

    def fetch(url: str, timeout: float) -> Any:
        expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        asked.append(expr)
        if expr.startswith("timestamp("):
            result = results["scraped"]
        elif expr.startswith("floor("):
            result = sieved(results, Filters(max_util_ratio=0.1))
        elif "fleet_problem" in expr:
            result = problems(results)
        elif "fleet_reason" in expr:
            result = [
                {"metric": {"fleet_reason": "gpus"}, "value": [NOW, "6"]},
                {"metric": {"fleet_reason": "max_util"}, "value": [NOW, "1"]},
                {"metric": {"fleet_reason": "leased"}, "value": [NOW, "1"]},
            ]
        else:
            raise AssertionError(f"not a sieve query: {expr}")
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    return fetch


def test_a_sieved_choice_and_a_sieved_refusal() -> None:
    raw = mixed_fleet()
    asked: list[str] = []
    args = {"n": "1", "max_util": "10%"}
    result = choose_fleet(
        args,
        prometheus="prom:9090",
        fetch=sieve_fetch(raw, asked),
        claimer=fixed_claimer,
        wall_clock=lambda: NOW,
        sieve=True,
    )
    assert result.placements[0].url == "http://a:9400"
    assert len(asked) == 3  # the scrape times, then the sieve and the problems together
    passed = {url: why for _, url, why in result.passed_over}
    assert passed["http://stale:9400"] == "figures are 400 s old (max_age 60 s)"
    assert "target down" in passed["http://dead:9400"]
    with pytest.raises(ApiError) as info:
        choose_fleet(
            {"n": "2", "max_util": "10%"},
            prometheus="prom:9090",
            fetch=sieve_fetch(raw, []),
            claimer=fixed_claimer,
            wall_clock=lambda: NOW,
            sieve=True,
        )
    message = info.value.message
    assert message.startswith("no 2 GPUs qualify on one host (5 hosts; ")
    assert "http://a:9400: 1 GPU passes the filters, 2 requested" in message
    assert "http://dead:9400: target down" in message
    assert message.endswith(
        "of 6 GPUs (counted in the store; one may fail several filters): "
        "1 leased (at the last scrape), 1 with utilization > max_util 0.10"
    )


def test_small_fleets_read_every_series_and_large_ones_are_sieved() -> None:
    hosts = {f"h{i}:9400": gpu(f"h{i}:9400", 0) for i in range(DETAIL_UP_TO_HOSTS + 1)}
    results = host_results(hosts)
    for size, sieved_queries in ((DETAIL_UP_TO_HOSTS, False), (DETAIL_UP_TO_HOSTS + 1, True)):
        part = {**results, "scraped": results["scraped"][:size]}
        asked: list[str] = []

        def fetch(url: str, timeout: float, asked: list[str] = asked, part: Any = part) -> Any:
            expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
            if expr.startswith("{__name__"):
                asked.append("values")
                found = part["values"]
            elif expr.startswith("up"):
                found = []
            else:
                return sieve_fetch(part, asked)(url, timeout)
            return {"status": "success", "data": {"resultType": "vector", "result": found}}

        choose_fleet(
            {"n": "1"},
            prometheus="p:9090",
            fetch=fetch,
            claimer=fixed_claimer,
            wall_clock=lambda: NOW,
        )
        assert any(q.startswith("floor(") for q in asked) is sieved_queries
        assert ("values" in asked) is not sieved_queries


def test_the_refusal_counts_read_well() -> None:
    samples = [
        {"metric": {"fleet_reason": "gpus"}, "value": [NOW, "100000"]},
        {"metric": {"fleet_reason": "down"}, "value": [NOW, "1000"]},
        {"metric": {"fleet_reason": "min_free"}, "value": [NOW, "35000"]},
    ]
    text = reasons_text(samples, Filters(min_free_bytes=40 * GIB))
    assert text == (
        "of 100,000 GPUs (counted in the store; one may fail several filters): "
        "1,000 down, 35,000 with free memory < min_free 40.0 GiB"
    )


def test_leaving_out_the_gpus_that_surely_fail_never_changes_a_ranking() -> None:
    import random

    from gpu_exporter.choose.fleet import Fleet, Host, shortfall
    from gpu_exporter.choose.rank import NotEnoughGpus, rank
    from gpu_exporter.model import GpuSample

    rnd = random.Random(19)

    def maybe(value: Any) -> Any:
        return None if rnd.random() < 0.1 else value

    hosts = []
    for h in range(60):
        gpus = tuple(
            GpuSample(
                index=i,
                uuid=f"GPU-{h}-{i}",
                up=rnd.random() > 0.05,
                memory_free_bytes=maybe(rnd.choice((8, 40, 41, 79)) * GIB),
                utilization_ratio=maybe(rnd.choice((0.0, 0.05, 0.1, 0.5, 0.97))),
                memory_utilization_ratio=maybe(rnd.choice((0.0, 0.5, 0.9))),
                compute_processes=maybe(rnd.choice((0, 0, 1, 2))),
            )
            for i in range(8)
        )
        leased = tuple(g.uuid for g in gpus if rnd.random() < 0.05)
        hosts.append(Host(f"http://h{h}:9400", f"h{h}", gpus, leased))
    fleet = Fleet(tuple(hosts), "prometheus", NOW)
    for n, filters in (
        (1, Filters()),
        (2, Filters(min_free_bytes=40 * GIB, max_util_ratio=0.1, max_procs=0)),
        (3, Filters(max_util_ratio=0.5, max_mem_util_ratio=0.5, defaulted=("max_util",))),
    ):
        ranking = rank_fleet(fleet, n, filters)
        for candidate in ranking.candidates:
            full = rank(
                candidate.host.gpus,
                filters,
                leased=dict.fromkeys(candidate.host.leased, "leased (at the last scrape)"),
            )
            assert candidate.qualified == full.qualified
            assert candidate.shortfall == shortfall(full)
        for host, why in ranking.passed_over:  # every GPU's reasons, as before
            held = dict.fromkeys(host.leased, "leased (at the last scrape)")
            assert why == str(NotEnoughGpus(n, rank(host.gpus, filters, leased=held)))
