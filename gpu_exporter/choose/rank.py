"""Ranking GPUs for ``/choose``: pure functions over snapshot values — no Flask, no NVML.

Which GPUs qualify, and why the others do not, is :mod:`gpu_exporter.choose.filters`; this
module orders those that do and picks ``n``. The default order, best first:

1. most free memory, counted in whole GiB (differences under 1 GiB — a driver context, a
   display — are noise, and would otherwise decide every tie before utilization could);
2. lowest utilization;
3. highest NVML index, so GPU 0 — where programs that ignore ``CUDA_VISIBLE_DEVICES``
   land — stays free the longest.

Other orders (``sort=``): ``free_ratio`` (free share of the card), ``util`` (least busy
first), ``sm_active`` (least SM activity first, by GPM; utilization on a card without GPM),
``power`` (lowest draw/limit first) and ``pack`` (the fullest card that still passes the
filters, to keep whole cards free). Each falls back to the default order on ties, then to
the index rule above, so every order is total and deterministic.

MIG: a CUDA process can use only one MIG device, and no whole GPU once a MIG device is
visible (NVIDIA's MIG user guide), so one answer never mixes the kinds: under ``mig=allow``
the kind of the best-ranked GPU whose kind has ``n`` qualifying wins, and the other kind is
passed over with the reason (:func:`one_kind`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from gpu_exporter.choose.filters import (
    Filters,
    Window,
    candidates,
    instance_order,
    rejection_reasons,
    sm_activity,
    window_reasons,
)
from gpu_exporter.model import GpuSample
from gpu_exporter.units import plural

GIB = 2**30


SORTS = ("free", "free_ratio", "util", "power", "pack", "sm_active")


@dataclass(frozen=True, slots=True)
class Rejected:
    gpu: GpuSample
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ranking:
    qualified: tuple[GpuSample, ...]  # best first
    rejected: tuple[Rejected, ...]  # in NVML index order


@dataclass(frozen=True, slots=True)
class Selection:
    """What :func:`choose` picked, and why every other GPU was not picked. (The client's
    :class:`gpu_exporter.client.Choice` is what a caller gets back over HTTP.)"""

    chosen: tuple[GpuSample, ...]  # best first, exactly as many as requested
    not_chosen: tuple[Rejected, ...]  # every other GPU, each with its reasons


class NotEnoughGpus(Exception):
    def __init__(self, requested: int, ranking: Ranking, note: str = "") -> None:
        self.requested = requested
        self.ranking = ranking
        details = "; ".join(f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in ranking.rejected)
        super().__init__(
            f"{how_many_qualify(ranking)}, {requested} requested"
            + (f" ({details})" if details else "")
            + (f"; {note}" if note else "")
        )


def how_many_qualify(ranking: Ranking) -> str:
    """``"2 of 8 GPUs qualify"``, ``"0 of 1 GPU qualifies"``."""
    total = len(ranking.qualified) + len(ranking.rejected)
    verb = "qualifies" if total == 1 else "qualify"
    return f"{len(ranking.qualified)} of {plural(total, 'GPU')} {verb}"


SortKey = tuple[tuple[bool, float], ...]


_UNKNOWN: Final = (True, 0.0)


def _known(value: float | None) -> tuple[bool, float]:
    """Unknown values sort after every known one."""
    return (value is None, value if value is not None else 0.0)


def score(gpu: GpuSample, sort: str = "free") -> float | None:
    """The figure a sort order ranks by (shown as ``score`` in JSON); None when unknown.

    >>> g = GpuSample(index=0, uuid="GPU-0", up=True, memory_free_bytes=GIB * 5 // 2)
    >>> score(g, "free"), score(g, "util")  # whole GiB; this GPU reports no utilization
    (2.0, None)
    """
    free, total = gpu.memory_free_bytes, gpu.memory_total_bytes
    if sort in ("free", "pack"):
        return None if free is None else float(free // GIB)
    if sort == "free_ratio":
        return None if free is None or not total else round(free / total, 2)
    if sort == "util":
        return gpu.utilization_ratio
    if sort == "sm_active":
        return sm_activity(gpu)
    if sort == "power":
        draw, limit = gpu.power_draw_watts, gpu.power_limit_watts
        return None if draw is None or not limit else round(draw / limit, 2)
    raise ValueError(f"unknown sort {sort!r}")


def sort_key(gpu: GpuSample, sort: str = "free") -> SortKey:
    """Ascending key: best first. Ties fall back to the default order, then highest index."""
    # Spelled out rather than through score() and _known(): a fleet ranks 100,000 GPUs
    # (bench/cluster.py), and this is most of that time.
    free = gpu.memory_free_bytes
    util = gpu.utilization_ratio
    # Last: the highest index; among one card's MIG devices, the lowest instance first.
    default = (
        _UNKNOWN if free is None else (False, -float(free // GIB)),
        _UNKNOWN if util is None else (False, util),
        (False, -gpu.index),
        (False, gpu.gpu_instance_id or 0),
        (False, gpu.compute_instance_id or 0),
    )
    if sort == "free":
        return default
    primary = score(gpu, sort)
    if primary is not None and sort == "free_ratio":
        primary = -primary  # more is better
    if sort == "pack":  # least free memory that still passed the filters
        return (_known(primary), *default[1:])
    return (_known(primary), *default)


def rank(
    gpus: Iterable[GpuSample],
    filters: Filters,
    *,
    sort: str = "free",
    window: Window | None = None,
    leased: Mapping[str, str] | None = None,
    fit: Mapping[str, int] | None = None,
) -> Ranking:
    """Split GPUs into qualified (best first) and rejected (with reasons).

    ``leased`` maps the UUIDs of GPUs someone holds to a short description of the lease.
    ``fit`` (a memory lease's request: UUID → the room left there) orders the least room
    first, best fit, before ``sort``.
    """
    qualified, rejected = [], []
    for gpu in candidates(gpus, filters.mig):
        reasons = rejection_reasons(gpu, filters)
        if not reasons and leased and gpu.uuid in leased:
            reasons = (leased[gpu.uuid],)
        if not reasons and window is not None:
            reasons = window_reasons(gpu, filters, window)
        if reasons:
            rejected.append(Rejected(gpu, reasons))
        else:
            qualified.append(gpu)
    if fit is None:
        ordered = sorted(qualified, key=lambda g: sort_key(g, sort))
    else:
        ordered = sorted(qualified, key=lambda g: ((fit.get(g.uuid, 0),), sort_key(g, sort)))
    return Ranking(tuple(ordered), tuple(rejected))


def one_kind(ranking: Ranking, n: int, filters: Filters) -> Ranking:
    """Keep whole GPUs or MIG devices, never both (``mig=allow`` may qualify both), and MIG
    devices only up to ``max_mig_devices`` (``mig=allow`` or ``only``); what is left out is
    passed over with why.

    The kind of the best-ranked GPU whose kind has ``n`` qualifying (MIG devices only up to
    ``max_mig_devices``); when neither has, the kind with more, so the refusal counts those.
    """
    if filters.mig == "deny":  # no MIG device qualifies
        return ranking
    whole = [g for g in ranking.qualified if not g.is_mig_device]
    mig = [g for g in ranking.qualified if g.is_mig_device]
    mig_fits = filters.max_mig_devices is None or n <= filters.max_mig_devices
    enough = {False: len(whole) >= n, True: mig_fits and len(mig) >= n}
    kind = next((g.is_mig_device for g in ranking.qualified if enough[g.is_mig_device]), None)
    if kind is None:
        kind = mig_fits and len(mig) > len(whole)
    if kind:
        dropped, why = whole, "a whole GPU: this answer is MIG devices (one answer never mixes "
        why += "them: a CUDA process that sees a MIG device cannot use a whole GPU)"
    elif not mig_fits:
        dropped = mig
        why = (
            f"a MIG device: n={n} MIG devices need format=list or json "
            "(a CUDA process can use only one MIG device)"
        )
    else:
        dropped = mig
        why = "a MIG device: this answer is whole GPUs (one answer never mixes them)"
    if not dropped:
        return ranking
    kept = tuple(g for g in ranking.qualified if g.is_mig_device == kind)
    rejected = sorted(
        (*ranking.rejected, *(Rejected(g, (why,)) for g in dropped)),
        key=lambda r: (r.gpu.index, r.gpu.is_mig_device, instance_order(r.gpu)),
    )
    return Ranking(kept, tuple(rejected))


def choose(
    gpus: Iterable[GpuSample],
    n: int,
    filters: Filters,
    *,
    sort: str = "free",
    window: Window | None = None,
    leased: Mapping[str, str] | None = None,
    fit: Mapping[str, int] | None = None,
    note: str = "",
) -> Selection:
    """The ``n`` best qualifying GPUs; raises :class:`NotEnoughGpus` (saying ``note`` too)
    if fewer qualify."""
    if n < 1:
        raise ValueError("n must be at least 1")
    ranking = rank(gpus, filters, sort=sort, window=window, leased=leased, fit=fit)
    ranking = one_kind(ranking, n, filters)
    if len(ranking.qualified) < n:
        raise NotEnoughGpus(n, ranking, note)
    chosen = ranking.qualified[:n]
    passed_over = tuple(
        Rejected(g, (f"ranked {place} of {len(ranking.qualified)} qualifying; {n} requested",))
        for place, g in enumerate(ranking.qualified[n:], start=n + 1)
    )
    not_chosen = sorted(
        ranking.rejected + passed_over,
        key=lambda r: (r.gpu.index, r.gpu.is_mig_device, instance_order(r.gpu)),
    )
    return Selection(chosen, tuple(not_chosen))
