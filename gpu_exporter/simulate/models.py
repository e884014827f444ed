"""The GPU models the simulator knows: memory, power, clocks, and which NVML calls each card
(with the driver a typical host has for it) answers ``NOT_SUPPORTED`` or lacks.

The figures follow the real cards (memory, power limit, clocks, MIG profiles), so a simulated
fleet looks like a real one on the status page and in Grafana.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpu_exporter import nvml

GIB = 1024**3
MIB = 1024**2

_EVENTS_ALL = (
    nvml.EVENT_TYPE_XID | 0x1 | 0x2 | 0x4 | 0x10  # Xid, single/double-bit ECC, P-state, clock
)


@dataclass(frozen=True, slots=True)
class Model:
    """One card: its fixed figures, in the units the field names say."""

    memory_total_bytes: int
    memory_reserved_bytes: int
    power_limit_watts: float
    idle_power_watts: float
    max_sm_clock_mhz: int
    max_memory_clock_mhz: int
    # NVML functions this model answers with NOT_SUPPORTED (datacenter cards have no fan).
    unsupported: frozenset[str] = frozenset()
    # Functions the driver of a typical host for this card lacks: FUNCTION_NOT_FOUND.
    missing: frozenset[str] = frozenset()
    # MIG profiles this card can be split into: name → memory of one such MIG device.
    mig_profiles: Mapping[str, int] = field(default_factory=dict)
    pcie_generation: int = 4
    pcie_width: int = 16
    persistence_mode: bool = True
    # (shutdown, slowdown, memory max, GPU max) in °C
    temperature_thresholds: tuple[int, int, int, int] = (92, 89, 95, 87)
    supported_events: int = _EVENTS_ALL
    # NVLinks (issue 25): an SXM board's; PCIe cards have none (NVML: NOT_SUPPORTED).
    nvlinks: int = 0
    # The memory's own sensor (NVML_FI_DEV_MEMORY_TEMP): HBM cards report it.
    memory_temperature: bool = False
    gpm: bool = False  # GPM (nvmlGpmQueryDeviceSupport): Hopper and later


# nvmlDeviceGetRetiredPages*: Ampere and later retire rows instead (RemappedRows); before
# Ampere it is the other way round. Cards without MIG answer NOT_SUPPORTED for its calls.
_NO_FAN = frozenset({"nvmlDeviceGetFanSpeed"})
_NO_PAGES = frozenset({"nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"})
_NO_MIG = frozenset({"nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount"})
_A100_80_MIG = {
    "1g.10gb": 9728 * MIB,
    "1g.20gb": 19968 * MIB,
    "2g.20gb": 19968 * MIB,
    "3g.40gb": 40192 * MIB,
    "4g.40gb": 40192 * MIB,
    "7g.80gb": 80 * GIB - 534 * MIB,
}
_A100_40_MIG = {
    "1g.5gb": 4864 * MIB,
    "2g.10gb": 9856 * MIB,
    "3g.20gb": 19968 * MIB,
    "4g.20gb": 19968 * MIB,
    "7g.40gb": 40 * GIB - 446 * MIB,
}
MODELS: dict[str, Model] = {
    "NVIDIA A100-SXM4-80GB": Model(
        80 * GIB, 534 * MIB, 400.0, 55.0, 1410, 1593, _NO_FAN | _NO_PAGES,
        mig_profiles=_A100_80_MIG, nvlinks=12, memory_temperature=True,
    ),
    "NVIDIA A100-PCIE-40GB": Model(
        40 * GIB, 446 * MIB, 250.0, 35.0, 1410, 1215, _NO_FAN | _NO_PAGES,
        mig_profiles=_A100_40_MIG, memory_temperature=True,
    ),
    "NVIDIA H100 80GB HBM3": Model(
        80 * GIB, 567 * MIB, 700.0, 70.0, 1980, 2619, _NO_FAN | _NO_PAGES,
        mig_profiles=_A100_80_MIG, pcie_generation=5, nvlinks=18, memory_temperature=True,
        gpm=True,
    ),
    "NVIDIA L4": Model(
        23034 * MIB, 374 * MIB, 72.0, 16.0, 2040, 6251, _NO_FAN | _NO_PAGES | _NO_MIG
    ),
    "Tesla V100-SXM2-16GB": Model(
        16 * GIB, 305 * MIB, 300.0, 40.0, 1530, 877,
        _NO_FAN | _NO_MIG | {"nvmlDeviceGetRemappedRows"}, pcie_generation=3, nvlinks=6,
        memory_temperature=True,
    ),
    "NVIDIA GeForce RTX 4090": Model(
        24 * GIB, 400 * MIB, 450.0, 20.0, 2520, 10501,
        _NO_PAGES | _NO_MIG | {"nvmlDeviceGetRemappedRows"}, persistence_mode=False,
    ),
    # A consumer card on an old driver: half of NVML says NOT_SUPPORTED, the clocks-event
    # call is missing (FUNCTION_NOT_FOUND; its older name works), and no Xid events.
    "NVIDIA GeForce GTX 1080": Model(
        8 * GIB, 120 * MIB, 180.0, 8.0, 1733, 5005,
        _NO_PAGES | _NO_MIG | {
            "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetClockInfo", "nvmlDeviceGetEccMode", "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetPowerManagementDefaultLimit",
            "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceGetTemperatureThreshold",
        },
        missing=frozenset(
            {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlGpmQueryDeviceSupport"}
        ),
        pcie_generation=3, persistence_mode=False, supported_events=0x4 | 0x10,
    ),
}  # fmt: skip
# What NVML answers for a MIG device handle; everything else is NOT_SUPPORTED.
MIG_FUNCTIONS = frozenset(
    {
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
    }
)
COMPUTE_MODES = {name: code for code, name in nvml.COMPUTE_MODES.items()}
DEFAULT_MODEL = "NVIDIA A100-SXM4-80GB"
