"""The ``/choose`` claim loop: first come first served, waiting for GPUs up to a deadline.

Plain Python over the lease table and an injected clock; no Flask. :class:`Claimer` serves
one request at a time per thread:

* Each claim takes a ticket in the lease table's queue; only the claimer at its head claims,
  so a request that waits for two GPUs is not overtaken by a later one that wants one.
* A claimer that found too few GPUs and still has time marks itself waiting: later requests
  then queue behind it (and, without ``wait=``, give up at once). A request queued only behind
  requests being served is not waiting for GPUs: its turn is a millisecond away.
* Waiting for GPUs takes one of the ``--max-waiters`` slots (:class:`Waiters`), held until the
  request ends, so long-polling clients can never take every server thread.
* ``wait=`` sets a deadline on the injected monotonic clock; past it the last failure is
  raised. Shutdown (:attr:`Waiters.stopping`) ends every wait at once with ``shutting_down``.

:class:`Waiters` is shared by everything that long-polls, so its slots and its shutdown
event are the same for every waiting endpoint.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.params import ApiError, ChooseRequest
from gpu_exporter.choose.rank import NotEnoughGpus, Selection, Window
from gpu_exporter.clock import Clock
from gpu_exporter.counters import RequestCounter
from gpu_exporter.model import Snapshot

DEFAULT_MAX_WAITERS = 8
WAIT_POLL_SECONDS = 0.1  # waiters also wake at once on lease changes


class Snapshots(Protocol):
    """Where the claimer reads samples from (the sampler's snapshot cache)."""

    def get(self) -> Snapshot: ...

    def history(self) -> tuple[Snapshot, ...]: ...


def snapshot_problem(
    snapshot: Snapshot, monotonic_now: float, max_age_seconds: float
) -> ApiError | None:
    """Why this snapshot must not be used to hand out GPUs, or None if it may."""
    if snapshot.sequence == 0:
        return ApiError(503, "not_ready", "no sample yet: the exporter is starting")
    if not snapshot.nvml_up:
        return ApiError(503, "nvml_unavailable", f"NVML is not available: {snapshot.nvml_error}")
    age = snapshot.age_seconds(monotonic_now)
    if age > max_age_seconds:
        return ApiError(
            503,
            "snapshot_stale",
            f"the last sample is {age:.1f} s old (limit {max_age_seconds:g} s); "
            "the sampler may be stuck in a driver call",
        )
    return None


def history_window(history: Sequence[Snapshot], seconds: float, monotonic_now: float) -> Window:
    """The samples of the last ``seconds`` (``history`` oldest first), for ``idle_for``."""
    covered = history[0].age_seconds(monotonic_now) if history else 0.0
    past = tuple(
        (snap.age_seconds(monotonic_now), snap.gpus)
        for snap in history
        if snap.age_seconds(monotonic_now) <= seconds
    )
    return Window(seconds, covered, past)


class Waiters:
    """The ``--max-waiters`` slots and the shutdown event every long-polling request shares.

    Refusals for want of a slot are counted as ``too_many_waiters`` in ``rejections``.
    """

    def __init__(
        self,
        limit: int = DEFAULT_MAX_WAITERS,
        *,
        stopping: threading.Event | None = None,
        rejections: RequestCounter | None = None,
    ) -> None:
        self.limit = limit
        self.active = 0  # requests waiting right now
        self.stopping = stopping if stopping is not None else threading.Event()
        self.rejections = rejections
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.active >= self.limit:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.active -= 1

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot while waiting; ``too_many_waiters`` (503) when none is free."""
        if not self.try_enter():
            if self.rejections is not None:
                self.rejections.inc("too_many_waiters")
            raise ApiError(
                503,
                "too_many_waiters",
                f"{self.limit} requests are already waiting for GPUs (--max-waiters); retry later",
                "wait",
            )
        try:
            yield
        finally:
            self.leave()

    def check(self) -> None:
        """Raise ``shutting_down`` (503) once the exporter is stopping."""
        if self.stopping.is_set():
            raise ApiError(503, "shutting_down", "the exporter is shutting down")

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of real time, ending at once with ``shutting_down`` on shutdown."""
        self.stopping.wait(seconds)
        self.check()


@dataclass(frozen=True, slots=True)
class Claimed:
    """A served ``/choose``: what was chosen, the lease (None for advice), and from which
    sample, with the monotonic time it was read at (for the sample's age)."""

    choice: Selection
    lease: Lease | None
    snapshot: Snapshot
    monotonic_now: float


class Claimer:
    """Selects and claims GPUs under the lease table's lock, waiting first come first served.

    ``pause(seconds)`` waits between tries; by default until the lease table changes or
    ``poll_seconds`` pass (new samples are seen at the next poll).
    """

    def __init__(
        self,
        snapshots: Snapshots,
        table: LeaseTable,
        waiters: Waiters,
        *,
        clock: Clock,
        max_age_seconds: float = 10.0,
        poll_seconds: float = WAIT_POLL_SECONDS,
        pause: Callable[[float], object] | None = None,
    ) -> None:
        self._snapshots = snapshots
        self._table = table
        self._waiters = waiters
        self._clock = clock
        self.max_age_seconds = max_age_seconds
        self._poll_seconds = poll_seconds
        self._pause = pause if pause is not None else table.wait_for_change

    def claim(self, req: ChooseRequest, requester: str) -> Claimed:
        """Serve ``req`` for ``requester`` (its address); raises :class:`ApiError` or
        :class:`~gpu_exporter.choose.leases.LeaseError`."""
        deadline = self._clock.monotonic() + req.wait_seconds
        ticket = self._table.enqueue()
        try:
            with contextlib.ExitStack() as slot:  # one --max-waiters slot once really waiting
                waiting = False
                while True:
                    claimed, failure = self._try(req, requester, ticket, deadline)
                    if claimed is not None:
                        return claimed
                    if failure is not None and self._clock.monotonic() >= deadline:
                        raise failure
                    self._waiters.check()
                    if failure is not None and not waiting:  # waiting for GPUs, not our turn
                        slot.enter_context(self._waiters.slot())
                        waiting = True
                    self._pause(self._poll_seconds)
        finally:
            self._table.dequeue(ticket)

    def _try(
        self, req: ChooseRequest, requester: str, ticket: object, deadline: float
    ) -> tuple[Claimed | None, ApiError | None]:
        """One try: the claim, or why not (no reason: only requests being served are ahead)."""
        snapshot, now = self._snapshots.get(), self._clock.monotonic()
        problem = snapshot_problem(snapshot, now, self.max_age_seconds)
        if problem is not None:
            return None, problem
        ahead, waiting_ahead = self._table.ahead_of(ticket)
        if ahead == 0:
            window = None
            if req.idle_for_seconds is not None:
                history = self._snapshots.history()
                window = history_window(history, req.idle_for_seconds, now)
            try:
                choice, lease = self._table.claim(
                    snapshot,
                    req.n,
                    req.filters,
                    ttl_seconds=req.lease_seconds,
                    requester=requester,
                    owner=req.owner,
                    sort=req.sort,
                    window=window,
                    pids=req.pids,
                )
            except NotEnoughGpus as exc:
                if self._clock.monotonic() < deadline:
                    self._table.mark_waiting(ticket)  # later claimers now queue behind us
                return None, ApiError(503, "not_enough_gpus", str(exc))
            return Claimed(choice, lease, snapshot, now), None
        if waiting_ahead == 0:
            return None, None  # our turn is next
        return None, ApiError(
            503,
            "not_enough_gpus",
            f"{waiting_ahead} earlier requests are waiting for GPUs and are served first",
        )
