"""The lease table's side of ``leases.json``: what a restart brings back, and what is saved.

:class:`~gpu_exporter.choose.leases.LeaseTable` owns one :class:`Persistence` and calls it
under its lock; the file itself (atomic writes, forgiving reads, the directory lock) is
:mod:`gpu_exporter.choose.statefile`'s.

A restart brings back only what is still in force: expired leases are left out, and none ends
later than ``--max-lease`` from now, since no renewal could reach further. Leases restored
from the file are kept only for GPUs this host has: the first sample with NVML up drops the
others (``not_on_this_host``), e.g. when two exporters once shared a state directory.

The keys of keyed leases that ended before their expiry come back too, so a retry with one
stays refused (409 ``lease_ended``) after a restart.

A file that was read and not trusted (set aside as not a lease table, or with malformed
entries) may have held leases nobody can see any more: the GPUs it could have named (every
GPU for a file set aside, the GPU UUIDs in the malformed entries otherwise) are **withheld**
from claims until ``--max-lease`` after the file last changed (no lease in it could end
later), never before the restart plus ``--max-lease``. The withheld GPUs are saved with the
table, so a second restart keeps them; ``--discard-leases`` starts with none of it.

A write that fails is remembered (:attr:`Persistence.unsaved`), so the table writes again on
every published sample; :attr:`Persistence.problem` says why until a write succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.statefile import StateFile, StateWriteError, Withheld
from gpu_exporter.model import GpuSample, Snapshot, all_devices
from gpu_exporter.units import plural

log = logging.getLogger(__name__)


class Persistence:
    """Saving and restoring the lease table, through ``state`` (None: kept in memory only).

    Not thread-safe: the table's lock serialises every call.
    """

    def __init__(self, state: StateFile | None) -> None:
        self._state = state
        self._restored: set[str] = set()  # ids loaded from the file, not yet seen on a sample
        self._withheld: tuple[Withheld, ...] = ()

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

    def save(
        self, leases: Iterable[Lease], ended: Mapping[str, float] | None = None
    ) -> StateWriteError | None:
        """Write ``leases`` and the ``ended`` keys (with what is withheld); the failure
        (already counted and logged), or None."""
        if self._state is None:
            return None
        try:
            self._state.save(leases, ended, self._withheld)
        except StateWriteError as exc:
            return exc
        return None

    def restore(
        self, now: float, max_ttl_seconds: float
    ) -> tuple[dict[str, Lease], dict[str, float]]:
        """The leases in the file still in force at ``now``, none ending more than
        ``max_ttl_seconds`` later, and the ended keys (key hash → until) still refused; written
        back at once if the file held entries that were skipped as malformed, leases that were
        shortened, or was not trusted."""
        if self._state is None:
            return {}, {}
        loaded = self._state.load()
        latest = now + max_ttl_seconds  # no renewal reaches further
        live = [x for x in loaded.leases if x.expires_at > now]
        clamped = sum(1 for x in live if x.expires_at > latest)
        leases = {x.id: replace(x, expires_at=min(x.expires_at, latest)) for x in live}
        ended = {k: min(t, latest) for k, t in loaded.ended.items() if t > now}
        withheld = [replace(w, until=min(w.until, latest)) for w in loaded.withheld]
        doubt = loaded.doubt
        until = min(doubt.mtime, now) + max_ttl_seconds if doubt is not None else now
        if doubt is not None and doubt.uuids != () and until > now:
            what = "every GPU" if doubt.uuids is None else "the GPUs its malformed entries name"
            why = f"{doubt.why}, and may have held it (--discard-leases frees it)"
            withheld.append(Withheld(doubt.uuids, until, why))
            log.warning(
                "%s in %s: no claim gets %s until %s (--max-lease after the file last "
                "changed), in case it held leases; if no job does, start once with "
                "--discard-leases",
                doubt.why,
                self._state.path.parent,
                what,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until)),
            )
        self._withheld = tuple(w for w in withheld if w.until > now)
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
        if loaded.skipped or clamped or loaded.doubt is not None:
            self.save(leases.values(), ended)  # what is in force now, withheld GPUs included
        return leases, ended

    def withheld(self, gpus: Iterable[GpuSample], now: float) -> dict[str, str]:
        """UUID → why, for the GPUs among ``gpus`` no claim may get at ``now``."""
        reasons: dict[str, str] = {}
        for w in self._withheld:
            if w.until > now:
                why = f"withheld for {w.until - now:.0f} s more: {w.why}"
                reasons |= {g.uuid: why for g in gpus if w.uuids is None or g.uuid in w.uuids}
        return reasons

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
