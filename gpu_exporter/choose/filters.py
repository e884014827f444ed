"""Which GPUs a ``/choose`` request's filters accept, and why not the others: pure functions.

:class:`Filters` is what a request asks of a GPU (:mod:`gpu_exporter.choose.request` builds it
from the query string). :func:`rejection_reasons` says why a GPU does not qualify now,
:func:`window_reasons` why it did not throughout ``idle_for`` (a :class:`Window`), and
:func:`never_reasons` / :func:`never_enough` what no amount of waiting can cure. Ordering the
GPUs that qualify, and picking ``n``, is :mod:`gpu_exporter.choose.rank`'s.

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

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_exporter.choose.selectors import selector_matches
from gpu_exporter.model import GpuSample, all_devices
from gpu_exporter.units import format_bytes, plural

MIG_MODES = ("deny", "allow", "only")


@dataclass(frozen=True, slots=True)
class Filters:
    min_free_bytes: int | None = None
    max_util_ratio: float | None = None
    exclude: tuple[str, ...] = ()  # NVML indices, UUIDs (or their prefixes), PCI bus ids
    min_total_bytes: int | None = None
    max_mem_util_ratio: float | None = None
    max_procs: int | None = None  # 0: no compute process at all
    model: str | None = None  # case-insensitive substring of the name
    include: tuple[str, ...] = ()  # when given, only these GPUs
    mig: str = "deny"  # deny | allow | only (see MIG_MODES)
    max_mig_devices: int | None = None  # most MIG devices one answer may name (None: any)
    defaulted: tuple[str, ...] = ()  # parameters from the defaults: unknown values pass them
    max_mem_used_ratio: float | None = None  # memory in use ÷ total (occupancy)
    min_free_ratio: float | None = None  # free memory ÷ total (min_free=25%)
    max_sm_active_ratio: float | None = None  # GPM SM activity (utilization without GPM)


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
    >>> rejection_reasons(g, Filters(max_util_ratio=0.5))
    ('utilization unknown',)
    >>> rejection_reasons(g, Filters(max_util_ratio=0.5, defaulted=("max_util",)))
    ()
    """
    if not gpu.up:
        return (f"down: {gpu.error or 'not answering'}",)
    mig_reason = _mig_reason(gpu, filters.mig)
    if mig_reason is not None:
        return (mig_reason,)
    # Each check is skipped outright when its filter is unset: this runs for every GPU of a
    # fleet (bench/cluster.py ranks 10,000).
    reasons: list[str] = []
    d = filters.defaulted
    _identity_reasons(reasons, gpu, filters)
    if filters.model is not None and filters.model.lower() not in (gpu.name or "").lower():
        reasons.append(f"model {gpu.name!r} does not contain {filters.model!r}")
    if filters.min_free_bytes is not None:
        _limit(reasons, "free memory", gpu.memory_free_bytes, filters.min_free_bytes, "min_free", d)
    if filters.min_free_ratio is not None:
        _share(reasons, "free memory", gpu.memory_free_ratio, filters.min_free_ratio, "min_free", d)
    if filters.min_total_bytes is not None:
        _limit(
            reasons, "total memory", gpu.memory_total_bytes, filters.min_total_bytes, "min_total", d
        )
    if filters.max_util_ratio is not None:
        _limit(
            reasons,
            "utilization",
            gpu.utilization_ratio,
            filters.max_util_ratio,
            "max_util",
            d,
            True,
        )
    if filters.max_mem_used_ratio is not None:
        _limit(
            reasons,
            "memory used",
            gpu.memory_used_ratio,
            filters.max_mem_used_ratio,
            "max_mem_used",
            d,
            True,
        )
    if filters.max_mem_util_ratio is not None:
        _limit(
            reasons,
            "memory utilization",
            gpu.memory_utilization_ratio,
            filters.max_mem_util_ratio,
            "max_mem_util",
            d,
            True,
        )
    if filters.max_sm_active_ratio is not None:
        what = "SM activity" if gpu.sm_active_ratio is not None else "utilization (no GPM)"
        limit = filters.max_sm_active_ratio
        _limit(reasons, what, sm_activity(gpu), limit, "max_sm_active", d, True)
    if filters.max_procs is not None:
        procs = gpu.compute_processes
        if procs is None:  # an unsupported process list never reads as "idle"
            if "max_procs" not in filters.defaulted:
                reasons.append("compute processes unknown")
        elif procs > filters.max_procs:
            reasons.append(f"{procs} compute processes > max_procs {filters.max_procs}")
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


# The fields each filter reads (GpuSample.fields_supported's names): a filter the request
# gave on a field the device answered NOT_SUPPORTED for can never pass there.
_FILTER_FIELDS = (
    ("max_util", "max_util_ratio", "utilization"),
    ("max_mem_util", "max_mem_util_ratio", "utilization"),
    ("max_procs", "max_procs", "processes"),
    ("min_free", "min_free_bytes", "memory"),
    ("max_mem_used", "max_mem_used_ratio", "memory"),
)


def never_reasons(
    gpu: GpuSample, filters: Filters, mem: int | None = None, headroom: int = 0
) -> tuple[str, ...]:
    """Why ``gpu`` can never qualify under ``filters`` (and a memory lease of ``mem`` with
    ``headroom`` kept free), whatever its load; empty when it might.

    Only what no job changes counts: the device's kind (whole card or MIG device, MIG mode),
    ``include``/``exclude``, its model, its total memory less the driver's reservation (against
    ``min_total``, ``min_free`` and ``mem``), and what it cannot report (a field NVML answered
    NOT_SUPPORTED for, utilization in MIG mode) where the request filters on it. A GPU that
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
    total = gpu.memory_total_bytes
    if total is not None:
        usable = total - (gpu.memory_reserved_bytes or 0)
        _limit(reasons, "total memory", total, filters.min_total_bytes, "min_total", ())
        _limit(reasons, "usable memory", usable, filters.min_free_bytes, "min_free", ())
        if mem is not None and usable - headroom < mem:
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
    for param, attribute, field in _FILTER_FIELDS:
        given = getattr(filters, attribute) is not None and param not in filters.defaulted
        if given and field in unsupported:
            reasons.append(f"cannot report its {field} ({param})")
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


def _limit(
    reasons: list[str],
    what: str,
    value: float | None,
    limit: float | None,
    param: str,
    defaulted: tuple[str, ...],
    most: bool = False,
) -> None:
    """Add why ``value`` misses ``limit`` (above it if ``most``, else below it); an unknown
    ``value`` misses unless ``param`` came from the defaults."""
    if limit is None:
        return
    if value is None:
        if param not in defaulted:
            reasons.append(f"{what} unknown")
    elif most and value > limit:
        reasons.append(f"{what} {value:.2f} > {param} {limit:.2f}")
    elif not most and value < limit:
        reasons.append(f"{what} {format_bytes(int(value))} < {param} {format_bytes(int(limit))}")


def _share(
    reasons: list[str],
    what: str,
    value: float | None,
    least: float,
    param: str,
    defaulted: tuple[str, ...],
) -> None:
    """Add why a share of the total ``value`` is below ``least`` (as :func:`_limit`)."""
    if value is None:
        if param not in defaulted:
            reasons.append(f"{what} unknown")
    elif value < least:
        reasons.append(f"{what} {value:.2f} of total < {param} {least:.2f}")


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
