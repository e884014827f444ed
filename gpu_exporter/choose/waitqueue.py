"""The queue of ``/choose`` requests waiting for GPUs, its wake-up, and what each one reserves.

:class:`WaitQueue` holds the waiting requests and the condition they wait on under one lock:
:class:`~gpu_exporter.choose.claim.Claimer` tries a claim and joins under it, and is woken
through it whenever the lease table changes (:attr:`LeaseTable.on_change
<gpu_exporter.choose.leases.LeaseTable.on_change>`, called once the table's lock is released,
so the two locks never nest the other way) or a waiter leaves. A request joins only once it
found too few GPUs and may wait (``wait=``) for a lease; advice (``lease=0``) never joins.

What a waiter blocks (:func:`reserved_for`): the GPUs that qualify for it by its filters on
the current sample, leased or not. A later request chooses among the other GPUs; one that
could use only reserved GPUs fails (or, with ``wait=``, queues behind). So GPUs that several
waiters could use go first come first served, and a waiter never holds back GPUs it could not
use anyway. The ``idle_for`` window is not consulted here: a GPU busy a minute ago that the
filters accept now is reserved, which errs towards the earlier request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from gpu_exporter.choose.filters import Filters, candidates, rejection_reasons
from gpu_exporter.model import GpuSample
from gpu_exporter.units import format_bytes

_NO_FILTERS = Filters()


@dataclass(frozen=True, slots=True)
class Waiter:
    """One request waiting for GPUs; ``ticket`` orders the queue (smaller is earlier)."""

    ticket: int
    n: int
    filters: Filters
    requester: str  # who asks (web.peers.requester): a user, or a remote address
    owner: str | None
    since_monotonic_seconds: float  # when it started waiting, on the claimer's clock

    def filters_json(self) -> dict[str, Any]:
        """The filters it gave (those that differ from no filter): its limits by
        :attr:`~gpu_exporter.choose.filters.Bound.shown_as`, then the others by field name."""
        out: dict[str, Any] = {bound.shown_as: bound.value for bound in self.filters.limits}
        for f in fields(Filters):
            if f.name == "limits":
                continue
            value = getattr(self.filters, f.name)
            if value != getattr(_NO_FILTERS, f.name):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def describe(self) -> str:
        """``2 GPUs (model=A100, min_total_bytes=40.0 GiB)``, for people."""
        parts = [f"{name}={_text(name, value)}" for name, value in self.filters_json().items()]
        gpus = "1 GPU" if self.n == 1 else f"{self.n} GPUs"
        return gpus + (f" ({', '.join(parts)})" if parts else "")

    def to_json(self, monotonic_now: float, *, holders: bool = True) -> dict[str, Any]:
        """``holders``: show who waits (else ``requester`` and ``owner`` are null)."""
        return {
            "n": self.n,
            "filters": self.filters_json(),
            "requester": self.requester if holders else None,
            "owner": self.owner if holders else None,
            "since_seconds": round(max(0.0, monotonic_now - self.since_monotonic_seconds), 3),
        }


def _text(name: str, value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value)
    return format_bytes(value) if name.endswith("_bytes") else str(value)


class WaitQueue:
    """Waiting requests, first come first served, and their wake-up; all under :attr:`turn`."""

    def __init__(self) -> None:
        # Held to try a claim and join; reentrant: a claim's change wakes the queue at once.
        self.turn = threading.Condition(threading.RLock())
        self._waiters: dict[int, Waiter] = {}  # insertion order is ticket order
        self._next_ticket = 0
        self._changes = 0  # how many wake-ups so far: a wait sees one that came before it

    def __len__(self) -> int:
        return len(self._waiters)

    def join(
        self, n: int, filters: Filters, requester: str, owner: str | None, now: float
    ) -> Waiter:
        """Queue a request at the end; it must :meth:`leave` when it ends, however it ends."""
        with self.turn:
            self._next_ticket += 1
            waiter = Waiter(self._next_ticket, n, filters, requester, owner, now)
            self._waiters[waiter.ticket] = waiter
            return waiter

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` is done; the others are woken: they may use what it reserved."""
        with self.turn:
            self._waiters.pop(waiter.ticket, None)
            self.wake()

    def waiting(self) -> tuple[Waiter, ...]:
        """Every waiter, earliest first."""
        with self.turn:
            return tuple(self._waiters.values())

    def ahead_of(self, waiter: Waiter | None) -> tuple[Waiter, ...]:
        """The waiters before ``waiter``; all of them for a request not in the queue."""
        with self.turn:
            if waiter is None:
                return self.waiting()
            return tuple(w for w in self._waiters.values() if w.ticket < waiter.ticket)

    def wake(self) -> None:
        """Something changed (a lease, the queue): every waiter tries again."""
        with self.turn:
            self._changes += 1
            self.turn.notify_all()

    @property
    def changes(self) -> int:
        """A mark for :meth:`wait`, taken with the try it follows."""
        return self._changes

    def wait(self, since: int, timeout_seconds: float) -> None:
        """Block until a wake-up after the mark ``since``, or the timeout."""
        with self.turn:
            self.turn.wait_for(lambda: self._changes != since, timeout_seconds)


def reserved_for(gpus: Iterable[GpuSample], ahead: Sequence[Waiter]) -> Mapping[str, str]:
    """UUID → why it is reserved: every device that qualifies for a waiter in ``ahead`` by its
    filters on these samples (leases ignored), attributed to the earliest such waiter."""
    if not ahead:
        return {}
    gpus = tuple(gpus)
    reserved: dict[str, str] = {}
    for waiter in ahead:
        for gpu in candidates(gpus, waiter.filters.mig):
            if gpu.uuid not in reserved and not rejection_reasons(gpu, waiter.filters):
                reserved[gpu.uuid] = (
                    f"reserved for an earlier request waiting for {waiter.describe()}"
                )
    return reserved
