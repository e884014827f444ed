"""Memory-sized leases (``/choose?mem=8GiB``): what a card has committed, and who may join it.

Pure functions over a snapshot and the lease table's leases; the table calls them under its
lock (:meth:`~gpu_exporter.choose.leases.LeaseTable.claim`). Per card:

* **usable** = total − the driver's reservation (NVML's memory v2 ``reserved``; 0 where the
  snapshot has none, as NVML v1 then counts it in ``used``);
* **attributed** to a memory lease: the memory of the processes
  :func:`~gpu_exporter.choose.settle.attributed` to it (its registered PIDs, their
  descendants, their cgroup);
* **committed** = the memory in use that no memory lease's processes account for (NVML's
  ``used`` less the attributed memory: foreign jobs, processes the exporter cannot see) + Σ
  over the card's memory leases of max(reserved, attributed);
* a request for ``mem`` is **admitted** when committed + mem + headroom ≤ usable
  (``--mem-headroom``, 512 MiB by default).

A card holding a memory lease is never handed out whole, and a card with a whole-card lease
takes no memory lease. Among the cards that admit a request, the one with the least room left
comes first (best fit), so whole cards stay free for whole-card requests. Memory leases are
for whole cards only: MIG devices are refused (their memory is already a hard partition).

The caps handed to frameworks (``format=env``, the Python client) are in :func:`env_caps`.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.settle import attributed
from gpu_exporter.model import GpuSample
from gpu_exporter.units import format_bytes

MIB = 2**20
DEFAULT_HEADROOM_BYTES = 512 * MIB
# What a CUDA context takes besides what a framework's allocator counts (cuBLAS, cuDNN and the
# kernels loaded): a few hundred MiB on current cards, so 500 MiB. Framework caps count only
# their allocator, so the fraction handed to them leaves this much of the lease out.
CUDA_CONTEXT_BYTES = 500 * MIB

# The variables format=env, `gpu-exporter run` and Choice.env() add for a memory lease.
MEM_LIMIT_ENV = "GPU_MEM_LIMIT_BYTES"  # the lease's bytes per card
MEM_FRACTION_ENV = "GPU_MEM_FRACTION"  # (mem − context allowance) / the card's total
TF_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"  # growth, not a cap
# JAX's cap. Every JAX reads XLA_PYTHON_CLIENT_MEM_FRACTION; newer JAX also reads
# XLA_CLIENT_MEM_FRACTION, and refuses the two together: its CUDA plugin does not start and
# JAX runs on the CPU (JAX 0.11.2 on an H100, docs/real-gpu.md). So only the first is set,
# and `run` and use_gpus() take the second out of the job's environment.
JAX_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_FRACTION_CONFLICT = "XLA_CLIENT_MEM_FRACTION"
MEM_ENV_NAMES = (MEM_LIMIT_ENV, MEM_FRACTION_ENV, TF_GROWTH_ENV, JAX_FRACTION_ENV)


@dataclass(frozen=True, slots=True)
class CardMemory:
    """One card's memory as the admission rule sees it, in bytes."""

    uuid: str
    usable: int  # total − the driver's reservation
    foreign: int  # in use by processes no memory lease accounts for
    leased: int  # Σ reservations of the card's memory leases
    attributed: Mapping[str, int]  # lease id → memory of its attributed processes
    pids: Mapping[str, tuple[int, ...]]  # lease id → its attributed processes on this card
    overrun: int  # Σ over its memory leases of max(0, attributed − reserved)
    committed: int

    def room(self, headroom: int) -> int:
        """What one more memory lease may reserve here."""
        return self.usable - self.committed - headroom


def _in_mig_mode(gpu: GpuSample) -> bool:
    return bool(gpu.mig_mode_enabled or gpu.mig_devices)


def memory_leases(leases: Iterable[Lease]) -> dict[str, list[Lease]]:
    """UUID → the memory leases holding a share of that card."""
    found: dict[str, list[Lease]] = {}
    for lease in leases:
        if lease.mem_bytes is not None:
            for uuid in lease.uuids:
                found.setdefault(uuid, []).append(lease)
    return found


def card_memory(gpu: GpuSample, leases: Iterable[Lease]) -> CardMemory:
    """``gpu``'s committed memory under ``leases`` (those holding a share of it)."""
    leases = [x for x in leases if x.mem_bytes is not None]
    used_by: dict[str, int] = {x.id: 0 for x in leases}
    pids: dict[str, list[int]] = {x.id: [] for x in leases}
    for proc in gpu.processes or ():
        owner = next((x for x in leases if attributed(proc, x)), None)
        if owner is not None:  # each process counts once, for the first lease it belongs to
            used_by[owner.id] += proc.used_memory_bytes or 0
            pids[owner.id].append(proc.pid)
    total = gpu.memory_total_bytes or 0
    usable = total - (gpu.memory_reserved_bytes or 0)
    foreign = max(0, (gpu.memory_used_bytes or 0) - sum(used_by.values()))
    shares = [max(x.mem_bytes or 0, used_by[x.id]) for x in leases]
    return CardMemory(
        uuid=gpu.uuid,
        usable=usable,
        foreign=foreign,
        leased=sum(x.mem_bytes or 0 for x in leases),
        attributed=used_by,
        pids={k: tuple(v) for k, v in pids.items()},
        overrun=sum(max(0, used_by[x.id] - (x.mem_bytes or 0)) for x in leases),
        committed=foreign + sum(shares),
    )


def shared_cards(leases: Iterable[Lease]) -> dict[str, str]:
    """UUID → why a whole-card request cannot have it: it holds memory leases."""
    return {
        uuid: f"shared: {format_bytes(sum(x.mem_bytes or 0 for x in found))} reserved by "
        "memory leases"
        for uuid, found in memory_leases(leases).items()
    }


def fraction(mem: int, total: int) -> float:
    """The share of a card's ``total`` a framework may allocate under a lease of ``mem``:
    (mem − :data:`CUDA_CONTEXT_BYTES`) / total, rounded down to 4 places.

    >>> fraction(8 * 2**30, 80 * 2**30)
    0.0938
    """
    if total <= 0:
        return 0.0
    share = max(0, mem - CUDA_CONTEXT_BYTES) / total
    return min(1.0, int(share * 10_000) / 10_000)


def env_caps(mem: int, totals: Iterable[int]) -> dict[str, str]:
    """The environment a job under a memory lease of ``mem`` a card gets, on cards of
    ``totals`` bytes: the largest decides the fraction, the smallest of the cards', so that
    fraction × total stays within the share on every one of them."""
    return caps_env(mem, fraction(mem, max(totals, default=0)))


def caps_env(mem: int, share: float) -> dict[str, str]:
    """The variables of :data:`MEM_ENV_NAMES` for ``mem`` bytes, ``share`` of the card
    (the server's ``format=env`` and the client's ``Choice.env()`` both write them here).

    >>> caps_env(8 * 2**30, 0.0938)["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    '0.0938'
    """
    text = f"{share:.4f}"
    return {
        MEM_LIMIT_ENV: str(mem),
        MEM_FRACTION_ENV: text,
        TF_GROWTH_ENV: "true",
        JAX_FRACTION_ENV: text,
    }


@dataclass(frozen=True, slots=True)
class MemoryFit:
    """What :func:`memory_fit` hands :func:`~gpu_exporter.choose.rank.choose`: the cards a
    memory request cannot have (UUID → why), the room on the others (best fit first), and
    what a refusal adds (the room on the best card)."""

    refused: dict[str, str]
    fit: dict[str, int]
    note: str


def memory_fit(
    gpus: Iterable[GpuSample],
    leases: Iterable[Lease],
    mem: int,
    headroom: int,
    describe: Mapping[str, str],
    wanted: Container[str] | None = None,
) -> MemoryFit:
    """Which cards admit ``mem`` more under ``leases`` (see the module docstring): why each
    card cannot (a whole-card lease, ``describe``\\ d, or too little room), and the room on
    every card that takes memory leases.

    ``wanted``: the cards the request's other filters accept; a refusal's note names the
    best of those (the roomiest card is no help to a request that excludes it).
    """
    leases = list(leases)
    shared = memory_leases(leases)
    whole = {u for x in leases if x.mem_bytes is None for u in x.uuids}
    refused: dict[str, str] = {}
    room: dict[str, int] = {}
    for gpu in gpus:
        if gpu.uuid in whole:
            refused[gpu.uuid] = describe.get(gpu.uuid, "leased whole")
            continue
        if gpu.memory_total_bytes is None:
            refused[gpu.uuid] = "reports no memory total, so no share of it can be leased"
            continue
        if _in_mig_mode(gpu):
            refused[gpu.uuid] = "in MIG mode: memory leases take shares of whole cards"
            continue
        card = card_memory(gpu, shared.get(gpu.uuid, ()))
        room[gpu.uuid] = card.room(headroom)
        if card.room(headroom) < mem:
            refused[gpu.uuid] = (
                f"{format_bytes(max(0, card.usable - card.committed))} uncommitted, "
                f"{format_bytes(mem)} requested + {format_bytes(headroom)} headroom"
            )
    candidates = [uuid for uuid in room if wanted is None or uuid in wanted]
    if candidates:
        best = max(candidates, key=lambda uuid: room[uuid])
        note = (
            f"the best card ({best}) has {format_bytes(max(0, room[best] + headroom))} "
            f"uncommitted; a memory lease needs {format_bytes(mem)} + "
            f"{format_bytes(headroom)} headroom (--mem-headroom)"
        )
    elif room:
        note = "no card the other filters accept can take a memory lease"
    else:
        note = "every card is leased whole"
    return MemoryFit(refused, room, note)


def usage_json(lease: Lease, gpus: Iterable[GpuSample], leases: Iterable[Lease]) -> list[Any]:
    """``/leases``' ``memory`` of a memory lease: per card, the bytes and PIDs attributed to
    it now (empty before the first sample shows its cards)."""
    shared = memory_leases(leases)
    by_uuid = {g.uuid: g for g in gpus}
    rows = []
    for held in lease.gpus:
        gpu = by_uuid.get(held.uuid)
        if gpu is None or lease.mem_bytes is None:
            continue
        card = card_memory(gpu, shared.get(held.uuid, [lease]))
        rows.append(
            {
                "uuid": held.uuid,
                "index": held.index,
                "reserved_bytes": lease.mem_bytes,
                "attributed_bytes": card.attributed.get(lease.id, 0),
                "pids": list(card.pids.get(lease.id, ())),
                "committed_bytes": card.committed,
                "usable_bytes": card.usable,
            }
        )
    return rows
