"""Leases: ``/choose`` selects AND claims GPUs under one lock, so concurrent jobs never share.

A lease as data is :mod:`gpu_exporter.choose.lease`'s, what ends it early
:mod:`gpu_exporter.choose.settle`'s. The table is written to ``<state-dir>/leases.json`` on
every change and read back at start (:mod:`gpu_exporter.choose.persistence`), so a restart
never re-issues GPUs that were just handed out. Expiry uses the wall clock for that reason.

A change that holds GPUs longer (a claim, a renewal) is made only once it is saved: if
``leases.json`` cannot be written it is rolled back and refused with 503 ``state_unwritable``.
A change that lets GPUs go (a release, expiry, an early end) takes effect at once even then:
the worst a restart can do with the stale file is keep those GPUs until the old expiry. While
writes fail, :attr:`LeaseTable.state_problem` says why (``/readyz``) and every published
sample tries the write again, so readiness comes back by itself once the disk is fixed.
Leases restored from the file are kept only for GPUs this host has (``not_on_this_host``);
GPUs withheld after a file that could not be trusted are refused as leased ones are.

Reads never change the table (a scrape must not fsync ``leases.json`` or wake waiters): they
show what :func:`~gpu_exporter.choose.settle.settle` would keep, and
:meth:`~LeaseTable.prune` commits it on every published sample (the daemon subscribes it to
the snapshot cache) and before each change.

:meth:`~LeaseTable.authorize` checks a lease's token (:mod:`gpu_exporter.choose.tokens`)
before a renewal or release. While a lease claimed with an ``Idempotency-Key`` is in force, a
retry with the key gets it back (:meth:`~LeaseTable.again`), token included, instead of
claiming more GPUs; once it has ended before its expiry (released, or
let go early) a retry is refused until that expiry rather than granted anew. Those ended
keys are saved with the table (hashed), so a restart keeps refusing them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

from gpu_exporter.choose.filters import Filters, Window, rejection_reasons
from gpu_exporter.choose.lease import Held, Lease
from gpu_exporter.choose.memory import (
    DEFAULT_HEADROOM_BYTES,
    card_memory,
    memory_fit,
    memory_leases,
    shared_cards,
)
from gpu_exporter.choose.persistence import Persistence
from gpu_exporter.choose.rank import Selection, choose
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.settle import settle
from gpu_exporter.choose.statefile import StateFile, StateWriteError
from gpu_exporter.choose.tokens import (
    ClaimKey,
    Keyed,
    lease_id_of,
    make_token,
    new_lease_id,
    new_secret,
    sha256_hex,
)
from gpu_exporter.clock import Clock
from gpu_exporter.counters import ARRIVED, NOT_ON_THIS_HOST
from gpu_exporter.model import Snapshot, all_devices
from gpu_exporter.units import plural

log = logging.getLogger(__name__)

MAX_PIDS = 64  # registered PIDs per lease: a job's launcher or two, not its every worker


def _no_cgroup(pid: int) -> str | None:
    return None


def _nothing() -> None:
    pass


def _credentials(key: ClaimKey | None) -> tuple[Keyed | None, str]:
    """What a new lease keeps of ``key``, and its secret: random, or derived from the key,
    so that a retry with the key gets the same token."""
    if key is None:
        return None, new_secret()
    keyed = Keyed(key.key_hash, key.request_hash, new_secret())
    return keyed, new_secret(keyed.salt, key.key)


class LeaseTable:
    """Every active lease, behind one lock. All methods are thread-safe."""

    def __init__(
        self,
        clock: Clock,
        *,
        state_file: Path | StateFile | None = None,
        max_ttl_seconds: float = 3600.0,
        max_gpus_per_requester: int = 0,
        cgroup_of: Callable[[int], str | None] = _no_cgroup,
        mem_headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    ) -> None:
        self._clock = clock
        self.mem_headroom_bytes = mem_headroom_bytes  # kept free on a card memory leases share
        self._renewed_by_id: set[str] = set()  # leases whose renewal by id was logged
        # pid → its cgroup key (procinfo.read_cgroup_key, injected: choose/ reads no /proc)
        self._cgroup_of = cgroup_of
        self._file = Persistence(
            StateFile(state_file) if isinstance(state_file, Path) else state_file
        )
        self.max_ttl_seconds = max_ttl_seconds
        self.max_gpus_per_requester = max_gpus_per_requester
        self._lock = threading.RLock()
        self._dirty = False  # a change since the lock was taken: wake the waiters after it
        # Called after every change, once the lock is released (the claimer's wait queue).
        self.on_change: Callable[[], None] = _nothing
        self.dropped: Counter[str] = Counter()  # GPUs dropped from leases, by reason
        # The leases, and the keys of keyed leases that ended early → their expiry.
        self._leases, self._spent = self._file.restore(clock.time(), max_ttl_seconds)

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

    def memory_by_card(self, snapshot: Snapshot) -> dict[str, tuple[int, int]]:
        """UUID → (bytes reserved by memory leases, bytes their attributed processes use beyond
        that), for the cards of ``snapshot`` holding memory leases (the metrics)."""
        with self._lock:  # most tables hold none: a scrape then settles the leases only once
            if all(lease.mem_bytes is None for lease in self._leases.values()):
                return {}
        shared = memory_leases(self.active(snapshot))
        cards = (card_memory(g, shared[g.uuid]) for g in snapshot.gpus if g.uuid in shared)
        return {card.uuid: (card.leased, card.overrun) for card in cards}

    def withheld(self, snapshot: Snapshot) -> dict[str, str]:
        """UUID → why, for the devices of ``snapshot`` no claim may get now: those a
        ``leases.json`` that could not be trusted may have leased (see persistence)."""
        return self._file.withheld(all_devices(snapshot.gpus), self._clock.time())

    @property
    def state_problem(self) -> str | None:
        """Why the last write of ``leases.json`` failed, until one succeeds (``/readyz``)."""
        return self._file.problem

    @property
    def state_write_errors(self) -> int:
        """Writes of ``leases.json`` that failed since start."""
        return self._file.write_errors

    def get(self, lease_id: str) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self._clock.time():
            raise ApiError(
                404, "unknown_lease", f"no active lease {lease_id!r} (expired or released?)"
            )
        return lease

    def authorize(self, ref: str, *, admin: bool = False, renewing_for: str | None = None) -> str:
        """The id of the lease ``ref`` (its token) may change; ``admin`` may change any by id.

        ``renewing_for``: a renewal from this requester. A client from before lease tokens
        renews by the id; renewing never takes a card from anyone, so the requester that
        claimed the lease may still do that (logged once per lease, as deprecated), and only
        that: release and the rest take the token.

        404 ``unknown_lease`` when no such lease is active, 403 ``forbidden`` when ``ref`` is
        not its token. Never echoes ``ref``, which may be a token.
        """
        lease = self.get(lease_id_of(ref))
        if admin or lease.accepts(ref):
            return lease.id
        if ref == lease.id and renewing_for is not None and renewing_for == lease.requester:
            if lease.id not in self._renewed_by_id:
                self._renewed_by_id &= set(self._leases)  # only active leases' ids stay
                self._renewed_by_id.add(lease.id)
                log.warning(
                    "lease %s renewed by its id from %s, which claimed it: a client from "
                    "before lease tokens; renewing by id is deprecated (use the token)",
                    lease.id,
                    renewing_for,
                )
            return lease.id
        if ref == lease.id:
            message = (
                f"lease {lease.id} can only be renewed or released with its token "
                "(the X-GPU-Lease header, $GPU_LEASE or lease.token of the claim's answer), "
                "not its id (only the address that claimed it may still renew it by id)"
            )
        else:
            message = f"wrong token for lease {lease.id}"
        raise ApiError(403, "forbidden", message, "lease")

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
        key: ClaimKey | None = None,
        reserved: Mapping[str, str] | None = None,
        pids: Iterable[int] = (),
        mem: int | None = None,
        holders: bool = True,
    ) -> tuple[Selection, Lease | None]:
        """Choose ``n`` GPUs that nobody holds and, unless ``ttl_seconds`` is 0, hold them
        for the job whose processes are ``pids`` (see :func:`~gpu_exporter.choose.settle.settle`).

        With ``mem`` (bytes), ``n`` cards that admit that much more each
        (:mod:`gpu_exporter.choose.memory`: shared with other memory leases, best fit first),
        reserved in a memory lease.

        The lease returned carries its token (:attr:`Lease.token`); with ``key``, one that a
        retry with the key derives again (the caller asks :meth:`again` first).
        ``reserved`` (UUID → why) are GPUs that earlier waiters keep from this request.
        ``holders``: a leased GPU's reason names its lease's owner.

        Raises :class:`~gpu_exporter.choose.rank.NotEnoughGpus` or :class:`ApiError`.
        """
        self._check_ttl(ttl_seconds, "lease")
        with self._changing():
            self._prune(snapshot)
            now = self._clock.time()
            leased = {
                uuid: f"leased until {lease.expires_at - now:.0f} s from now"
                + (f" by {lease.owner}" if lease.owner and holders else "")
                for lease in self._leases.values()
                for uuid in lease.uuids
            }
            leased = self.withheld(snapshot) | leased
            if ttl_seconds > 0 and self.max_gpus_per_requester:
                holding = sum(
                    len(lease.gpus)
                    for lease in self._leases.values()
                    if lease.requester == requester
                )
                if holding + n > self.max_gpus_per_requester:
                    raise ApiError(
                        429,
                        "too_many_gpus",
                        f"{requester} holds {plural(holding, 'GPU')} in leases; {n} more would "
                        f"exceed the limit of {self.max_gpus_per_requester} per requester",
                        "n",
                    )
            fit, note = None, ""
            if mem is None:
                leased.update(shared_cards(self._leases.values()))
            else:
                headroom = self.mem_headroom_bytes
                wanted = {  # what the request could have but for memory: a refusal's note
                    g.uuid
                    for g in snapshot.gpus
                    if g.uuid not in (reserved or {}) and not rejection_reasons(g, filters)
                }
                fits = memory_fit(
                    snapshot.gpus, self._leases.values(), mem, headroom, leased, wanted
                )
                leased, fit, note = fits.refused, fits.fit, fits.note
            if reserved:
                leased = {**reserved, **leased}
            choice = choose(
                snapshot.gpus,
                n,
                filters,
                sort=sort,
                window=window,
                leased=leased,
                fit=fit,
                note=note,
            )
            if ttl_seconds <= 0:
                return choice, None
            keyed, secret = _credentials(key)  # keyed: a retry derives the same token
            lease = self._with_pids(
                Lease(
                    id=new_lease_id(),
                    gpus=tuple(Held.of(g) for g in choice.chosen),
                    created_at=now,
                    expires_at=now + ttl_seconds,
                    requester=requester,
                    owner=owner,
                    token_hash=sha256_hex(secret),
                    keyed=keyed,
                    mem_bytes=mem,
                ),
                pids,
            )
            self._hold(lease, None, "no GPU was claimed")
            return choice, replace(lease, token=make_token(lease.id, secret))

    def again(self, key: ClaimKey, snapshot: Snapshot) -> tuple[Selection, Lease] | None:
        """The lease a claim with ``key`` already made, with its token, or None if none did.

        Raises :class:`ApiError`: 422 ``idempotency_key_reused`` if that claim had other
        parameters, 409 ``lease_ended`` if its lease was released (or let go) before expiry.
        """
        with self._lock:
            for lease in self._leases.values():
                if lease.keyed is None or lease.keyed.key_hash != key.key_hash:
                    continue
                if lease.keyed.request_hash != key.request_hash:
                    raise ApiError(
                        422,
                        "idempotency_key_reused",
                        f"this Idempotency-Key was used for another request (lease {lease.id}); "
                        "a retry must repeat the parameters, a new request needs a new key",
                    )
                by_uuid = {g.uuid: g for g in all_devices(snapshot.gpus)}
                chosen = tuple(by_uuid[u] for u in lease.uuids if u in by_uuid)
                token = make_token(lease.id, new_secret(lease.keyed.salt, key.key))
                return Selection(chosen, ()), replace(lease, token=token)
            if self._spent.get(key.key_hash, 0.0) > self._clock.time():
                raise ApiError(
                    409,
                    "lease_ended",
                    "the lease claimed with this Idempotency-Key has already ended (released, "
                    "or let go early); claim again with a new key",
                )
            return None

    def release(self, lease_id: str) -> Lease:
        """End the lease ``lease_id`` now (check the caller with :meth:`authorize` first)."""
        with self._changing():
            self._prune(None)
            lease = self.get(lease_id)
            self._set({k: v for k, v in self._leases.items() if k != lease_id})
            self._changed()
            return lease

    def renew(self, lease_id: str, ttl_seconds: float) -> Lease:
        self._check_ttl(ttl_seconds, "ttl")
        with self._changing():
            self._prune(None)
            old = self.get(lease_id)
            lease = replace(old, expires_at=self._clock.time() + ttl_seconds, renewed=True)
            left = old.expires_at - self._clock.time()
            self._hold(lease, old, f"the lease was not renewed (it ends in {left:.0f} s)")
            return lease

    def add_pids(self, lease_id: str, pids: Iterable[int]) -> Lease:
        """Register more of the job's processes with its lease (e.g. once the job started)."""
        with self._changing():
            self._prune(None)
            old = self.get(lease_id)
            lease = self._with_pids(old, pids)
            if lease is not old:
                self._hold(lease, old, "the PIDs were not registered")
            return lease

    def _check_ttl(self, ttl_seconds: float, param: str) -> None:
        if ttl_seconds > self.max_ttl_seconds:
            message = (
                f"{param} {ttl_seconds:g} s is longer than this exporter allows "
                f"({self.max_ttl_seconds:g} s, --max-lease)"
            )
            advice = "; renew it instead" if param == "lease" else ""
            raise ApiError(429, "lease_too_long", message + advice, param)

    def _with_pids(self, lease: Lease, pids: Iterable[int]) -> Lease:
        new = [p for p in dict.fromkeys(pids) if p not in lease.pids]
        if not new:
            return lease
        if len(lease.pids) + len(new) > MAX_PIDS:
            raise ApiError(
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

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The lock, for a change; :attr:`on_change` is called once it is released (never
        under it: the claimer calls the table under its queue's lock)."""
        changed = False
        try:
            with self._lock:
                try:
                    yield
                finally:
                    changed, self._dirty = self._dirty, False
        finally:
            if changed:
                self.on_change()

    # -- housekeeping -----------------------------------------------------------------------
    def prune(self, snapshot: Snapshot | None = None) -> None:
        """Commit what :func:`settle` keeps; save and wake waiters if a lease or GPU went.

        After a failed write, the table is written again here (once per published sample)
        until a write succeeds, so :attr:`state_problem` clears by itself.
        """
        with self._changing():
            self._prune(snapshot)
            if self._file.unsaved:
                self._save()

    def _prune(self, snapshot: Snapshot | None) -> None:
        if snapshot is not None and (foreign := self._file.drop_foreign(self._leases, snapshot)):
            self.dropped[NOT_ON_THIS_HOST] += foreign
            self._changed()
        kept, drops = settle(self._leases, snapshot, self._clock.time())
        if kept == self._leases:
            return
        for drop in drops:
            self.dropped[drop.reason] += 1
            level = logging.INFO if drop.reason == ARRIVED else logging.WARNING
            log.log(level, "lease %s: GPU %s released (%s)", drop.lease_id, drop.uuid, drop.reason)
        self._set(kept)
        self._changed()

    def _hold(self, lease: Lease, old: Lease | None, refused: str) -> None:
        """Put ``lease`` in the table (replacing ``old``) only if the table can be saved;
        otherwise undo and raise ``state_unwritable`` (503), saying ``refused``."""
        self._leases[lease.id] = lease
        failure = self._save()
        if failure is not None:
            if old is None:
                del self._leases[lease.id]
            else:
                self._leases[lease.id] = old
            raise ApiError(503, "state_unwritable", f"{failure}; {refused}")
        self._dirty = True

    def _set(self, leases: Mapping[str, Lease]) -> None:
        """Replace the table, remembering the keys of keyed leases that end before expiry."""
        now = self._clock.time()
        self._spent = {k: until for k, until in self._spent.items() if until > now}
        for lease in self._leases.values():
            if lease.id not in leases and lease.keyed is not None and lease.expires_at > now:
                self._spent[lease.keyed.key_hash] = lease.expires_at
        self._leases = dict(leases)

    def _changed(self) -> None:
        """A change that lets GPUs go: in force at once, saved if the file can be written."""
        self._save()
        self._dirty = True

    def _save(self) -> StateWriteError | None:
        return self._file.save(self._leases.values(), self._spent)
