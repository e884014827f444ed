"""The Xid listener: events arriving while the exporter runs, repeats, clean stops, re-init."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from conftest import FakeClock, Stack, build_stack, sim_of
from gpu_exporter.collect.xid import XidListener
from gpu_exporter.simulate import Fault, Load, Scenario, SimGpu, SimulatedNvml

A100 = "NVIDIA A100-SXM4-80GB"
GTX = "NVIDIA GeForce GTX 1080"  # reports no Xid events in the simulator


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll: generous bounds, the test machine is shared."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def running() -> Iterator[tuple[Stack, XidListener]]:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("busy")),
            SimGpu(1, A100, Load("idle")),
            SimGpu(2, GTX, Load("idle")),
            SimGpu(3, A100, Load("idle"), unsupported=frozenset({"nvmlDeviceRegisterEvents"})),
        )
    )
    s.sample()  # the sampler holds its own NVML reference
    listener = XidListener(s.nvml, s.xids, clock=s.clock, timeout_ms=50)
    listener.start()
    try:
        eventually(lambda: bool(listener.listening))
        yield s, listener
    finally:
        listener.stop()


def test_xids_are_counted_with_repeats(running: tuple[Stack, XidListener]) -> None:
    s, listener = running
    uuids = [g.uuid for g in s.sim.gpus]
    # Only GPUs that support Xid events are registered; the others are skipped, not fatal.
    assert listener.listening == (uuids[0], uuids[1])
    assert s.sim.inject_xid(1, 79) == 1
    s.sim.inject_xid(1, 79)
    s.sim.inject_xid(1, 48)
    eventually(lambda: s.xids.total() == 3)  # stamped when received
    s.clock.advance(5)
    s.sim.inject_xid(0, 13)
    assert s.sim.inject_xid(2, 79) == 0  # nobody listens on the GeForce
    eventually(lambda: s.xids.total() == 4)
    assert s.value("gpu_xid_errors_total", 1, xid="79") == 2
    assert s.value("gpu_xid_errors_total", 1, xid="48") == 1
    assert s.value("gpu_xid_errors_total", 0, xid="13") == 1
    assert s.value("gpu_xid_errors_total", 2, xid="79") is None
    assert s.value("gpu_last_xid_timestamp_seconds", 0) == s.clock.time()
    assert s.value("gpu_last_xid_timestamp_seconds", 1) == s.clock.time() - 5
    assert s.value("gpu_last_xid_timestamp_seconds", 2) is None
    gpus = s.client.get("/gpus").get_json()["gpus"]
    assert gpus[1]["xid_errors"] == {"79": 2, "48": 1}
    assert gpus[2]["xid_errors"] == {}


def test_stop_is_prompt_and_frees_everything(running: tuple[Stack, XidListener]) -> None:
    s, listener = running
    assert s.sim.init_count == 2  # the sampler's reference and the listener's
    assert len(s.sim.event_sets) == 1
    started = time.monotonic()
    listener.stop()
    assert not listener.is_alive()
    assert time.monotonic() - started < 5.0  # one 50 ms wait, plus a busy machine
    assert s.sim.event_sets == []
    assert s.sim.init_count == 1  # the sampler still has NVML


def test_counts_survive_nvml_going_away(running: tuple[Stack, XidListener]) -> None:
    s, _ = running
    s.sim.inject_xid(0, 79)
    eventually(lambda: s.xids.total() == 1)
    before = s.sim.calls.get("nvmlEventSetCreate", 0)
    fault = Fault("nvmlEventSetWait_v2", "DRIVER_NOT_LOADED")
    s.sim.faults.append(fault)
    eventually(lambda: s.sim.event_sets == [])  # torn down and shut down
    s.sim.faults.remove(fault)
    # Re-initialised after the 1 s backoff and registered again.
    eventually(lambda: s.sim.calls.get("nvmlEventSetCreate", 0) > before and s.sim.event_sets != [])
    eventually(lambda: s.sim.inject_xid(0, 79) == 1)
    eventually(lambda: s.xids.total() == 2)
    assert s.value("gpu_xid_errors_total", 0, xid="79") == 2  # not reset


def test_no_xid_support_anywhere_is_not_an_error() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, GTX, Load("idle")),
            faults=[Fault("nvmlDeviceGetSupportedEventTypes", "FUNCTION_NOT_FOUND")],
        )
    )
    listener = XidListener(s.nvml, s.xids, clock=s.clock, timeout_ms=50)
    listener.start()
    try:
        eventually(lambda: s.sim.calls.get("nvmlDeviceGetSupportedEventTypes", 0) >= 1)
        assert listener.listening == ()
        assert listener.is_alive()
    finally:
        listener.stop()
    assert not listener.is_alive()
    assert s.nvml.error_counts() == {}  # unsupported is not a failure


def test_scenario_xids_follow_the_simulated_clock() -> None:
    clock = FakeClock()
    s = build_stack(
        lambda c: SimulatedNvml.of(
            Scenario.from_table(
                {
                    "gpus": [{"model": A100}, {"model": A100}],
                    "xid_events": [
                        {"gpu": 1, "xid": 79, "after_seconds": 10},
                        {"gpu": 0, "xid": 31, "after_seconds": 5, "every_seconds": 5},
                    ],
                }
            ),
            clock=c.monotonic,
        ),
        clock=clock,
    )
    listener = XidListener(s.nvml, s.xids, clock=clock, timeout_ms=20)
    listener.start()
    try:
        eventually(lambda: len(listener.listening) == 2)
        time.sleep(0.1)
        assert s.xids.total() == 0  # nothing is due at t=0
        clock.advance(20)  # 79 once at 10 s; 31 at 5, 10, 15 and 20 s
        eventually(lambda: s.xids.total() == 5)
        assert s.value("gpu_xid_errors_total", 1, xid="79") == 1
        assert s.value("gpu_xid_errors_total", 0, xid="31") == 4
    finally:
        listener.stop()


def test_scenario_xid_events_are_checked() -> None:
    with pytest.raises(ValueError, match="xid_events: no GPU 3"):
        SimulatedNvml.of(
            Scenario.from_table({"gpus": [{}], "xid_events": [{"gpu": 3, "xid": 79}]}),
            clock=FakeClock().monotonic,
        )


def test_a_library_without_event_sets_leaves_the_listener_idle() -> None:
    """An old driver (or the fake libnvidia-ml) lacks nvmlEventSetCreate: no retry loop."""
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("idle")),
            faults=[Fault("nvmlEventSetCreate", "FUNCTION_NOT_FOUND")],
        )
    )
    listener = XidListener(s.nvml, s.xids, clock=s.clock, timeout_ms=20)
    listener.start()
    try:
        eventually(lambda: s.sim.calls.get("nvmlEventSetCreate", 0) == 1)
        time.sleep(1.5)  # longer than the first re-initialisation backoff
        assert listener.is_alive() and listener.listening == ()
        assert s.sim.calls["nvmlInit"] == 1 and s.sim.calls["nvmlEventSetCreate"] == 1
    finally:
        listener.stop()
    assert s.sim.init_count == 0
