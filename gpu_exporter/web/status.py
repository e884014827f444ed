"""What the status page at ``/`` shows, computed from one snapshot and the lease table.

Pure: no Flask, no NVML. The recommendation is :func:`gpu_exporter.choose.rank.rank` with no
filters, the current leases and the GPUs waiting requests reserve, i.e. what ``/choose?n=1``
would claim now.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.rank import Filters, rank
from gpu_exporter.choose.waitqueue import Waiter, reserved_for
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.units import format_bytes


@dataclass(frozen=True, slots=True)
class GpuRow:
    gpu: GpuSample
    memory_used_ratio: float | None  # used / total, 0–1
    memory_text: str  # "12.0 GiB / 80.0 GiB", or "" when unknown
    holder: str | None  # "alice, 42 s left", when a lease holds the GPU


@dataclass(frozen=True, slots=True)
class LeaseRow:
    id: str
    gpus: str  # "0, 3"
    holder: str  # owner, else the requester's address
    requester: str
    expires_in_seconds: float


@dataclass(frozen=True, slots=True)
class WaitingRow:
    wants: str  # "2 GPUs (model=A100)"
    holder: str  # owner, else the requester's address
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


def _holder(lease: Lease) -> str:
    return lease.owner or lease.requester


def status_view(
    snapshot: Snapshot,
    leases: tuple[Lease, ...],
    *,
    wall_now: float,
    age_seconds: float,
    problem: str | None,
    waiting: tuple[Waiter, ...] = (),
    monotonic_now: float = 0.0,
) -> StatusView:
    held = {uuid: lease for lease in leases for uuid in lease.uuids}
    rows = []
    for gpu in snapshot.gpus:
        used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
        ratio, text = None, ""
        if used is not None and total:
            ratio, text = used / total, f"{format_bytes(used)} / {format_bytes(total)}"
        lease = held.get(gpu.uuid)
        holder = (
            f"{_holder(lease)}, {max(0.0, lease.expires_at - wall_now):.0f} s left"
            if lease
            else None
        )
        rows.append(GpuRow(gpu, ratio, text, holder))
    lease_rows = tuple(
        LeaseRow(
            lease.id,
            ", ".join(str(g.index) for g in lease.gpus),
            _holder(lease),
            lease.requester,
            max(0.0, lease.expires_at - wall_now),
        )
        for lease in leases
    )
    leased = {
        **reserved_for(snapshot.gpus, waiting),
        **{uuid: f"leased by {_holder(lease)}" for uuid, lease in held.items()},
    }
    ranking = rank(snapshot.gpus, Filters(), leased=leased)
    if problem is None and ranking.qualified:
        recommendation = Recommendation(ranking.qualified[0], ())
    else:
        why = tuple(f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in ranking.rejected)
        recommendation = Recommendation(None, (problem,) if problem else why)
    waiting_rows = tuple(
        WaitingRow(w.describe(), w.owner or w.requester, monotonic_now - w.since_monotonic_seconds)
        for w in waiting
    )
    return StatusView(
        snapshot, age_seconds, tuple(rows), lease_rows, recommendation, problem, waiting_rows
    )
