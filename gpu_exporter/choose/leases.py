"""Leases: ``/choose`` selects AND claims GPUs under one lock, so concurrent jobs never share.

A lease holds GPUs (by UUID) until the first of:

* it is released (``DELETE /leases/<id>``) or its TTL runs out (``POST …/renew`` extends it);
* the claimant's work shows up on that GPU — a new compute process, or memory use up by more
  than :data:`ARRIVAL_BYTES` since the lease began — after which NVML's own figures keep
  other jobs away and the lease is no longer needed for that GPU;
* the GPU disappears or goes down (reported in the log and in
  ``gpu_exporter_leases_dropped_total``).

The table is written to ``<state-dir>/leases.json`` (atomically: temporary file, fsync,
rename) on every change and read back at start, so a restart never re-issues GPUs that were
just handed out. Expiry uses the wall clock for that reason.

Reads never change the table (a scrape must not fsync ``leases.json`` or wake waiters): they
show what :func:`settle` would keep, and :meth:`~LeaseTable.prune` commits it on every
published sample (the daemon subscribes it to the snapshot cache) and before each change.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpu_exporter.choose.rank import Filters, Selection, Window, choose
from gpu_exporter.clock import Clock
from gpu_exporter.model import GpuSample, Snapshot, all_devices

log = logging.getLogger(__name__)

ARRIVAL_BYTES = 256 * 2**20  # a memory rise this large means the claimant's job has started
STATE_VERSION = 1


class LeaseError(Exception):
    """A lease request that must be refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


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
        }

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> Lease:
        return cls(
            id=str(data["id"]),
            gpus=tuple(Held(str(u), int(i), p, m) for u, i, p, m in data["held"]),
            created_at=float(data["created_at"]),
            expires_at=float(data["expires_at"]),
            requester=str(data["requester"]),
            owner=data.get("owner"),
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


class LeaseTable:
    """Every active lease, behind one lock. All methods are thread-safe."""

    def __init__(
        self,
        clock: Clock,
        *,
        state_file: Path | None = None,
        max_ttl_seconds: float = 3600.0,
        max_gpus_per_requester: int = 0,
    ) -> None:
        self._clock = clock
        self._state_file = state_file
        self.max_ttl_seconds = max_ttl_seconds
        self.max_gpus_per_requester = max_gpus_per_requester
        self._leases: dict[str, Lease] = {}
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)  # notified on every change
        self.dropped: Counter[str] = Counter()  # GPUs dropped from leases, by reason
        self._queue: deque[object] = deque()  # claimers, first come first served
        self._waiting: set[object] = set()  # claimers that failed once and are waiting
        if state_file is not None:
            self._load(state_file)

    # -- queries: they never change the table, save it or wake anyone -----------------------
    def active(self, snapshot: Snapshot | None = None) -> tuple[Lease, ...]:
        """The leases in force now, oldest first: what :meth:`prune` would keep (without
        expired leases and, with ``snapshot``, the GPUs it shows gone, down or in use by their
        claimant), without pruning."""
        with self._lock:
            kept, _ = settle(self._leases, snapshot, self._clock.time())
        return tuple(sorted(kept.values(), key=lambda lease: lease.created_at))

    def holders(self, snapshot: Snapshot | None = None) -> dict[str, Lease]:
        """UUID → the lease holding it."""
        return {uuid: lease for lease in self.active(snapshot) for uuid in lease.uuids}

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self._clock.time():
            raise LeaseError(
                404, "unknown_lease", f"no active lease {lease_id!r} (expired or released?)"
            )
        return lease

    # -- changes ----------------------------------------------------------------------------
    def claim(
        self,
        snapshot: Snapshot,
        n: int,
        filters: Filters,
        *,
        ttl_seconds: float,
        requester: str,
        owner: str | None = None,
        sort: str = "free",
        window: Window | None = None,
    ) -> tuple[Selection, Lease | None]:
        """Choose ``n`` GPUs that nobody holds and, unless ``ttl_seconds`` is 0, hold them.

        Raises :class:`~gpu_exporter.choose.rank.NotEnoughGpus` or :class:`LeaseError`.
        """
        if ttl_seconds > self.max_ttl_seconds:
            raise LeaseError(
                429,
                "lease_too_long",
                f"lease {ttl_seconds:g} s is longer than this exporter allows "
                f"({self.max_ttl_seconds:g} s, --max-lease); renew it instead",
                "lease",
            )
        with self._lock:
            self._prune(snapshot)
            now = self._clock.time()
            leased = {
                uuid: f"leased until {lease.expires_at - now:.0f} s from now"
                + (f" by {lease.owner}" if lease.owner else "")
                for lease in self._leases.values()
                for uuid in lease.uuids
            }
            if ttl_seconds > 0 and self.max_gpus_per_requester:
                holding = sum(
                    len(lease.gpus)
                    for lease in self._leases.values()
                    if lease.requester == requester
                )
                if holding + n > self.max_gpus_per_requester:
                    raise LeaseError(
                        429,
                        "too_many_gpus",
                        f"{requester} holds {holding} GPUs in leases; {n} more would exceed the "
                        f"limit of {self.max_gpus_per_requester} per requester",
                        "n",
                    )
            choice = choose(snapshot.gpus, n, filters, sort=sort, window=window, leased=leased)
            if ttl_seconds <= 0:
                return choice, None
            lease = Lease(
                id=secrets.token_urlsafe(9),
                gpus=tuple(
                    Held(g.uuid, g.index, g.compute_processes, g.memory_used_bytes)
                    for g in choice.chosen
                ),
                created_at=now,
                expires_at=now + ttl_seconds,
                requester=requester,
                owner=owner,
            )
            self._leases[lease.id] = lease
            self._changed()
            return choice, lease

    def release(self, lease_id: str) -> Lease:
        with self._lock:
            self._prune(None)
            lease = self.get(lease_id)
            del self._leases[lease_id]
            self._changed()
            return lease

    def renew(self, lease_id: str, ttl_seconds: float) -> Lease:
        if ttl_seconds > self.max_ttl_seconds:
            raise LeaseError(
                429,
                "lease_too_long",
                f"ttl {ttl_seconds:g} s is longer than this exporter allows "
                f"({self.max_ttl_seconds:g} s, --max-lease)",
                "ttl",
            )
        with self._lock:
            self._prune(None)
            lease = replace(self.get(lease_id), expires_at=self._clock.time() + ttl_seconds)
            self._leases[lease_id] = lease
            self._changed()
            return lease

    # -- the queue of claimers ----------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Claimers in the queue now: being served, waiting for their turn or for GPUs."""
        with self._lock:
            return len(self._queue)

    def enqueue(self) -> object:
        """Join the queue of claimers; the returned ticket must be passed to :meth:`dequeue`."""
        ticket = object()
        with self._lock:
            self._queue.append(ticket)
        return ticket

    def ahead_of(self, ticket: object) -> tuple[int, int]:
        """(claimers before this one, how many of those are waiting for GPUs).

        Claimers ahead that are merely being served take a millisecond; only waiters ahead
        make a request without ``wait`` give up.
        """
        with self._lock:
            position = self._queue.index(ticket)
            waiting = sum(1 for t in list(self._queue)[:position] if t in self._waiting)
            return position, waiting

    def mark_waiting(self, ticket: object) -> None:
        with self._lock:
            self._waiting.add(ticket)

    def dequeue(self, ticket: object) -> None:
        with self._lock:
            self._queue.remove(ticket)
            self._waiting.discard(ticket)
            self.changed.notify_all()

    def wait_for_change(self, timeout_seconds: float) -> None:
        """Block until the table changes or a claimer leaves the queue, or the timeout ends."""
        with self._lock:
            self.changed.wait(timeout_seconds)

    # -- housekeeping -----------------------------------------------------------------------
    def prune(self, snapshot: Snapshot | None = None) -> None:
        """Commit what :func:`settle` keeps; save and wake waiters if a lease or GPU went."""
        with self._lock:
            self._prune(snapshot)

    def _prune(self, snapshot: Snapshot | None) -> None:
        kept, drops = settle(self._leases, snapshot, self._clock.time())
        if kept == self._leases:
            return
        for drop in drops:
            self.dropped[drop.reason] += 1
            level = logging.INFO if drop.reason == "arrived" else logging.WARNING
            log.log(level, "lease %s: GPU %s released (%s)", drop.lease_id, drop.uuid, drop.reason)
        self._leases = kept
        self._changed()

    def _changed(self) -> None:
        self._save()
        self.changed.notify_all()

    def _save(self) -> None:
        if self._state_file is None:
            return
        data = {"version": STATE_VERSION, "leases": [x.to_state() for x in self._leases.values()]}
        try:
            _write_atomically(self._state_file, json.dumps(data, indent=1))
        except OSError as exc:
            log.error("cannot save leases to %s: %s", self._state_file, exc)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            leases = [Lease.from_state(x) for x in data["leases"]]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad = path.with_suffix(".corrupt")
            log.error("cannot read leases from %s (%s); moved it to %s", path, exc, bad)
            with contextlib.suppress(OSError):
                path.replace(bad)
            return
        now = self._clock.time()
        self._leases = {x.id: x for x in leases if x.expires_at > now}
        log.info("restored %d active leases from %s", len(self._leases), path)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
