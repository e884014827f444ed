"""Ranking GPUs for ``/choose``: pure functions over snapshot values — no Flask, no NVML.

The default order, best first:

1. most free memory, counted in whole GiB (differences under 1 GiB — a driver context, a
   display — are noise, and would otherwise decide every tie before utilization could);
2. lowest utilization;
3. highest NVML index, so GPU 0 — where programs that ignore ``CUDA_VISIBLE_DEVICES``
   land — stays free the longest.

A GPU that is down never qualifies. A filter on a value the GPU cannot report rejects it
(unknown is not "free"). Memory used by processes we cannot see (another container) is
already counted in NVML's "used", so it is never mistaken for free memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpu_exporter.model import GpuSample
from gpu_exporter.units import format_bytes

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Filters:
    min_free_bytes: int | None = None
    max_util_ratio: float | None = None
    exclude: tuple[str, ...] = ()  # NVML indices, UUIDs (or their prefixes), PCI bus ids


@dataclass(frozen=True, slots=True)
class Rejected:
    gpu: GpuSample
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ranking:
    qualified: tuple[GpuSample, ...]  # best first
    rejected: tuple[Rejected, ...]  # in NVML index order


@dataclass(frozen=True, slots=True)
class Choice:
    chosen: tuple[GpuSample, ...]  # best first, exactly as many as requested
    not_chosen: tuple[Rejected, ...]  # every other GPU, each with its reasons


class NotEnoughGpus(Exception):
    def __init__(self, requested: int, ranking: Ranking) -> None:
        self.requested = requested
        self.ranking = ranking
        total = len(ranking.qualified) + len(ranking.rejected)
        details = "; ".join(f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in ranking.rejected)
        super().__init__(
            f"{len(ranking.qualified)} of {total} GPUs qualify, {requested} requested"
            + (f" ({details})" if details else "")
        )


def selector_matches(gpu: GpuSample, selector: str) -> bool:
    """Does ``selector`` (index, UUID or UUID prefix, PCI bus id) name this GPU?

    >>> g = GpuSample(index=3, uuid="GPU-5a1e0003-abcd", up=True, pci_bus_id="00000000:48:00.0")
    >>> [selector_matches(g, s) for s in ("3", "GPU-5a1e", "gpu-5A1E0003-ABCD", "48:00.0", "4")]
    [True, True, True, True, False]
    """
    s = selector.strip()
    if s.isdigit():
        return int(s) == gpu.index
    if s.upper().startswith(("GPU-", "MIG-")):
        return gpu.uuid.upper().startswith(s.upper())
    if ":" in s and gpu.pci_bus_id:
        return _normalise_bus_id(gpu.pci_bus_id) == _normalise_bus_id(s)
    return False


def _normalise_bus_id(bus_id: str) -> str:
    """``0000:3b:00.0``, ``3B:00.0`` and ``00000000:3B:00.0`` are the same device."""
    parts = bus_id.upper().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    domain, rest = parts[0], ":".join(parts[1:])
    return f"{int(domain, 16):08X}:{rest}" if _is_hex(domain) else bus_id.upper()


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


def rejection_reasons(gpu: GpuSample, filters: Filters) -> tuple[str, ...]:
    """Why ``gpu`` does not qualify; empty when it does."""
    if not gpu.up:
        return (f"down: {gpu.error or 'not answering'}",)
    reasons = []
    if any(selector_matches(gpu, s) for s in filters.exclude):
        reasons.append("excluded")
    if filters.min_free_bytes is not None:
        free = gpu.memory_free_bytes
        if free is None:
            reasons.append("free memory unknown")
        elif free < filters.min_free_bytes:
            wanted = format_bytes(filters.min_free_bytes)
            reasons.append(f"free memory {format_bytes(free)} < min_free {wanted}")
    if filters.max_util_ratio is not None:
        util = gpu.utilization_ratio
        if util is None:
            reasons.append("utilization unknown")
        elif util > filters.max_util_ratio:
            reasons.append(f"utilization {util:.2f} > max_util {filters.max_util_ratio:.2f}")
    return tuple(reasons)


def sort_key(gpu: GpuSample) -> tuple[bool, int, bool, float, int]:
    """Ascending key for the default order (see the module docstring). Unknowns sort last."""
    free = gpu.memory_free_bytes
    util = gpu.utilization_ratio
    return (
        free is None,
        -(free // GIB) if free is not None else 0,
        util is None,
        util if util is not None else 0.0,
        -gpu.index,
    )


def rank(gpus: Iterable[GpuSample], filters: Filters) -> Ranking:
    qualified, rejected = [], []
    for gpu in sorted(gpus, key=lambda g: g.index):
        reasons = rejection_reasons(gpu, filters)
        if reasons:
            rejected.append(Rejected(gpu, reasons))
        else:
            qualified.append(gpu)
    return Ranking(tuple(sorted(qualified, key=sort_key)), tuple(rejected))


def choose(gpus: Iterable[GpuSample], n: int, filters: Filters) -> Choice:
    """The ``n`` best qualifying GPUs; raises :class:`NotEnoughGpus` if fewer qualify."""
    if n < 1:
        raise ValueError("n must be at least 1")
    ranking = rank(gpus, filters)
    if len(ranking.qualified) < n:
        raise NotEnoughGpus(n, ranking)
    chosen = ranking.qualified[:n]
    passed_over = tuple(
        Rejected(g, (f"ranked {place} of {len(ranking.qualified)} qualifying; {n} requested",))
        for place, g in enumerate(ranking.qualified[n:], start=n + 1)
    )
    not_chosen = sorted(ranking.rejected + passed_over, key=lambda r: r.gpu.index)
    return Choice(chosen, tuple(not_chosen))
