"""The /choose claim loop on a fake clock, without Flask or threads: FIFO, what a waiter
reserves, caps, deadline, stop, a client that hangs up.

The claimer's ``pause`` is where a real request would sleep; here it moves the fake clock and
lets a test act "meanwhile" (another request arrives, a lease is released, the exporter stops).
A request started "meanwhile" runs its own pauses on the same list of actions.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import FakeClock
from gpu_exporter.choose.claim import (
    Claimed,
    Claimer,
    Waiters,
    history_window,
    snapshot_problem,
)
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import ChooseRequest, parse_choose_args
from gpu_exporter.counters import RequestCounter
from gpu_exporter.model import GpuSample, Snapshot

GIB = 2**30


A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


class Samples:
    """A snapshot source holding one snapshot, taken now on the fake clock: idle 80 GiB
    GPUs, of ``models`` by index (A100 for the rest)."""

    def __init__(self, clock: FakeClock, gpus: int, models: tuple[str, ...] = ()) -> None:
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
                    name=models[i] if i < len(models) else A100,
                    memory_total_bytes=80 * GIB,
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

    def __init__(
        self,
        gpus: int,
        *,
        max_waiters: int = 8,
        per_requester: int = 0,
        models: tuple[str, ...] = (),
    ) -> None:
        self.clock = FakeClock()
        self.samples = Samples(self.clock, gpus, models)
        self.table = LeaseTable(self.clock)
        self.rejections = RequestCounter()
        self.waiters = Waiters(max_waiters, per_requester=per_requester, rejections=self.rejections)
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

    def hold(self, n: int, filters: Filters | None = None) -> str:
        """Lease ``n`` GPUs for someone else; the lease id."""
        _, lease = self.table.claim(
            self.samples.get(), n, filters or Filters(), ttl_seconds=600, requester="other"
        )
        assert lease is not None
        return lease.id

    def choose(self, query: str, requester: str = "10.0.0.1") -> Claimed:
        return self.claimer.claim(request(query), requester)

    def refusal(self, query: str, requester: str = "10.0.0.1") -> ApiError:
        with pytest.raises(ApiError) as info:
            self.choose(query, requester)
        return info.value

    def settled(self) -> bool:
        """Nobody left in the wait queue and no waiter slot held."""
        return self.claimer.waiting() == () and self.waiters.active == 0

    def indices(self, claimed: Claimed) -> list[int]:
        return sorted(g.index for g in claimed.choice.chosen)


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
    assert "reserved for an earlier request waiting for 2 GPUs" in later[0].message
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
        "1 request is already waiting for GPUs (--max-waiters); retry later"
    )
    assert box.rejections.counts() == {"too_many_waiters": 1}
    assert box.settled()


def test_the_deadline_raises_the_last_failure() -> None:
    box = Box(1)
    box.hold(1)
    started = box.clock.monotonic()
    refused = box.refusal("n=1&wait=2s")
    assert refused.code == "not_enough_gpus" and refused.message.startswith("0 of 1 GPU qualifies")
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


def test_advice_waits_only_in_slots_no_claim_needs() -> None:
    # Issue 28.10: advice waiters filled every slot, and a claim with wait= got 503.
    waiters = Waiters(2, per_requester=2)
    with waiters.slot("bob", advice=True) as bob, waiters.slot("carol", advice=True) as carol:
        with pytest.raises(ApiError, match="already waiting"), waiters.slot("bob", advice=True):
            pass  # advice never takes advice's slot
        with waiters.slot("alice"):  # a claim takes the oldest advice waiter's
            assert bob.ended.is_set() and not carol.ended.is_set()
            assert waiters.active == 2
    assert waiters.active == 0
    # Over bob's own share: one of bob's advice waits gives way to bob's claim.
    with (
        waiters.slot("bob", advice=True) as first,
        waiters.slot("bob", advice=True),
        waiters.slot("bob"),
    ):
        assert first.ended.is_set()


# -- issue 13.2: a waiter blocks only what it could use, and only while its client is there --


def test_a_waiter_whose_client_hung_up_leaves_and_claims_nothing() -> None:
    box = Box(1)
    held = box.hold(1)
    asked: list[float] = []

    def connected() -> bool:
        asked.append(box.clock.monotonic())
        return len(asked) < 2  # the client hangs up during the second pause

    box.meanwhile = [lambda: None, lambda: box.table.release(held)]  # the GPU frees meanwhile
    with pytest.raises(ApiError) as info:
        box.claimer.claim(request("n=1&wait=1h"), "10.0.0.1", connected=connected)
    assert (info.value.status, info.value.code) == (499, "client_closed")
    assert box.pauses == 2 and len(asked) == 2  # asked after each pause
    assert box.table.active() == () and box.settled()
    assert len(box.choose("n=1").choice.chosen) == 1  # the next request gets the GPU


def test_more_gpus_than_could_ever_qualify_are_refused_at_once() -> None:
    box = Box(4, models=(A100, A100, H100, H100))
    cases = {
        "n=5&wait=1h": "4 of 4 GPUs qualify, 5 requested; at most 4 of the 4 GPUs here could",
        "n=3&model=h100&wait=1h": "at most 2 of the 4 GPUs here could ever qualify (gpu 0: model",
        "n=1&min_total=100GiB&wait=1h": "total memory 80.0 GiB < min_total 100.0 GiB",
        "n=1&min_free=81GiB&wait=1h": "usable memory 80.0 GiB < min_free 81.0 GiB",
        "n=1&mig=only&lease=0&wait=1h": "gpu 0: not a MIG device (mig=only)",
        "n=3&exclude=0,1&wait=1h": "gpu 1: excluded",
    }
    for query, says in cases.items():
        refused = box.refusal(query)
        assert (refused.status, refused.code, refused.param) == (503, "not_enough_gpus", None)
        assert says in refused.message, (query, refused.message)
    assert box.pauses == 0 and box.settled()


def test_busy_or_leased_gpus_could_still_qualify_so_those_requests_wait() -> None:
    box = Box(2)
    box.hold(2)
    refused = box.refusal("n=2&max_util=0%&wait=2s")  # leased now, idle enough: worth waiting
    assert refused.message.startswith("0 of 2 GPUs qualify") and box.pauses == 20


def test_advice_is_never_blocked_by_a_waiter_and_never_queues() -> None:
    box = Box(2)
    held = box.hold(1)
    seen: list[object] = []
    box.meanwhile = [
        lambda: seen.append(box.choose("n=1&lease=0")),  # the free GPU, advice only
        lambda: seen.append(box.claimer.waiting()),
        lambda: box.table.release(held),
    ]
    claimed = box.choose("n=2&wait=1m")
    assert box.indices(claimed) == [0, 1]
    advice = seen[0]
    assert isinstance(advice, Claimed) and advice.lease is None
    assert [w.n for w in seen[1]] == [2]  # type: ignore[attr-defined]
    assert box.settled()


def test_waiting_advice_holds_a_slot_but_no_place_in_the_queue() -> None:
    box = Box(1)
    held = box.hold(1)
    seen: list[object] = []
    box.meanwhile = [
        lambda: seen.append((box.claimer.waiting(), box.waiters.active)),
        lambda: box.table.release(held),
    ]
    advice = box.choose("n=1&lease=0&wait=1m")
    assert advice.lease is None and seen[0] == ((), 1)
    assert box.settled()


def test_a_waiter_blocks_only_the_gpus_it_could_use() -> None:
    box = Box(4, models=(A100, A100, H100, H100))
    held = box.hold(1, Filters(model="A100"))  # GPU 1 (highest index first)
    later: list[object] = []
    box.meanwhile = [
        lambda: later.append(box.choose("n=2")),  # the two H100s: GPU 0 is the waiter's
        lambda: later.append(box.refusal("n=1&model=a100")),
        lambda: box.table.release(held),
    ]
    claimed = box.choose("n=2&model=A100&wait=1m")
    assert box.indices(claimed) == [0, 1]
    assert isinstance(later[0], Claimed) and box.indices(later[0]) == [2, 3]
    refused = later[1]
    assert isinstance(refused, ApiError) and refused.code == "not_enough_gpus"
    assert (
        "gpu 0: reserved for an earlier request waiting for 2 GPUs (model=A100)" in refused.message
    )
    assert box.settled()


def test_contended_gpus_go_first_come_first_served() -> None:
    box = Box(2)
    held = box.hold(2)
    second: list[ApiError] = []
    box.meanwhile = [
        lambda: second.append(box.refusal("n=1&wait=3s", "10.0.0.2")),  # queues behind
        lambda: box.table.release(held),  # both free: both reserved for the first waiter
    ]
    first = box.choose("n=2&wait=1m")
    assert box.indices(first) == [0, 1]
    assert "reserved for an earlier request waiting for 2 GPUs" in second[0].message
    assert box.settled()


def test_a_waiter_that_leaves_frees_what_it_reserved() -> None:
    box = Box(2)
    box.hold(1)
    refused = box.refusal("n=2&wait=1s")
    assert refused.code == "not_enough_gpus"
    assert len(box.choose("n=1").choice.chosen) == 1  # nothing reserved any more


def test_a_requester_may_hold_only_so_many_waiting_slots() -> None:
    box = Box(1, per_requester=1)
    held = box.hold(1)
    seen: list[object] = []
    box.meanwhile = [
        lambda: seen.append(box.refusal("n=1&wait=1m")),  # same address: over its limit
        lambda: seen.append(box.refusal("n=1&wait=1s", "10.0.0.2")),  # another may wait
        lambda: box.table.release(held),
    ]
    assert len(box.choose("n=1&wait=1m").choice.chosen) == 1
    mine, theirs = seen
    assert isinstance(mine, ApiError) and isinstance(theirs, ApiError)
    assert (mine.status, mine.code, mine.param) == (429, "too_many_waiters", "wait")
    assert mine.message == (
        "10.0.0.1 already has 1 request waiting for GPUs (--max-waiters-per-requester 1)"
    )
    assert theirs.code == "not_enough_gpus"
    assert box.rejections.counts() == {"too_many_waiters": 1}
    assert box.settled()


def test_waiters_json_says_what_each_one_waits_for() -> None:
    box = Box(3)
    box.hold(3)
    seen: list[dict[str, object]] = []
    box.meanwhile = [lambda: seen.append(box.claimer.waiting()[0].to_json(box.clock.monotonic()))]
    box.refusal("n=2&min_total=40GiB&exclude=2&owner=alice&wait=150ms")
    assert seen == [
        {
            "n": 2,
            "filters": {"min_total_bytes": 40 * GIB, "exclude": ["2"]},
            "requester": "10.0.0.1",
            "owner": "alice",
            "since_seconds": pytest.approx(0.1),
        }
    ]
