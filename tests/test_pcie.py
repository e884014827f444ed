"""PCIe throughput: its own thread, exact values, never on the main sampling path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.collect.pcie import PcieThroughputSampler
from gpu_exporter.simulate import Load, SimGpu

A100 = "NVIDIA A100-SXM4-80GB"


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def host() -> Stack:
    return build_stack(
        sim_of(
            SimGpu(0, A100, Load("constant", utilization=0.25)),
            SimGpu(1, A100, Load("idle")),
            SimGpu(2, A100, Load("busy"), unsupported=frozenset({"nvmlDeviceGetPcieThroughput"})),
        ),
        pcie_throughput=True,
    )


def test_throughput_values_in_bytes_per_second(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpu_exporter.collect.pcie")
    s = host()
    pcie = s.pcie
    assert pcie is not None
    thread = PcieThroughputSampler(s.nvml, pcie, interval_seconds=0.05)
    thread.start()
    try:
        # At least three passes asked (GPU 2 once per direction, then two GPUs × two
        # directions per pass), and a pass published.
        eventually(
            lambda: (
                s.sim.calls.get("nvmlDeviceGetPcieThroughput", 0) >= 2 + 2 * 2 * 3
                and len(pcie.rates()) == 2
            )
        )
    finally:
        thread.stop()
    st = s.sim.state(0)
    assert st.pcie_tx_kb_per_second == 500_000  # NVML's unit: KB/s
    assert s.value("gpu_pcie_throughput_bytes_per_second", 0, direction="tx") == 500_000 * 1024
    assert s.value("gpu_pcie_throughput_bytes_per_second", 0, direction="rx") == (
        st.pcie_rx_kb_per_second * 1024
    )
    assert s.value("gpu_pcie_throughput_bytes_per_second", 1, direction="rx") == 0
    # Unsupported: absent, asked once per direction, never again (each ask would answer
    # NOT_SUPPORTED and say so in the log).
    assert s.value("gpu_pcie_throughput_bytes_per_second", 2, direction="tx") is None
    told = [r.getMessage() for r in caplog.records if "does not report PCIe" in r.getMessage()]
    assert told == [
        f"GPU {s.sim.gpus[2].uuid} does not report PCIe {direction} throughput; not asking again"
        for direction in ("tx", "rx")
    ]
    assert not thread.is_alive()
    assert s.sim.init_count == 0  # its NVML reference was given back


def test_the_main_sampler_never_measures_pcie_and_is_not_held_up_by_it() -> None:
    s = host()
    assert s.pcie is not None
    for _ in range(3):
        s.sample()
    assert "nvmlDeviceGetPcieThroughput" not in s.sim.calls
    # Now with the driver taking a whole second per measurement on the other thread.
    s.sim.pcie_sample_seconds = 1.0
    thread = PcieThroughputSampler(s.nvml, s.pcie, interval_seconds=0.05)
    thread.start()
    try:
        eventually(lambda: s.sim.calls.get("nvmlDeviceGetPcieThroughput", 0) >= 1)
        started = time.monotonic()
        s.sample()  # while the PCIe thread sits inside its 1 s call
        assert time.monotonic() - started < 0.9
    finally:
        s.sim.pcie_sample_seconds = 0.0
        thread.stop()
    assert s.cache.get().gpus[0].up
