"""What a simulated GPU reports at one moment: a pure function of the GPU and the time.

:func:`gpu_state` and :func:`mig_state` give the exact values, in NVML's own units, so a test
with a fake clock can compare the exporter's metrics with them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_exporter import nvml
from gpu_exporter.readings import CLOCKS_EVENT_REASON_BITS
from gpu_exporter.simulate.scenario import SimGpu


@dataclass(frozen=True, slots=True)
class GpuState:
    """Exact values a simulated GPU reports at one moment, in NVML's own units."""

    memory_total: int  # bytes
    memory_reserved: int
    memory_used: int
    memory_free: int
    utilization_gpu: int  # percent
    utilization_memory: int
    power_usage_mw: int
    power_limit_mw: int
    temperature_c: int
    fan_percent: int
    clocks_mhz: dict[int, int]
    processes: tuple[tuple[int, int], ...]  # (pid, used bytes)
    clocks_event_reasons: int = 0  # bitmask
    performance_state: int = 0
    pcie_generation: int = 4  # current
    pcie_width: int = 16  # current
    pcie_tx_kb_per_second: int = 0
    pcie_rx_kb_per_second: int = 0
    encoder_percent: int = 0
    decoder_percent: int = 0


@dataclass(frozen=True, slots=True)
class MigState:
    """Exact values one simulated MIG device reports."""

    uuid: str
    name: str
    profile: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int
    memory_used: int
    memory_free: int
    processes: tuple[tuple[int, int], ...]


def _int(v: float) -> int:
    return round(v)


def gpu_state(gpu: SimGpu, t: float) -> GpuState:
    """What ``gpu`` reports ``t`` seconds into the simulation."""
    index = gpu.index
    m = gpu.model
    util, mem_ratio, nprocs = gpu.load.at(t, phase=index / 8)
    usable = m.memory_total_bytes - m.memory_reserved_bytes
    used = _int(usable * mem_ratio)
    processes: tuple[tuple[int, int], ...]
    if gpu.mig:  # the whole card is the sum of its MIG devices
        migs = [mig_state(gpu, slot, t) for slot in range(len(gpu.mig))]
        used = sum(x.memory_used for x in migs)
        processes = tuple(p for x in migs for p in x.processes)
    else:
        hidden = gpu.load.hidden_processes if gpu.load.kind == "constant" else 0
        per_proc = used // (nprocs + hidden) if nprocs + hidden else 0
        pids = gpu.load.pids
        processes = tuple(
            (pids[k] if k < len(pids) else 4000 + 100 * index + k, per_proc) for k in range(nprocs)
        )
    busy = util > 0
    sm = _int(m.max_sm_clock_mhz * min(1.0, 0.5 + util)) if busy else 210
    reasons = 0
    if not busy:
        reasons |= CLOCKS_EVENT_REASON_BITS["gpu_idle"]
    elif util >= 0.9:
        reasons |= CLOCKS_EVENT_REASON_BITS["sw_power_cap"]
    for reason in gpu.health.clocks_event_reasons:
        reasons |= CLOCKS_EVENT_REASON_BITS[reason]
    return GpuState(
        memory_total=m.memory_total_bytes,
        memory_reserved=m.memory_reserved_bytes,
        memory_used=used,
        memory_free=usable - used,
        utilization_gpu=_int(util * 100),
        utilization_memory=_int(util * 60),
        power_usage_mw=_int(
            1000 * (m.idle_power_watts + (m.power_limit_watts - m.idle_power_watts) * 0.9 * util)
        ),
        power_limit_mw=_int(m.power_limit_watts * 1000),
        temperature_c=_int(31 + 50 * util),
        fan_percent=_int(30 + 50 * util),
        clocks_mhz={
            nvml.CLOCK_TYPES["graphics"]: sm,
            nvml.CLOCK_TYPES["sm"]: sm,
            nvml.CLOCK_TYPES["memory"]: m.max_memory_clock_mhz if busy else 405,
            nvml.CLOCK_TYPES["video"]: _int(sm * 0.85),
        },
        processes=processes,
        clocks_event_reasons=reasons,
        performance_state=0 if busy else 8,
        # Idle links drop to generation 1 to save power, as real cards do.
        pcie_generation=m.pcie_generation if busy else 1,
        pcie_width=gpu.health.pcie_link_width or m.pcie_width,
        pcie_tx_kb_per_second=_int(util * 2_000_000),
        pcie_rx_kb_per_second=_int(util * 6_000_000),
        encoder_percent=0,
        decoder_percent=_int(util * 10),
    )


def mig_state(gpu: SimGpu, slot: int, t: float) -> MigState:
    """What MIG device ``slot`` of ``gpu`` reports ``t`` seconds into the simulation."""
    index = gpu.index
    profile = gpu.mig[slot]
    total = gpu.model.mig_profiles[profile]
    _util, mem_ratio, nprocs = gpu.load.at(t, phase=(index + slot) / 8)
    used = _int(total * mem_ratio)
    per_proc = used // nprocs if nprocs else 0
    return MigState(
        uuid=gpu.mig_uuid(slot),
        name=f"{gpu.model_name} MIG {profile}",
        profile=profile,
        gpu_instance_id=slot + 1,
        compute_instance_id=0,
        memory_total=total,
        memory_used=used,
        memory_free=total - used,
        processes=tuple((5000 + 100 * index + 10 * slot + k, per_proc) for k in range(nprocs)),
    )


# -- GPM: what nvmlGpmMetricsGet answers for one sample, by NVML_GPM_METRIC_* id ----------------
_GPM_IDS = {name: metric_id for name, (metric_id, _scale) in nvml.GPM_METRICS.items()}


def gpm_values(gpu: SimGpu, t: float, gpu_instance_id: int | None = None) -> dict[int, float]:
    """GPM's figures (percent, MiB/s) of ``gpu`` (or one MIG GPU instance: SM, occupancy,
    tensor and DRAM only) at ``t``. SM activity grows with the square of utilization: a card
    running one small kernel now and then reads "12 % utilized" while its SMs idle (the
    "light" load), a saturated one is about as active as it is utilized."""
    if gpu_instance_id is None:
        util = gpu.load.at(t, phase=gpu.index / 8)[0]
    else:
        util = gpu.load.at(t, phase=(gpu.index + gpu_instance_id - 1) / 8)[0]
    sm = round(95 * util * util, 2)
    out = {
        _GPM_IDS["sm_active_ratio"]: sm,
        _GPM_IDS["sm_occupancy_ratio"]: round(sm * 0.15, 2),
        _GPM_IDS["tensor_active_ratio"]: round(sm * 0.95, 2),
        _GPM_IDS["dram_active_ratio"]: round(25 * util, 2),
    }
    if gpu_instance_id is not None:
        return out
    s = gpu_state(gpu, t)
    return out | {
        _GPM_IDS["graphics_active_ratio"]: float(s.utilization_gpu),
        _GPM_IDS["tensor_hmma_active_ratio"]: round(sm * 0.95, 2),
        _GPM_IDS["tensor_imma_active_ratio"]: 0.0,
        _GPM_IDS["tensor_dfma_active_ratio"]: 0.0,
        _GPM_IDS["fp64_active_ratio"]: 0.0,
        _GPM_IDS["fp32_active_ratio"]: round(sm * 0.02, 2),
        _GPM_IDS["fp16_active_ratio"]: 0.0,
        _GPM_IDS["pcie_transmit_bytes_per_second"]: round(s.pcie_tx_kb_per_second / 1024, 1),
        _GPM_IDS["pcie_receive_bytes_per_second"]: round(s.pcie_rx_kb_per_second / 1024, 1),
        _GPM_IDS["nvlink_transmit_bytes_per_second"]: round(util * 10_000, 1),
        _GPM_IDS["nvlink_receive_bytes_per_second"]: round(util * 10_000, 1),
    }
