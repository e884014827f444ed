"""Leases: ``/choose`` selects AND claims GPUs under one lock, so concurrent jobs never share.

What a lease is and what ends it early is :mod:`gpu_exporter.choose.lease`'s. The table is
written to ``<state-dir>/leases.json`` (:mod:`gpu_exporter.choose.statefile`) on every change
and read back at start, so a restart never re-issues GPUs that were just handed out. Expiry
uses the wall clock for that reason.

Reads never change the table (a scrape must not fsync ``leases.json`` or wake waiters): they
show what :func:`~gpu_exporter.choose.lease.settle` would keep, and
:meth:`~LeaseTable.prune` commits it on every published sample (the daemon subscribes it to
the snapshot cache) and before each change.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from gpu_exporter.choose.lease import Held, Lease, settle
from gpu_exporter.choose.rank import Filters, Selection, Window, choose
from gpu_exporter.choose.statefile import StateFile
from gpu_exporter.clock import Clock
from gpu_exporter.model import Snapshot

log = logging.getLogger(__name__)


class LeaseError(Exception):
    """A lease request that must be refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


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
        self._state = StateFile(state_file) if state_file is not None else None
        self.max_ttl_seconds = max_ttl_seconds
        self.max_gpus_per_requester = max_gpus_per_requester
        self._leases: dict[str, Lease] = {}
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)  # notified on every change
        self.dropped: Counter[str] = Counter()  # GPUs dropped from leases, by reason
        if self._state is not None:
            self._load(self._state)

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
        reserved: Mapping[str, str] | None = None,
    ) -> tuple[Selection, Lease | None]:
        """Choose ``n`` GPUs that nobody holds and, unless ``ttl_seconds`` is 0, hold them.

        ``reserved`` (UUID → why) are GPUs that earlier waiters keep from this request.

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
            if reserved:
                leased = {**reserved, **leased}
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

    # -- waking waiters ---------------------------------------------------------------------
    def wake_waiters(self) -> None:
        """Wake every :meth:`wait_for_change` now (a waiter left: what it reserved is free)."""
        with self._lock:
            self.changed.notify_all()

    def wait_for_change(self, timeout_seconds: float) -> None:
        """Block until the table changes, :meth:`wake_waiters` is called, or the timeout ends."""
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
        if self._state is not None:
            self._state.save(self._leases.values())

    def _load(self, state: StateFile) -> None:
        now = self._clock.time()
        self._leases = {x.id: x for x in state.load() if x.expires_at > now}
        if self._leases:
            log.info("restored %d active leases from %s", len(self._leases), state.path)
