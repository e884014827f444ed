"""NVLink and memory temperature on the simulator (issue 25's field-value parts): per link
on SXM cards, nothing on PCIe cards, off unless --collect.nvlink; the NVLink counters as
MonotonicCounters keeps them (a driver reset never makes them go backwards)."""

from __future__ import annotations

from conftest import build_stack, sim_of
from gpu_exporter.counters import MonotonicCounters
from gpu_exporter.model import NVLINK_ERRORS
from gpu_exporter.simulate import Load, SimGpu

H100 = "NVIDIA H100 80GB HBM3"  # SXM: 18 NVLinks
A100_PCIE = "NVIDIA A100-PCIE-40GB"  # none
L4 = "NVIDIA L4"  # GDDR: no memory temperature


def gpus() -> tuple[SimGpu, ...]:
    busy = Load("constant", utilization=0.5, memory_used_ratio=0.3)
    return (SimGpu(0, H100, busy), SimGpu(1, A100_PCIE, busy), SimGpu(2, L4, busy))


def test_nvlink_per_link_on_an_sxm_card_and_nothing_on_pcie_cards() -> None:
    s = build_stack(sim_of(*gpus()), collect_disabled=())  # every group on
    s.sample()
    s.clock.advance(30)  # the NVLink counters are slow fields: read again 30 s later
    s.sample()
    h100 = s.cache.get().gpus[0]
    assert h100.nvlink is not None and [n.link for n in h100.nvlink] == list(range(18))
    assert all(n.active for n in h100.nvlink)
    assert s.value("gpu_nvlink_up", 0, link="17") == 1
    sent = s.value("gpu_nvlink_transmit_bytes_total", 0, link="3")
    assert sent is not None and sent > 0  # KiB from NVML, bytes here
    assert sent == h100.nvlink[3].transmit_bytes and sent % 1024 == 0
    for error in NVLINK_ERRORS:
        assert s.value("gpu_nvlink_errors_total", 0, link="0", error=error) == 0
    text = s.client.get("/metrics").get_data(as_text=True)
    per_link = [
        line for line in text.splitlines() if line.startswith("gpu_nvlink_") and "link=" in line
    ]
    assert len(per_link) == 18 * 7  # up, transmit, receive, 4 errors per link; GPU 0 only
    for index in (1, 2):
        assert s.cache.get().gpus[index].nvlink is None
        assert s.value("gpu_exporter_field_supported", index, field="nvlink") == 0
    # memory temperature: the HBM cards report it, beside the core temperature
    assert s.value("gpu_memory_temperature_celsius", 0) == h100.temperature_celsius + 6
    assert s.value("gpu_memory_temperature_celsius", 1) is not None
    assert s.value("gpu_memory_temperature_celsius", 2) is None
    assert s.value("gpu_exporter_field_supported", 2, field="memory_temperature") == 0


def test_nvlink_is_off_by_default_and_asks_nothing() -> None:
    s = build_stack(sim_of(*gpus()))
    s.sample()
    assert s.cache.get().gpus[0].nvlink is None
    assert "nvlink_link_count" not in dict(s.cache.get().gpus[0].fields_supported)
    text = s.client.get("/metrics").get_data(as_text=True)
    assert not [
        line for line in text.splitlines() if line.startswith("gpu_nvlink_") and "link=" in line
    ]
    assert 'field="nvlink' not in text


def test_a_counter_reset_restarts_from_the_new_base() -> None:
    c = MonotonicCounters()
    assert [c.value(("GPU-a", 0, "transmit"), r) for r in (100, 150, 20, 50, 50)] == [
        100,
        150,
        150,
        180,
        180,
    ]
    # each counter on its own: another link, another GPU
    assert c.value(("GPU-a", 1, "transmit"), 7) == 7
    assert c.value(("GPU-b", 0, "transmit"), 3) == 3
