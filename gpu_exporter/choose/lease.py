"""One lease as data, and :func:`settle`: which leases and GPUs are still in force.

A lease holds GPUs (by UUID) until the first of:

* it is released (``DELETE /leases/<token>``) or its TTL runs out (``POST …/renew`` extends
  it); both take the lease's token (:mod:`gpu_exporter.choose.tokens`), not just its id;
* the claimant's work shows up on that GPU — a new compute process, or memory use up by more
  than :data:`ARRIVAL_BYTES` since the lease began — after which NVML's own figures keep
  other jobs away and the lease is no longer needed for that GPU;
* the GPU disappears or goes down (reported in the log and in
  ``gpu_exporter_leases_dropped_total``).

Pure data and pure functions: :class:`~gpu_exporter.choose.leases.LeaseTable` holds the
lock, and :mod:`gpu_exporter.choose.statefile` the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpu_exporter.choose.tokens import Keyed, token_matches
from gpu_exporter.model import GpuSample, Snapshot, all_devices

ARRIVAL_BYTES = 256 * 2**20  # a memory rise this large means the claimant's job has started


@dataclass(frozen=True, slots=True)
class Held:
    """One GPU inside a lease, with what it looked like when it was claimed."""

    uuid: str
    index: int
    processes_at_claim: int | None
    memory_used_at_claim: int | None


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    gpus: tuple[Held, ...]
    created_at: float  # Unix time
    expires_at: float
    requester: str  # client address
    owner: str | None = None  # free-form label from ?owner=
    token_hash: str | None = None  # sha256 of the token's secret; None: a lease from before tokens
    keyed: Keyed | None = None  # the Idempotency-Key it was claimed with, if any
    # The token itself: set only on the Lease handed to its claimant, never kept or listed.
    token: str | None = field(default=None, compare=False, repr=False)

    def accepts(self, ref: str) -> bool:
        """Does ``ref`` (a token, or an id for a lease from before tokens) prove the claim?"""
        return token_matches(self.id, self.token_hash, ref)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpus": list(self.uuids),
            "indices": [g.index for g in self.gpus],
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "requester": self.requester,
            "owner": self.owner,
        }

    def to_state(self) -> dict[str, Any]:
        return {
            **self.to_json(),
            "held": [
                [g.uuid, g.index, g.processes_at_claim, g.memory_used_at_claim] for g in self.gpus
            ],
            "token_hash": self.token_hash,
            "idempotency": self.keyed.to_state() if self.keyed is not None else None,
        }

    @classmethod
    def from_state(cls, data: object) -> Lease:
        """The lease :meth:`to_state` wrote; :class:`ValueError` (and nothing else) for any entry
        of the wrong shape or type, so one bad entry in ``leases.json`` is skipped, not served."""
        if not isinstance(data, dict):
            raise ValueError(f"a lease must be an object, not {_kind(data)}")
        held = data.get("held")
        if not isinstance(held, list) or not held:
            raise ValueError("'held' must be a non-empty list")
        created_at = _timestamp(data, "created_at")
        expires_at = _timestamp(data, "expires_at")
        if expires_at < created_at:
            raise ValueError("'expires_at' is before 'created_at'")
        owner = data.get("owner")
        if owner is not None and not isinstance(owner, str):
            raise ValueError(f"'owner' must be a string or null, not {_kind(owner)}")
        return cls(
            id=_text(data, "id"),
            gpus=tuple(_held(x) for x in held),
            created_at=created_at,
            expires_at=expires_at,
            requester=_text(data, "requester"),
            owner=owner,
            # Files written before tokens have neither: such a lease takes its id as its token.
            token_hash=_text(data, "token_hash") if data.get("token_hash") is not None else None,
            keyed=Keyed.from_state(data.get("idempotency")),
        )


# Bounds of the numbers a valid leases.json holds: what datetime can show, what NVML reports.
MAX_UNIX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z
MAX_INDEX = 2**31 - 1
MAX_COUNT = 2**63 - 1


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _text(data: dict[Any, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key!r} must be a non-empty string, not {_kind(value)}")
    return value


def _timestamp(data: dict[Any, Any], key: str) -> float:
    value = data.get(key)
    # bool is an int; compare before float() so that a huge int cannot overflow
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key!r} must be a number, not {_kind(value)}")
    if not 0 <= value <= MAX_UNIX_TIME:  # also false for NaN
        raise ValueError(f"{key!r} is not a Unix time: {value!r}")
    return float(value)


def _count(value: object, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise ValueError(f"{what} must be an integer from 0 to {limit}, not {value!r:.40}")
    return value


def _held(entry: object) -> Held:
    if not isinstance(entry, list) or len(entry) != 4:
        raise ValueError("each 'held' entry must be [uuid, index, processes, memory_used]")
    uuid, index, procs, used = entry
    if not isinstance(uuid, str) or not uuid:
        raise ValueError(f"a held GPU's uuid must be a non-empty string, not {_kind(uuid)}")
    return Held(
        uuid,
        _count(index, "a held GPU's index", MAX_INDEX),
        None if procs is None else _count(procs, "a held GPU's process count", MAX_COUNT),
        None if used is None else _count(used, "a held GPU's memory used", MAX_COUNT),
    )


def _arrived(held: Held, gpu: GpuSample) -> bool:
    procs, used = gpu.compute_processes, gpu.memory_used_bytes
    if (
        procs is not None
        and held.processes_at_claim is not None
        and procs > held.processes_at_claim
    ):
        return True
    if used is not None and held.memory_used_at_claim is not None:
        return used - held.memory_used_at_claim >= ARRIVAL_BYTES
    return False


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
        keep = []
        for held in lease.gpus:
            gpu = by_uuid.get(held.uuid)
            reason = (
                "gone" if gpu is None
                else "down" if not gpu.up
                else "arrived" if _arrived(held, gpu)
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
