"""The fleet at scale: the store keeps only the GPUs that pass a request's filters (pure).

Reading every series of every GPU costs the store, the transfer and the chooser time linear
in the fleet (about 5 series a GPU; docs/cluster.md). Past :data:`DETAIL_UP_TO_HOSTS`
exporters the chooser therefore asks the store to do the filtering, in two instant queries
beside the exporters' scrape times it reads first (:func:`hosts_query`, which also sizes the
fleet):

* :func:`sieve_query`: one series per GPU that passes the request's fixed filters (not
  down, not leased, not allocated to a Kubernetes pod, ``min_free``, ``max_util``,
  ``max_mem_util``, ``max_procs``, ``min_total``, ``model``), as PromQL comparisons
  joined with ``and on(instance, job, uuid)`` / ``unless``. Its value packs what the
  ranking needs, whole free GiB and utilization: ``floor(free / 2^30) + utilization / 2``
  (:func:`unpack`).
* :func:`problems_query`: the exporters that cannot serve at all (NVML down, a stuck
  sampler, a failed scrape); with the scrape times, every host's problem as
  :func:`gpu_exporter.choose.promql.parse_fleet` states it.

The same queries run on the raw series or on the recorded view
(:mod:`gpu_exporter.choose.fleetview`): :class:`Names` spells each series either way.
:func:`parse_sieve` builds a :class:`~gpu_exporter.choose.fleet.Fleet` whose hosts hold only
their qualifying GPUs (``sieved``; each a light :class:`SievedGpu`); ranking it with
:func:`gpu_exporter.choose.fleet.rank_fleet` gives the same order as the full read. A refusal
counts the reasons across the fleet (:func:`reasons_query`) instead of naming each GPU's.

Not sieved (every series is read, as for small fleets): ``idle_for``, ``include``/``exclude``,
and the orders that need other figures (``free_ratio``, ``power``). A GPU that reports no free
memory or no utilization is not ranked here (it could not be ordered).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleet import Fleet, Host
from gpu_exporter.choose.fleetview import FIELDS, check_prefix
from gpu_exporter.choose.promql import (
    TARGET_DOWN,
    URL_LABEL,
    check_selector,
    exporter_url,
    host_problem,
    sample_value,
)
from gpu_exporter.choose.values import digits
from gpu_exporter.model import GpuSample
from gpu_exporter.units import format_bytes

DETAIL_UP_TO_HOSTS: Final = 500  # up to 4,000 GPUs, every series is read (per-GPU reasons)
SIEVED_SORTS: Final = ("free", "util", "pack")  # orders free GiB and utilization decide
GIB: Final = 2**30
GPU_KEY: Final = "on(instance, job, uuid)"
# Arithmetic keeps only the labels it matches on: ignoring() keeps the rest (gpu, and
# gpu_exporter_url where the scrape config sets it), and the view's `field` differs.
SAME_SERIES: Final = "ignoring(field)"
_RE2_SPECIAL: Final = re.compile(r"[\\.+*?()|\[\]{}^$]")  # RE2 takes these escaped
_RAW: Final = {field: name for name, field in FIELDS.items()}


@dataclass(frozen=True, slots=True)
class Names:
    """How a series is spelled: raw (``gpu_memory_free_bytes{…}``) or in the recorded view
    (``gpu_fleet:gpu{field="memory_free_bytes", …}``), narrowed by ``selector``.

    >>> Names().gpu("up"), Names("gpu_fleet", 'pool="a"').gpu("up")
    ('gpu_up{uuid!~"MIG-.*"}', 'gpu_fleet:gpu{field="up", uuid!~"MIG-.*", pool="a"}')
    """

    prefix: str = ""
    selector: str = ""

    def __post_init__(self) -> None:
        check_selector(self.selector)
        if self.prefix:
            check_prefix(self.prefix)

    def _braces(self, *matchers: str) -> str:
        return "{" + ", ".join(m for m in (*matchers, self.selector.strip()) if m) + "}"

    def gpu(self, field: str, *matchers: str) -> str:
        """A per-GPU figure (whole cards only: MIG devices are never handed out)."""
        whole = ('uuid!~"MIG-.*"', *matchers)
        if self.prefix:
            return f"{self.prefix}:gpu" + self._braces(f'field="{field}"', *whole)
        return _RAW[field] + self._braces(*whole)

    def host(self, field: str) -> str:
        """A per-exporter figure: ``nvml_up``, ``sampled_at``, ``scraped_at``, ``target_up``."""
        if self.prefix:
            return f"{self.prefix}:host" + self._braces(f'field="{field}"')
        if field == "scraped_at":
            return f"timestamp({self.host('sampled_at')})"
        if field == "target_up":
            return "up" + self._braces()
        return _RAW[field] + self._braces()


def sievable(filters: Filters, sort: str, idle_for_seconds: float | None) -> bool:
    """Whether the store can do this request's filtering (see the module's docstring)."""
    return (
        not idle_for_seconds
        and not filters.include
        and not filters.exclude
        and sort in SIEVED_SORTS
    )


def hosts_query(names: Names) -> str:
    """Every exporter's last scrape time: the first read, which also sizes the fleet."""
    return names.host("scraped_at")


def _model_regex(model: str) -> str:
    """``model`` (a case-insensitive substring) as a PromQL string holding an RE2 regex.

    >>> print(_model_regex('A100 (80GB) "x"'))
    "(?i).*A100 \\\\(80GB\\\\) \\"x\\".*"
    """
    pattern = "(?i).*" + _RE2_SPECIAL.sub(r"\\\g<0>", model) + ".*"
    return '"' + pattern.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _limit(names: Names, field: str, op: str, limit: float, param: str, filters: Filters) -> str:
    """``and on(…) (x <= limit)``: an unknown figure fails; a defaulted filter, which nobody
    asked for, lets it pass: ``unless on(…) (x > limit)`` (as rejection_reasons judges)."""
    if param in filters.defaulted:
        worse = {"<=": ">", ">=": "<"}[op]
        return f" unless {GPU_KEY} ({names.gpu(field)} {worse} {limit!r})"
    return f" and {GPU_KEY} ({names.gpu(field)} {op} {limit!r})"


def sieve_query(names: Names, filters: Filters) -> str:
    """The GPUs that pass the request's fixed filters, one series each (:func:`unpack`).

    >>> print(sieve_query(Names(), Filters(min_free_bytes=2**30, max_procs=0)))
    floor((gpu_memory_free_bytes{uuid!~"MIG-.*"} >= 1073741824) / 1073741824) + ignoring(field) (gpu_utilization_ratio{uuid!~"MIG-.*"} / 2) unless on(instance, job, uuid) (gpu_up{uuid!~"MIG-.*"} != 1) unless on(instance, job, uuid) (gpu_leased{uuid!~"MIG-.*"} == 1) unless on(instance, job, uuid) gpu_pod_info{uuid!~"MIG-.*"} and on(instance, job, uuid) (gpu_compute_processes{uuid!~"MIG-.*"} <= 0)
    """  # noqa: E501
    free = names.gpu("memory_free_bytes")
    if filters.min_free_bytes is not None:
        free = f"({free} >= {filters.min_free_bytes!r})"
    util = names.gpu("utilization_ratio")
    if filters.max_util_ratio is not None:
        util = f"({util} <= {filters.max_util_ratio!r})"
    expr = f"floor({free} / {GIB}) + {SAME_SERIES} ({util} / 2)"
    # unless (up != 1) rather than and (up == 1): the right side is the few GPUs down, not
    # every one, which costs VictoriaMetrics 0.6 s less at 100,000 GPUs. A GPU with figures
    # and no gpu_up series at all would pass; the exporter exports gpu_up for every GPU.
    expr += f" unless {GPU_KEY} ({names.gpu('up')} != 1)"
    expr += f" unless {GPU_KEY} ({names.gpu('leased')} == 1)"
    expr += f" unless {GPU_KEY} {names.gpu('pod')}"  # the kubelet gave it to a pod
    if filters.max_mem_util_ratio is not None:
        expr += _limit(
            names, "memory_utilization_ratio", "<=", filters.max_mem_util_ratio,
            "max_mem_util", filters,
        )  # fmt: skip
    if filters.max_procs is not None:
        expr += _limit(names, "compute_processes", "<=", filters.max_procs, "max_procs", filters)
    if filters.min_total_bytes is not None:
        expr += _limit(
            names, "memory_total_bytes", ">=", filters.min_total_bytes, "min_total", filters
        )
    if filters.model is not None:
        expr += f" and {GPU_KEY} {names.gpu('info', f'name=~{_model_regex(filters.model)}')}"
    return expr


def problems_query(names: Names, max_age_seconds: float) -> str:
    """The exporters that cannot serve whatever their GPUs show, told apart by
    ``fleet_problem``: ``nvml_down``, ``stuck`` (value: how old the exporter's last sample
    was when scraped) and ``target_down`` (raw ``up``: any job; parse_sieve keeps the
    gpu-exporter ones)."""
    lag = f"({names.host('scraped_at')} - {SAME_SERIES} {names.host('sampled_at')})"
    parts = [
        ("nvml_down", f"{names.host('nvml_up')} == 0"),
        ("stuck", f"{lag} > {max_age_seconds!r}"),
        ("target_down", f"{names.host('target_up')} == 0"),
    ]
    return " or ".join(
        f'label_replace({expr}, "fleet_problem", "{name}", "", "")' for name, expr in parts
    )


_DEFAULTS: Final = {f.name: f.default for f in fields(GpuSample)}
_SET: Final = ("index", "uuid", "up", "memory_free_bytes", "utilization_ratio")
_UNSET: Final = ("memory_total_bytes", "parent_uuid", "gpu_instance_id", "compute_instance_id")
_setattr = object.__setattr__


class SievedGpu(GpuSample):
    """A GPU as the store's filtering gives it: index, UUID, free memory and utilization,
    every other figure at its default. A plain GpuSample sets all 67 fields in its
    ``__init__`` (7 µs: 0.2 s for the 31,000 GPUs that pass at 100,000); this sets the
    few the ranking reads, and an unset one reads as its default (``__getattr__``)."""

    __slots__ = ()

    @classmethod
    def of(cls, index: int, uuid: str, free_bytes: int, util: float) -> SievedGpu:
        gpu = object.__new__(cls)
        for name, value in zip(_SET, (index, uuid, True, free_bytes, util), strict=True):
            _setattr(gpu, name, value)
        for name in _UNSET:  # read while ranking: set, so no __getattr__ is needed
            _setattr(gpu, name, None)
        return gpu

    def __getattr__(self, name: str) -> Any:  # only for slots left unset
        try:
            return _DEFAULTS[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_sample(self) -> GpuSample:
        """The same figures as a plain :class:`GpuSample` (they compare equal then)."""
        return GpuSample(**{name: getattr(self, name) for name in _DEFAULTS})


def unpack(value: float) -> tuple[int, float]:
    """Whole free GiB and utilization from a sieve value (``floor(free/GiB) + util/2``).

    Utilization comes back to 9 decimals (the packing keeps about 12).

    >>> unpack(79 + 0.95 / 2), unpack(3.0)
    ((79, 0.95), (3, 0.0))
    """
    whole = math.floor(value)
    return whole, round((value - whole) * 2, 9)


def parse_sieve(
    answers: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    evaluated_at: float,
    max_age_seconds: float,
    unpack: Callable[[float], tuple[int, float]] = unpack,
) -> Fleet:
    """The fleet from ``hosts`` (scrape times), ``sieve`` and ``problems`` answers: every
    exporter, each with only its qualifying GPUs, or its problem (as parse_fleet says it).
    ``unpack``: whole free GiB and utilization from a ``sieve`` value (the packed series'
    answer takes :func:`gpu_exporter.choose.fleetpacked.unpack`)."""
    scraped: dict[str, float | None] = {}
    instances: dict[str, str] = {}
    jobs = set()
    for sample in answers.get("hosts", ()):
        labels = sample.get("metric", {})
        url = exporter_url(labels)
        scraped[url] = sample_value(sample)
        instances[url] = labels.get("instance", url)
        jobs.add(labels.get("job"))
    gpus: dict[str, list[GpuSample]] = {}
    urls: dict[str, str] = {}  # the URL label (or instance) → the exporter: 8 GPUs share one
    for sample in answers.get("sieve", ()):
        labels = sample.get("metric", {})
        value, index, uuid = sample_value(sample), digits(labels.get("gpu", "")), labels.get("uuid")
        if value is None or index is None or not uuid or uuid.startswith("MIG-"):
            continue
        where = labels.get(URL_LABEL) or labels.get("instance", "")
        url = urls.get(where) or urls.setdefault(where, exporter_url(labels))
        if url not in instances:
            instances[url] = labels.get("instance", url)
        free_gib, util = unpack(value)
        gpus.setdefault(url, []).append(SievedGpu.of(index, uuid, free_gib * GIB, util))
    flagged: dict[str, dict[str, Any]] = {}
    for sample in answers.get("problems", ()):
        labels = sample.get("metric", {})
        kind = labels.get("fleet_problem")
        if kind == "target_down" and labels.get("job") not in jobs:
            continue  # not a gpu-exporter target
        url = exporter_url(labels)
        instances.setdefault(url, labels.get("instance", url))
        info = flagged.setdefault(url, {})
        if kind == "nvml_down":
            info["nvml_up"] = 0
        elif kind == "stuck":
            info["lag"] = sample_value(sample)
        elif kind == "target_down":
            info["down"] = True
    hosts = []
    for url in sorted(instances):
        info = flagged.get(url, {})
        at = scraped.get(url)
        age = None if at is None else max(0.0, evaluated_at - at)
        lag = info.get("lag")
        sampled_at = None if at is None or lag is None else at - lag
        problem = host_problem(
            {"nvml_up": info.get("nvml_up"), "sampled_at": sampled_at},
            at,
            age,
            max_age_seconds,
            True,
        )
        if info.get("down"):
            problem = TARGET_DOWN
        mine = () if problem else tuple(sorted(gpus.get(url, ()), key=lambda g: g.index))
        hosts.append(Host(url, instances[url], mine, (), problem, age_seconds=age))
    return Fleet(tuple(hosts), "prometheus", evaluated_at, sieved=True)


# -- why a sieved fleet cannot serve: counts, not every GPU's reasons ------------------------


def reasons_query(names: Names, filters: Filters) -> str:
    """How many GPUs fail each of the request's filters (``fleet_reason``; one GPU may fail
    several), and how many there are (``gpus``)."""
    parts = [
        ("gpus", names.gpu("up")),
        ("down", f"{names.gpu('up')} != 1"),
        ("leased", f"{names.gpu('leased')} == 1"),
        ("pod", names.gpu("pod")),
    ]
    for param, field, op, limit in _limits(filters):
        parts.append((param, f"{names.gpu(field)} {op} {limit!r}"))
    if filters.model is not None:
        name = names.gpu("info", f"name!~{_model_regex(filters.model)}")
        parts.append(("model", name))
    return " or ".join(
        f'label_replace(count({expr}), "fleet_reason", "{name}", "", "")' for name, expr in parts
    )


def _limits(filters: Filters) -> list[tuple[str, str, str, float]]:
    """(param, field, the comparison that fails it, limit) for each filter that is set."""
    out: list[tuple[str, str, str, float]] = []
    for param, field, op, limit in (
        ("min_free", "memory_free_bytes", "<", filters.min_free_bytes),
        ("max_util", "utilization_ratio", ">", filters.max_util_ratio),
        ("max_mem_util", "memory_utilization_ratio", ">", filters.max_mem_util_ratio),
        ("max_procs", "compute_processes", ">", filters.max_procs),
        ("min_total", "memory_total_bytes", "<", filters.min_total_bytes),
    ):
        if limit is not None:
            out.append((param, field, op, limit))
    return out


def reasons_text(samples: Sequence[Mapping[str, Any]], filters: Filters) -> str:
    """``"of 100,000 GPUs: 1,000 down, 5,000 leased (at the last scrape), …"`` from
    :func:`reasons_query`'s answer."""
    counts = {s.get("metric", {}).get("fleet_reason"): sample_value(s) for s in samples}

    def count(name: str) -> int:
        return int(counts.get(name) or 0)

    what = {
        "down": "down",
        "leased": "leased (at the last scrape)",
        "pod": "allocated to a Kubernetes pod",
        "min_free": f"with free memory < min_free {format_bytes(filters.min_free_bytes or 0)}",
        "max_util": f"with utilization > max_util {filters.max_util_ratio or 0:.2f}",
        "max_mem_util": "with memory utilization > max_mem_util "
        f"{filters.max_mem_util_ratio or 0:.2f}",
        "max_procs": f"with more than max_procs {filters.max_procs} compute processes",
        "min_total": f"with total memory < min_total {format_bytes(filters.min_total_bytes or 0)}",
        "model": f"of a model that does not contain {filters.model!r}",
    }
    parts = [f"{count(k):,} {text}" for k, text in what.items() if k in counts]
    gpus = count("gpus")
    total = f"of {gpus:,} GPU{'' if gpus == 1 else 's'} (counted in the store"
    return f"{total}; one may fail several filters): " + (", ".join(parts) or "none fails one")
