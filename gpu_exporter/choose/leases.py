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
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from gpu_exporter.choose.lease import Held, Lease, settle
from gpu_exporter.choose.rank import Filters, Selection, Window, choose
from gpu_exporter.choose.statefile import StateFile
from gpu_exporter.clock import Clock
from gpu_exporter.model import Snapshot

log = logging.getLogger(__name__)

MAX_PIDS = 64  # registered PIDs per lease: a job's launcher or two, not its every worker


def _no_cgroup(pid: int) -> str | None:
    return None


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
        cgroup_of: Callable[[int], str | None] = _no_cgroup,
    ) -> None:
        self._clock = clock
        # pid → its cgroup key (procinfo.read_cgroup_key, injected: choose/ reads no /proc)
        self._cgroup_of = cgroup_of
        self._state = StateFile(state_file) if state_file is not None else None
        self.max_ttl_seconds = max_ttl_seconds
        self.max_gpus_per_requester = max_gpus_per_requester
        self._leases: dict[str, Lease] = {}
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)  # notified on every change
        self.dropped: Counter[str] = Counter()  # GPUs dropped from leases, by reason
        self._queue: deque[object] = deque()  # claimers, first come first served
        self._waiting: set[object] = set()  # claimers that failed once and are waiting
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
        pids: Iterable[int] = (),
    ) -> tuple[Selection, Lease | None]:
        """Choose ``n`` GPUs that nobody holds and, unless ``ttl_seconds`` is 0, hold them
        for the job whose processes are ``pids`` (see :func:`~gpu_exporter.choose.lease.settle`).

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
            lease = self._with_pids(
                Lease(
                    id=secrets.token_urlsafe(9),
                    gpus=tuple(Held.of(g) for g in choice.chosen),
                    created_at=now,
                    expires_at=now + ttl_seconds,
                    requester=requester,
                    owner=owner,
                ),
                pids,
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
            lease = replace(
                self.get(lease_id), expires_at=self._clock.time() + ttl_seconds, renewed=True
            )
            self._leases[lease_id] = lease
            self._changed()
            return lease

    def add_pids(self, lease_id: str, pids: Iterable[int]) -> Lease:
        """Register more of the job's processes with its lease (e.g. once the job started)."""
        with self._lock:
            self._prune(None)
            lease = self._with_pids(self.get(lease_id), pids)
            self._leases[lease_id] = lease
            self._changed()
            return lease

    def _with_pids(self, lease: Lease, pids: Iterable[int]) -> Lease:
        new = [p for p in dict.fromkeys(pids) if p not in lease.pids]
        if not new:
            return lease
        if len(lease.pids) + len(new) > MAX_PIDS:
            raise LeaseError(
                400,
                "too_many_pids",
                f"a lease takes at most {MAX_PIDS} PIDs; register the job's launcher, "
                "its descendants count as its own",
                "pid",
            )
        cgroups = (self._cgroup_of(p) for p in new)
        return replace(
            lease,
            pids=lease.pids + tuple(new),
            cgroups=tuple(dict.fromkeys([*lease.cgroups, *(c for c in cgroups if c)])),
        )

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
        if self._state is not None:
            self._state.save(self._leases.values())

    def _load(self, state: StateFile) -> None:
        now = self._clock.time()
        self._leases = {x.id: x for x in state.load() if x.expires_at > now}
        if self._leases:
            log.info("restored %d active leases from %s", len(self._leases), state.path)
