"""The /choose claim loop on a fake clock, without Flask or threads: FIFO, caps, deadline, stop.

The claimer's ``pause`` is where a real request would sleep; here it moves the fake clock and
lets a test act "meanwhile" (another request arrives, a lease is released, the exporter stops).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import FakeClock
from gpu_exporter.choose.claim import (
    Claimer,
    Waiters,
    history_window,
    snapshot_problem,
)
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.params import ApiError, ChooseRequest, parse_choose_args
from gpu_exporter.choose.rank import Filters
from gpu_exporter.counters import RequestCounter
from gpu_exporter.model import GpuSample, Snapshot

GIB = 2**30


class Samples:
    """A snapshot source holding one snapshot, taken now on the fake clock."""

    def __init__(self, clock: FakeClock, gpus: int) -> None:
        self.snapshot = Snapshot(
            taken_at_seconds=clock.time(),
            monotonic_seconds=clock.monotonic(),
            sample_duration_seconds=0.01,
            nvml_up=True,
            simulated=True,
            gpus=tuple(
                GpuSample(
                    index=i,
                    uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
                    up=True,
                    memory_free_bytes=80 * GIB,
                    utilization_ratio=0.0,
                )
                for i in range(gpus)
            ),
            sequence=1,
        )

    def get(self) -> Snapshot:
        return self.snapshot

    def history(self) -> tuple[Snapshot, ...]:
        return (self.snapshot,)


class Box:
    """A lease table over ``gpus`` idle GPUs, and a claimer whose pause runs ``meanwhile``."""

    def __init__(self, gpus: int, *, max_waiters: int = 8) -> None:
        self.clock = FakeClock()
        self.samples = Samples(self.clock, gpus)
        self.table = LeaseTable(self.clock)
        self.rejections = RequestCounter()
        self.waiters = Waiters(max_waiters, rejections=self.rejections)
        self.meanwhile: list[Callable[[], object]] = []  # one action per pause, in order
        self.pauses = 0
        self.claimer = Claimer(
            self.samples, self.table, self.waiters, clock=self.clock, pause=self.pause
        )

    def pause(self, seconds: float) -> None:
        self.pauses += 1
        self.clock.advance(seconds)
        if self.meanwhile:
            self.meanwhile.pop(0)()

    def hold(self, n: int) -> str:
        """Lease ``n`` GPUs for someone else; the lease id."""
        _, lease = self.table.claim(
            self.samples.get(), n, Filters(), ttl_seconds=600, requester="other"
        )
        assert lease is not None
        return lease.id

    def choose(self, query: str) -> object:
        return self.claimer.claim(request(query), "10.0.0.1")

    def refusal(self, query: str) -> ApiError:
        with pytest.raises(ApiError) as info:
            self.choose(query)
        return info.value

    def settled(self) -> bool:
        """No ticket left in the queue and no waiter slot held."""
        probe = self.table.enqueue()
        try:
            return self.table.ahead_of(probe) == (0, 0) and self.waiters.active == 0
        finally:
            self.table.dequeue(probe)


def request(query: str) -> ChooseRequest:
    return parse_choose_args(dict(part.split("=") for part in query.split("&")))


def test_free_gpus_are_claimed_at_once() -> None:
    box = Box(2)
    claimed = box.claimer.claim(request("n=2&lease=30s"), "10.0.0.1")
    assert len(claimed.choice.chosen) == 2
    assert claimed.lease is not None and claimed.lease.requester == "10.0.0.1"
    assert claimed.snapshot is box.samples.snapshot and box.pauses == 0


def test_a_later_request_does_not_overtake_a_waiting_one() -> None:
    box = Box(2)
    held = box.hold(1)
    later: list[ApiError] = []
    box.meanwhile = [
        lambda: later.append(box.refusal("n=1")),  # one GPU is free, but n=2 came first
        lambda: box.table.release(held),
    ]
    claimed = box.claimer.claim(request("n=2&wait=1m"), "10.0.0.1")
    assert len(claimed.choice.chosen) == 2
    assert later[0].code == "not_enough_gpus"
    assert later[0].message == "1 earlier requests are waiting for GPUs and are served first"
    assert box.settled()


def test_beyond_max_waiters_the_request_is_refused_and_counted() -> None:
    box = Box(1, max_waiters=1)
    box.hold(1)
    second: list[ApiError] = []
    box.meanwhile = [lambda: second.append(box.refusal("n=1&wait=1m"))]
    first = box.refusal("n=1&wait=2s")  # waits, holding the only slot, then gives up
    assert first.code == "not_enough_gpus"
    assert (second[0].status, second[0].code, second[0].param) == (503, "too_many_waiters", "wait")
    assert second[0].message == (
        "1 requests are already waiting for GPUs (--max-waiters); retry later"
    )
    assert box.rejections.counts() == {"too_many_waiters": 1}
    assert box.settled()


def test_the_deadline_raises_the_last_failure() -> None:
    box = Box(1)
    box.hold(1)
    started = box.clock.monotonic()
    refused = box.refusal("n=1&wait=2s")
    assert refused.code == "not_enough_gpus" and refused.message.startswith("0 of 1 GPUs qualify")
    assert box.clock.monotonic() - started == pytest.approx(2.0)
    assert box.settled()


def test_without_wait_a_failure_is_answered_at_once() -> None:
    box = Box(1, max_waiters=0)
    box.hold(1)
    assert box.refusal("n=1").code == "not_enough_gpus"
    assert box.pauses == 0 and box.rejections.counts() == {}


def test_shutdown_ends_a_wait_at_once() -> None:
    box = Box(1)
    box.hold(1)
    box.meanwhile = [box.waiters.stopping.set]
    refused = box.refusal("n=1&wait=1h")
    assert (refused.code, refused.message) == ("shutting_down", "the exporter is shutting down")
    assert box.pauses == 1 and box.settled()


def test_queued_only_behind_requests_being_served_is_not_waiting() -> None:
    box = Box(1, max_waiters=0)  # any real waiting would be refused
    serving = box.table.enqueue()  # a claim in progress
    box.meanwhile = [lambda: box.table.dequeue(serving)]
    claimed = box.claimer.claim(request("n=1&lease=0"), "10.0.0.1")
    assert claimed.lease is None and box.pauses == 1
    assert box.rejections.counts() == {}


def test_a_stale_or_missing_sample_is_not_used() -> None:
    box = Box(1)
    box.clock.advance(11)
    assert box.refusal("n=1").code == "snapshot_stale"
    snap = box.samples.snapshot
    assert snapshot_problem(snap, snap.monotonic_seconds, 10) is None
    never = Snapshot(0.0, 0.0, 0.0, nvml_up=False, simulated=False, nvml_error="x", sequence=0)
    assert snapshot_problem(never, 0.0, 10) == ApiError(
        503, "not_ready", "no sample yet: the exporter is starting"
    )


def test_history_window_covers_the_asked_seconds() -> None:
    clock = FakeClock()
    old = Samples(clock, 1).snapshot
    clock.advance(30)
    new = Samples(clock, 1).snapshot
    window = history_window((old, new), 10, clock.monotonic())
    assert (window.seconds, window.covered_seconds) == (10, 30)
    assert [age for age, _ in window.past] == [0.0]


def test_waiters_sleep_ends_at_once_on_shutdown() -> None:
    waiters = Waiters(1)
    waiters.sleep(0)  # returns: not stopping
    waiters.stopping.set()
    with pytest.raises(ApiError, match="shutting down"):
        waiters.sleep(60)
    with waiters.slot():
        assert waiters.active == 1
        with pytest.raises(ApiError, match="already waiting"), waiters.slot():
            pass
    assert waiters.active == 0
