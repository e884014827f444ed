"""What the status page at ``/`` shows, computed from one snapshot and the lease table.

Pure: no Flask, no NVML. The recommendation is :func:`gpu_exporter.choose.rank.rank` with no
filters, the current leases and the GPUs waiting requests reserve, i.e. what ``/choose?n=1``
would claim now. Without ``holders`` (a client that proved no user while basic auth has
users) it names no holder, requester or lease: GPU states and counts only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.memory import card_memory, memory_leases
from gpu_exporter.choose.rank import rank
from gpu_exporter.choose.waitqueue import Waiter, reserved_for
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.units import format_bytes, plural


@dataclass(frozen=True, slots=True)
class Cell:
    """One value of the GPU table: its text (and bar ratio), or why there is none."""

    text: str
    ratio: float | None = None  # 0–1 for a bar
    missing: str | None = None  # set instead of a value: shown as "n/a" with this tooltip


@dataclass(frozen=True, slots=True)
class DeviceCells:
    """The value columns of one GPU or MIG device, in table order."""

    memory: Cell
    utilization: Cell
    sm_active: Cell  # GPM's SM activity, beside utilization: how much of the card works
    temperature: Cell
    power: Cell
    processes: Cell


@dataclass(frozen=True, slots=True)
class GpuRow:
    gpu: GpuSample
    holder: str | None  # "alice, 42 s left", when a lease holds the GPU
    cells: DeviceCells
    migs: tuple[tuple[GpuSample, DeviceCells], ...] = ()  # shown grouped under the card
    # A card memory leases share: (committed / usable, "24.0 GiB of 79.5 GiB committed").
    committed: tuple[float, str] | None = None


# Column → (the FieldReader field behind it, what it is called in a tooltip).
_FIELDS = {
    "memory": ("memory", "memory use"),
    "utilization": ("utilization", "utilization"),
    "sm_active": ("gpm", "SM activity (GPM, Hopper and later)"),
    "temperature": ("temperature", "temperature"),
    "power": ("power_draw", "power draw"),
    "processes": ("processes", "its processes"),
}


def _missing(gpu: GpuSample, column: str) -> str:
    """Why ``gpu`` has no value for ``column``: the tooltip of its "n/a"."""
    field, what = _FIELDS[column]
    if not gpu.up:
        return "the GPU did not answer the last sample"
    if dict(gpu.fields_supported).get(field) is False:
        kind = "MIG device" if gpu.is_mig_device else "card"
        return f"this {kind} cannot report {what} (NVML: not supported)"
    if gpu.is_mig_device and column in ("utilization", "temperature", "power"):
        return f"NVML reports {what} for the whole card, not per MIG device"
    if column == "sm_active":  # GPM needs two samples, --gpm-interval apart
        return f"{what}: not measured over a whole --gpm-interval yet"
    return f"{what} was not reported in the last sample" + (f": {gpu.error}" if gpu.error else "")


def _cell(gpu: GpuSample, column: str, text: str | None, ratio: float | None = None) -> Cell:
    return Cell(text, ratio) if text is not None else Cell("n/a", None, _missing(gpu, column))


def device_cells(gpu: GpuSample) -> DeviceCells:
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    util, temp, power = gpu.utilization_ratio, gpu.temperature_celsius, gpu.power_draw_watts
    sm = gpu.sm_active_ratio
    known = used is not None and bool(total)
    memory = f"{format_bytes(used or 0)} / {format_bytes(total or 0)}" if known else None
    mem_ratio = (used or 0) / (total or 1) if known else None
    watts = None
    if power is not None:
        limit = f" / {gpu.power_limit_watts:.0f}" if gpu.power_limit_watts else ""
        watts = f"{power:.0f}{limit} W"
    procs = gpu.compute_processes
    return DeviceCells(
        _cell(gpu, "memory", memory, mem_ratio),
        _cell(gpu, "utilization", f"{util * 100:.0f} %" if util is not None else None, util),
        _cell(gpu, "sm_active", f"{sm * 100:.0f} %" if sm is not None else None, sm),
        _cell(gpu, "temperature", f"{temp:.0f} °C" if temp is not None else None),
        _cell(gpu, "power", watts),
        _cell(gpu, "processes", str(procs) if procs is not None else None),
    )


@dataclass(frozen=True, slots=True)
class LeaseRow:
    id: str
    gpus: str  # "0, 3"
    holder: str  # owner, else the requester
    requester: str
    expires_in_seconds: float


@dataclass(frozen=True, slots=True)
class WaitingRow:
    wants: str  # "2 GPUs (model=A100)"
    holder: str | None  # owner, else the requester; None: not shown
    since_seconds: float


@dataclass(frozen=True, slots=True)
class Recommendation:
    gpu: GpuSample | None  # the GPU /choose?n=1 would return now, if any qualifies
    why_not: tuple[str, ...]  # when none qualifies: "gpu 3: leased …" per GPU


@dataclass(frozen=True, slots=True)
class StatusView:
    snapshot: Snapshot
    age_seconds: float
    rows: tuple[GpuRow, ...]
    leases: tuple[LeaseRow, ...]
    recommendation: Recommendation
    problem: str | None  # why /choose would refuse right now (NVML down, stale, starting)
    waiting: tuple[WaitingRow, ...] = ()  # requests waiting for GPUs, earliest first
    lease_count: int = 0  # active leases, shown whether or not ``leases`` lists them
    holders: bool = True  # False: who holds what is not shown (``leases`` is empty)


def _holder(lease: Lease) -> str:
    return lease.owner or lease.requester


def _shared(
    gpu: GpuSample, leases: list[Lease], holders: bool
) -> tuple[str, tuple[float, str] | None]:
    """A card memory leases share: who holds them, and its committed memory as a bar."""
    who = plural(len(leases), "memory lease")
    if holders:
        who += ": " + ", ".join(dict.fromkeys(_holder(x) for x in leases))
    card = card_memory(gpu, leases)
    if card.usable <= 0:
        return who, None
    text = f"{format_bytes(card.committed)} of {format_bytes(card.usable)} committed"
    return who, (min(1.0, card.committed / card.usable), text)


def status_view(
    snapshot: Snapshot,
    leases: tuple[Lease, ...],
    *,
    wall_now: float,
    age_seconds: float,
    problem: str | None,
    filters: Filters | None = None,
    waiting: tuple[Waiter, ...] = (),
    monotonic_now: float = 0.0,
    holders: bool = True,
    withheld: Mapping[str, str] | None = None,
) -> StatusView:
    """What ``/`` shows; the recommendation is what ``/choose?n=1`` would give under
    ``filters`` (the server's ``--choose-defaults``). ``holders``: name who holds what.
    ``withheld``: UUID → why, the devices no claim may get (an untrusted state file)."""
    held = {uuid: lease for lease in leases for uuid in lease.uuids}
    withheld = withheld or {}
    shared = memory_leases(leases)
    rows = []
    for gpu in snapshot.gpus:
        lease = held.get(gpu.uuid)
        holder = (
            f"{_holder(lease) if holders else 'leased'}, "
            f"{max(0.0, lease.expires_at - wall_now):.0f} s left"
            if lease
            else withheld.get(gpu.uuid)
        )
        committed = None
        if gpu.uuid in shared:
            holder, committed = _shared(gpu, shared[gpu.uuid], holders)
        migs = tuple((m, device_cells(m)) for m in gpu.mig_devices)
        rows.append(GpuRow(gpu, holder, device_cells(gpu), migs, committed))
    lease_rows = tuple(
        LeaseRow(
            lease.id,
            ", ".join(str(g.index) for g in lease.gpus)
            + (f" ({format_bytes(lease.mem_bytes)} each)" if lease.mem_bytes else ""),
            _holder(lease),
            lease.requester,
            max(0.0, lease.expires_at - wall_now),
        )
        for lease in leases
        if holders
    )
    leased = {
        **withheld,
        **reserved_for(snapshot.gpus, waiting),
        **{
            uuid: f"leased by {_holder(lease)}" if holders else "leased"
            for uuid, lease in held.items()
        },
    }
    ranking = rank(snapshot.gpus, filters or Filters(), leased=leased)
    if problem is None and ranking.qualified:
        recommendation = Recommendation(ranking.qualified[0], ())
    else:
        why = tuple(f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in ranking.rejected)
        recommendation = Recommendation(None, (problem,) if problem else why)
    waiting_rows = tuple(
        WaitingRow(
            w.describe(),
            (w.owner or w.requester) if holders else None,
            monotonic_now - w.since_monotonic_seconds,
        )
        for w in waiting
    )
    return StatusView(
        snapshot,
        age_seconds,
        tuple(rows),
        lease_rows,
        recommendation,
        problem,
        waiting_rows,
        len(leases),
        holders,
    )
