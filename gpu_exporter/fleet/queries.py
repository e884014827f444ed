"""The PromQL the fleet is read with (pure): the full read's instant queries, and the count of
the reasons no GPU passed, for a refusal after the packed read.

The full read (:func:`full_queries`) asks every series a choice needs, per GPU: ``values``
(only the metrics this request needs, :func:`needed_metrics`), ``scraped`` (every exporter's
last scrape time, on the store's clock; read first, it sizes the fleet), ``down`` (targets
whose last scrape failed) and, for ``idle_for``, ``window``: each figure's worst over the
window. A selector (label matchers only, :func:`check_selector`) narrows every query.

Every limit is read from its row (:class:`~gpu_exporter.choose.filters.Limit`, carried by its
parameter in :data:`~gpu_exporter.choose.params.PARAMS`): its series, its fallback's, the
comparison that fails it (:func:`failing`) and how a refusal counts it (:func:`reasons_text`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpu_exporter.choose.filters import Bound, Filters, Limit

GPU_KEY: Final = "on(instance, job, uuid)"
TOTAL: Final = "gpu_memory_total_bytes"


def judged(limit: Limit, selector: str = "") -> str:
    """The PromQL of the figure each GPU is judged by: its series, or where a card has none,
    its fallback's (``or`` per GPU: only the fallback's GPUs with no series of their own), as
    :meth:`Limit.judged <gpu_exporter.choose.filters.Limit.judged>` does on the host.

    >>> from gpu_exporter.choose.filters import RATIO, Fallback
    >>> print(judged(Limit("SM activity", "sm_active_ratio", RATIO,
    ...                    fallback=Fallback("utilization_ratio", "utilization", "GPM"))))
    (gpu_sm_active_ratio or on(instance, job, uuid) gpu_utilization_ratio)
    """
    if limit.fallback is None:
        return f"{limit.series}{selector}"
    return f"({limit.series}{selector} or {GPU_KEY} gpu_{limit.fallback.field}{selector})"


def failing(limit: Limit, value: float, selector: str = "") -> str:
    """The PromQL of the GPUs ``value`` fails as ``limit``: ``gpu_utilization_ratio > 0.5``.

    >>> from gpu_exporter.choose.filters import RATIO
    >>> failing(Limit("utilization", "utilization_ratio", RATIO), 0.5)
    'gpu_utilization_ratio > 0.5'
    >>> used = Limit("memory used", "memory_used_bytes", RATIO, of_total=True)
    >>> print(failing(used, 0.5, '{pool="a"}'))
    gpu_memory_used_bytes{pool="a"} / gpu_memory_total_bytes{pool="a"} > 0.5
    """
    total = f" / {TOTAL}{selector}" if limit.of_total else ""
    return f"{judged(limit, selector)}{total} {limit.op} {value!r}"


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
    if sort == "free_ratio":
        names.append(TOTAL)
    for bound in filters.limits:
        limit = bound.limit
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
    figures' worst: a card without GPM is judged by its utilization's worst. A figure no job
    changes (:attr:`Limit.fixed <gpu_exporter.choose.filters.Limit.fixed>`) has no worst.

    >>> print(window_query(Filters(), 60).split(" or ")[0])
    label_replace(min_over_time(gpu_up[60s]), "fleet_field", "up", "__name__", ".*")
    """
    rng = braces(selector) + f"[{max(1, math.ceil(seconds))}s]"
    parts = [
        ("up", f"min_over_time(gpu_up{rng})"),
        ("oldest", f"min_over_time(gpu_exporter_last_sample_timestamp_seconds{rng})"),
    ]
    for bound in filters.limits:
        limit = bound.limit
        if limit.fixed:
            continue
        worst = "max" if limit.most else "min"
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
    for bound in filters.limits:
        parts.append((bound.key, failing(bound.limit, bound.value, whole)))
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
        **{bound.key: "with " + _failing_words(bound) for bound in filters.limits},
        "model": f"of a model that does not contain {filters.model!r}",
    }
    parts = [f"{int(float(counts[k])):,} {text}" for k, text in what.items() if k in counts]
    gpus = int(float(counts.get("gpus") or 0))
    total = f"of {gpus:,} GPU{'' if gpus == 1 else 's'} (counted in the store"
    return f"{total}; one may fail several filters): " + (", ".join(parts) or "none fails one")


def _failing_words(bound: Bound) -> str:
    """The GPUs a limit fails, in words: ``utilization > max_util 0.50``.

    >>> from gpu_exporter.choose.filters import SHARE
    >>> _failing_words(Bound("x", Limit("free memory", "memory_free_bytes", SHARE,
    ...                                 most=False, of_total=True), 0.25))
    'free memory < x 25% of total'
    """
    limit, name = bound.limit, bound.name
    if limit.unit.counted:
        than = "more" if limit.most else "fewer"
        return f"{than} than {name} {limit.unit.show(bound.value)} {limit.what}"
    what = limit.what
    if limit.fallback is not None:
        what += f" ({limit.fallback.what} without {limit.fallback.lacking})"
    shown = f"{bound.value * 100:g}%" if limit.unit.share else limit.unit.show(bound.value)
    return f"{what} {limit.op} {name} {shown}" + (" of total" if limit.of_total else "")
