"""The recorded fleet view: one instant query instead of three, from recording rules (pure).

``deploy/prometheus/gpu-exporter.fleet.rules.yml`` (Prometheus ``rule_files:`` or vmalert)
records every series the chooser reads under two names, told apart by a ``field`` label:

* ``<prefix>:gpu``: per GPU, ``field`` = ``up``, ``leased``, ``memory_free_bytes``, … (the
  :class:`~gpu_exporter.model.GpuSample` field), or ``info`` (``gpu_info``'s labels);
* ``<prefix>:host``: per exporter, ``field`` = ``nvml_up``, ``sampled_at`` (the exporter's
  last sample), ``scraped_at`` (``timestamp()`` of it: when the store scraped it) and
  ``target_up`` (``up`` of the gpu-exporter jobs).

So a choice is one selector over two metric names (:func:`view_query`), and
:func:`from_view` turns its answer back into the raw queries' answers, which
:func:`gpu_exporter.choose.promql.parse_fleet` reads as before: the same fleet, the same
choices and refusals. Every target label is kept, so a selector narrows the view as it does
the raw series. ``idle_for``'s window always reads the raw series (the rules' own history
starts when they were loaded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.promql import VALUE_METRICS, check_selector, needed_metrics

# Raw series → its ``field`` in the view (the host ones under <prefix>:host).
FIELDS: Final[Mapping[str, str]] = {
    "gpu_up": "up",
    "gpu_leased": "leased",
    "gpu_info": "info",
    "gpu_pod_info": "pod",
    **{name: field for name, (field, _) in VALUE_METRICS.items()},
    "gpu_exporter_nvml_up": "nvml_up",
    "gpu_exporter_last_sample_timestamp_seconds": "sampled_at",
}
RAW: Final[Mapping[str, str]] = {field: name for name, field in FIELDS.items()}
HOST_FIELDS: Final = ("nvml_up", "sampled_at", "scraped_at", "target_up")
_PREFIX = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*(?::[a-zA-Z0-9_]+)*$")
DEFAULT_PREFIX: Final = "gpu_fleet"  # what the shipped rules record


def check_prefix(prefix: str) -> str:
    """A recording-rule prefix such as ``gpu_fleet``; raises ValueError.

    >>> check_prefix("gpu_fleet")
    'gpu_fleet'
    >>> check_prefix('x"} or vector(1)')
    Traceback (most recent call last):
    ValueError: expected a metric name prefix such as gpu_fleet, got 'x"} or vector(1)'
    """
    if not _PREFIX.match(prefix):
        raise ValueError(f"expected a metric name prefix such as {DEFAULT_PREFIX}, got {prefix!r}")
    return prefix


def view_query(prefix: str, filters: Filters, sort: str, selector: str = "") -> str:
    """The one instant query reading the recorded view: only the fields this choice needs.

    >>> view_query("gpu_fleet", Filters(), "free")  # doctest: +NORMALIZE_WHITESPACE
    '{__name__=~"gpu_fleet:gpu|gpu_fleet:host",
      field=~"up|leased|memory_free_bytes|utilization_ratio|pod|nvml_up|sampled_at|scraped_at|target_up"}'
    """
    sel = check_selector(selector)
    prefix = check_prefix(prefix)
    fields = [FIELDS[name] for name in needed_metrics(filters, sort)]
    fields += [f for f in HOST_FIELDS if f not in fields]
    names = f"{prefix}:gpu|{prefix}:host"
    return f'{{__name__=~"{names}", field=~"{"|".join(fields)}"{", " + sel if sel else ""}}}'


def from_view(samples: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The raw queries' answers (``values``, ``scraped``, ``down``) from the view's answer.

    The samples are relabelled in place (they are the caller's freshly decoded JSON): at
    100,000 GPUs a copy of every label set would cost more than the rest of this.
    """
    values: list[dict[str, Any]] = []
    scraped: list[dict[str, Any]] = []
    down: list[dict[str, Any]] = []
    for sample in samples:
        labels = sample.get("metric")
        if not isinstance(labels, dict):
            continue
        field = labels.pop("field", None)
        if field == "scraped_at":
            labels.pop("__name__", None)
            scraped.append(sample)
        elif field == "target_up":
            if _is_zero(sample):
                labels["__name__"] = "up"
                down.append(sample)
        elif field in RAW:
            labels["__name__"] = RAW[field]
            values.append(sample)
    return {"values": values, "scraped": scraped, "down": down}


def _is_zero(sample: Mapping[str, Any]) -> bool:
    try:
        return float(sample["value"][1]) == 0
    except (KeyError, IndexError, TypeError, ValueError):
        return False
