"""The sampler: per-GPU and per-field isolation, init backoff, recovery, call counts."""

from __future__ import annotations

import logging
import threading

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.simulate import Fault, Load, SimGpu, SimulatedNvml

A100 = "NVIDIA A100-SXM4-80GB"


def three_gpus(*faults: Fault) -> Stack:
    return build_stack(
        sim_of(
            SimGpu(0, A100, Load("busy")),
            SimGpu(1, A100, Load("idle")),
            SimGpu(2, A100, Load("constant", utilization=0.3, memory_used_ratio=0.5, processes=2)),
            faults=list(faults),
        )
    )


def test_values_match_the_simulated_state() -> None:
    s = three_gpus()
    s.sample()
    snap = s.cache.get()
    assert (
        snap.nvml_up and snap.driver_version == "550.54.15" and snap.cuda_driver_version == "12.4"
    )
    for gpu in snap.gpus:
        st = s.sim.state(gpu.index)
        assert gpu.up and gpu.error is None
        assert gpu.uuid == s.sim.gpus[gpu.index].uuid
        assert gpu.name == A100
        assert gpu.memory_total_bytes == st.memory_total
        assert gpu.memory_used_bytes == st.memory_used
        assert gpu.memory_free_bytes == st.memory_free
        assert gpu.memory_reserved_bytes == st.memory_reserved
        assert gpu.utilization_ratio == st.utilization_gpu / 100
        assert gpu.power_draw_watts == st.power_usage_mw / 1000
        assert gpu.temperature_celsius == st.temperature_c
        assert gpu.compute_processes == len(st.processes)
        assert gpu.fan_speed_ratio is None  # A100s are passively cooled: NOT_SUPPORTED
    assert snap.gpus[2].compute_processes == 2
    assert snap.gpus[2].utilization_ratio == 0.3


def test_one_lost_gpu_leaves_the_others() -> None:
    s = three_gpus(Fault("*", "GPU_IS_LOST", gpu=1, after_seconds=5))
    s.sample()
    uuid1 = s.sim.gpus[1].uuid
    s.clock.advance(10)
    s.sample()
    gpus = s.cache.get().gpus
    assert [g.up for g in gpus] == [True, False, True]
    lost = gpus[1]
    assert lost.uuid == uuid1  # identity remembered from before it was lost
    assert "GPU_IS_LOST" in (lost.error or "")
    assert lost.memory_used_bytes is None and lost.utilization_ratio is None
    assert gpus[0].memory_used_bytes is not None and gpus[2].power_draw_watts is not None


def test_gpu_lost_mid_sample_drops_values_already_read() -> None:
    s = three_gpus(Fault("nvmlDeviceGetPowerUsage", "GPU_IS_LOST", gpu=0))
    s.sample()
    g = s.cache.get().gpus[0]
    assert not g.up
    assert g.memory_used_bytes is None  # read before the loss, but not kept
    assert g.name == A100


def test_gpu_lost_before_its_uuid_was_ever_read() -> None:
    s = three_gpus(Fault("nvmlDeviceGetHandleByIndex", "UNKNOWN", gpu=2))
    s.sample()
    g = s.cache.get().gpus[2]
    assert not g.up and g.uuid == "" and "UNKNOWN" in (g.error or "")


def test_a_failing_field_is_absent_and_the_gpu_stays_up() -> None:
    s = three_gpus(Fault("nvmlDeviceGetPowerUsage", "UNKNOWN", gpu=2))
    s.sample()
    s.sample()
    g = s.cache.get().gpus[2]
    assert g.up
    assert g.power_draw_watts is None
    assert g.power_limit_watts == 400.0
    # Power is an entry of the fast field-value batch: the error names the field.
    function = "nvmlDeviceGetFieldValues(NVML_FI_DEV_POWER_INSTANT)"
    assert function in (g.error or "")
    assert (function, "UNKNOWN", 2) in s.cache.get().nvml_errors


def test_unsupported_fields_are_not_asked_again() -> None:
    s = three_gpus()
    for _ in range(5):
        s.sample()
    # A100: no fan. Asked once per GPU in the first sample, never again.
    assert s.sim.calls["nvmlDeviceGetFanSpeed"] == 3
    assert s.sim.calls["nvmlDeviceGetUtilizationRates"] == 15
    # Identity and the handle are read once per GPU, not on every sample.
    assert s.sim.calls["nvmlDeviceGetUUID"] == 3
    assert s.sim.calls["nvmlDeviceGetHandleByIndex"] == 3


def test_unsupported_fields_are_logged_once_per_gpu_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A card lacking several fields says so in one INFO line, not one line per field."""
    caplog.set_level(logging.INFO, logger="gpu_exporter.collect.fields")
    s = three_gpus()
    for _ in range(3):
        s.sample()
    lines = [r.getMessage() for r in caplog.records if r.name == "gpu_exporter.collect.fields"]
    assert len(lines) == 3, lines  # one per GPU, in the first sample only
    uuid = s.sim.gpus[0].uuid
    (line,) = [line for line in lines if uuid in line]
    assert line.startswith(f"GPU {uuid} cannot report fan_speed, ")
    assert "retired_pages_" in line and line.endswith("; not asking again")


def test_nvml_calls_per_sample_are_exactly_the_supported_fields() -> None:
    s = three_gpus()
    s.sample()
    before = sum(s.sim.calls.values())
    s.sample()
    per_sample = sum(s.sim.calls.values()) - before
    # count + per GPU the fast calls: memory, utilization, the fast field-value batch
    # (power, temperature, memory temperature), graphics and SM clocks, processes, clocks
    # event reasons = 7 (issue 31: 13 before), and the processes' utilization where there
    # are any (GPUs 0 and 2). Not again within --slow-interval: the slow batch and getters;
    # not again at all: the handle, identity, the static values, and whether the card has
    # GPM (an A100 has not: no GPM call after that).
    assert per_sample == 1 + 3 * 7 + 2
    assert s.sim.calls["nvmlDeviceGetFieldValues"] == 3 * (2 + 1)  # fast and slow, then fast


def test_nvml_missing_at_start_then_appearing() -> None:
    s = build_stack(
        lambda clock: SimulatedNvml(
            [SimGpu(0, A100, Load("idle"))],
            faults=[Fault("nvmlInit", "LIBRARY_NOT_FOUND", for_seconds=20)],
            clock=clock.monotonic,
        )
    )
    attempts_at = []
    for _ in range(40):
        before = s.sim.calls.get("nvmlInit", 0)
        s.sample()
        if s.sim.calls.get("nvmlInit", 0) > before:
            attempts_at.append(round(s.sim.elapsed()))
        snap = s.cache.get()
        if snap.nvml_up:
            break
        assert snap.gpus == ()  # never invents GPUs
        assert "LIBRARY_NOT_FOUND" in (snap.nvml_error or "")
        s.clock.advance(1)
    # Backoff: 1, 2, 4, 8, 16 s between attempts; the one at t=31 succeeds.
    assert attempts_at == [0, 1, 3, 7, 15, 31]
    assert s.cache.get().nvml_up
    assert len(s.cache.get().gpus) == 1


def test_backoff_is_capped_at_five_minutes() -> None:
    s = build_stack(
        lambda clock: SimulatedNvml(
            [], faults=[Fault("nvmlInit", "DRIVER_NOT_LOADED")], clock=clock.monotonic
        )
    )
    gaps = []
    last = None
    for _ in range(3000):
        before = s.sim.calls.get("nvmlInit", 0)
        s.sample()
        if s.sim.calls.get("nvmlInit", 0) > before:
            now = s.sim.elapsed()
            if last is not None:
                gaps.append(now - last)
            last = now
        s.clock.advance(1)
    assert max(gaps) == 300
    assert gaps[-1] == 300


def test_driver_going_away_mid_run_reinitialises() -> None:
    s = three_gpus(
        Fault("nvmlDeviceGetCount", "LIB_RM_VERSION_MISMATCH", after_seconds=5, for_seconds=3)
    )
    s.sample()
    assert s.cache.get().nvml_up
    s.clock.advance(5)
    s.sample()
    snap = s.cache.get()
    assert not snap.nvml_up and snap.gpus == ()
    assert "LIB_RM_VERSION_MISMATCH" in (snap.nvml_error or "")
    s.clock.advance(3)  # the fault is over and the 1 s backoff has passed
    s.sample()
    assert s.cache.get().nvml_up
    assert len(s.cache.get().gpus) == 3


def test_snapshots_are_sequenced_and_kept_in_history() -> None:
    s = three_gpus()
    for _ in range(3):
        s.sample()
        s.clock.advance(1)
    history = s.cache.history()
    assert [h.sequence for h in history] == [1, 2, 3]
    assert s.cache.get() is history[-1]
    assert history[1].taken_at_seconds - history[0].taken_at_seconds == 1


def test_wait_for_newer_wakes_on_publish() -> None:
    s = three_gpus()
    s.sample()
    seq = s.cache.get().sequence
    got = []
    t = threading.Thread(target=lambda: got.append(s.cache.wait_for_newer(seq, 5.0)))
    t.start()
    s.sample()
    t.join(5)
    assert got and got[0].sequence == seq + 1


def test_background_thread_samples_and_stops() -> None:
    s = three_gpus()
    s.sampler.interval_seconds = 0.01
    s.sampler.start()
    try:
        s.cache.wait_for_newer(2, 5.0)
    finally:
        s.sampler.stop()
    assert s.cache.get().sequence >= 3
    assert not s.sim.initialised  # NVML shut down on stop


@pytest.mark.parametrize("error", ["GPU_IS_LOST", "UNKNOWN", "RESET_REQUIRED"])
def test_failing_one_gpu_scenarios(error: str) -> None:
    """gpustat GH-125: one bad GPU must not hide the rest."""
    s = three_gpus(Fault("nvmlDeviceGetHandleByIndex", error, gpu=0))
    s.sample()
    gpus = s.cache.get().gpus
    assert not gpus[0].up
    assert gpus[1].up and gpus[2].up
