"""One recorded series per GPU (gpu_exporter.fleet.packing): the store filters
``gpu_fleet:packed`` with comparisons and ``%`` only, and the chooser ranks what passes; the
same choices as from every series.

The packed series are written here as the rule writes them (tests/fleets.py), and the query
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

from fleets import NOW, fixed_claimer, pack, scraped, series
from gpu_exporter import client
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.request import filters_of
from gpu_exporter.choose.values import OfTotal
from gpu_exporter.fleet.packing import (
    FIELDS,
    MIB,
    packable,
    packed_query,
    sm_active_query,
    unpack,
)
from gpu_exporter.fleet.placing import choose_fleet
from gpu_exporter.fleet.queries import reasons_query, reasons_text
from gpu_exporter.fleet.ranking import rank_fleet
from gpu_exporter.fleet.reading import PrometheusReader, parse_full, parse_packed

GIB = 2**30
MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")


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
            model = rnd.choice(MODELS)
            values += [
                series("gpu_up", int(up), instance, **ids),
                series("gpu_leased", int(rnd.random() < 0.1), instance, **ids),
                series("gpu_info", 1, instance, name=model, **ids),
            ]
            if rnd.random() < 0.08:
                pod = {"namespace": "ml", "pod": f"train-{h}-{i}", "container": "main"}
                values.append(series("gpu_pod_info", 1, instance, **ids, **pod))
            if not up:
                continue
            free = rnd.choice((8 * GIB, 40 * GIB, 40 * GIB - MIB, 41 * GIB + 7, 79 * GIB + 5 * MIB))
            util = rnd.choice((0, 5, 10, 11, 50, 97)) / 100
            if "H100" in model:  # GPM: SM activity grows with the square of utilization
                values.append(series("gpu_sm_active_ratio", round(util * util, 4), instance, **ids))
            values += [
                series("gpu_memory_free_bytes", free, instance, **ids),
                series("gpu_memory_total_bytes", 80 * GIB, instance, **ids),
                series("gpu_memory_used_bytes", 80 * GIB - free, instance, **ids),
                series("gpu_utilization_ratio", util, instance, **ids),
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
            memory_used_bytes=int(entry["gpu_memory_used_bytes"]),
            memory_total_bytes=int(entry["gpu_memory_total_bytes"]),
            compute_processes=int(entry["gpu_compute_processes"]),
        )
        out.append((labels, value, names[key]))
    return out


def evaluate(expr: str, results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The store's answer to packed_query: its comparisons and ``%`` applied in order (exact
    in float64, as in the store), its ``gpu_info`` join for ``model``, and its join with SM
    activity (utilization where a card has none) for ``max_sm_active``."""
    arithmetic, _, model = expr.partition(" and on(instance, job, uuid) ")
    ops = re.findall(r"(<|>=|%) (\d+)", arithmetic.split("}")[-1].split(":packed")[-1])
    wanted = re.search(r'name=~"\(\?i\)\.\*(.*)\.\*"', model)
    sm_test = re.search(
        r"\(\(gpu_sm_active_ratio or on\(instance, job, uuid\) gpu_utilization_ratio\) "
        r"<= ([0-9.e-]+)\)$",
        expr,
    )
    raw = figures(results)
    out = []
    for labels, value, name in recorded(results):
        if sm_test:
            card = raw[(labels["instance"], labels["uuid"])]
            sm = card.get("gpu_sm_active_ratio", card.get("gpu_utilization_ratio"))
            if sm is None or not sm <= float(sm_test.group(1)):
                continue
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
    assert sum(f.top * 10**f.low for f in FIELDS) < 2**53
    value = pack(
        memory_free_bytes=79 * GIB + 5,
        utilization_ratio=0.97,
        memory_used_bytes=40 * GIB,
        memory_total_bytes=80 * GIB,
        compute_processes=12,  # capped at 9
    )
    assert value == 97 * 10**13 + 50 * 10**10 + 9 * 10**9 + 79 * 1024 * 10**3 + 97
    assert unpack(float(value)) == (79, 0.97)
    assert float(value) == value  # an exact float64


def test_only_what_the_packing_tests_exactly_is_packed() -> None:
    assert packable(filters_of(min_free=40 * GIB, max_procs=0, model="A100"), "free", None, 60)
    assert not packable(filters_of(min_free=40 * 10**9), "free", None, 60)  # not whole MiB
    assert not packable(filters_of(max_procs=9), "free", None, 60)  # capped at 9
    assert not packable(filters_of(min_total=80 * GIB), "free", None, 60)
    assert packable(filters_of(max_mem_used=0.5, max_mem_util=1.0), "free", None, 60)
    assert not packable(filters_of(max_mem_used=0.505), "free", None, 60)  # not whole %
    assert not packable(filters_of(max_mem_util=0.5), "free", None, 60)  # not packed
    assert not packable(filters_of(min_free=OfTotal(0.25)), "free", None, 60)
    assert not packable(Filters(), "power", None, 60) and not packable(Filters(), "free", 60, 60)
    assert not packable(Filters(include=("0",)), "free", None, 60)
    assert not packable(Filters(), "free", None, 4)  # the rule records lags past 5 s only
    query = packed_query(Filters(model="A100"), 'pool="a"')
    assert query.startswith('(gpu_fleet:packed{pool="a"} % 1000000000) and on(instance, job, uuid)')
    assert 'gpu_info{name=~"(?i).*A100.*", pool="a"}' in query


@pytest.mark.parametrize("seed", range(12))
def test_the_packed_read_chooses_exactly_as_every_series_does(seed: int) -> None:
    rnd = random.Random(seed)
    results = random_fleet(rnd)
    full_fleet = parse_full(results, NOW, 60)
    for _ in range(6):
        filters = filters_of(
            min_free=rnd.choice((None, 40 * GIB, 40 * GIB - MIB, 41 * GIB, 70 * GIB)),
            max_util=rnd.choice((None, 0.0, 0.1, 0.105, 0.5, 1.0)),
            max_mem_used=rnd.choice((None, 0.3, 0.5, 0.51, 1.0)),
            max_procs=rnd.choice((None, 0, 1, 2)),
            model=rnd.choice((None, None, "a100", "H100")),
            max_sm_active=rnd.choice((None, None, 0.0, 0.01, 0.1, 0.25, 0.5)),
        )
        n, spread = rnd.choice((1, 2, 3, 4)), rnd.random() < 0.3
        sort = rnd.choice(("free", "util", "sm_active"))
        assert packable(filters, sort, None, 60)
        answers = {
            "scraped": results["scraped"],
            "packed": evaluate(packed_query(filters), results),
            "problems": problems(results),
        }
        if sort == "sm_active":
            query = urllib.parse.urlencode({"query": sm_active_query(filters)})
            sm = packed_fetch(results, [])(f"/api/v1/query?{query}", 1)
            answers["sm_active"] = sm["data"]["result"]
        packed = parse_packed(answers, NOW, 60)
        full = rank_fleet(full_fleet, n, filters, sort=sort, spread=spread)
        quick = rank_fleet(packed, n, filters, sort=sort, spread=spread)
        case = (seed, filters, n, spread, sort)
        assert [(c.host.url, [g.uuid for g in c.qualified]) for c in quick.candidates] == [
            (c.host.url, [g.uuid for g in c.qualified]) for c in full.candidates
        ], case
        assert {h.url for h, _ in quick.passed_over} == {h.url for h, _ in full.passed_over}, case


def packed_fetch(results: Mapping[str, Any], asked: list[str], *, recorded: bool = True) -> Any:
    """A store with the fleet rules loaded (or, ``recorded=False``, without gpu_fleet:packed)."""

    raw = figures(results)

    def fetch(url: str, timeout: float) -> Any:
        expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        asked.append(expr)
        if expr.startswith("timestamp("):
            result = results["scraped"]
        elif expr.startswith("gpu_fleet:problem"):  # the stuck ones past max_age 60
            result = problems(results) if recorded else []
        elif expr.startswith("gpu_sm_active_ratio and on(instance, job, uuid) ("):
            passing = evaluate(expr.partition(" (")[2][:-1], results) if recorded else []
            result = [
                {"metric": p["metric"], "value": [NOW, repr(sm)]}
                for p in passing
                if (sm := raw[(p["metric"]["instance"], p["metric"]["uuid"])].get(
                    "gpu_sm_active_ratio"
                )) is not None
            ]  # fmt: skip
        elif expr.startswith("count(gpu_fleet:packed"):
            result = [{"metric": {}, "value": [NOW, "3"]}] if recorded else []
        elif "gpu_fleet:packed" in expr:
            result = evaluate(expr, results) if recorded else []
        elif "fleet_reason" in expr:
            result = [{"metric": {"fleet_reason": "gpus"}, "value": [NOW, "3"]}]
        elif expr.startswith("{__name__"):  # every series
            result = results["values"]
        else:
            assert expr.startswith("up"), expr
            result = results["down"]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    return fetch


def test_a_choice_reads_the_packed_series_and_reads_every_series_without_them() -> None:
    results = random_fleet(random.Random(7), hosts=6)
    args = {"n": "1", "max_util": "10%", "max_mem_used": "100%"}
    picks = {}
    for recorded_there in (True, False):
        asked: list[str] = []
        fetch = packed_fetch(results, asked, recorded=recorded_there)
        choice = choose_fleet(
            args,
            prometheus=PrometheusReader("prom:9090", fetch=fetch, packed=True),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )
        picks[recorded_there] = [(p.url, p.uuids) for p in choice.placements]
        read = [e for e in asked if "gpu_fleet:packed" in e]
        if recorded_there:  # one read of one metric, no join
            assert read == ["(gpu_fleet:packed < 110000000000000) % 1000000000"]
            assert not any(e.startswith("{__name__") for e in asked)
        else:  # an empty answer, nothing recorded: every series
            assert "count(gpu_fleet:packed)" in asked
            assert any(e.startswith("{__name__") for e in asked)
    assert picks[True] == picks[False]
    # No GPU passes, yet the series are there: a refusal, with the reasons counted.
    with pytest.raises(Exception, match="counted in the store"):
        choose_fleet(
            {"n": "9"},
            prometheus=PrometheusReader("prom:9090", fetch=packed_fetch(results, []), packed=True),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )


def test_the_reader_remembers_a_large_fleet_and_reads_it_all_at_once() -> None:
    asked: list[str] = []
    reader = PrometheusReader("prom:9090")

    def choose(hosts: int) -> list[str]:
        asked.clear()
        reader.fetch = packed_fetch(random_fleet(random.Random(3), hosts=hosts), asked)
        choose_fleet(
            {"n": "1", "max_util": "10%", "max_mem_used": "100%"},
            prometheus=reader,
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )
        return sorted(e.split("{")[0].split(" ")[0] for e in asked)

    packed = [
        "(gpu_fleet:packed",
        "gpu_fleet:problem",
        "timestamp(gpu_exporter_last_sample_timestamp_seconds)",
    ]
    assert choose(510) == packed  # past 500 exporters: the scrape times, then the packed read
    assert reader.was_large  # remembered by the caller's reader: the next read asks at once
    assert choose(510) == packed
    assert "" in choose(20)  # a fleet that shrank is read in full again: {__name__=~"…"}
    assert not reader.was_large


def test_refusal_reasons_are_counted_in_the_store() -> None:
    samples = [
        {"metric": {"fleet_reason": "gpus"}, "value": [NOW, "100000"]},
        {"metric": {"fleet_reason": "down"}, "value": [NOW, "1000"]},
        {"metric": {"fleet_reason": "min_free"}, "value": [NOW, "35000"]},
    ]
    text = reasons_text(samples, filters_of(min_free=40 * GIB))
    assert text == (
        "of 100,000 GPUs (counted in the store; one may fail several filters): "
        "1,000 down, 35,000 with free memory < min_free 40.0 GiB"
    )


def test_sm_activity_is_tested_in_the_store_with_utilization_where_a_card_has_no_gpm() -> None:
    judged = (
        '(gpu_sm_active_ratio{pool="a"} or on(instance, job, uuid) gpu_utilization_ratio{pool="a"})'
    )
    query = packed_query(filters_of(max_util=0.5, max_sm_active=0.125), 'pool="a"')
    assert query == (
        '((gpu_fleet:packed{pool="a"} < 510000000000000) % 1000000000) '
        f"and on(instance, job, uuid) ({judged} <= 0.125)"
    )
    assert packable(filters_of(max_sm_active=0.125), "sm_active", None, 60)
    assert sm_active_query(filters_of(max_sm_active=0.125), 'pool="a"') == (
        'gpu_sm_active_ratio{pool="a"} and on(instance, job, uuid) ('
        + packed_query(filters_of(max_sm_active=0.125), 'pool="a"')
        + ")"
    )
    whole = '{uuid!~"MIG-.*", pool="a"}'
    counted = reasons_query(filters_of(max_sm_active=0.2), 'pool="a"')
    assert (
        f"label_replace(count((gpu_sm_active_ratio{whole} or on(instance, job, uuid) "
        f'gpu_utilization_ratio{whole}) > 0.2), "fleet_reason", "max_sm_active", "", "")'
    ) in counted
    samples = [
        {"metric": {"fleet_reason": "gpus"}, "value": [NOW, "100"]},
        {"metric": {"fleet_reason": "max_sm_active"}, "value": [NOW, "60"]},
    ]
    assert reasons_text(samples, filters_of(max_sm_active=0.2)) == (
        "of 100 GPUs (counted in the store; one may fail several filters): "
        "60 with SM activity (utilization without GPM) > max_sm_active 0.20"
    )


def test_a_packed_read_by_sm_activity_asks_it_of_the_passing_gpus_only() -> None:
    results = random_fleet(random.Random(5), hosts=8)
    picks = {}
    for packed in (True, False):
        asked: list[str] = []
        choice = choose_fleet(
            {"n": "2", "spread": "1", "max_sm_active": "10%", "sort": "sm_active", "lease": "0"},
            prometheus=PrometheusReader(
                "prom:9090", fetch=packed_fetch(results, asked), packed=packed
            ),
            claimer=fixed_claimer,
            release=client.release,
            wall_clock=lambda: NOW,
        )
        picks[packed] = [(p.url, p.uuids) for p in choice.placements]
        if packed:
            assert not any(e.startswith("{__name__") for e in asked)  # no full read
            (sm,) = [e for e in asked if e.startswith("gpu_sm_active_ratio and")]
            assert sm.endswith(" gpu_utilization_ratio) <= 0.1))")  # of those that pass
        else:
            (values,) = [e for e in asked if e.startswith("{__name__")]
            assert "gpu_sm_active_ratio" in values
    assert picks[True] == picks[False] and sum(len(u) for _, u in picks[True]) == 2


def test_the_committed_fleet_rules_equal_the_generators_output() -> None:
    import importlib.util
    import sys

    from harness import ROOT

    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts/generate_deploy.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    assert gen.FLEET_RULES.read_text() == gen.fleet_rules(), "run scripts/generate_deploy.py"


def test_leaving_out_the_gpus_that_surely_fail_never_changes_a_ranking() -> None:
    import random

    from gpu_exporter.choose.rank import NotEnoughGpus, rank
    from gpu_exporter.fleet.inventory import Fleet, Host
    from gpu_exporter.fleet.ranking import shortfall
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
                memory_total_bytes=80 * GIB,
                memory_used_bytes=maybe(rnd.choice((0, 40, 41, 72)) * GIB),
                compute_processes=maybe(rnd.choice((0, 0, 1, 2))),
            )
            for i in range(8)
        )
        leased = tuple(g.uuid for g in gpus if rnd.random() < 0.05)
        hosts.append(Host(f"http://h{h}:9400", f"h{h}", gpus, leased))
    fleet = Fleet(tuple(hosts), "prometheus", NOW)
    for n, filters in (
        (1, Filters()),
        (2, filters_of(min_free=40 * GIB, max_util=0.1, max_procs=0)),
        (3, filters_of(max_util=0.5, max_mem_util=0.5, defaulted=("max_util",))),
        (2, filters_of(max_util=0.5, max_mem_used=0.5, defaulted=("max_mem_used",))),
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


def test_reading_leaves_the_garbage_collector_alone() -> None:
    """No process-wide switch from a library: the collector stays as the caller set it."""
    import gc

    results = random_fleet(random.Random(5), hosts=6)
    seen: list[bool] = []
    store = packed_fetch(results, [])

    def fetch(url: str, timeout: float) -> Any:
        seen.append(gc.isenabled())
        return store(url, timeout)

    reader = PrometheusReader("prom:9090", fetch=fetch, packed=True)
    choose_fleet(
        {"n": "1", "max_util": "10%", "max_mem_used": "100%"},
        prometheus=reader,
        claimer=fixed_claimer,
        release=client.release,
        wall_clock=lambda: NOW,
    )
    assert seen and all(seen) and gc.isenabled()
