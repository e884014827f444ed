"""Release tokens and idempotency keys: who may end a lease, and which claim a retry repeats.

A lease's id is public (``/``, ``/leases``, the metrics); its **token** is ``<id>.<secret>``
and goes only to the claimant (``X-GPU-Lease``, ``GPU_LEASE``, the JSON ``lease.token``).
Renewing or releasing takes the token, so ``DELETE /leases/$GPU_LEASE`` keeps working while
the id alone is refused. Only ``sha256(secret)`` is kept (in memory and in ``leases.json``)
and compared in constant time, so neither the status page nor the state file gives a token
away.

An ``Idempotency-Key`` (IETF httpapi draft) makes a retried claim return the lease the first
try made. The key is scoped to the requester (a user, or a remote address): another client using the
same key gets its own claim. The secret of a keyed claim is ``HMAC(salt, key)``, so a retry,
which carries the key again, gets the same token even after a restart, while the state file
holds only the salt and hashes. Pure functions; no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255  # as long as the longest keys in common use (Stripe's)
# Visible ASCII without quotes, backslash or separators that break logs and headers.
_KEY = re.compile(rf"^[!#-\[\]-~]{{1,{MAX_KEY_LENGTH}}}$")
SECRET_BYTES = 18  # 24 URL-safe characters, 144 bits
LEASE_ID_BYTES = 9  # 12 URL-safe characters


@dataclass(frozen=True, slots=True)
class ClaimKey:
    """A claim's ``Idempotency-Key`` as the table matches it: scoped to its requester, and the
    request it came with (a retry must repeat the parameters too)."""

    key: str
    requester: str
    request_hash: str

    @property
    def key_hash(self) -> str:
        return sha256_hex(f"{self.requester}\0{self.key}")


@dataclass(frozen=True, slots=True)
class Keyed:
    """What a lease keeps of the key it was claimed with: hashes only, and the token's salt."""

    key_hash: str
    request_hash: str
    salt: str

    def to_state(self) -> dict[str, str]:
        return {"key_hash": self.key_hash, "request_hash": self.request_hash, "salt": self.salt}

    @classmethod
    def from_state(cls, data: object) -> Keyed | None:
        """None for a lease claimed without a key; :class:`ValueError` for a malformed entry
        (so that lease alone is skipped when ``leases.json`` is read)."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"'idempotency' must be an object or null, not {type(data).__name__}")
        key_hash, request_hash, salt = (data.get(k) for k in ("key_hash", "request_hash", "salt"))
        if not (
            isinstance(key_hash, str) and isinstance(request_hash, str) and isinstance(salt, str)
        ):
            raise ValueError("'idempotency' must hold key_hash, request_hash and salt strings")
        return cls(key_hash, request_hash, salt)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def new_secret(salt: str | None = None, key: str | None = None) -> str:
    """A fresh random secret (or salt), or (with ``salt`` and ``key``) the one a keyed claim
    derives."""
    if salt is None or key is None:
        return secrets.token_urlsafe(SECRET_BYTES)
    digest = hmac.new(salt.encode("ascii"), key.encode("utf-8"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:SECRET_BYTES]).decode("ascii")


def new_lease_id() -> str:
    """A fresh public lease id: 12 URL-safe characters (72 bits), never starting with ``-``,
    so a token is never read as an option (``gpu-exporter release TOKEN``, ``curl``, shells).

    >>> all(not new_lease_id().startswith("-") for _ in range(1000))
    True
    """
    while True:
        lease_id = secrets.token_urlsafe(LEASE_ID_BYTES)
        if not lease_id.startswith("-"):
            return lease_id


def make_token(lease_id: str, secret: str) -> str:
    return f"{lease_id}.{secret}"


def lease_id_of(ref: str) -> str:
    """The lease id in a token or an id.

    >>> lease_id_of("Ab3x.s3cr3t"), lease_id_of("Ab3x")
    ('Ab3x', 'Ab3x')
    """
    return ref.partition(".")[0]


def token_matches(lease_id: str, token_hash: str | None, ref: str) -> bool:
    """Does ``ref`` prove the claim on this lease? In constant time for a given length.

    A lease from a ``leases.json`` written before tokens existed has no ``token_hash``: its
    id is its token, since the id is all its claimant ever got.
    """
    if token_hash is None:
        return hmac.compare_digest(ref.encode("utf-8"), lease_id.encode("utf-8"))
    ref_id, sep, secret = ref.partition(".")
    if not sep or ref_id != lease_id:
        return False
    return hmac.compare_digest(sha256_hex(secret), token_hash)


def parse_idempotency_key(header: str) -> str:
    """The key in an ``Idempotency-Key`` header: the draft's quoted string (``"8e03…"``), or
    the same without quotes as most clients send it. ValueError for anything else.

    A request with the header twice arrives with the two joined by a comma (RFC 9110 5.3),
    so an unquoted key with a comma is refused as several keys; a quoted one may hold one.

    >>> parse_idempotency_key('"8e03978e-40d5"'), parse_idempotency_key("job-42")
    ('8e03978e-40d5', 'job-42')
    >>> parse_idempotency_key("aaa,bbb")
    Traceback (most recent call last):
    ValueError: give one Idempotency-Key, not several (a key with a comma must be quoted)
    """
    value = header.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    elif "," in value:
        raise ValueError(
            f"give one {IDEMPOTENCY_HEADER}, not several (a key with a comma must be quoted)"
        )
    if not _KEY.match(value):
        raise ValueError(
            f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_KEY_LENGTH} visible ASCII characters "
            'without quotes, backslashes or spaces (e.g. a UUID: "8e03978e-40d5-43e8-bc93-…")'
        )
    return value


def request_hash(items: Iterable[tuple[str, str]]) -> str:
    """A fingerprint of a request's parameters, in any order (a retry must repeat them)."""
    return sha256_hex("&".join(f"{k}={v}" for k, v in sorted(items)))
