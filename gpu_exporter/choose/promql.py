"""The fleet as Prometheus shows it: the PromQL to ask, and the hosts from its answers (pure).

1. :func:`fleet_queries`: a few instant queries, evaluated at one moment: the per-GPU series
   this choice needs (``gpu_up``, ``gpu_leased``, free memory, utilization, ``gpu_info`` …,
   :func:`needed_metrics`), the scrape time of every exporter
   (``timestamp(gpu_exporter_last_sample_timestamp_seconds)``), the targets that are down
   (``up == 0``) and, for ``idle_for``, the worst figure of the window from range functions
   (``max_over_time``, ``min_over_time``: :func:`window_query`).
2. :func:`parse_fleet`: every host's GPUs from the result vectors. Figures older than
   ``max_age`` (by Prometheus' own sample timestamps, and by the exporter's
   ``gpu_exporter_last_sample_timestamp_seconds``) make the host passed over, with the reason.

A host's exporter URL is ``http://<instance>``, unless the scrape config sets the target label
``gpu_exporter_url`` (see docs/cluster.md). Its host name (``GPU_HOST``) is that URL's host.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, Final

from gpu_exporter.choose.filters import Filters, Window
from gpu_exporter.choose.fleet import Fleet, Host, base_url
from gpu_exporter.choose.values import digits
from gpu_exporter.model import GpuSample

URL_LABEL: Final = "gpu_exporter_url"
TARGET_DOWN: Final = "target down: Prometheus' last scrape failed (up 0)"
# Per-GPU series → GpuSample field, and how to read the value.
VALUE_METRICS: Final[Mapping[str, tuple[str, type]]] = {
    "gpu_memory_free_bytes": ("memory_free_bytes", int),
    "gpu_memory_total_bytes": ("memory_total_bytes", int),
    "gpu_utilization_ratio": ("utilization_ratio", float),
    "gpu_memory_utilization_ratio": ("memory_utilization_ratio", float),
    "gpu_compute_processes": ("compute_processes", int),
    "gpu_power_draw_watts": ("power_draw_watts", float),
    "gpu_power_limit_watts": ("power_limit_watts", float),
}
# idle_for: (the filter that needs it, the field, the range function giving the worst value).
WINDOW_FIELDS: Final = (
    ("min_free_bytes", "memory_free_bytes", "min_over_time", "gpu_memory_free_bytes"),
    ("max_util_ratio", "utilization_ratio", "max_over_time", "gpu_utilization_ratio"),
    (
        "max_mem_util_ratio",
        "memory_utilization_ratio",
        "max_over_time",
        "gpu_memory_utilization_ratio",
    ),
    ("max_procs", "compute_processes", "max_over_time", "gpu_compute_processes"),
)


def exporter_url(labels: Mapping[str, str]) -> str:
    """The exporter behind a series: its ``gpu_exporter_url`` label, else ``http://<instance>``.

    >>> exporter_url({"instance": "node1:9400"}), exporter_url(
    ...     {"instance": "node1", "gpu_exporter_url": "https://node1.lab:9443/"}
    ... )
    ('http://node1:9400', 'https://node1.lab:9443')
    """
    url = labels.get(URL_LABEL) or labels.get("instance", "")
    return base_url(url)


def needed_metrics(filters: Filters, sort: str) -> tuple[str, ...]:
    """The series a choice with these filters and this order needs — and no others.

    The answer for 10,000 GPUs is megabytes of JSON (bench/cluster.py), so every series
    left out counts: ``gpu_info`` (name, PCI bus id) only for ``model`` or a bus-id selector.
    """
    names = [
        "gpu_up",
        "gpu_leased",
        "gpu_memory_free_bytes",
        "gpu_utilization_ratio",
        "gpu_pod_info",  # the kubelet gave the card to a pod (--kubernetes): not handed out
        "gpu_exporter_nvml_up",
        "gpu_exporter_last_sample_timestamp_seconds",
    ]
    by_bus_id = any(":" in sel for sel in (*filters.include, *filters.exclude))
    if filters.model is not None or by_bus_id:  # the name and PCI bus id are on gpu_info
        names.append("gpu_info")
    if filters.min_total_bytes is not None or sort == "free_ratio":
        names.append("gpu_memory_total_bytes")
    if filters.max_mem_util_ratio is not None:
        names.append("gpu_memory_utilization_ratio")
    if filters.max_procs is not None:
        names.append("gpu_compute_processes")
    if sort == "power":
        names += ["gpu_power_draw_watts", "gpu_power_limit_watts"]
    return tuple(names)


_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_SELECTOR = re.compile(rf"^(?:{_MATCHER}(?:,{_MATCHER})*)?$")


def check_selector(selector: str) -> str:
    """Label matchers that narrow the fleet, e.g. ``job="gpu-shared"``; raises ValueError.

    Only matchers, never other PromQL, so a selector cannot turn into another query.

    >>> check_selector('job="gpu-shared", rack=~"r1|r2"')
    'job="gpu-shared", rack=~"r1|r2"'
    >>> check_selector('job="x"} or vector(1')
    Traceback (most recent call last):
    ValueError: expected label matchers such as job="gpu-shared", got 'job="x"} or vector(1'
    """
    if not _SELECTOR.match(selector):
        raise ValueError(f'expected label matchers such as job="gpu-shared", got {selector!r}')
    return selector.strip()


def fleet_queries(
    filters: Filters, sort: str, idle_for_seconds: float | None, selector: str = ""
) -> dict[str, str]:
    """The instant queries that read the fleet, by name; ``selector`` narrows every one.

    >>> sorted(fleet_queries(Filters(), "free", None))
    ['down', 'scraped', 'values']
    >>> fleet_queries(Filters(), "free", None, 'job="shared"')["down"]
    'up{job="shared"} == 0'
    """
    sel = check_selector(selector)
    braces = f"{{{sel}}}" if sel else ""
    names = "|".join(needed_metrics(filters, sort))
    queries = {
        "values": f'{{__name__=~"{names}"{", " + sel if sel else ""}}}',
        "scraped": f"timestamp(gpu_exporter_last_sample_timestamp_seconds{braces})",
        "down": f"up{braces} == 0",
    }
    if idle_for_seconds:
        queries["window"] = window_query(filters, idle_for_seconds, sel)
    return queries


def window_query(filters: Filters, seconds: float, selector: str = "") -> str:
    """One query for every worst-of-window figure idle_for needs, told apart by ``fleet_field``.

    ``gpu_up`` (min: down at any point) and the oldest exporter sample in the window (how far
    back the history reaches) are always asked for.
    """
    rng = (f"{{{selector}}}" if selector else "") + f"[{max(1, math.ceil(seconds))}s]"
    parts = [
        ("up", f"min_over_time(gpu_up{rng})"),
        ("oldest", f"min_over_time(gpu_exporter_last_sample_timestamp_seconds{rng})"),
    ]
    for flt, name, func, metric in WINDOW_FIELDS:
        if getattr(filters, flt) is not None:
            parts.append((name, f"{func}({metric}{rng})"))
    return " or ".join(
        f'label_replace({expr}, "fleet_field", "{name}", "__name__", ".*")' for name, expr in parts
    )


def sample_value(sample: Mapping[str, Any]) -> float | None:
    """An instant vector sample's value; NaN (and anything unreadable) is absent."""
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _gpu_key(labels: Mapping[str, str]) -> str | None:
    uuid = labels.get("uuid")
    if not uuid or uuid.startswith("MIG-"):  # whole cards only
        return None
    return uuid


def parse_fleet(
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    evaluated_at: float,
    max_age_seconds: float,
    idle_for_seconds: float | None = None,
) -> Fleet:
    """Build every host's GPUs from the queries' result vectors (``data.result``).

    Pure: the same answers give the same fleet. A host is passed over (``problem``) when its
    target is down, NVML is down there, or its figures are older than ``max_age_seconds``
    (or of unknown age).
    """
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}  # url → uuid → fields
    per_host: dict[str, dict[str, Any]] = {}  # url → instance, nvml_up, sampled_at
    for sample in results.get("values", ()):
        labels = sample.get("metric", {})
        url = exporter_url(labels)
        host = per_host.setdefault(url, {"instance": labels.get("instance", url)})
        name = labels.get("__name__")
        value = sample_value(sample)
        if name == "gpu_exporter_nvml_up":
            host["nvml_up"] = value
            continue
        if name == "gpu_exporter_last_sample_timestamp_seconds":
            host["sampled_at"] = value
            continue
        uuid, index = _gpu_key(labels), digits(labels.get("gpu", ""))
        if uuid is None or index is None:  # digits(): int() would take "²" and fail on it
            continue
        gpu = per_gpu.setdefault(url, {}).setdefault(uuid, {"index": index})
        if name == "gpu_up":
            gpu["up"] = value == 1
        elif name == "gpu_leased":
            gpu["leased"] = value == 1
        elif name == "gpu_info":
            gpu["name"] = labels.get("name")
            gpu["pci_bus_id"] = labels.get("pci_bus_id")
        elif name == "gpu_pod_info":
            pod = f"{labels.get('namespace', '')}/{labels.get('pod', '')}"
            gpu.setdefault("pods", set()).add(pod)
        elif name in VALUE_METRICS and value is not None:
            field_name, kind = VALUE_METRICS[name]
            gpu[field_name] = kind(value)

    scraped = {
        exporter_url(s.get("metric", {})): sample_value(s) for s in results.get("scraped", ())
    }
    window = _parse_window(results.get("window", ())) if idle_for_seconds else {}

    hosts: list[Host] = []
    for url, info in sorted(per_host.items()):
        gpus = tuple(
            sorted(
                (_sample(uuid, values) for uuid, values in per_gpu.get(url, {}).items()),
                key=lambda g: g.index,
            )
        )
        leased = tuple(u for u, v in per_gpu.get(url, {}).items() if v.get("leased"))
        allocated = tuple(
            (u, allocated_to(v["pods"])) for u, v in per_gpu.get(url, {}).items() if v.get("pods")
        )
        scraped_at = scraped.get(url)
        age = None if scraped_at is None else max(0.0, evaluated_at - scraped_at)
        problem = host_problem(info, scraped_at, age, max_age_seconds, bool(gpus))
        host_window = None
        if idle_for_seconds and problem is None:
            host_window = _host_window(
                window.get(url, {}), gpus, idle_for_seconds, evaluated_at, max_age_seconds
            )
        hosts.append(
            Host(
                url=url,
                instance=str(info["instance"]),
                gpus=gpus,
                leased=leased,
                problem=problem,
                window=host_window,
                allocated=allocated,
                age_seconds=age,
            )
        )
    # Targets whose last scrape failed: passed over even if series of theirs are still
    # around (Prometheus stale-marks them, but remote or federated data is not).
    jobs = {s.get("metric", {}).get("job") for s in results.get("values", ())}
    by_url = {h.url: i for i, h in enumerate(hosts)}
    for sample in results.get("down", ()):
        labels = sample.get("metric", {})
        if labels.get("job") not in jobs:
            continue  # not a gpu-exporter target
        url = exporter_url(labels)
        if url in by_url:
            hosts[by_url[url]] = replace(hosts[by_url[url]], problem=TARGET_DOWN, window=None)
            continue
        by_url[url] = len(hosts)
        hosts.append(Host(url=url, instance=labels.get("instance", url), problem=TARGET_DOWN))
    return Fleet(tuple(hosts), "prometheus", evaluated_at, window_checked=bool(idle_for_seconds))


def allocated_to(pods: set[str]) -> str:
    """Why a card the kubelet gave to pods is passed over, as the host's /choose says it.

    >>> allocated_to({"ml/train-0"}), allocated_to({"b/y", "a/x"})
    ('allocated to pod ml/train-0', 'allocated to pods a/x, b/y')
    """
    if len(pods) == 1:
        return f"allocated to pod {next(iter(pods))}"
    return f"allocated to pods {', '.join(sorted(pods))}"


def _sample(uuid: str, values: Mapping[str, Any]) -> GpuSample:
    up = values.get("up")
    known = {f.name for f in fields(GpuSample)} - {"index", "uuid", "up", "error"}
    if not up:
        return GpuSample(
            index=values["index"],
            uuid=uuid,
            up=False,
            name=values.get("name"),
            pci_bus_id=values.get("pci_bus_id"),
            error="gpu_up 0" if up is False else "no gpu_up series",
        )
    return GpuSample(
        index=values["index"],
        uuid=uuid,
        up=True,
        **{k: v for k, v in values.items() if k in known},
    )


def host_problem(
    info: Mapping[str, Any],
    scraped_at: float | None,
    age: float | None,
    max_age_seconds: float,
    has_gpus: bool,
) -> str | None:
    if age is None:
        return "the age of its figures is unknown (no gpu_exporter_last_sample_timestamp_seconds)"
    if age > max_age_seconds:
        return f"figures are {age:.0f} s old (max_age {max_age_seconds:g} s)"
    if info.get("nvml_up") == 0:
        return "NVML is down there (gpu_exporter_nvml_up 0)"
    sampled_at = info.get("sampled_at")
    lag = None if sampled_at is None or scraped_at is None else scraped_at - sampled_at
    if lag is not None and lag > max_age_seconds:
        # The exporter's sampler is stuck (its clock and Prometheus' may differ a little;
        # max_age is meant to be far larger than that).
        return (
            f"its exporter's last sample was {lag:.0f} s old when scraped "
            f"(max_age {max_age_seconds:g} s)"
        )
    if not has_gpus:
        return "no GPUs"
    return None


def _parse_window(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[Any, Any]]:
    """url → {"oldest": t, (uuid, field): worst value}."""
    out: dict[str, dict[Any, Any]] = {}
    for sample in samples:
        labels = sample.get("metric", {})
        kind = labels.get("fleet_field")
        value = sample_value(sample)
        host = out.setdefault(exporter_url(labels), {})
        if kind == "oldest":
            if value is not None:
                host["oldest"] = min(value, host.get("oldest", value))
            continue
        uuid = _gpu_key(labels)
        if uuid is not None and kind is not None and value is not None:
            host[(uuid, kind)] = value
    return out


def _host_window(
    worst: Mapping[Any, Any],
    gpus: Sequence[GpuSample],
    seconds: float,
    evaluated_at: float,
    max_age_seconds: float,
) -> Window:
    """idle_for as a :class:`~gpu_exporter.choose.filters.Window`: each GPU's worst figures.

    The window's first sample comes at most one scrape after its start, so a history that
    reaches back to within ``max_age_seconds`` of the start counts as covering it.
    """
    oldest = worst.get("oldest")
    covered = 0.0 if oldest is None else evaluated_at - oldest + max_age_seconds
    past = []
    for gpu in gpus:
        if (gpu.uuid, "up") not in worst:
            continue  # no figures for this GPU in the window: window_reasons says so
        if worst[(gpu.uuid, "up")] < 1:
            past.append(replace(gpu, up=False, error="down"))
            continue
        changes: dict[str, Any] = {}
        for _, name, _, _ in WINDOW_FIELDS:
            if (gpu.uuid, name) in worst:
                value = worst[(gpu.uuid, name)]
                changes[name] = (
                    int(value) if name in ("memory_free_bytes", "compute_processes") else value
                )
        past.append(replace(gpu, **changes))
    return Window(seconds, covered, ((seconds, tuple(past)),), worst_case=True)
