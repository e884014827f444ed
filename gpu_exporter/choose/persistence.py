"""The lease table's side of ``leases.json``: what a restart brings back, and what is saved.

:class:`~gpu_exporter.choose.leases.LeaseTable` owns one :class:`Persistence` and calls it
under its lock; the file itself (atomic writes, forgiving reads, the directory lock) is
:mod:`gpu_exporter.choose.statefile`'s.

A restart brings back only what is still in force: expired leases are left out, and none ends
later than ``--max-lease`` from now, since no renewal could reach further. Leases restored
from the file are kept only for GPUs this host has: the first sample with NVML up drops the
others (``not_on_this_host``), e.g. when two exporters once shared a state directory.

A write that fails is remembered (:attr:`Persistence.unsaved`), so the table writes again on
every published sample; :attr:`Persistence.problem` says why until a write succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.statefile import StateFile, StateWriteError
from gpu_exporter.model import Snapshot, all_devices
from gpu_exporter.units import plural

log = logging.getLogger(__name__)


class Persistence:
    """Saving and restoring the lease table, through ``state`` (None: kept in memory only).

    Not thread-safe: the table's lock serialises every call.
    """

    def __init__(self, state: StateFile | None) -> None:
        self._state = state
        self._restored: set[str] = set()  # ids loaded from the file, not yet seen on a sample

    @property
    def problem(self) -> str | None:
        """Why the last write of ``leases.json`` failed, until one succeeds (``/readyz``)."""
        return self._state.problem if self._state is not None else None

    @property
    def unsaved(self) -> bool:
        """The last write failed: the table writes again on every prune."""
        return self.problem is not None

    @property
    def write_errors(self) -> int:
        """Writes of ``leases.json`` that failed since start."""
        return self._state.write_errors if self._state is not None else 0

    def save(self, leases: Iterable[Lease]) -> StateWriteError | None:
        """Write ``leases``; the failure (already counted and logged), or None."""
        if self._state is None:
            return None
        try:
            self._state.save(leases)
        except StateWriteError as exc:
            return exc
        return None

    def restore(self, now: float, max_ttl_seconds: float) -> dict[str, Lease]:
        """The leases in the file still in force at ``now``, none ending more than
        ``max_ttl_seconds`` later; written back at once if the file held entries that were
        skipped as malformed or leases that were shortened."""
        if self._state is None:
            return {}
        loaded = self._state.load()
        latest = now + max_ttl_seconds  # no renewal reaches further
        live = [x for x in loaded.leases if x.expires_at > now]
        clamped = sum(1 for x in live if x.expires_at > latest)
        leases = {x.id: replace(x, expires_at=min(x.expires_at, latest)) for x in live}
        self._restored = set(leases)
        if leases:
            log.info("restored %s from %s", plural(len(leases), "active lease"), self._state.path)
        if clamped:
            log.warning(
                "%s in %s ended more than --max-lease (%g s) from now; they now end then",
                plural(clamped, "lease"),
                self._state.path,
                max_ttl_seconds,
            )
        if loaded.skipped or clamped:
            self.save(leases.values())  # the good entries, as they are now in force
        return leases

    def drop_foreign(self, leases: dict[str, Lease], snapshot: Snapshot) -> int:
        """Once, at the first sample with NVML up: take the GPUs this host lacks out of the
        restored leases in ``leases`` (in place; a lease left with none goes). How many GPUs
        that took out."""
        if not (self._restored and snapshot.nvml_up and snapshot.sequence):
            return 0
        here = {g.uuid for g in all_devices(snapshot.gpus)}
        foreign = 0
        for lease_id in self._restored & leases.keys():
            lease = leases[lease_id]
            keep = tuple(g for g in lease.gpus if g.uuid in here)
            foreign += len(lease.gpus) - len(keep)
            if not keep:
                del leases[lease_id]
            elif len(keep) < len(lease.gpus):
                leases[lease_id] = replace(lease, gpus=keep)
        self._restored = set()
        if foreign:
            log.warning(
                "dropped %s of leases restored from %s that this host does not have "
                "(did another exporter use this --state-dir?)",
                plural(foreign, "GPU"),
                self._state.path if self._state is not None else "the state file",
            )
        return foreign
