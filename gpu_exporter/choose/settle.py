"""What ends a lease before its TTL: :func:`settle`, which leases and GPUs are still in force.

A lease holds GPUs (by UUID) until the first of:

* it is released (``DELETE /leases/<token>``) or its TTL runs out (``POST …/renew`` extends
  it);
* the GPU disappears or goes down (reported in the log and in
  ``gpu_exporter_leases_dropped_total``);
* the claimant's work shows up on that GPU ("arrived"), after which NVML's own figures keep
  other jobs away and the lease is no longer needed for that GPU. Only the claimant's work
  counts, so that a neighbour's job can never free a card somebody holds (:func:`_arrived`):

  - a lease its holder has renewed never ends this way: the job holds its card for its
    whole life (``gpu-exporter run``, ``use_gpus()`` renew);
  - a lease with registered PIDs (``pid=``, ``POST /leases/<id>/pids``) ends on a GPU when a
    process :func:`attributed` to it is there: a registered PID, a descendant of one, or a
    process of the same Slurm job, pod, container or cgroup;
  - a lease without (a plain ``curl``) ends when a compute process appears that was not there
    at claim time and is not attributed to another lease — nor kin of the processes that
    were there (their child, a sibling, the same job cgroup: the incumbent job restarting or
    forking a worker). Wrongly taking the claimant's work for kin only keeps the lease to
    its TTL; the other way round would hand the card out twice.

  A memory lease (``mem=``) never ends this way: the card is shared, so the claimant's work
  arriving there is what the lease is for; it runs to its TTL (renewed by its holder) or
  release.

  Memory rises alone never end a lease, and neither do processes the exporter cannot see
  (another PID namespace, no ``/proc`` access: ``ancestors`` is None): the lease then runs
  to its TTL or release.

Pure data and pure functions: :class:`~gpu_exporter.choose.leases.LeaseTable` holds the
lock, and :mod:`gpu_exporter.choose.statefile` the file. What ``/proc`` says arrives in the
snapshot (:class:`~gpu_exporter.model.ProcessSample`'s ``ancestors`` and ``cgroup``) and,
for the registered PIDs, in the lease (``cgroups``, read when they were registered).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gpu_exporter.choose.lease import Held, Lease
from gpu_exporter.counters import ARRIVED, DOWN, GONE
from gpu_exporter.model import GpuSample, ProcessSample, Snapshot, all_devices


def attributed(proc: ProcessSample, lease: Lease) -> bool:
    """Is ``proc`` the work of ``lease``'s claimant: a registered PID, a descendant of one,
    or in the same job cgroup as one?"""
    if proc.pid in lease.pids:
        return True
    if proc.ancestors and not set(proc.ancestors).isdisjoint(lease.pids):
        return True
    return proc.cgroup is not None and proc.cgroup in lease.cgroups


def _arrived(lease: Lease, held: Held, gpu: GpuSample, others: Iterable[Lease]) -> bool:
    if lease.renewed or lease.mem_bytes is not None or not gpu.processes:
        return False
    # Only processes /proc shows: an invisible one may be anybody's.
    visible = [p for p in gpu.processes if p.ancestors is not None]
    if lease.pids:
        return any(attributed(p, lease) for p in visible)
    theirs = [p for p in visible if not held.kin(p) and not any(attributed(p, o) for o in others)]
    if held.pids_at_claim is not None:
        return any(p.pid not in held.pids_at_claim for p in theirs)
    # A state file from before pids_at_claim: more unattributed processes than at claim.
    return held.processes_at_claim is not None and len(theirs) > held.processes_at_claim


@dataclass(frozen=True, slots=True)
class Drop:
    """One GPU let go from a lease before its expiry, and why: gone, down or arrived."""

    lease_id: str
    uuid: str
    reason: str


def settle(
    leases: Mapping[str, Lease], snapshot: Snapshot | None, now: float
) -> tuple[dict[str, Lease], list[Drop]]:
    """The leases still in force at wall time ``now`` after ``snapshot``, and the GPUs it let go.

    Pure: the table's reads show the result, :meth:`LeaseTable.prune` commits it. A snapshot
    taken before a lease began says nothing about that lease's GPUs.
    """
    live = {lease.id: lease for lease in leases.values() if lease.expires_at > now}
    if snapshot is None or not snapshot.nvml_up:
        return live, []
    by_uuid = {g.uuid: g for g in all_devices(snapshot.gpus)}
    kept: dict[str, Lease] = {}
    drops: list[Drop] = []
    for lease in live.values():
        if snapshot.taken_at_seconds <= lease.created_at:
            kept[lease.id] = lease
            continue
        others = [o for o in live.values() if o.id != lease.id and (o.pids or o.cgroups)]
        keep = []
        for held in lease.gpus:
            gpu = by_uuid.get(held.uuid)
            reason = (
                GONE if gpu is None
                else DOWN if not gpu.up
                else ARRIVED if _arrived(lease, held, gpu, others)
                else None
            )  # fmt: skip
            if reason is None:
                keep.append(held)
            else:
                drops.append(Drop(lease.id, held.uuid, reason))
        if len(keep) == len(lease.gpus):
            kept[lease.id] = lease
        elif keep:
            kept[lease.id] = replace(lease, gpus=tuple(keep))
    return kept, drops
