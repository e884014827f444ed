"""The ``/choose`` claim loop: claim now, or wait for GPUs first come first served.

Plain Python over the lease table and an injected clock; no Flask. :class:`Claimer` serves
one request at a time per thread. What a request does, and what it blocks:

* A claim (``lease`` > 0) takes the best free GPUs at once, choosing only among GPUs that no
  earlier *waiter* reserves. With too few and ``wait=`` time left it joins the wait queue and
  tries again whenever it is woken or ``poll_seconds`` pass (new samples). What a waiter
  reserves, and the one lock under which a try reads the queue, claims and joins:
  :mod:`gpu_exporter.choose.waitqueue`.
* A claim with an ``Idempotency-Key`` that an earlier try already granted gets that lease
  back (looked up once per try, under that lock), without queueing behind anyone.
* Advice (``lease=0``) never joins the queue and ignores reservations: it answers from the
  current sample and leases. With ``wait=`` it may still wait for GPUs to become free, in a
  ``--max-waiters`` slot but without a place in the queue, so it blocks nobody.
* ``include``/``exclude`` naming a GPU this host does not have is refused (400), never
  ignored or waited for (:func:`~gpu_exporter.choose.selectors.check_selectors`).
* ``n`` more than the GPUs here could ever give under what no job changes (device count,
  kind, ``include``/``exclude``, ``model``, total memory against ``min_free`` and ``mem``,
  the fields a card cannot report, MIG devices per answer;
  :func:`~gpu_exporter.choose.filters.never_enough`) is refused at once, never waited for.
* Waiting holds one of the ``--max-waiters`` slots (:class:`Waiters`, shared by everything
  that long-polls) until the request ends, so long-polling clients can never take every
  server thread. Advice only borrows a slot: a claim that finds none free takes the oldest
  advice waiter's, which then answers with what it has. The injected ``connected`` callable
  is asked after every pause: a waiter whose client hung up (curl ``-m``, Ctrl-C) leaves the
  queue within a poll and claims nothing.
* GPUs held outside the lease table (``taken``, injected: on a Kubernetes node the ones the
  kubelet allocated to pods) are never chosen, for claims and advice alike.
* ``wait=`` sets a deadline on the injected monotonic clock; past it the last failure is
  raised. Shutdown (:attr:`Waiters.stopping`) ends every wait at once with ``shutting_down``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpu_exporter.choose.filters import Window, never_enough
from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.rank import NotEnoughGpus, Selection
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import ChooseRequest
from gpu_exporter.choose.selectors import check_selectors
from gpu_exporter.choose.tokens import ClaimKey
from gpu_exporter.choose.waitqueue import Waiter, WaitQueue, reserved_for
from gpu_exporter.clock import Clock
from gpu_exporter.counters import TOO_MANY_WAITERS, RequestCounter
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.units import plural

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

    Sized by ``--max-waiters`` and ``--max-waiters-per-requester`` (:class:`Limits
    <gpu_exporter.web.limits.Limits>`, the one place limits are defined).
    A request waits in one slot; beyond ``limit`` requests at once it is refused with 503
    ``too_many_waiters`` (the exporter is busy), and beyond ``per_requester`` (0: no limit)
    from one requester (:func:`gpu_exporter.web.peers.requester`) with 429
    ``too_many_waiters`` (that client asks too much). Both refusals are counted as
    ``too_many_waiters`` in ``rejections``.

    Advice (``advice=True``: it claims nothing) never takes a slot from a claim: when every
    slot (or every one of its requester's) is held, a claim takes the oldest advice waiter's
    (its requester's), whose :attr:`Slot.ended` is set so that it answers at once with what
    it has.
    """

    def __init__(
        self,
        limit: int,
        *,
        per_requester: int = 0,
        stopping: threading.Event | None = None,
        rejections: RequestCounter | None = None,
    ) -> None:
        self.limit = limit
        self.per_requester = per_requester
        self.stopping = stopping if stopping is not None else threading.Event()
        self.rejections = rejections
        self._held: dict[Slot, None] = {}  # oldest first
        self._by_requester: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        """Requests waiting in a slot right now."""
        return len(self._held)

    @contextlib.contextmanager
    def slot(self, requester: str | None = None, *, advice: bool = False) -> Iterator[Slot]:
        """Hold one slot while waiting; ``too_many_waiters`` (503, or 429 for a requester
        over its own limit) when none may be taken."""
        per, who = (self.per_requester, requester) if requester is not None else (0, "")
        mine = Slot(who if per else None, advice)
        with self._lock:
            refusal = None
            if per and self._by_requester[who] >= per and not self._bump(advice, who):
                waiting = plural(self._by_requester[who], "request")
                message = f"{who} already has {waiting} waiting for GPUs"
                refusal = ApiError(
                    429, TOO_MANY_WAITERS, f"{message} (--max-waiters-per-requester {per})", "wait"
                )
            elif len(self._held) >= self.limit and not self._bump(advice):
                are = "is" if self.limit == 1 else "are"
                message = f"{plural(self.limit, 'request')} {are} already waiting for GPUs"
                refusal = ApiError(
                    503, TOO_MANY_WAITERS, f"{message} (--max-waiters); retry later", "wait"
                )
            if refusal is None:
                self._held[mine] = None
                if mine.requester is not None:
                    self._by_requester[mine.requester] += 1
        if refusal is not None:
            if self.rejections is not None:
                self.rejections.inc(TOO_MANY_WAITERS)
            raise refusal
        try:
            yield mine
        finally:
            with self._lock:
                self._release(mine)

    def _bump(self, advice: bool, requester: str | None = None) -> bool:
        """Under the lock: end the oldest advice wait (``requester``'s, if given) to free its
        slot for a claim; False if ``advice`` asks (advice takes no one's) or there is none."""
        if advice:
            return False
        for held in self._held:
            if held.advice and (requester is None or held.requester == requester):
                self._release(held)
                held.ended.set()
                return True
        return False

    def _release(self, held: Slot) -> None:
        """Under the lock: ``held`` no longer counts (idempotent)."""
        if self._held.pop(held, False) is None and held.requester is not None:
            self._by_requester[held.requester] -= 1
            if self._by_requester[held.requester] <= 0:
                del self._by_requester[held.requester]

    def check(self) -> None:
        """Raise ``shutting_down`` (503) once the exporter is stopping."""
        if self.stopping.is_set():
            raise ApiError(503, "shutting_down", "the exporter is shutting down")

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of real time, ending at once with ``shutting_down`` on shutdown."""
        self.stopping.wait(seconds)
        self.check()


@dataclass(eq=False)
class Slot:
    """One request's ``--max-waiters`` slot: whose (None: not counted per requester), whether
    it is advice, and whether a claim took it over (the wait is then over)."""

    requester: str | None
    advice: bool
    ended: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class Claimed:
    """A served ``/choose``: what was chosen, the lease (None for advice), and from which
    sample, with the monotonic time it was read at (for the sample's age)."""

    choice: Selection
    lease: Lease | None
    snapshot: Snapshot
    monotonic_now: float


class Claimer:
    """Selects and claims GPUs under the lease table's lock; waiters queue first come first
    served for the GPUs they could use (see the module docstring).

    Between tries it waits until the lease table changes, a waiter leaves or ``poll_seconds``
    pass (new samples are seen at the next poll); ``pause(seconds)`` replaces that wait.
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
        taken: Callable[[tuple[GpuSample, ...]], Mapping[str, str]] | None = None,
    ) -> None:
        self._snapshots = snapshots
        # UUID → why, for GPUs held outside the lease table (--kubernetes: the kubelet's pods)
        self._taken = taken
        self._table = table
        self._waiters = waiters
        self._clock = clock
        self.max_age_seconds = max_age_seconds
        self._poll_seconds = poll_seconds
        self._pause = pause
        self._queue = WaitQueue()
        table.on_change = self._queue.wake

    def waiting(self) -> tuple[Waiter, ...]:
        """The requests waiting in the queue now, earliest first."""
        return self._queue.waiting()

    def claim(
        self,
        req: ChooseRequest,
        requester: str,
        key: ClaimKey | None = None,
        *,
        connected: Callable[[], bool] | None = None,
        holders: bool = True,
    ) -> Claimed:
        """Serve ``req`` for ``requester`` (who asks: a user, or a remote address); raises
        :class:`~gpu_exporter.choose.refusal.ApiError`.

        With ``key`` (its ``Idempotency-Key``), a retry of a claim already granted gets that
        lease at once, without queueing behind anyone. ``connected`` says whether the client
        is still there; it is asked after every pause, and a client that left gets
        ``client_closed`` (499) with nothing claimed for it. ``holders``: the reasons name
        the owners of leased GPUs (not for a client that proved no user).
        """
        deadline = self._clock.monotonic() + req.wait_seconds
        waiter: Waiter | None = None
        try:
            with contextlib.ExitStack() as stack:  # one --max-waiters slot once really waiting
                slot: Slot | None = None
                advice = req.lease_seconds <= 0
                while True:
                    with self._queue.turn:  # reading the queue, claiming and joining: one step
                        outcome = self._try(req, requester, waiter, key, holders)
                        if isinstance(outcome, Claimed):
                            return outcome
                        ended = slot is not None and slot.ended.is_set()  # a claim took it
                        if ended or self._clock.monotonic() >= deadline:
                            raise outcome
                        self._waiters.check()
                        if slot is None:
                            slot = stack.enter_context(self._waiters.slot(requester, advice=advice))
                        if waiter is None and req.lease_seconds > 0:
                            waiter = self._queue.join(
                                req.n, req.filters, requester, req.owner, self._clock.monotonic()
                            )
                        since = self._queue.changes
                    if self._pause is not None:
                        self._pause(self._poll_seconds)
                    else:
                        self._queue.wait(since, self._poll_seconds)
                    self._waiters.check()
                    if connected is not None and not connected():
                        raise ApiError(
                            499, "client_closed", "the client closed the connection while waiting"
                        )
        finally:
            if waiter is not None:
                self._queue.leave(waiter)  # later waiters may use what it reserved

    def _try(
        self,
        req: ChooseRequest,
        requester: str,
        waiter: Waiter | None,
        key: ClaimKey | None,
        holders: bool = True,
    ) -> Claimed | ApiError:
        """One try: the claim, or why not. Raises what waiting cannot cure."""
        snapshot, now = self._snapshots.get(), self._clock.monotonic()
        if key is not None and req.lease_seconds > 0:  # the one look-up of the key
            again = self._table.again(key, snapshot)
            if again is not None:
                return Claimed(*again, snapshot, now)
        problem = snapshot_problem(snapshot, now, self.max_age_seconds)
        if problem is not None:
            return problem
        check_selectors(snapshot.gpus, req.filters.include, req.filters.exclude)
        # Advice claims nothing, so it neither waits its turn nor respects reservations.
        reserved: dict[str, str] = {}
        if req.lease_seconds > 0:
            reserved.update(reserved_for(snapshot.gpus, self._queue.ahead_of(waiter)))
        if self._taken is not None:  # advice too: a pod's GPU is never free
            reserved.update(self._taken(snapshot.gpus))
        window = None
        if req.idle_for_seconds is not None:
            window = history_window(self._snapshots.history(), req.idle_for_seconds, now)
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
                reserved=reserved,
                key=key,
                pids=req.pids,
                mem=req.mem_bytes,
                holders=holders,
            )
        except NotEnoughGpus as exc:
            headroom = self._table.mem_headroom_bytes
            never = never_enough(snapshot.gpus, req.n, req.filters, req.mem_bytes, headroom)
            if never is not None:  # waiting cannot help: refused at once
                blamed = "mem" if "can never fit" in never else None
                raise ApiError(503, "not_enough_gpus", f"{exc}; {never}", blamed) from None
            return ApiError(503, "not_enough_gpus", str(exc))
        return Claimed(choice, lease, snapshot, now)
