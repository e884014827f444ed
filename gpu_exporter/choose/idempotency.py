"""Idempotent claims: which lease a retried claim gets back, and which retry comes too late.

A claim with an ``Idempotency-Key`` (:class:`~gpu_exporter.choose.tokens.ClaimKey`) makes a
keyed lease: it keeps the key's hash and a salt (:class:`~gpu_exporter.choose.tokens.Keyed`),
from which a retry, carrying the key again, derives the same token. While that lease is in
force a retry gets it back, token included, instead of claiming more GPUs; once it has ended
before its expiry (released, or let go early) a retry is refused until that expiry rather
than granted anew. Those ended keys are kept in memory only.

:class:`~gpu_exporter.choose.leases.LeaseTable` owns one :class:`ClaimKeys` and calls it under
its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpu_exporter.choose.lease import Lease, LeaseError
from gpu_exporter.choose.rank import Selection
from gpu_exporter.choose.tokens import ClaimKey, Keyed, make_token, new_salt, new_secret
from gpu_exporter.model import Snapshot, all_devices


class ClaimKeys:
    """What the table knows of idempotency keys beyond its leases. Not thread-safe: the table's
    lock serialises every call."""

    def __init__(self) -> None:
        # Keys of keyed leases that ended before their expiry → that expiry.
        self._spent: dict[str, float] = {}

    @staticmethod
    def credentials(key: ClaimKey | None) -> tuple[Keyed | None, str]:
        """What a new lease keeps of ``key``, and its secret: random, or with a key derived
        from it, so that a retry with the key gets the same token."""
        if key is None:
            return None, new_secret()
        keyed = Keyed(key.key_hash, key.request_hash, new_salt())
        return keyed, new_secret(keyed.salt, key.key)

    def again(
        self, leases: Iterable[Lease], key: ClaimKey, snapshot: Snapshot, now: float
    ) -> tuple[Selection, Lease] | None:
        """The lease among ``leases`` a claim with ``key`` made, with its token, or None.

        Raises :class:`~gpu_exporter.choose.lease.LeaseError`: 422 ``idempotency_key_reused``
        if that claim had other parameters, 409 ``lease_ended`` if its lease ended early.
        """
        key_hash = key.key_hash
        for lease in leases:
            if lease.keyed is None or lease.keyed.key_hash != key_hash:
                continue
            if lease.keyed.request_hash != key.request_hash:
                raise LeaseError(
                    422,
                    "idempotency_key_reused",
                    f"this Idempotency-Key was used for another request (lease {lease.id}); "
                    "a retry must repeat the parameters, a new request needs a new key",
                )
            by_uuid = {g.uuid: g for g in all_devices(snapshot.gpus)}
            chosen = tuple(by_uuid[u] for u in lease.uuids if u in by_uuid)
            token = make_token(lease.id, new_secret(lease.keyed.salt, key.key))
            return Selection(chosen, ()), replace(lease, token=token)
        if self._spent.get(key_hash, 0.0) > now:
            raise LeaseError(
                409,
                "lease_ended",
                "the lease claimed with this Idempotency-Key has already ended (released, or "
                "let go early); claim again with a new key",
            )
        return None

    def ended(self, before: Iterable[Lease], after: Mapping[str, Lease], now: float) -> None:
        """Remember the keys of the keyed leases in ``before`` that ``after`` lacks although
        they had not expired; forget those whose expiry has passed."""
        self._spent = {k: until for k, until in self._spent.items() if until > now}
        for lease in before:
            if lease.id not in after and lease.keyed is not None and lease.expires_at > now:
                self._spent[lease.keyed.key_hash] = lease.expires_at
