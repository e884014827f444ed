"""Every documented ``/choose`` and ``/cluster/choose`` parameter is heard, and a limit is one
row: the property that a parameter parsed and documented is never silently ignored.

* For each parameter of the OpenAPI document, some request changes the answer when the
  parameter is added (Hypothesis' ``find``: it fails when no input does). The answer is the
  whole outcome: on a host, the claim loop (:class:`~gpu_exporter.choose.claim.Claimer`) over
  made-up GPUs and their history, rendered as ``/choose`` renders it, under the shipped
  ``--choose-defaults``; across the fleet,
  :func:`~gpu_exporter.fleet.placing.choose_fleet` over a store faked from the same GPUs
  (answering the PromQL it is asked) and the hosts' own ``/choose`` (that same claim loop).
* Each limit row is handled by every place that judges limits: the fleet chooses as the host
  does (full read), the packed read tests it or leaves it to the full read, its series are
  exported, and every filter parameter lands in :class:`Filters` or the request.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from conftest import FakeClock, build_stack, sim_of
from fleets import NOW
from gpu_exporter.choose.claim import Claimer, Waiters, history_window
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.filters import BYTES, COUNT, RATIO, SHARE, Filters, Limit
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.params import BY_NAME, LIMITS, PARAMS
from gpu_exporter.choose.rank import rank
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import (
    REQUEST_FILTERS,
    filters_of,
    parse_choose_args,
    parse_cluster_args,
)
from gpu_exporter.choose.values import OfTotal
from gpu_exporter.client import Choice
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.client.transport import ServerError
from gpu_exporter.fleet.packing import NO_LIMIT, packable, packed_query, packed_test
from gpu_exporter.fleet.placing import choose_fleet
from gpu_exporter.fleet.queries import full_queries, scraped_query
from gpu_exporter.fleet.ranking import rank_fleet
from gpu_exporter.fleet.reading import VALUE_METRICS, parse_full
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.simulate import Load, SimGpu
from gpu_exporter.web.leaseapi import choice_text
from gpu_exporter.web.openapi import document

GIB = 2**30
A100, H100 = "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"
PAST_AGES = (600.0, 120.0)  # the history: the past figures this long ago, the present now
PAUSE_SECONDS = 600.0  # a waiting request's pause, on the fake clock: few pauses per wait
HOSTS = ("a:9400", "b:9400", "c:9400")


def documented(path: str) -> dict[str, Mapping[str, Any]]:
    """The query parameters of ``GET path`` in the OpenAPI document: name → schema."""
    op = document()["paths"][path]["get"]
    return {p["name"]: p["schema"] for p in op["parameters"] if p["in"] == "query"}


CHOOSE, CLUSTER = documented("/choose"), documented("/cluster/choose")


# -- what a parameter's value may be, from its schema ---------------------------------------


def values(schema: Mapping[str, Any]) -> st.SearchStrategy[str]:
    """Texts a parameter documented by ``schema`` takes: its enum, its examples, numbers in
    its range, durations, what its pattern matches; a plain string: words of a GPU's name."""
    if "enum" in schema:
        return st.sampled_from([str(v) for v in schema["enum"]])
    if schema.get("type") == "integer":
        low = schema.get("minimum", 0)
        return st.integers(low, min(schema.get("maximum", low + 8), low + 8)).map(str)
    choices: list[st.SearchStrategy[str]] = []
    if "examples" in schema:
        choices.append(st.sampled_from(schema["examples"]))
    if "pattern" in schema:
        if "(ms|s|m|h)" in schema["pattern"]:  # a duration
            choices.append(st.sampled_from(["0", "1s", "30s", "90s", "5m", "15m", "1h"]))
        choices.append(
            st.from_regex(schema["pattern"], fullmatch=True).filter(lambda t: len(t) < 40)
        )
    if not choices:
        words = st.sampled_from(["A100", "H100", "80GB", "x"])
        choices.append(
            words if "maxLength" not in schema else st.text("abc", min_size=1, max_size=8)
        )
    return st.one_of(choices)


def requests(schemas: Mapping[str, Mapping[str, Any]], name: str) -> st.SearchStrategy[Any]:
    """(other parameters, this one's value): up to two others, for context (``spread`` needs
    ``n``)."""
    pairs = st.lists(
        st.sampled_from(sorted(set(schemas) - {name})).flatmap(
            lambda other: st.tuples(st.just(other), values(schemas[other]))
        ),
        max_size=2,
    ).map(dict)
    return st.tuples(pairs, values(schemas[name]))


# -- made-up GPUs, their history, and the store's view of them -------------------------------


def figure(limit: Limit) -> st.SearchStrategy[Any]:
    """A figure a limit reads, in its unit, sometimes unknown."""
    unit = limit.unit
    if unit in (BYTES, SHARE):
        known: st.SearchStrategy[Any] = st.sampled_from([0, 2, 4, 8, 20, 40, 70, 80]).map(
            lambda g: g * GIB
        )
    elif unit is RATIO:
        known = st.sampled_from([0.0, 0.05, 0.2, 0.35, 0.5, 0.8, 1.0])
    elif unit is COUNT:
        known = st.integers(0, 4)
    else:  # a new unit: whole numbers that matter to limits such as the examples
        known = st.integers(0, 120).map(unit.kind)
    return st.one_of(st.none(), known, known)


# Every figure a limit reads (with its fallback's), and what the ranking orders by.
FIGURES: dict[str, st.SearchStrategy[Any]] = {
    **{field: figure(limit) for limit in LIMITS for field, _ in limit.figures},
    "power_draw_watts": st.sampled_from([60.0, 200.0, 400.0]),
    "power_limit_watts": st.just(700.0),
    "memory_total_bytes": st.sampled_from([4, 16, 40, 80]).map(lambda g: g * GIB),
}


class Card:
    """A GPU now and PAST_AGES ago. Not a dataclass: Hypothesis would print every field of
    both samples (and warn of a large repr)."""

    def __init__(self, now: GpuSample, past: GpuSample) -> None:
        self.now, self.past = now, past

    def __repr__(self) -> str:
        return f"Card({self.now.index})"


@st.composite
def cards(draw: st.DrawFn, count: int) -> tuple[Card, ...]:
    out = []
    for i in range(count):
        uuid = ("GPU-5a1e" if i == 1 else f"GPU-{i:04x}") + "0000-1111-2222-333333333333"
        same = {
            "index": i,
            "uuid": uuid,
            "name": draw(st.sampled_from([A100, H100])),
            "pci_bus_id": f"00000000:{0x3B + i:02X}:00.0",
            "memory_reserved_bytes": draw(st.sampled_from([0, GIB])),
            "fields_supported": draw(st.sampled_from([(), (("utilization", False),)])),
        }
        mig = draw(st.booleans()) and i == 2
        if mig:
            device = GpuSample(
                index=i,
                uuid=f"MIG-{i:04x}0000-1111-2222-333333333333",
                up=True,
                parent_uuid=uuid,
                gpu_instance_id=1,
                compute_instance_id=0,
                memory_total_bytes=10 * GIB,
                memory_free_bytes=10 * GIB,
            )
            same.update(mig_mode_enabled=True, mig_devices=(device,))
        now, past = ({k: draw(s) for k, s in FIGURES.items()} for _ in range(2))
        up = draw(st.sampled_from([True, True, True, False]))
        out.append(
            Card(
                GpuSample(up=up, **same, **now),
                GpuSample(
                    up=True, **same, **{**past, "memory_total_bytes": now["memory_total_bytes"]}
                ),
            )
        )
    return tuple(out)


class History:
    """The host's samples (:class:`~gpu_exporter.choose.claim.Snapshots`): the past figures
    at PAST_AGES, the present now."""

    def __init__(self, clock: FakeClock, gpus: Sequence[Card]) -> None:
        def at(age: float, which: str, sequence: int) -> Snapshot:
            return Snapshot(
                taken_at_seconds=clock.time() - age,
                monotonic_seconds=clock.monotonic() - age,
                sample_duration_seconds=0.01,
                nvml_up=True,
                simulated=True,
                gpus=tuple(getattr(c, which) for c in gpus),
                sequence=sequence,
            )

        past = tuple(at(age, "past", i) for i, age in enumerate(PAST_AGES, 1))
        self.snapshots = (*past, at(0.0, "now", len(past) + 1))

    def get(self) -> Snapshot:
        return self.snapshots[-1]

    def history(self) -> tuple[Snapshot, ...]:
        return self.snapshots


def host_claim(gpus: Sequence[Card], args: Mapping[str, str]) -> Any:
    """``/choose`` on a host of ``gpus``: (the request, what was claimed or the refusal, how
    long it waited)."""
    req = parse_choose_args(args, defaults=SHIPPED_DEFAULTS)  # ApiError: no answer to compare
    clock = FakeClock()
    claimer = Claimer(
        History(clock, gpus),
        LeaseTable(clock),
        Waiters(8),
        clock=clock,
        pause=lambda _: clock.advance(PAUSE_SECONDS),
    )
    start = clock.monotonic()
    try:
        outcome: Any = claimer.claim(req, "10.0.0.1")
    except ApiError as exc:
        outcome = exc
    return req, outcome, clock.monotonic() - start


def choose_answer(gpus: Sequence[Card], args: Mapping[str, str]) -> Any:
    """What ``/choose`` answers, in every detail but the lease's random id and token."""
    try:
        req, claimed, waited = host_claim(gpus, args)
    except ApiError:
        return None
    if isinstance(claimed, ApiError):
        return ("refused", claimed.status, claimed.code, str(claimed), waited)
    lease = claimed.lease
    shown = (
        "json"
        if req.format == "json"
        else choice_text(claimed.choice, None, req.format, req.mem_bytes)
    )
    return (
        shown,
        [g.uuid for g in claimed.choice.chosen],
        [(r.gpu.uuid, r.reasons) for r in claimed.choice.not_chosen],
        lease
        and (
            lease.uuids,
            lease.expires_at - lease.created_at,
            lease.owner,
            lease.pids,
            lease.mem_bytes,
        ),
        waited,
    )


def host_figures(gpu: GpuSample) -> dict[str, float]:
    """A card's series as its exporter exports them (``gpu_`` and the field), present only
    where known."""
    return {
        "gpu_" + name: float(value) for name in FIGURES if (value := getattr(gpu, name)) is not None
    }


def store(hosts: Mapping[str, tuple[float, Sequence[Card]]]) -> Callable[[str, float], Any]:
    """A Prometheus query API over the hosts' cards ({instance: (seconds since its last scrape,
    cards)}): answers the full read's queries by what they ask, their past at PAST_AGES."""

    def labels(instance: str, gpu: GpuSample, **more: str) -> dict[str, str]:
        return {"instance": instance, "job": "gpu", "gpu": str(gpu.index), "uuid": gpu.uuid, **more}

    def sample(metric: Mapping[str, str], value: float) -> dict[str, Any]:
        return {"metric": dict(metric), "value": [NOW, repr(value)]}

    def ask(expr: str) -> list[dict[str, Any]]:
        out = []
        if expr.startswith("timestamp("):
            return [
                sample({"instance": i, "job": "gpu"}, NOW - ago) for i, (ago, _) in hosts.items()
            ]
        if expr.startswith("{__name__=~"):
            asked = set(re.search(r'__name__=~"([^"]*)"', expr)[1].split("|"))  # type: ignore[index]
            for instance, (ago, gpus) in hosts.items():
                out.append(
                    sample(
                        {"__name__": "gpu_exporter_nvml_up", "instance": instance, "job": "gpu"}, 1
                    )
                )
                stamp = {
                    "__name__": "gpu_exporter_last_sample_timestamp_seconds",
                    "instance": instance,
                    "job": "gpu",
                }
                out.append(sample(stamp, NOW - ago - 1))
                for card in gpus:
                    gpu = card.now
                    series = {"gpu_up": float(gpu.up), "gpu_leased": 0.0, **host_figures(gpu)}
                    for name, value in series.items():
                        if name in asked:
                            out.append(sample(labels(instance, gpu, __name__=name), value))
                    if "gpu_info" in asked:
                        info = labels(
                            instance,
                            gpu,
                            __name__="gpu_info",
                            name=gpu.name or "",
                            pci_bus_id=gpu.pci_bus_id or "",
                        )
                        out.append(sample(info, 1))
            return out
        if expr.startswith("up"):
            return []
        assert expr.startswith("label_replace("), expr  # the window: each figure's worst
        for worst, series, seconds, field in re.findall(
            r'label_replace\((min|max)_over_time\((\w+)\[(\d+)s\]\), "fleet_field", "(\w+)"', expr
        ):
            ages = [age for age in (*PAST_AGES, 0.0) if age <= float(seconds)]
            pick = min if worst == "min" else max
            for instance, (ago, gpus) in hosts.items():
                if field == "oldest":  # the exporter has been scraped all along
                    exporter = {"instance": instance, "job": "gpu", "fleet_field": field}
                    out.append(sample(exporter, NOW - float(seconds) - ago))
                    continue
                for card in gpus:
                    seen = []
                    for age in ages:
                        gpu = card.now if age == 0 else card.past
                        value = {"gpu_up": float(gpu.up), **host_figures(gpu)}.get(series)
                        if value is not None:
                            seen.append(value)
                    if seen:
                        out.append(
                            sample(labels(instance, card.now, fleet_field=field), pick(seen))
                        )
        return out

    def fetch(url: str, timeout: float) -> Any:
        expr = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        return {"status": "success", "data": {"resultType": "vector", "result": ask(expr)}}

    return fetch


def cluster_answer(
    hosts: Mapping[str, tuple[float, Sequence[Card]]], args: Mapping[str, str]
) -> Any:
    """What ``/cluster/choose`` answers: the fleet's choice over the store, claimed on each
    chosen host through its own ``/choose`` (which checks the filters passed on again)."""
    try:
        req = parse_cluster_args(args, defaults=SHIPPED_DEFAULTS)
    except ApiError:
        return None
    elapsed = [0.0]

    def choose_on_host(
        n: int, url: str, *, lease: Any, owner: str | None, include: tuple[str, ...], **kw: Any
    ) -> Choice:
        passed = {
            k: str(v)
            for k, v in kw.items()
            if k not in ("wait", "timeout", "ignore_mask") and v is not None
        }
        asked = {"n": str(n), "include": ",".join(include), "lease": str(lease), **passed}
        if owner is not None:
            asked["owner"] = owner
        instance = urllib.parse.urlsplit(url).netloc
        _, claimed, _ = host_claim(hosts[instance][1], asked)
        if isinstance(claimed, ApiError):
            raise ServerError(claimed.status, str(claimed), code=claimed.code, param=claimed.param)
        lease_id = (
            None
            if claimed.lease is None
            else f"lease-{claimed.lease.owner}-{claimed.lease.mem_bytes}"
        )
        uuids = tuple(g.uuid for g in claimed.choice.chosen)
        return Choice(uuids, tuple(g.index for g in claimed.choice.chosen), lease_id, None, url)

    def sleep(seconds: float) -> None:
        elapsed[0] += PAUSE_SECONDS

    try:
        result = choose_fleet(
            args,
            claimer=lambda *a: http_claimer(*a, choose_on_host=choose_on_host),
            release=lambda _: None,
            prometheus="prom:9090",
            fetch=store(hosts),
            wall_clock=lambda: NOW,
            monotonic=lambda: elapsed[0],
            sleep=sleep,
            defaults=SHIPPED_DEFAULTS,
        )
    except ApiError as exc:
        return ("refused", exc.status, exc.code, str(exc), elapsed[0])
    fmt = req.choose.format
    try:
        text = result.text(fmt) if fmt != "json" else "json"
    except ValueError as exc:
        text = str(exc)
    return (
        text,
        [(c.url, c.uuids, c.lease_id) for c in result.placements],
        result.passed_over,
        elapsed[0],
    )


# -- the properties ------------------------------------------------------------------------

FIND = settings(
    max_examples=3000,
    database=None,
    derandomize=True,
    phases=[Phase.generate],  # the first input that changes the answer will do: no shrinking
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("name", sorted(CHOOSE))
def test_every_choose_parameter_changes_some_answer(name: str) -> None:
    def changes(case: tuple[tuple[Card, ...], tuple[dict[str, str], str]]) -> bool:
        gpus, (others, value) = case
        without = choose_answer(gpus, others)
        with_it = choose_answer(gpus, {**others, name: value})
        return None not in (without, with_it) and without != with_it

    find(
        st.tuples(st.integers(1, 4).flatmap(cards), requests(CHOOSE, name)), changes, settings=FIND
    )


fleets = st.lists(
    st.tuples(st.sampled_from([2.0, 45.0, 90.0]), st.integers(1, 3).flatmap(cards)),
    min_size=1,
    max_size=3,
).map(lambda hosts: dict(zip(HOSTS, hosts, strict=False)))


@pytest.mark.parametrize("name", sorted(CLUSTER))
def test_every_cluster_parameter_changes_some_answer(name: str) -> None:
    def changes(case: tuple[dict[str, Any], tuple[dict[str, str], str]]) -> bool:
        hosts, (others, value) = case
        without = cluster_answer(hosts, others)
        with_it = cluster_answer(hosts, {**others, name: value})
        return None not in (without, with_it) and without != with_it

    find(st.tuples(fleets, requests(CLUSTER, name)), changes, settings=FIND)


# -- each limit row, in every place that judges limits --------------------------------------


def test_every_filter_is_a_limit_a_field_of_filters_or_the_requests() -> None:
    structural = {f.name for f in fields(Filters)} - {"limits", "max_mig_devices", "defaulted"}
    for param in PARAMS:
        if param.filter:
            homes = [bool(param.limits), param.name in structural, param.name in REQUEST_FILTERS]
            assert homes.count(True) == 1, param.name
        # A size may also be given as a share: then, and only then, its SHARE row applies.
        shares = [limit.unit.share for limit in param.limits]
        assert shares.count(True) <= 1 and shares.count(False) <= 1, param.name
    assert structural <= set(BY_NAME)


def limit_values(limit: Limit) -> st.SearchStrategy[Any]:
    """Numbers a request may give the limit: in its unit, a share as a share."""
    if limit.unit is SHARE:
        return st.sampled_from([0.1, 0.25, 0.5, 0.9]).map(OfTotal)
    return figure(limit).filter(lambda v: v is not None)


def named(limit: Limit) -> str:
    return next(p.name for p in PARAMS if limit in p.limits)


@settings(max_examples=400, suppress_health_check=list(HealthCheck))
@given(
    gpus=st.integers(1, 4).flatmap(cards),
    limit=st.sampled_from(LIMITS),
    data=st.data(),
    idle_for=st.sampled_from([None, 300.0]),
)
def test_the_fleet_judges_each_limit_as_the_host_does(
    gpus: tuple[Card, ...], limit: Limit, data: st.DataObject, idle_for: float | None
) -> None:
    """The full read asks for every series a limit reads, fills the figure from it and ranks
    as the host ranks the same cards (over ``idle_for``: each figure's worst in the window)."""
    # A figure missing from a past sample: the host's window says "unknown", the store's
    # worst is over the samples it has (and with a fallback, each figure's worst is taken).
    if limit.fallback is not None or any(
        getattr(c.past, field) is None for c in gpus for field, _ in limit.figures
    ):
        idle_for = None
    gpus = tuple(c for c in gpus if not c.now.mig_mode_enabled)  # the full read has no MIG
    filters = filters_of(**{named(limit): data.draw(limit_values(limit))})
    window = None
    if idle_for:
        window = history_window(History(FakeClock(), gpus).history(), idle_for, 1000.0)
    host = rank([c.now for c in gpus], filters, window=window)
    ask = store({"a:9400": (2.0, gpus)})
    queries = {**full_queries(filters, "free", idle_for), "scraped": scraped_query()}
    answers = {
        kind: ask("/api/v1/query?" + urllib.parse.urlencode({"query": q}), 1)["data"]["result"]
        for kind, q in queries.items()
    }
    fleet = rank_fleet(parse_full(answers, NOW, 60, idle_for), 1, filters)
    qualified = [g.uuid for c in fleet.candidates for g in c.qualified]
    assert qualified == [g.uuid for g in host.qualified], (host.rejected, fleet.passed_over)


@settings(max_examples=200)
@given(limit=st.sampled_from(LIMITS), data=st.data())
def test_every_limit_is_tested_by_the_packed_read_or_left_to_the_full_read(
    limit: Limit, data: st.DataObject
) -> None:
    filters = filters_of(**{named(limit): data.draw(limit_values(limit))})
    if packed_test(filters.limits[0]) != NO_LIMIT:
        assert not packable(filters, "free", None, 60) or (
            packed_query(filters) != packed_query(Filters())
        )


def test_every_limit_reads_series_the_exporter_exports() -> None:
    s = build_stack(sim_of(SimGpu(0, H100, Load("busy"))), gpm_interval_seconds=5.0)
    s.sample()
    s.clock.advance(5.0)
    gpu = s.sample().gpus[0]
    for limit in LIMITS:
        for field, series in limit.figures:
            assert VALUE_METRICS[series][0] == field  # the fleet fills the figure from it
            assert s.value(series, 0) == pytest.approx(getattr(gpu, field)), series
