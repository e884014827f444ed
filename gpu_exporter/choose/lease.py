"""One lease as data: the GPUs it holds, who may end it, and how it is kept in ``leases.json``.

What ends a lease early is :mod:`gpu_exporter.choose.settle`'s; the table holding leases under
one lock is :class:`~gpu_exporter.choose.leases.LeaseTable`, the file
:mod:`gpu_exporter.choose.statefile`. Release and renewal take the lease's token
(:mod:`gpu_exporter.choose.tokens`), not just its id. :meth:`Lease.from_state` checks every
entry strictly, so one malformed entry in ``leases.json`` is skipped, never served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_exporter.choose.tokens import Keyed, token_matches
from gpu_exporter.model import GpuSample, ProcessSample


@dataclass(frozen=True, slots=True)
class Held:
    """One GPU inside a lease, with what it looked like when it was claimed."""

    uuid: str
    index: int
    processes_at_claim: int | None
    memory_used_at_claim: int | None
    # The compute processes there at claim time; None in state files written before 13.1
    # (processes_at_claim is compared then).
    pids_at_claim: tuple[int, ...] | None = None
    kin_at_claim: tuple[int, ...] = ()  # those processes' ancestors (init excluded)
    cgroups_at_claim: tuple[str, ...] = ()  # and their cgroup keys

    @classmethod
    def of(cls, gpu: GpuSample) -> Held:
        """``gpu`` as it is at claim time."""
        procs = gpu.processes or ()
        return cls(
            gpu.uuid,
            gpu.index,
            gpu.compute_processes,
            gpu.memory_used_bytes,
            None if gpu.processes is None else tuple(p.pid for p in procs),
            tuple(dict.fromkeys(a for p in procs for a in p.ancestors or ())),
            tuple(dict.fromkeys(p.cgroup for p in procs if p.cgroup)),
        )

    def kin(self, proc: ProcessSample) -> bool:
        """Is ``proc`` related to a process that was on this GPU at claim time?"""
        family = {*(self.pids_at_claim or ()), *self.kin_at_claim}
        if proc.ancestors and not family.isdisjoint(proc.ancestors):
            return True
        return proc.cgroup is not None and proc.cgroup in self.cgroups_at_claim


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    gpus: tuple[Held, ...]
    created_at: float  # Unix time
    expires_at: float
    requester: str  # who asked (web.peers.requester): a user, or a remote address
    owner: str | None = None  # free-form label from ?owner=
    token_hash: str | None = None  # sha256 of the token's secret; None: a lease from before tokens
    keyed: Keyed | None = None  # the Idempotency-Key it was claimed with, if any
    # The token itself: set only on the Lease handed to its claimant, never kept or listed.
    token: str | None = field(default=None, compare=False, repr=False)
    pids: tuple[int, ...] = ()  # registered by the claimant: its job's processes
    cgroups: tuple[str, ...] = ()  # the registered PIDs' cgroup keys (never shown: privacy)
    renewed: bool = False  # renewed at least once: its holder is alive and keeps it
    # A memory lease (?mem=): the bytes it reserves on each of its cards, which it shares with
    # other memory leases (choose/memory.py); None: the cards are held whole.
    mem_bytes: int | None = None

    def accepts(self, ref: str) -> bool:
        """Does ``ref`` (a token, or an id for a lease from before tokens) prove the claim?"""
        return token_matches(self.id, self.token_hash, ref)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "gpus": list(self.uuids),
            "indices": [g.index for g in self.gpus],
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "requester": self.requester,
            "owner": self.owner,
            "pids": list(self.pids),
            "renewed": self.renewed,
        }
        if self.mem_bytes is not None:  # a whole-card lease reads as it always did
            data["mem_bytes"] = self.mem_bytes
        return data

    def to_state(self) -> dict[str, Any]:
        return {
            **self.to_json(),
            "held": [
                [
                    g.uuid,
                    g.index,
                    g.processes_at_claim,
                    g.memory_used_at_claim,
                    None if g.pids_at_claim is None else list(g.pids_at_claim),
                    list(g.kin_at_claim),
                    list(g.cgroups_at_claim),
                ]
                for g in self.gpus
            ],
            "cgroups": list(self.cgroups),
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
            # Files written before job PIDs were registered have none of these.
            pids=_counts(data.get("pids"), "'pids'", MAX_PID),
            cgroups=_texts(data.get("cgroups"), "'cgroups'"),
            renewed=_flag(data.get("renewed", False), "'renewed'"),
            # Files written before memory leases have none: every lease then holds whole cards.
            mem_bytes=_mem(data.get("mem_bytes")),
        )


# Bounds of the numbers a valid leases.json holds: what datetime can show, what NVML reports.
MAX_UNIX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z
MAX_INDEX = 2**31 - 1
MAX_COUNT = 2**63 - 1
MAX_PID = 2**22  # Linux's pid_max limit


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


def _counts(value: object, what: str, limit: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, not {_kind(value)}")
    return tuple(_count(v, f"each of {what}", limit) for v in value)


def _texts(value: object, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of strings")
    return tuple(value)


def _mem(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNT:
        raise ValueError(f"'mem_bytes' must be a positive integer or null, not {value!r:.40}")
    return value


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, not {_kind(value)}")
    return value


def _held(entry: object) -> Held:
    # [uuid, index, processes, memory_used]; files written since PIDs are registered add
    # [pids_at_claim, kin_at_claim, cgroups_at_claim].
    if not isinstance(entry, list) or len(entry) not in (4, 7):
        raise ValueError(
            "each 'held' entry must be [uuid, index, processes, memory_used] "
            "(and pids, kin, cgroups at claim)"
        )
    uuid, index, procs, used, *rest = entry
    pids, kin, cgroups = [*rest, None, None, None][:3]
    if not isinstance(uuid, str) or not uuid:
        raise ValueError(f"a held GPU's uuid must be a non-empty string, not {_kind(uuid)}")
    return Held(
        uuid,
        _count(index, "a held GPU's index", MAX_INDEX),
        None if procs is None else _count(procs, "a held GPU's process count", MAX_COUNT),
        None if used is None else _count(used, "a held GPU's memory used", MAX_COUNT),
        None if pids is None else _counts(pids, "a held GPU's pids", MAX_PID),
        _counts(kin, "a held GPU's kin", MAX_PID),
        _texts(cgroups, "a held GPU's cgroups"),
    )
