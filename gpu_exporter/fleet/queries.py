"""The PromQL the fleet is read with (pure): the full read's instant queries, and the count of
the reasons no GPU passed, for a refusal after the packed read.

The full read (:func:`full_queries`) asks every series a choice needs, per GPU: ``values``
(only the metrics this request needs, :func:`needed_metrics`), ``scraped`` (every exporter's
last scrape time, on the store's clock; read first, it sizes the fleet), ``down`` (targets
whose last scrape failed) and, for ``idle_for``, ``window``: each figure's worst over the
window. A selector (label matchers only, :func:`check_selector`) narrows every query.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from gpu_exporter.choose.filters import Filters
from gpu_exporter.units import format_bytes

GPU_KEY: Final = "on(instance, job, uuid)"
TOTAL: Final = "gpu_memory_total_bytes"


class Limit(NamedTuple):
    """One of a GPU's limits as the store tests it. idle_for judges each by its worst over the
    window (min for "<", max for ">"). With a ``fallback``, a card without the series is
    judged by that one instead (SM activity: utilization on a card without GPM), as
    :func:`~gpu_exporter.choose.filters.sm_activity` does on the host."""

    reason: str  # what it is counted as in a refusal (fleet_reason): the parameter's name
    attr: str  # the Filters field
    field: str  # the GpuSample field its series fills
    series: str
    op: str  # the comparison that fails it
    of_total: bool = False  # the limit is a share of gpu_memory_total_bytes
    fallback: tuple[str, str] | None = None  # (GpuSample field, series) where there is none

    @property
    def figures(self) -> tuple[tuple[str, str], ...]:
        """(GpuSample field, series) of every figure the limit reads: its own, its fallback's."""
        return ((self.field, self.series), *((self.fallback,) if self.fallback else ()))

    def judged(self, selector: str = "") -> str:
        """The PromQL of the figure each GPU is judged by: its series, or where a card has none,
        its fallback's (``or`` per GPU: only the fallback's GPUs with no series of their own).

        >>> print(LIMITS[6].judged())
        (gpu_sm_active_ratio or on(instance, job, uuid) gpu_utilization_ratio)
        """
        if self.fallback is None:
            return f"{self.series}{selector}"
        return f"({self.series}{selector} or {GPU_KEY} {self.fallback[1]}{selector})"

    @property
    def compared(self) -> str:
        """The GpuSample attribute the limit is compared with (a share: its ratio property)."""
        return self.field.replace("_bytes", "_ratio") if self.of_total else self.field

    def failing(self, limit: float, selector: str = "") -> str:
        """The PromQL of the GPUs ``limit`` fails: ``gpu_utilization_ratio > 0.5``.

        >>> LIMITS[1].failing(0.5)
        'gpu_utilization_ratio > 0.5'
        >>> print(LIMITS[2].failing(0.5, '{pool="a"}'))
        gpu_memory_used_bytes{pool="a"} / gpu_memory_total_bytes{pool="a"} > 0.5
        """
        total = f" / {TOTAL}{selector}" if self.of_total else ""
        return f"{self.judged(selector)}{total} {self.op} {limit!r}"


LIMITS: Final = (
    Limit("min_free", "min_free_bytes", "memory_free_bytes", "gpu_memory_free_bytes", "<"),
    Limit("max_util", "max_util_ratio", "utilization_ratio", "gpu_utilization_ratio", ">"),
    Limit("max_mem_used", "max_mem_used_ratio", "memory_used_bytes", "gpu_memory_used_bytes",
          ">", of_total=True),
    Limit("min_free_share", "min_free_ratio", "memory_free_bytes", "gpu_memory_free_bytes", "<",
          of_total=True),
    Limit("max_mem_util", "max_mem_util_ratio", "memory_utilization_ratio",
          "gpu_memory_utilization_ratio", ">"),
    Limit("max_procs", "max_procs", "compute_processes", "gpu_compute_processes", ">"),
    Limit("max_sm_active", "max_sm_active_ratio", "sm_active_ratio", "gpu_sm_active_ratio", ">",
          fallback=("utilization_ratio", "gpu_utilization_ratio")),
)  # fmt: skip
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_SELECTOR = re.compile(rf"^(?:{_MATCHER}(?:,{_MATCHER})*)?$")
_RE2_SPECIAL: Final = re.compile(r"[\\.+*?()|\[\]{}^$]")  # RE2 takes these escaped


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


def braces(selector: str, *matchers: str) -> str:
    """``{matchers, selector}``, or nothing when both are empty.

    >>> braces('pool="a"', 'uuid!~"MIG-.*"'), braces("")
    ('{uuid!~"MIG-.*", pool="a"}', '')
    """
    inside = ", ".join(m for m in (*matchers, check_selector(selector)) if m)
    return "{" + inside + "}" if inside else ""


def model_regex(model: str) -> str:
    """``model`` (a case-insensitive substring) as a PromQL string holding an RE2 regex.

    >>> print(model_regex('A100 (80GB) "x"'))
    "(?i).*A100 \\\\(80GB\\\\) \\"x\\".*"
    """
    pattern = "(?i).*" + _RE2_SPECIAL.sub(r"\\\g<0>", model) + ".*"
    return '"' + pattern.replace("\\", "\\\\").replace('"', '\\"') + '"'


def needed_metrics(filters: Filters, sort: str) -> tuple[str, ...]:
    """The series a choice with these filters and this order needs, and no others: the
    answer for 10,000 GPUs is megabytes of JSON, so every series left out counts."""
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
    for limit in LIMITS:
        if getattr(filters, limit.attr) is not None:
            wanted = (*(series for _, series in limit.figures), *[TOTAL] * limit.of_total)
            names += [s for s in wanted if s not in names]
    if sort == "sm_active" and "gpu_sm_active_ratio" not in names:  # else utilization
        names.append("gpu_sm_active_ratio")
    if sort == "power":
        names += ["gpu_power_draw_watts", "gpu_power_limit_watts"]
    return tuple(names)


def scraped_query(selector: str = "") -> str:
    """Every exporter's last scrape time: the first read, which also sizes the fleet."""
    return f"timestamp(gpu_exporter_last_sample_timestamp_seconds{braces(selector)})"


def full_queries(
    filters: Filters, sort: str, idle_for_seconds: float | None, selector: str = ""
) -> dict[str, str]:
    """The full read's instant queries but ``scraped``, by name.

    >>> sorted(full_queries(Filters(), "free", None))
    ['down', 'values']
    >>> full_queries(Filters(), "free", None, 'job="shared"')["down"]
    'up{job="shared"} == 0'
    """
    names = "|".join(needed_metrics(filters, sort))
    queries = {
        "values": braces(selector, f'__name__=~"{names}"'),
        "down": f"up{braces(selector)} == 0",
    }
    if idle_for_seconds:
        queries["window"] = window_query(filters, idle_for_seconds, selector)
    return queries


def window_query(filters: Filters, seconds: float, selector: str = "") -> str:
    """One query for every worst-of-window figure idle_for needs, told apart by
    ``fleet_field``; ``gpu_up`` (min: down at any point) and the oldest exporter sample in
    the window (how far back the history reaches) always. A limit with a fallback asks both
    figures' worst: a card without GPM is judged by its utilization's worst.

    >>> q = window_query(Filters(max_sm_active_ratio=0.2), 60)
    >>> "max_over_time(gpu_sm_active_ratio[60s])" in q, '"fleet_field", "utilization_ratio"' in q
    (True, True)
    """
    rng = braces(selector) + f"[{max(1, math.ceil(seconds))}s]"
    parts = [
        ("up", f"min_over_time(gpu_up{rng})"),
        ("oldest", f"min_over_time(gpu_exporter_last_sample_timestamp_seconds{rng})"),
    ]
    for limit in LIMITS:
        if getattr(filters, limit.attr) is None:
            continue
        worst = "min" if limit.op == "<" else "max"
        for field, series in limit.figures:
            if field not in dict(parts):
                parts.append((field, f"{worst}_over_time({series}{rng})"))
    return " or ".join(
        f'label_replace({expr}, "fleet_field", "{name}", "__name__", ".*")' for name, expr in parts
    )


# -- why no GPU passed the packed read: counts across the fleet, not each GPU's reasons ------


def reasons_query(filters: Filters, selector: str = "") -> str:
    """How many GPUs fail each of the request's filters (``fleet_reason``; one GPU may fail
    several), and how many there are (``gpus``)."""
    whole = braces(selector, 'uuid!~"MIG-.*"')
    parts = [
        ("gpus", f"gpu_up{whole}"),
        ("down", f"gpu_up{whole} != 1"),
        ("leased", f"gpu_leased{whole} == 1"),
        ("pod", f"gpu_pod_info{whole}"),
    ]
    for limit in LIMITS:
        if (value := getattr(filters, limit.attr)) is not None:
            parts.append((limit.reason, limit.failing(value, whole)))
    if filters.model is not None:
        name = f'uuid!~"MIG-.*", name!~{model_regex(filters.model)}'
        parts.append(("model", f"gpu_info{braces(selector, name)}"))
    return " or ".join(
        f'label_replace(count({expr}), "fleet_reason", "{name}", "", "")' for name, expr in parts
    )


def reasons_text(samples: Sequence[Mapping[str, Any]], filters: Filters) -> str:
    """``"of 100,000 GPUs …: 1,000 down, 5,000 leased (at the last scrape), …"`` from
    :func:`reasons_query`'s answer."""
    counts = {s.get("metric", {}).get("fleet_reason"): s.get("value", (0, 0))[1] for s in samples}
    what = {
        "down": "down",
        "leased": "leased (at the last scrape)",
        "pod": "allocated to a Kubernetes pod",
        "min_free": f"with free memory < min_free {format_bytes(filters.min_free_bytes or 0)}",
        "min_free_share": "with free memory < min_free "
        f"{(filters.min_free_ratio or 0) * 100:g}% of total",
        "max_util": f"with utilization > max_util {filters.max_util_ratio or 0:.2f}",
        "max_mem_used": "with memory used > max_mem_used "
        f"{filters.max_mem_used_ratio or 0:.2f} of total",
        "max_mem_util": "with memory utilization > max_mem_util "
        f"{filters.max_mem_util_ratio or 0:.2f}",
        "max_procs": f"with more than max_procs {filters.max_procs} compute processes",
        "max_sm_active": "with SM activity (utilization without GPM) > max_sm_active "
        f"{filters.max_sm_active_ratio or 0:.2f}",
        "model": f"of a model that does not contain {filters.model!r}",
    }
    parts = [f"{int(float(counts[k])):,} {text}" for k, text in what.items() if k in counts]
    gpus = int(float(counts.get("gpus") or 0))
    total = f"of {gpus:,} GPU{'' if gpus == 1 else 's'} (counted in the store"
    return f"{total}; one may fail several filters): " + (", ".join(parts) or "none fails one")
