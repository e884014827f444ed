"""Made-up fleets for the fleet tests: a store's answers series by series, canned fetches and
claims, and ``gpu_fleet:packed``'s value written the way the rule computes it (also for
bench/fleet_store.py; the chooser only reads it)."""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from gpu_exporter.choose.filters import Filters
from gpu_exporter.client import Choice
from gpu_exporter.fleet.inventory import Fleet, Host
from gpu_exporter.fleet.packing import FIELDS, MIB
from gpu_exporter.fleet.queries import full_queries, scraped_query
from gpu_exporter.fleet.reading import SourceUnavailable, parse_full


def pack(
    *,
    memory_free_bytes: int,
    utilization_ratio: float,
    memory_used_bytes: int,
    memory_total_bytes: int,
    compute_processes: int,
) -> int:
    """What the rule records for one card (the bench writes it this way too)."""
    util = math.floor(utilization_ratio * 100 + 0.5)  # PromQL's round(): halves up
    figures = {
        "utilization_pct_test": util,
        "memory_used_pct": math.ceil(memory_used_bytes * 100 / memory_total_bytes),
        "compute_processes": compute_processes,
        "memory_free_mib": memory_free_bytes // MIB,
        "utilization_pct": util,
    }
    return sum(min(max(int(figures[f.name]), 0), f.top) * 10**f.low for f in FIELDS)


NOW = 1_800_000_000.0
GIB = 2**30
A100 = "NVIDIA A100-SXM4-80GB"


def fleet_queries(
    filters: Filters, sort: str, idle_for: float | None, selector: str = ""
) -> dict[str, str]:
    return {**full_queries(filters, sort, idle_for, selector), "scraped": scraped_query(selector)}


def uuid(host: str, index: int) -> str:
    return f"GPU-{host.replace(':', '-')}-{index}"


def series(metric: str, value: float | str, instance: str, **labels: str) -> dict[str, Any]:
    return {
        "metric": {"__name__": metric, "instance": instance, "job": "gpu", **labels},
        "value": [NOW, str(value)],
    }


def gpu(
    instance: str,
    index: int,
    *,
    free_gib: float = 79,
    util: float = 0.0,
    up: bool = True,
    leased: bool = False,
    procs: int = 0,
    model: str = A100,
    sm_active: float | None = None,  # GPM's gpu_sm_active_ratio: absent on a card without it
    **labels: str,
) -> list[dict[str, Any]]:
    ids = {"gpu": str(index), "uuid": uuid(instance, index), **labels}
    out = [
        series("gpu_up", int(up), instance, **ids),
        series("gpu_leased", int(leased), instance, **ids),
        series("gpu_info", 1, instance, name=model, pci_bus_id=f"00000000:{index:02X}:00.0", **ids),
    ]
    if up:
        out += [
            series("gpu_memory_free_bytes", int(free_gib * GIB), instance, **ids),
            series("gpu_memory_total_bytes", 80 * GIB, instance, **ids),
            series("gpu_utilization_ratio", util, instance, **ids),
            series("gpu_compute_processes", procs, instance, **ids),
        ]
        if sm_active is not None:
            out.append(series("gpu_sm_active_ratio", sm_active, instance, **ids))
    return out


def exporter_series(
    instance: str, *, sampled_ago: float = 1.0, nvml_up: int = 1, **labels: str
) -> list[dict[str, Any]]:
    return [
        series("gpu_exporter_nvml_up", nvml_up, instance, **labels),
        series("gpu_exporter_last_sample_timestamp_seconds", NOW - sampled_ago, instance, **labels),
    ]


def scraped(instance: str, ago: float = 2.0, **labels: str) -> dict[str, Any]:
    return {"metric": {"instance": instance, "job": "gpu", **labels}, "value": [NOW, NOW - ago]}


def host_results(
    hosts: Mapping[str, Iterable[dict[str, Any]]], *, scraped_ago: float = 2.0
) -> dict[str, list[dict[str, Any]]]:
    """``values`` and ``scraped`` answers for hosts {instance: GPU series}."""
    values: list[dict[str, Any]] = []
    for instance, gpus in hosts.items():
        values += exporter_series(instance) + list(gpus)
    return {
        "values": values,
        "scraped": [scraped(i, scraped_ago) for i in hosts],
        "down": [],
    }


def fleet_of(results: Mapping[str, Any], **kwargs: Any) -> Fleet:
    return parse_full(results, NOW, 60, **kwargs)


def by_url(fleet: Fleet) -> dict[str, Host]:
    return {h.url: h for h in fleet.hosts}


def claimed(host: Host, n: int, include: tuple[str, ...]) -> Choice:
    return Choice(include[:n], tuple(range(n)), f"lease-{host.instance}", NOW + 60, host.url)


def fake_fetch(answers: Mapping[str, Any]) -> Any:
    """A Fetch over canned answers: Prometheus queries by kind, exporter paths by URL."""

    def fetch(url: str, timeout: float) -> Any:
        if url in answers:
            answer = answers[url]
        else:
            split = urllib.parse.urlsplit(url)
            if split.path != "/api/v1/query" or "prometheus" not in answers:
                raise SourceUnavailable(f"cannot reach {split.netloc}: connection refused")
            expr = urllib.parse.parse_qs(split.query)["query"][0]
            kind = (
                "window" if "label_replace" in expr
                else "values" if expr.startswith("{__name__")
                else "scraped" if expr.startswith("timestamp(")
                else "down"
            )  # fmt: skip
            result = answers["prometheus"].get(kind, [])
            answer = {"status": "success", "data": {"resultType": "vector", "result": result}}
        if isinstance(answer, Exception):
            raise answer
        return answer

    return fetch


def fixed_claimer(*_: Any) -> Any:
    return claimed
