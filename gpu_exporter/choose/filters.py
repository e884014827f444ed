"""Which GPUs a ``/choose`` request's filters accept, and why not the others: pure functions.

:class:`Filters` is what a request asks of a GPU (:mod:`gpu_exporter.choose.request` builds it
from the query string): its numeric limits, each a :class:`Bound` carrying its parameter's
:class:`Limit` (the row :data:`~gpu_exporter.choose.params.PARAMS` gives it), and the few
filters that are code (``include``, ``exclude``, ``model``, ``mig``). :func:`rejection_reasons`
says why a GPU does not qualify now, :func:`window_reasons` why it did not throughout
``idle_for`` (a :class:`Window`), and :func:`never_reasons` / :func:`never_enough` what no
amount of waiting can cure. Ordering the GPUs that qualify, and picking ``n``, is
:mod:`gpu_exporter.choose.rank`'s.

MIG (``mig=``): ``deny`` (default) hands out whole cards only, and a card in MIG mode is not
one (CUDA would see only its MIG devices); ``allow`` adds every MIG device as a candidate of
its own (:func:`candidates`); ``only`` hands out MIG devices only. A MIG device is named by its
``MIG-…`` UUID, which is what ``CUDA_VISIBLE_DEVICES`` takes; it has its parent's index.

A GPU that is down never qualifies. A filter on a value the GPU cannot report rejects it
(unknown is not "free") — unless the filter is one of the server's defaults
(:attr:`Filters.defaulted`), which nobody asked for: a MIG device reports no utilization, and
``max_util=50%`` by default must not make every MIG device unusable. Memory used by
processes we cannot see (another container) is already counted in NVML's "used", so it is
never mistaken for free memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpu_exporter.choose.selectors import selector_matches
from gpu_exporter.model import GpuSample, all_devices
from gpu_exporter.readings import BY_ATTRIBUTE
from gpu_exporter.units import format_bytes, plural

MIG_MODES = ("deny", "allow", "only")


@dataclass(frozen=True, slots=True)
class Unit:
    """How a limit's figure is read and shown: bytes, a ratio, a share of the total, a count."""

    suffix: str  # after the parameter's name in a waiter's filters: min_free_bytes
    kind: Callable[[float], float]  # the figure's type (int or float): how a store's value is read
    show: Callable[[float], str]  # a figure or a limit in a refusal
    share: bool = False  # of the card's total: "free memory 0.20 of total < min_free 0.25"
    counted: bool = False  # a number of things: "3 compute processes > max_procs 2"


def _bytes(value: float) -> str:
    return format_bytes(int(value))


_ratio = "{:.2f}".format  # a bound method: a refusal is formatted for every GPU that fails

BYTES = Unit("_bytes", int, _bytes)
RATIO = Unit("_ratio", float, _ratio)
SHARE = Unit("_ratio", float, _ratio, share=True)  # a size parameter given in % (min_free=25%)
COUNT = Unit("", int, str, counted=True)


def series_of(field: str) -> str:
    """The series a GPU value is exported as: its row's family in the value table.

    >>> series_of("memory_free_bytes"), series_of("energy_joules")
    ('gpu_memory_free_bytes', 'gpu_energy_joules_total')
    """
    family = BY_ATTRIBUTE[field].family
    assert family is not None, f"{field} is not exported: no limit can read it from a store"
    return family.name


@dataclass(frozen=True, slots=True)
class Fallback:
    """The figure a card without the limit's own is judged by (SM activity: utilization)."""

    field: str  # its GpuSample field (its series: series_of(field))
    what: str  # "utilization"
    lacking: str  # what such a card lacks: "GPM"


@dataclass(frozen=True, slots=True)
class Limit:
    """A numeric filter's predicate on a GPU: one figure at most (or at least) a number.

    A :class:`~gpu_exporter.choose.params.Param` carries it; every place that judges the
    filter reads it from here: the check and its refusal here, the unsupported field in
    :func:`never_reasons`, the store's series and comparison in :mod:`gpu_exporter.fleet`.
    """

    what: str  # the figure, as a refusal names it: "free memory"
    field: str  # the GpuSample field its series (series_of(field)) fills: "memory_free_bytes"
    unit: Unit
    most: bool = True  # at most the limit (False: at least)
    of_total: bool = False  # a share of memory_total_bytes: compared as the field's _ratio
    fallback: Fallback | None = None  # where a card has no such figure
    reports: str | None = None  # the field NVML may not support (fields_supported's name)
    fixed: bool = False  # no job changes it (total memory): never_reasons judges it, not idle_for
    # The most the figure can ever be on a card, and what it is called (free memory: the
    # total less the driver's reservation), for never_reasons.
    ceiling: tuple[str, Callable[[GpuSample], float | None]] | None = None
    # The GpuSample attribute the limit is compared with (a share: the field's ratio
    # property), and the comparison that fails it: set once, read for every GPU.
    compared: str = dataclasses.field(init=False)
    op: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        compared = self.field.replace("_bytes", "_ratio") if self.of_total else self.field
        object.__setattr__(self, "compared", compared)
        object.__setattr__(self, "op", ">" if self.most else "<")

    @property
    def series(self) -> str:
        """The exporter's series for the figure: ``gpu_memory_free_bytes``."""
        return series_of(self.field)

    @property
    def figures(self) -> tuple[tuple[str, str], ...]:
        """(GpuSample field, series) of every figure it reads: its own, its fallback's."""
        own = ((self.field, self.series),)
        return (
            own
            if self.fallback is None
            else (*own, (self.fallback.field, series_of(self.fallback.field)))
        )

    def fails(self, value: float, limit: float) -> bool:
        return value > limit if self.most else value < limit

    def judged(self, gpu: GpuSample) -> tuple[str, float | None]:
        """What ``gpu`` is judged by, and its name: its figure, else its fallback's."""
        value = getattr(gpu, self.compared)
        if value is None and self.fallback is not None:
            fallback = self.fallback
            return f"{fallback.what} (no {fallback.lacking})", getattr(gpu, fallback.field)
        return self.what, value

    def refusal(self, what: str, value: float, name: str, limit: float) -> str:
        """``utilization 0.90 > max_util 0.50``: why ``value`` fails ``limit``."""
        show = self.unit.show
        if self.unit.counted:
            return f"{show(value)} {what} {self.op} {name} {show(limit)}"
        of_total = " of total" if self.unit.share else ""
        return f"{what} {show(value)}{of_total} {self.op} {name} {show(limit)}"


@dataclass(frozen=True, slots=True)
class Bound:
    """A limit as a request gives it: the parameter, its :class:`Limit`, its number."""

    name: str  # the parameter: "min_free"
    limit: Limit
    value: float

    @property
    def key(self) -> str:
        """What the limit is counted as (the store's ``fleet_reason``): ``min_free_share``
        for ``min_free=25%``, else the parameter's name."""
        return self.name + ("_share" if self.limit.unit.share else "")

    @property
    def shown_as(self) -> str:
        """Its name in a waiter's filters: ``min_free_bytes``, ``max_util_ratio``."""
        return self.name + self.limit.unit.suffix

    def reason(self, gpu: GpuSample, defaulted: tuple[str, ...]) -> str | None:
        """Why ``gpu`` fails it; None when it passes. An unknown figure fails, unless the
        limit came from the defaults. (:func:`rejection_reasons` tests a known figure itself.)"""
        what, value = self.limit.judged(gpu)
        if value is None:
            return None if self.name in defaulted else f"{what} unknown"
        if self.limit.fails(value, self.value):
            return self.limit.refusal(what, value, self.name, self.value)
        return None


@dataclass(frozen=True, slots=True)
class Filters:
    limits: tuple[Bound, ...] = ()  # the numeric limits given, in PARAMS order
    exclude: tuple[str, ...] = ()  # NVML indices, UUIDs (or their prefixes), PCI bus ids
    model: str | None = None  # case-insensitive substring of the name
    include: tuple[str, ...] = ()  # when given, only these GPUs
    mig: str = "deny"  # deny | allow | only (see MIG_MODES)
    max_mig_devices: int | None = None  # most MIG devices one answer may name (None: any)
    defaulted: tuple[str, ...] = ()  # parameters from the defaults: unknown values pass them

    def get(self, key: str) -> float | None:
        """The number a limit was given, by its :attr:`Bound.key`; None when not given."""
        return next((b.value for b in self.limits if b.key == key), None)


@dataclass(frozen=True, slots=True)
class Window:
    """``idle_for``: every GPU must have met the filters in each of these past samples.

    With ``worst_case``, ``past`` holds one entry per window whose GPUs carry the worst figure
    of the whole window (least free memory, highest utilization …), as Prometheus' range
    functions give them, rather than one sample.
    """

    seconds: float
    covered_seconds: float  # how far back the history actually reaches
    past: tuple[tuple[float, tuple[GpuSample, ...]], ...]  # (age in seconds, GPUs), oldest first
    worst_case: bool = False


def candidates(gpus: Iterable[GpuSample], mig: str = "deny") -> list[GpuSample]:
    """What may be handed out under ``mig``: whole GPUs and, unless denied, MIG devices.

    Sorted by index, a parent before its MIG devices.
    """
    out = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        out.append(gpu)
        if mig != "deny":
            out.extend(sorted(gpu.mig_devices, key=instance_order))
    return out


def instance_order(gpu: GpuSample) -> tuple[int, int, str]:
    """Orders one card's MIG devices: by GPU instance, then compute instance, then UUID."""
    return (gpu.gpu_instance_id or 0, gpu.compute_instance_id or 0, gpu.uuid)


def _mig_reason(gpu: GpuSample, mig: str) -> str | None:
    if gpu.is_mig_device:
        return None if mig != "deny" else "a MIG device (mig=deny)"
    if mig == "only":
        return "not a MIG device (mig=only)"
    if gpu.mig_mode_enabled:
        hint = "its MIG devices are candidates" if mig == "allow" else "use mig=allow or mig=only"
        return f"MIG mode is on ({hint})"
    return None


def rejection_reasons(gpu: GpuSample, filters: Filters) -> tuple[str, ...]:
    """Why ``gpu`` does not qualify; empty when it does.

    >>> g = GpuSample(index=0, uuid="GPU-0", up=True)  # reports no utilization
    >>> at_most_half = (Bound("max_util", Limit("utilization", "utilization_ratio", RATIO), 0.5),)
    >>> rejection_reasons(g, Filters(at_most_half))
    ('utilization unknown',)
    >>> rejection_reasons(g, Filters(at_most_half, defaulted=("max_util",)))
    ()
    """
    if not gpu.up:
        return (f"down: {gpu.error or 'not answering'}",)
    mig_reason = _mig_reason(gpu, filters.mig)
    if mig_reason is not None:
        return (mig_reason,)
    # Only the filters given are checked: this runs for every GPU of a fleet
    # (bench/cluster.py ranks 10,000).
    reasons: list[str] = []
    _identity_reasons(reasons, gpu, filters)
    if filters.model is not None and filters.model.lower() not in (gpu.name or "").lower():
        reasons.append(f"model {gpu.name!r} does not contain {filters.model!r}")
    for bound in filters.limits:
        limit = bound.limit
        value = getattr(gpu, limit.compared)
        if value is None:  # unknown, or judged by its fallback
            if (reason := bound.reason(gpu, filters.defaulted)) is not None:
                reasons.append(reason)
        elif value > bound.value if limit.most else value < bound.value:
            reasons.append(limit.refusal(limit.what, value, bound.name, bound.value))
    return tuple(reasons)


def sm_activity(gpu: GpuSample) -> float | None:
    """How busy the SMs were: GPM's SM activity, or, on a card without GPM (before Hopper, or
    before its first GPM interval), NVML's utilization, which is never below it (a kernel
    running on one SM counts as "utilized"), so a limit on it holds for both.

    >>> sm_activity(GpuSample(index=0, uuid="GPU-0", up=True, utilization_ratio=0.12))
    0.12
    """
    return gpu.sm_active_ratio if gpu.sm_active_ratio is not None else gpu.utilization_ratio


def _identity_reasons(reasons: list[str], gpu: GpuSample, filters: Filters) -> None:
    if filters.include and not any(selector_matches(gpu, s) for s in filters.include):
        reasons.append("not included")
    if filters.exclude and any(selector_matches(gpu, s) for s in filters.exclude):
        reasons.append("excluded")


def usable_memory(gpu: GpuSample) -> int | None:
    """The most memory a card can ever have free: its total less the driver's reservation."""
    total = gpu.memory_total_bytes
    return None if total is None else total - (gpu.memory_reserved_bytes or 0)


def never_reasons(
    gpu: GpuSample, filters: Filters, mem: int | None = None, headroom: int = 0
) -> tuple[str, ...]:
    """Why ``gpu`` can never qualify under ``filters`` (and a memory lease of ``mem`` with
    ``headroom`` kept free), whatever its load; empty when it might.

    Only what no job changes counts: the device's kind (whole card or MIG device, MIG mode),
    ``include``/``exclude``, its model, the limits on a figure no job changes
    (:attr:`Limit.fixed`) or beyond the most it can reach (:attr:`Limit.ceiling`), its total
    memory less the driver's reservation against ``mem``, and what it cannot report (a field
    NVML answered NOT_SUPPORTED for, utilization in MIG mode) where a limit reads it
    (:attr:`Limit.reports`). A GPU that
    is down, or a figure that failed once, might still come good.
    """
    mig_reason = _mig_reason(gpu, filters.mig)
    if mig_reason is not None:
        return (mig_reason,)
    reasons: list[str] = []
    _identity_reasons(reasons, gpu, filters)
    if filters.model is not None:  # a name is read once: unknown on a GPU up stays unknown
        if gpu.name is None and gpu.up:
            reasons.append("model unknown")
        elif gpu.name and filters.model.lower() not in gpu.name.lower():
            reasons.append(f"model {gpu.name!r} does not contain {filters.model!r}")
    # What no job changes: the card's own figures (its total memory), then the most a figure
    # can ever reach there (free memory: the total less the driver's reservation).
    for bound in filters.limits:
        if bound.limit.fixed:
            _never(reasons, bound, bound.limit.what, getattr(gpu, bound.limit.compared))
    for bound in filters.limits:
        if bound.limit.ceiling is not None:
            what, ceiling = bound.limit.ceiling
            _never(reasons, bound, what, ceiling(gpu))
    usable = usable_memory(gpu)
    if mem is not None and usable is not None and usable - headroom < mem:
        reasons.append(
            f"mem={format_bytes(mem)} can never fit: its total less the driver's "
            f"reservation and {format_bytes(headroom)} headroom is "
            f"{format_bytes(max(0, usable - headroom))}"
        )
    if mem is not None and (gpu.is_mig_device or gpu.mig_mode_enabled or gpu.mig_devices):
        reasons.append("memory leases take shares of whole cards, not MIG")
    unsupported = {field for field, ok in gpu.fields_supported if not ok}
    if gpu.is_mig_device or gpu.mig_mode_enabled:
        unsupported.add("utilization")  # NVML reports none for MIG (README, MIG)
    for bound in filters.limits:  # a field NVML answered NOT_SUPPORTED for stays unknown
        field = bound.limit.reports
        if field is not None and field in unsupported and bound.name not in filters.defaulted:
            reasons.append(f"cannot report its {field} ({bound.name})")
    return tuple(reasons)


def never_enough(
    gpus: Iterable[GpuSample],
    n: int,
    filters: Filters,
    mem: int | None = None,
    headroom: int = 0,
) -> str | None:
    """Why ``n`` devices can never qualify here under ``filters`` (and ``mem``): too few
    devices, too few that the fixed limits could ever accept, or more MIG devices than one
    answer may name; None when they might.

    >>> gpu = GpuSample(index=0, uuid="GPU-0", up=True, memory_total_bytes=40 * 2**30)
    >>> never_enough([gpu], 2, Filters()), never_enough([gpu], 1, Filters()) is None
    ('at most 1 of the 1 GPU here could ever qualify', True)
    """
    whole = mig = 0
    never = []
    devices = candidates(gpus, filters.mig)
    for gpu in devices:
        reasons = never_reasons(gpu, filters, mem, headroom)
        if reasons:
            never.append(f"gpu {gpu.index}: {', '.join(reasons)}")
        elif gpu.is_mig_device:
            mig += 1
        else:
            whole += 1
    # One answer holds one kind (mig=allow: the kind that has n) and at most
    # max_mig_devices MIG devices.
    if filters.max_mig_devices is not None and mig > filters.max_mig_devices:
        never.append(f"one answer names at most {plural(filters.max_mig_devices, 'MIG device')}")
        mig = filters.max_mig_devices
    possible = max(whole, mig)
    if possible >= n:
        return None
    details = f" ({'; '.join(never)})" if never else ""
    return (
        f"at most {possible} of the {plural(len(devices), 'GPU')} here could ever qualify{details}"
    )


def _never(reasons: list[str], bound: Bound, what: str, value: float | None) -> None:
    """Add why ``value``, a figure no job changes (or the most it can reach), fails ``bound``."""
    if value is not None and bound.limit.fails(value, bound.value):
        reasons.append(bound.limit.refusal(what, value, bound.name, bound.value))


def window_reasons(gpu: GpuSample, filters: Filters, window: Window) -> tuple[str, ...]:
    """Why ``gpu`` did not meet ``filters`` throughout ``window``; empty when it did."""
    if window.covered_seconds < window.seconds:
        return (
            f"only {window.covered_seconds:.0f} s of history for idle_for {window.seconds:g} s",
        )
    for age, gpus in reversed(window.past):  # the most recent violation is the telling one
        past = next((g for g in all_devices(gpus) if g.uuid == gpu.uuid), None)
        when = f"within the last {age:.0f} s" if window.worst_case else f"{age:.0f} s ago"
        if past is None:
            return (f"no figures {when}" if window.worst_case else f"not present {when}",)
        reasons = rejection_reasons(past, filters)
        if reasons:
            return (f"{when}: {reasons[0]}",)
    return ()
