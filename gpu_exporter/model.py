"""The snapshot: what one sample of every GPU on this host looked like.

Frozen, slotted dataclasses with the unit in every field name. ``None`` means the value is
absent (this GPU cannot report it, or the call failed this time) — never a stand-in 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CLOCKS = ("graphics", "sm", "memory", "video")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment. ``index`` is the NVML index (PCI order), not CUDA's."""

    index: int
    uuid: str  # "GPU-…"; "" when a GPU was lost before its UUID could be read
    up: bool  # False: the GPU did not answer; every value field below is then None
    name: str | None = None
    pci_bus_id: str | None = None
    error: str | None = None  # why up is False, or the last failed field this sample
    down_reason: str | None = None  # when up is False: "lost", "timeout" or "error"
    last_seen_seconds: float | None = None  # wall clock of the last sample it answered

    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None  # excludes reserved, as nvidia-smi ≥ 510
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_ratio: float | None = None  # 0–1: time a kernel was running
    memory_utilization_ratio: float | None = None  # 0–1: time memory was read or written
    power_draw_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None  # since the driver loaded; only ever grows
    temperature_celsius: float | None = None
    fan_speed_ratio: float | None = None
    clock_graphics_hz: float | None = None
    clock_sm_hz: float | None = None
    clock_memory_hz: float | None = None
    clock_video_hz: float | None = None
    compute_processes: int | None = None  # None when the process list is unsupported

    def clock_hz(self, clock: str) -> float | None:
        value: float | None = getattr(self, f"clock_{clock}_hz")
        return value

    def to_json(self) -> dict[str, Any]:
        """Every field, absent values as ``null``."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All GPUs of this host from one sampling pass. Replaced whole, never mutated."""

    taken_at_seconds: float  # wall clock (Unix time) when the sample started
    monotonic_seconds: float  # the same moment on the monotonic clock, for ages
    sample_duration_seconds: float
    nvml_up: bool
    simulated: bool
    gpus: tuple[GpuSample, ...] = ()
    nvml_error: str | None = None  # why nvml_up is False
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    # Failed NVML calls since start, by (function, error name); copied in at sample time.
    nvml_errors: tuple[tuple[str, str, int], ...] = field(default=())
    sequence: int = 0  # increases by one with every published snapshot

    def age_seconds(self, monotonic_now: float) -> float:
        return max(0.0, monotonic_now - self.monotonic_seconds)


def initial_snapshot(*, simulated: bool, monotonic_now: float, wall_now: float) -> Snapshot:
    """What the cache holds before the first sample: NVML not (yet) up, no GPUs."""
    return Snapshot(
        taken_at_seconds=wall_now,
        monotonic_seconds=monotonic_now,
        sample_duration_seconds=0.0,
        nvml_up=False,
        simulated=simulated,
        nvml_error="not sampled yet",
    )
