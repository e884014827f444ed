"""One recorded series per GPU (gpu_exporter.choose.fleetpacked): the store filters
``gpu_fleet:packed`` with comparisons and ``%`` only, and the chooser ranks what passes; the
same choices as from every series.

The packed series are written here as the rule writes them (:func:`pack`), and the query
:func:`packed_query` builds is evaluated on them by a small evaluator of its own arithmetic;
tests/test_cluster_prometheus.py runs the rule and the query in Prometheus and in
VictoriaMetrics (vmalert), and deploy/prometheus/gpu-exporter.fleet.rules.test.yml the rule
in promtool.
"""

from __future__ import annotations

import random
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import pytest
from test_cluster import NOW, fixed_claimer, scraped, series
from test_fleet_sieve import figures, problems

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleet import rank_fleet
from gpu_exporter.choose.fleetpacked import (
    LARGEST,
    MIB,
    pack,
    packable,
    packed_query,
    presence_query,
    unpack,
)
from gpu_exporter.choose.fleetsieve import Names, parse_sieve
from gpu_exporter.choose.promql import parse_fleet
from gpu_exporter.client.fleet import choose_fleet

GIB = 2**30
MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")


def random_fleet(rnd: random.Random, hosts: int = 40) -> dict[str, list[dict[str, Any]]]:
    """Raw answers: figures as NVML gives them (whole percents), some cards down, leased,
    allocated to pods, and hosts with problems."""
    values: list[dict[str, Any]] = []
    for h in range(hosts):
        instance = f"h{h:02d}:9400"
        sampled_ago = 200.0 if h % 13 == 12 else 1.0  # a stuck sampler
        values += [
            series("gpu_exporter_nvml_up", 0 if h % 17 == 16 else 1, instance),
            series("gpu_exporter_last_sample_timestamp_seconds", NOW - sampled_ago, instance),
        ]
        for i in range(rnd.choice((1, 4, 8))):
            ids = {"gpu": str(i), "uuid": f"GPU-{h}-{i}"}
            up = rnd.random() > 0.05
            values += [
                series("gpu_up", int(up), instance, **ids),
                series("gpu_leased", int(rnd.random() < 0.1), instance, **ids),
                series("gpu_info", 1, instance, name=rnd.choice(MODELS), **ids),
            ]
            if rnd.random() < 0.08:
                pod = {"namespace": "ml", "pod": f"train-{h}-{i}", "container": "main"}
                values.append(series("gpu_pod_info", 1, instance, **ids, **pod))
            if not up:
                continue
            free = rnd.choice((8 * GIB, 40 * GIB, 40 * GIB - MIB, 41 * GIB + 7, 79 * GIB + 5 * MIB))
            values += [
                series("gpu_memory_free_bytes", free, instance, **ids),
                series(
                    "gpu_utilization_ratio",
                    rnd.choice((0, 5, 10, 11, 50, 97)) / 100,
                    instance,
                    **ids,
                ),
                series(
                    "gpu_memory_utilization_ratio",
                    rnd.choice((0, 30, 50, 51, 90)) / 100,
                    instance,
                    **ids,
                ),
                series("gpu_compute_processes", rnd.choice((0, 0, 1, 2, 12)), instance, **ids),
            ]
    instances = sorted({s["metric"]["instance"] for s in values})
    return {
        "values": values,
        "scraped": [scraped(i, 400.0 if i == "h05:9400" else 2.0) for i in instances],
        "down": [series("up", 0, "h07:9400")],
    }


def recorded(results: Mapping[str, Any]) -> list[tuple[dict[str, str], int, str]]:
    """What the rule records: (labels, packed value, model) per card that can be handed out."""
    pods = {
        (s["metric"]["instance"], s["metric"]["uuid"])
        for s in results["values"]
        if s["metric"]["__name__"] == "gpu_pod_info"
    }
    names = {
        (s["metric"]["instance"], s["metric"]["uuid"]): s["metric"]["name"]
        for s in results["values"]
        if s["metric"]["__name__"] == "gpu_info"
    }
    out = []
    for key, entry in figures(results).items():
        if entry.get("gpu_up") != 1 or entry.get("gpu_leased") == 1 or key in pods:
            continue
        labels = {k: v for k, v in entry["labels"].items() if k != "__name__"}
        value = pack(
            memory_free_bytes=int(entry["gpu_memory_free_bytes"]),
            utilization_ratio=entry["gpu_utilization_ratio"],
            memory_utilization_ratio=entry["gpu_memory_utilization_ratio"],
            compute_processes=int(entry["gpu_compute_processes"]),
        )
        out.append((labels, value, names[key]))
    return out


def evaluate(expr: str, results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The store's answer to packed_query: its comparisons and ``%`` applied in order (exact
    in float64, as in the store), and its ``gpu_info`` join for ``model``."""
    arithmetic, _, model = expr.partition(" and on(instance, job, uuid) ")
    ops = re.findall(r"(<|>=|%) (\d+)", arithmetic.split("}")[-1].split(":packed")[-1])
    wanted = re.search(r'name=~"\(\?i\)\.\*(.*)\.\*"', model)
    out = []
    for labels, value, name in recorded(results):
        v: float | None = float(value)
        for op, number in ops:
            if v is None:
                break
            if op == "%":
                v = v % float(number)
            elif (op == "<" and not v < float(number)) or (op == ">=" and not v >= float(number)):
                v = None
        if v is None or (wanted and wanted.group(1).lower() not in name.lower()):
            continue
        out.append({"metric": labels, "value": [NOW, repr(v)]})
    return out


def test_the_packing_is_exact_and_unpacks() -> None:
    assert LARGEST < 2**53
    value = pack(
        memory_free_bytes=79 * GIB + 5,
        utilization_ratio=0.97,
        memory_utilization_ratio=0.5,
        compute_processes=12,  # capped at 9
    )
    assert value == 97 * 10**13 + 50 * 10**10 + 9 * 10**9 + 79 * 1024 * 10**3 + 97
    assert unpack(float(value)) == (79, 0.97)
    assert float(value) == value  # an exact float64


def test_only_what_the_packing_tests_exactly_is_packed() -> None:
    assert packable(Filters(min_free_bytes=40 * GIB, max_procs=0, model="A100"), "free", None)
    assert not packable(Filters(min_free_bytes=40 * 10**9), "free", None)  # not whole MiB
    assert not packable(Filters(max_procs=9), "free", None)  # capped at 9
    assert not packable(Filters(min_total_bytes=80 * GIB), "free", None)
    assert not packable(Filters(), "power", None) and not packable(Filters(), "free", 60)
    assert not packable(Filters(include=("0",)), "free", None)
    query = packed_query("gpu_fleet", Filters(model="A100"), Names("gpu_fleet", 'pool="a"'))
    assert query.startswith('(gpu_fleet:packed{pool="a"} % 1000000000) and on(instance, job, uuid)')
    assert 'gpu_fleet:gpu{field="info", uuid!~"MIG-.*", name=~"(?i).*A100.*", pool="a"}' in query
    assert presence_query("gpu_fleet", 'pool="a"') == 'count(gpu_fleet:packed{pool="a"})'


@pytest.mark.parametrize("seed", range(12))
def test_the_packed_read_chooses_exactly_as_every_series_does(seed: int) -> None:
    rnd = random.Random(seed)
    results = random_fleet(rnd)
    full_fleet = parse_fleet(results, evaluated_at=NOW, max_age_seconds=60)
    for _ in range(6):
        filters = Filters(
            min_free_bytes=rnd.choice((None, 40 * GIB, 40 * GIB - MIB, 41 * GIB, 70 * GIB)),
            max_util_ratio=rnd.choice((None, 0.0, 0.1, 0.105, 0.5, 1.0)),
            max_mem_util_ratio=rnd.choice((None, 0.3, 0.5, 0.505)),
            max_procs=rnd.choice((None, 0, 1, 2)),
            model=rnd.choice((None, None, "a100", "H100")),
        )
        n, spread, sort = rnd.choice((1, 2, 3, 4)), rnd.random() < 0.3, rnd.choice(("free", "util"))
        assert packable(filters, sort, None)
        answers = {
            "hosts": results["scraped"],
            "sieve": evaluate(packed_query("gpu_fleet", filters), results),
            "problems": problems(results),
        }
        packed = parse_sieve(answers, evaluated_at=NOW, max_age_seconds=60, unpack=unpack)
        full = rank_fleet(full_fleet, n, filters, sort=sort, spread=spread)
        quick = rank_fleet(packed, n, filters, sort=sort, spread=spread)
        case = (seed, filters, n, spread, sort)
        assert [(c.host.url, [g.uuid for g in c.qualified]) for c in quick.candidates] == [
            (c.host.url, [g.uuid for g in c.qualified]) for c in full.candidates
        ], case
        assert {h.url for h, _ in quick.passed_over} == {h.url for h, _ in full.passed_over}, case


def packed_fetch(results: Mapping[str, Any], asked: list[str], *, recorded: bool = True) -> Any:
    """A store with the fleet rules loaded (or, ``recorded=False``, without gpu_fleet:packed)."""
    from test_fleet_sieve import sieved

    def fetch(url: str, timeout: float) -> Any:
        expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        asked.append(expr)
        if expr.startswith("timestamp(") or expr == 'gpu_fleet:host{field="scraped_at"}':
            result = results["scraped"]
        elif expr.startswith("gpu_fleet:problem"):  # the stuck ones past max_age 60
            result = problems(results) if recorded else []
        elif expr.startswith("count(gpu_fleet:packed"):
            result = [{"metric": {}, "value": [NOW, "3"]}] if recorded else []
        elif "gpu_fleet:packed" in expr:
            result = evaluate(expr, results) if recorded else []
        elif expr.startswith("floor("):
            result = sieved(results, Filters(max_util_ratio=0.1))
        elif "fleet_problem" in expr:
            result = problems(results)
        elif "fleet_reason" in expr:
            result = [{"metric": {"fleet_reason": "gpus"}, "value": [NOW, "3"]}]
        elif expr.startswith("{__name__") and "gpu_fleet" not in expr:  # every raw series
            result = results["values"]
        elif expr.startswith("up"):
            result = results["down"]
        else:  # the view's other series are not loaded here
            result = []
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    return fetch


def test_a_choice_reads_the_packed_series_and_falls_back_to_the_sieve_without_them() -> None:
    results = random_fleet(random.Random(7), hosts=6)
    args = {"n": "1", "max_util": "10%", "max_mem_util": "100%"}
    picks = {}
    for recorded_there in (True, False):
        asked: list[str] = []
        choice = choose_fleet(
            args,
            prometheus="prom:9090",
            rule_prefix="gpu_fleet",
            sieve=True,
            fetch=packed_fetch(results, asked, recorded=recorded_there),
            claimer=fixed_claimer,
            wall_clock=lambda: NOW,
        )
        picks[recorded_there] = [(p.url, p.uuids) for p in choice.placements]
        read = [e for e in asked if "gpu_fleet:packed" in e or e.startswith("floor(")]
        if recorded_there:  # one read of one metric, no join
            assert len(read) == 1 and read[0] == "(gpu_fleet:packed < 110000000000000) % 1000000000"
        else:  # an empty answer, nothing recorded: the sieve
            assert read[0].startswith("(gpu_fleet:packed") and read[-1].startswith("floor(")
            assert "count(gpu_fleet:packed)" in asked
    assert picks[True] and picks[False]  # (the canned sieve answer here knows no pods)
    # No GPU passes, yet the series are there: a refusal, counted in the store as before.
    asked = []
    with pytest.raises(Exception, match="counted in the store"):
        choose_fleet(
            {"n": "9"},
            prometheus="prom:9090",
            rule_prefix="gpu_fleet",
            sieve=True,
            fetch=packed_fetch(results, asked),
            claimer=fixed_claimer,
            wall_clock=lambda: NOW,
        )
    assert not any(e.startswith("floor(") for e in asked)


def test_a_chooser_that_saw_a_large_fleet_reads_the_packed_series_with_the_scrape_times() -> None:
    from gpu_exporter.client import fleetread

    where = ("http://prom:9090", "", "gpu_fleet")
    fleetread._LARGE_FLEETS.discard(where)

    def choose(hosts: int) -> list[str]:
        asked: list[str] = []
        choose_fleet(
            {"n": "1", "max_util": "10%", "max_mem_util": "100%"},
            prometheus="prom:9090",
            rule_prefix="gpu_fleet",
            fetch=packed_fetch(random_fleet(random.Random(3), hosts=hosts), asked),
            claimer=fixed_claimer,
            wall_clock=lambda: NOW,
        )
        return asked

    for _ in range(2):  # past DETAIL_UP_TO_HOSTS
        asked = choose(510)
        assert where in fleetread._LARGE_FLEETS  # remembered: the next read asks all at once
        # the same three reads either way; the second time together
        assert sorted(e.split("{")[0].split(" ")[0] for e in asked) == [
            "(gpu_fleet:packed",
            "gpu_fleet:host",
            "gpu_fleet:problem",
        ]
    choose(20)  # a fleet that shrank below the size is read in full again, and forgotten
    assert where not in fleetread._LARGE_FLEETS
