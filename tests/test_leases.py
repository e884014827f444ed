"""Leases: concurrent /choose never hands a GPU out twice; release, renew, expiry, restarts."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import FakeClock, Stack, build_stack, fake_proc, sim_of
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.rank import NotEnoughGpus
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.tokens import lease_id_of
from gpu_exporter.model import ProcessSample
from gpu_exporter.simulate import Fault, Load, SimGpu
from gpu_exporter.web.limits import Limits
from gpu_exporter.web.server import Server

A100 = "NVIDIA A100-SXM4-80GB"


def idle_box(n: int = 8, **kwargs: object) -> Stack:
    s = build_stack(sim_of(*(SimGpu(i, A100, Load("idle")) for i in range(n))), **kwargs)  # type: ignore[arg-type]
    s.sample()
    return s


@pytest.fixture
def served() -> Iterator[tuple[Stack, str]]:
    """An 8-GPU simulated host behind the real server on loopback."""
    s = idle_box()
    server = Server(s.app, "127.0.0.1", 0, limits=Limits(max_in_flight=28))
    server.bind()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield s, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()
        thread.join(5)


def fetch(url: str, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


@pytest.mark.slow
def test_64_concurrent_choosers_get_8_distinct_gpus(served: tuple[Stack, str]) -> None:
    s, base = served
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda _: fetch(base + "/choose?n=1"), range(64)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) == 8 and len(refused) == 56
    uuids = [r[1].strip() for r in ok]
    assert sorted(uuids) == sorted(g.uuid for g in s.sim.gpus)  # 8 distinct, all of them
    assert all(r[1].startswith("error: 0 of 8 GPUs qualify") for r in refused)
    # Release every lease: all 8 can be chosen again.
    for r in ok:
        assert fetch(f"{base}/leases/{r[2]['X-GPU-Lease']}", "DELETE")[0] == 200
    status, text, _ = fetch(base + "/choose?n=8")
    assert status == 200 and len(text.strip().split(",")) == 8


def test_choose_claims_and_the_next_caller_gets_another_gpu() -> None:
    s = idle_box(2)
    first = s.client.get("/choose")
    second = s.client.get("/choose")
    assert first.text != second.text
    assert first.headers["X-GPU-Lease"] != second.headers["X-GPU-Lease"]
    third = s.client.get("/choose")
    assert third.status_code == 503
    assert "leased until 60 s from now" in s.client.get("/choose?format=json&lease=0").text


def test_env_format_and_json_lease() -> None:
    s = idle_box(2)
    env = s.client.get("/choose?n=2&format=env")
    token = env.headers["X-GPU-Lease"]
    uuids = f"{s.sim.gpus[1].uuid},{s.sim.gpus[0].uuid}"
    assert env.text == (
        f"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={uuids} GPU_LEASE={token}\n"
    )
    assert s.client.delete(f"/leases/{token}").get_json()["released"] == token.partition(".")[0]
    body = s.client.get("/choose?format=json&owner=alice&lease=5m").get_json()
    assert body["lease"]["owner"] == "alice"
    assert body["lease"]["expires_at"] - body["lease"]["created_at"] == 300
    assert body["lease"]["gpus"] == [s.sim.gpus[1].uuid]
    assert body["chosen"][0]["rank"] == 1 and body["chosen"][0]["score"] == 79.0
    listed = s.client.get("/leases").get_json()["leases"]
    assert [x["id"] for x in listed] == [body["lease"]["id"]]
    assert listed[0]["requester"] == "127.0.0.1"


def test_advisory_answers_claim_nothing() -> None:
    s = idle_box(1)
    resp = s.client.get("/choose?lease=0&format=env")
    assert "X-GPU-Lease" not in resp.headers
    assert "GPU_LEASE" not in resp.text
    assert s.client.get("/choose").status_code == 200


def test_release_renew_expiry() -> None:
    s = idle_box(1)
    lease = s.client.get("/choose?lease=30s").headers["X-GPU-Lease"]
    s.clock.advance(20)
    renewed = s.client.post(f"/leases/{lease}/renew?ttl=30s").get_json()
    assert renewed["expires_at"] == s.clock.time() + 30
    s.clock.advance(25)
    s.sample()
    assert s.client.get("/choose").status_code == 503  # still held after the renewal
    s.clock.advance(10)  # now expired
    s.sample()
    assert s.client.get("/choose?lease=0").status_code == 200
    gone = s.client.delete(f"/leases/{lease}")
    assert gone.status_code == 404
    assert gone.get_json()["error"]["code"] == "unknown_lease"
    assert s.client.post("/leases/nope/renew").status_code == 404


def test_lease_ends_when_the_claimants_work_arrives(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4100, ppid=900)  # the simulator's first process on GPU 1
    s = idle_box(2, proc_root=str(tmp_path))
    lease = s.client.get("/choose?n=2&format=json").get_json()["lease"]["id"]
    s.clock.advance(2)
    s.sim.gpus[1].load = Load("constant", memory_used_ratio=0.5, processes=1)
    s.sample()
    held = s.client.get("/leases").get_json()["leases"]
    assert held[0]["id"] == lease and held[0]["gpus"] == [s.sim.gpus[0].uuid]
    assert (
        s.registry.get_sample_value("gpu_exporter_lease_gpus_released_total", {"reason": "arrived"})
        == 1
    )
    assert s.value("gpu_leased", 0) == 1 and s.value("gpu_leased", 1) == 0


def test_memory_rises_alone_never_end_a_lease(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4000, ppid=900)
    s = build_stack(
        sim_of(SimGpu(0, A100, Load("constant", memory_used_ratio=0.01, processes=1))),
        proc_root=str(tmp_path),
    )
    s.sample()
    lease = s.client.get("/choose?max_util=100%&max_mem_used=100%").headers["X-GPU-Lease"]
    for ratio in (0.3, 0.6, 0.9):  # the process there at claim time grows …
        s.clock.advance(1)
        s.sim.gpus[0].load = Load("constant", memory_used_ratio=ratio, processes=1)
        s.sample()
    s.clock.advance(1)  # … and a process in another container takes memory, invisibly
    s.sim.gpus[0].load = Load("hidden", memory_used_ratio=0.95)
    s.sample()
    assert [x["id"] for x in s.client.get("/leases").get_json()["leases"]] == [lease_id_of(lease)]


def test_lost_gpu_is_dropped_from_its_lease() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("idle")),
            faults=[Fault("*", "GPU_IS_LOST", gpu=0, after_seconds=5)],
        )
    )
    s.sample()
    s.client.get("/choose")
    s.clock.advance(6)
    s.sample()
    assert s.client.get("/leases").get_json()["leases"] == []
    assert (
        s.registry.get_sample_value("gpu_exporter_lease_gpus_released_total", {"reason": "down"})
        == 1
    )


def test_limits_are_429(tmp_path: Path) -> None:
    clock = FakeClock()
    s = idle_box(4, clock=clock, max_lease_seconds=600, max_gpus_per_requester=2)
    too_long = s.client.get("/choose?lease=2h&format=json")
    assert too_long.status_code == 429
    assert too_long.get_json()["error"]["code"] == "lease_too_long"
    assert s.client.get("/choose?n=2").status_code == 200
    over = s.client.get("/choose", headers={"Accept": "application/json"})
    assert over.status_code == 429
    assert over.get_json()["error"] == {
        "code": "too_many_gpus",
        "message": "127.0.0.1 holds 2 GPUs in leases; 1 more would exceed the limit of 2 per requester",
        "param": "n",
    }
    assert s.client.get("/choose?lease=0").status_code == 200  # advice is never limited


def test_leases_survive_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "leases.json"
    clock = FakeClock()
    s = idle_box(2, clock=clock, state_dir=str(tmp_path))
    first = s.client.get("/choose").text
    assert json.loads(state.read_text())["leases"][0]["gpus"] == [first.strip()]
    restarted = idle_box(2, clock=clock, state_dir=str(tmp_path))
    assert restarted.client.get("/choose").text != first  # not re-issued
    assert restarted.client.get("/choose").status_code == 503


def test_corrupt_state_file_is_set_aside(tmp_path: Path) -> None:
    state = tmp_path / "leases.json"
    state.write_text("{not json")
    table = LeaseTable(FakeClock(), state_file=state)
    assert table.active() == ()
    assert (tmp_path / "leases.corrupt").read_text() == "{not json"


def test_wait_until_a_gpu_is_released() -> None:
    s = idle_box(1)
    held = s.client.get("/choose").headers["X-GPU-Lease"]
    got: list[tuple[int, str]] = []
    t = threading.Thread(target=lambda: got.append(_get(s, "/choose?wait=10m")))
    t.start()
    _wait_for_queue(s, 1)
    s.client.delete(f"/leases/{held}")
    t.join(5)
    assert got == [(200, s.sim.gpus[0].uuid + "\n")]


def test_wait_gives_up_at_the_deadline_on_the_injected_clock() -> None:
    s = idle_box(1)
    s.client.get("/choose")
    got: list[tuple[int, str]] = []
    t = threading.Thread(target=lambda: got.append(_get(s, "/choose?wait=30s")))
    t.start()
    _wait_for_queue(s, 1)
    s.clock.advance(31)
    s.sample()  # keeps the snapshot fresh on the fake clock; the lease (60 s) still holds
    t.join(5)
    assert got[0][0] == 503 and got[0][1].startswith("error: 0 of 1 GPU qualifies")


def test_waiters_are_served_first_come_first_served() -> None:
    s = idle_box(2)
    a = s.client.get("/choose").headers["X-GPU-Lease"]
    b = s.client.get("/choose").headers["X-GPU-Lease"]
    results: dict[str, tuple[int, str]] = {}
    big = threading.Thread(target=lambda: results.update(big=_get(s, "/choose?n=2&wait=10m")))
    big.start()
    _wait_for_queue(s, 1)
    small = threading.Thread(target=lambda: results.update(small=_get(s, "/choose?n=1&wait=10m")))
    small.start()
    _wait_for_queue(s, 2)
    s.client.delete(f"/leases/{a}")  # one GPU free: the n=2 waiter is first and keeps it
    assert "small" not in results
    s.client.delete(f"/leases/{b}")
    big.join(5)
    assert results["big"][0] == 200 and len(results["big"][1].split(",")) == 2
    s.clock.advance(61)  # the n=2 lease expires; the n=1 waiter is next
    s.sample()
    small.join(5)
    assert results["small"][0] == 200


def test_idle_for_uses_the_history() -> None:
    s = build_stack(sim_of(SimGpu(0, A100, Load("idle")), SimGpu(1, A100, Load("busy"))))
    for _ in range(20):
        s.sample()
        s.clock.advance(1)
    s.sim.gpus[1].load = Load("idle")  # the job on GPU 1 just ended
    s.sample()
    body = s.client.get("/choose?n=2&idle_for=10s&max_util=0.1&format=json&lease=0").get_json()
    assert body["error"]["code"] == "not_enough_gpus"
    assert "gpu 1: 1 s ago: utilization 0.97 > max_util 0.10" in body["error"]["message"]
    assert s.client.get("/choose?idle_for=10s&max_util=0.1&format=index&lease=0").text == "0\n"
    short = s.client.get("/choose?idle_for=60s&format=json&lease=0").get_json()["error"]["message"]
    assert "only 20 s of history for idle_for 60 s" in short


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("wait=2h", "wait: at most 3600 s, got '2h'"),
        ("lease=soon", "lease: expected a duration such as 30s, 10m or 1h, got 'soon'"),
        (
            "sort=random",
            "sort must be one of free, free_ratio, util, power, pack, sm_active, got 'random'",
        ),
        (
            "max_procs=-1",
            "max_procs must be a whole number from 0 to 4194304 (0 = no processes), got '-1'",
        ),
        ("include=x", "include: 'x' is not an NVML index, a UUID (GPU-…) or a PCI bus id"),
    ],
)
def test_new_parameters_are_validated(query: str, message: str) -> None:
    resp = idle_box(1).client.get(f"/choose?{query}")
    assert (resp.status_code, resp.text) == (400, f"error: {message}\n")


def test_sort_strategies() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("constant", utilization=0.0, memory_used_ratio=0.6)),
            SimGpu(1, A100, Load("constant", utilization=0.5, memory_used_ratio=0.1)),
            SimGpu(2, A100, Load("constant", utilization=0.2, memory_used_ratio=0.3)),
        )
    )
    s.sample()
    order = {
        # GPU 0 holds 60 % of its memory: over the default max_mem_used, but here the order
        # is the point, not the filter.
        sort: s.client.get(f"/choose?n=3&format=index&lease=0&max_mem_used=1&sort={sort}").text
        for sort in ("free", "free_ratio", "util", "power", "pack")
    }
    assert order == {
        "free": "1,2,0\n",
        "free_ratio": "1,2,0\n",
        "util": "0,2,1\n",
        "power": "0,2,1\n",
        "pack": "0,2,1\n",
    }


@contextmanager
def notifications(table: LeaseTable) -> Iterator[list[int]]:
    """Every time the table tells its waiters of a change while the block runs."""
    woken: list[int] = []
    before = table.on_change

    def counting() -> None:
        woken.append(1)
        before()

    table.on_change = counting
    try:
        yield woken
    finally:
        table.on_change = before


def test_scrapes_and_listings_never_write_the_state_file_or_wake_waiters(tmp_path: Path) -> None:
    s = idle_box(2, state_dir=str(tmp_path))
    state = tmp_path / "leases.json"
    assert s.client.get("/choose?lease=30s").status_code == 200
    s.clock.advance(31)  # the lease has expired; no sample has pruned it yet
    before = (state.stat().st_mtime_ns, state.read_bytes())
    with notifications(s.leases) as woken:
        assert s.client.get("/metrics").status_code == 200
        assert s.client.get("/").status_code == 200
        assert s.client.get("/leases").get_json() == {"leases": []}  # expired: not shown
        assert s.value("gpu_leased", 0) == 0 and s.value("gpu_leased", 1) == 0
    assert woken == []
    assert (state.stat().st_mtime_ns, state.read_bytes()) == before
    with notifications(s.leases) as woken:
        s.sample()  # the next sample prunes: saved, and waiters woken
    assert woken and json.loads(state.read_text())["leases"] == []


def test_reads_show_an_arrived_gpu_as_free_without_pruning(tmp_path: Path) -> None:
    s = idle_box(2, state_dir=str(tmp_path))
    state = tmp_path / "leases.json"
    lease = s.client.get("/choose?n=2&format=json").get_json()["lease"]["id"]
    s.clock.advance(2)
    sampled = s.cache.get()  # GPU 1 now runs the claimant's process (not yet published)
    arrived = replace(
        sampled,
        taken_at_seconds=s.clock.time(),
        gpus=tuple(
            replace(g, compute_processes=1, processes=(ProcessSample(777, 2**30, ancestors=()),))
            if g.index == 1
            else g
            for g in sampled.gpus
        ),
    )
    before = (state.stat().st_mtime_ns, state.read_bytes())
    with notifications(s.leases) as woken:
        assert set(s.leases.holders(arrived)) == {s.sim.gpus[0].uuid}
        assert s.leases.active(arrived)[0].uuids == (s.sim.gpus[0].uuid,)
        assert len(s.leases.get(lease).gpus) == 2
        assert s.leases.dropped == {}
    assert woken == []
    assert (state.stat().st_mtime_ns, state.read_bytes()) == before
    with notifications(s.leases) as woken:
        s.leases.prune(arrived)
    assert woken and s.leases.dropped == {"arrived": 1}
    assert json.loads(state.read_text())["leases"][0]["gpus"] == [s.sim.gpus[0].uuid]


# -- the state machine ----------------------------------------------------------------------


class LeaseMachine(RuleBasedStateMachine):
    """choose / release / renew / expire / GPU lost / GPU busy / restart, against invariants."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = Path(tempfile.mkdtemp())
        self.clock = FakeClock()
        self.stack = idle_box(4, clock=self.clock, state_dir=str(self.dir), max_lease_seconds=120)
        self.lost: set[int] = set()

    def _table(self) -> LeaseTable:
        return LeaseTable(self.clock, state_file=self.dir / "leases.json", max_ttl_seconds=120)

    @rule(n=st.integers(1, 3), ttl=st.sampled_from([0, 5, 30, 120]))
    def choose(self, n: int, ttl: int) -> None:
        snap = self.stack.cache.get()
        try:
            choice, _ = self.stack.leases.claim(snap, n, Filters(), ttl_seconds=ttl, requester="x")
        except NotEnoughGpus:
            return
        assert not {g.index for g in choice.chosen} & self.lost

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        leases = self.stack.leases.active()
        if leases:
            self.stack.leases.release(data.draw(st.sampled_from(leases)).id)

    @rule(data=st.data(), ttl=st.sampled_from([1, 60]))
    def renew(self, data: st.DataObject, ttl: int) -> None:
        leases = self.stack.leases.active()
        if leases:
            self.stack.leases.renew(data.draw(st.sampled_from(leases)).id, ttl)

    @rule(seconds=st.sampled_from([1, 10, 61]))
    def time_passes(self, seconds: int) -> None:
        self.clock.advance(seconds)
        self.stack.sample()

    @rule(gpu=st.integers(0, 3))
    def gpu_lost(self, gpu: int) -> None:
        self.stack.sim.faults.append(Fault("*", "GPU_IS_LOST", gpu=gpu))
        self.lost.add(gpu)
        self.clock.advance(1)
        self.stack.sample()

    @rule(gpu=st.integers(0, 3))
    def gpu_gets_busy(self, gpu: int) -> None:
        self.stack.sim.gpus[gpu].load = Load("busy")
        self.clock.advance(1)
        self.stack.sample()

    @rule()
    def restart(self) -> None:
        self.stack.leases = self._table()
        self.stack.sample()

    @invariant()
    def no_gpu_in_two_leases(self) -> None:
        uuids = [u for lease in self.stack.leases.active() for u in lease.uuids]
        assert len(uuids) == len(set(uuids))

    @invariant()
    def no_lease_outlives_its_ttl(self) -> None:
        assert all(x.expires_at > self.clock.time() for x in self.stack.leases.active())


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_lease_state_machine = LeaseMachine.TestCase


def test_lease_error_carries_status() -> None:
    exc = ApiError(429, "too_many_gpus", "no", "n")
    assert (exc.status, exc.code, exc.param, str(exc)) == (429, "too_many_gpus", "n", "no")


def _get(s: Stack, path: str) -> tuple[int, str]:
    resp = s.app.test_client().get(path)
    return resp.status_code, resp.text


def _wait_for_queue(s: Stack, length: int) -> None:
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if len(s.daemon.services.claimer.waiting()) >= length:
            return
        time.sleep(0.01)
    raise AssertionError("waiter did not queue")
