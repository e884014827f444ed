"""A simulated NVML: pynvml's functions over made-up GPUs whose load changes over time.

``gpu-exporter serve --simulate 4`` (or ``--simulate scenario.toml``) hands a
:class:`SimulatedNvml` to the same :class:`~gpu_exporter.nvml.Nvml` wrapper, sampler, cache and
endpoints that run against a real driver, so demos and tests exercise the real code path.
Errors are raised as genuine pynvml exceptions (via :func:`gpu_exporter.nvml.make_error`).

Every value is a pure function of the simulator's clock, so a test with a fake clock can ask
:meth:`SimulatedNvml.state` for the exact numbers the exporter should report.

Scenario files are TOML::

    driver_version = "550.54.15"     # optional
    cuda_driver_version = 12040      # optional, NVML's integer form

    [[gpus]]
    model = "NVIDIA A100-SXM4-80GB"  # one of MODELS
    count = 2                        # optional, default 1
    load = "sine"                    # idle | busy | light | sine | steps | hidden | constant
    period_seconds = 120             # sine and steps
    utilization = 0.3                # constant only (0–1)
    memory_used_ratio = 0.5          # constant and hidden (0–1)
    processes = 2                    # constant only
    hidden_processes = 1             # constant only: using memory, invisible (other container)
    unsupported = ["nvmlDeviceGetFanSpeed"]   # raise NOT_SUPPORTED
    mig = ["3g.40gb", "2g.20gb", "1g.10gb"]   # MIG mode on, with these MIG devices
    compute_mode = "exclusive_process"        # default | exclusive_process | prohibited

    [gpus.health]                    # optional: counters and states to report (see Health)
    ecc_uncorrected_volatile = 2
    remapped_rows_pending = true
    pcie_link_width = 4              # a link trained down from x16
    clocks_event_reasons = ["hw_thermal_slowdown"]

    [[xid_events]]                   # Xid errors delivered to NVML event sets
    gpu = 2
    xid = 79
    after_seconds = 300
    every_seconds = 60               # optional: repeat

    [[faults]]
    function = "nvmlDeviceGetPowerUsage"   # "*" = every call for that GPU (or every call)
    gpu = 2                                # omit for library-wide faults (nvmlInit…)
    error = "GPU_IS_LOST"                  # any NVML_ERROR_* name, or "HANG"
    hang_seconds = 30                      # HANG only: the call blocks this long (real time)
    after_seconds = 60                     # optional, default 0
    for_seconds = 30                       # optional, default forever

A ``HANG`` fault blocks the calling thread for ``hang_seconds`` of real time (like a driver
call stuck in the kernel), then the call goes on normally; every matching call made while
the fault is active hangs. :meth:`SimulatedNvml.release_hangs` ends them early.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpu_exporter import nvml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HANG = "HANG"  # a fault that blocks the call instead of failing it
GIB = 1024**3
MIB = 1024**2


_EVENTS_ALL = (
    nvml.EVENT_TYPE_XID | 0x1 | 0x2 | 0x4 | 0x10  # Xid, single/double-bit ECC, P-state, clock
)


@dataclass(frozen=True, slots=True)
class Model:
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
        mig_profiles=_A100_80_MIG,
    ),
    "NVIDIA A100-PCIE-40GB": Model(
        40 * GIB, 446 * MIB, 250.0, 35.0, 1410, 1215, _NO_FAN | _NO_PAGES,
        mig_profiles=_A100_40_MIG,
    ),
    "NVIDIA H100 80GB HBM3": Model(
        80 * GIB, 567 * MIB, 700.0, 70.0, 1980, 2619, _NO_FAN | _NO_PAGES,
        mig_profiles=_A100_80_MIG, pcie_generation=5,
    ),
    "NVIDIA L4": Model(
        23034 * MIB, 374 * MIB, 72.0, 16.0, 2040, 6251, _NO_FAN | _NO_PAGES | _NO_MIG
    ),
    "Tesla V100-SXM2-16GB": Model(
        16 * GIB, 305 * MIB, 300.0, 40.0, 1530, 877,
        _NO_FAN | _NO_MIG | {"nvmlDeviceGetRemappedRows"}, pcie_generation=3,
    ),
    "NVIDIA GeForce RTX 4090": Model(
        24 * GIB, 400 * MIB, 450.0, 20.0, 2520, 10501,
        _NO_PAGES | _NO_MIG | {"nvmlDeviceGetRemappedRows"}, persistence_mode=False,
    ),
    # A consumer card on an old driver: half of NVML says NOT_SUPPORTED, the clocks-event
    # call is missing (FUNCTION_NOT_FOUND; its older name works), and no Xid events.
    "NVIDIA GeForce GTX 1080": Model(
        8 * GIB,
        120 * MIB,
        180.0,
        8.0,
        1733,
        5005,
        _NO_PAGES
        | _NO_MIG
        | {
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetEccMode",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetPcieReplayCounter",
            "nvmlDeviceGetPowerManagementDefaultLimit",
            "nvmlDeviceGetPowerManagementLimitConstraints",
            "nvmlDeviceGetTemperatureThreshold",
        },
        missing=frozenset({"nvmlDeviceGetCurrentClocksEventReasons"}),
        pcie_generation=3,
        persistence_mode=False,
        supported_events=0x4 | 0x10,
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
LOADS = ("idle", "busy", "light", "sine", "steps", "hidden", "constant")
# --simulate N cycles through these, so a demo box has busy, idle and changing cards.
DEFAULT_LOADS = ("busy", "idle", "sine", "light", "steps", "idle", "hidden", "sine")


@dataclass(frozen=True, slots=True)
class Load:
    """What a GPU is doing: a pure function of time → (utilization, memory ratio, processes)."""

    kind: str = "idle"
    period_seconds: float = 120.0
    utilization: float = 0.0
    memory_used_ratio: float = 0.0
    processes: int = 0
    hidden_processes: int = 0  # constant only: they use memory but are not listed

    def at(self, t: float, phase: float) -> tuple[float, float, int]:
        if self.kind == "idle":
            return 0.0, 0.0, 0
        if self.kind == "busy":
            return 0.97, 0.86, 1
        if self.kind == "light":
            return 0.12, 0.18, 1
        if self.kind == "hidden":  # memory held by a process in another container: invisible
            return 0.0, self.memory_used_ratio or 0.4, 0
        if self.kind == "constant":
            return self.utilization, self.memory_used_ratio, self.processes
        wave = math.sin(2 * math.pi * (t / self.period_seconds + phase))
        if self.kind == "sine":
            util = round(0.5 + 0.5 * wave, 2)
            return util, round(0.3 + 0.3 * wave, 3), 1 if util > 0.05 else 0
        if self.kind == "steps":  # a job runs for one period, then the card idles for one
            return (0.9, 0.7, 2) if wave >= 0 else (0.0, 0.0, 0)
        raise ValueError(f"unknown load {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Fault:
    function: str  # an NVML function name, or "*"
    error: str  # NVML error name, e.g. "GPU_IS_LOST", or HANG
    gpu: int | None = None  # None: not tied to one GPU
    after_seconds: float = 0.0
    for_seconds: float = math.inf
    hang_seconds: float = 0.0  # HANG only: how long each matching call blocks

    def active(self, t: float) -> bool:
        return self.after_seconds <= t < self.after_seconds + self.for_seconds

    def matches(self, function: str, gpu: int | None) -> bool:
        if self.gpu is not None and self.gpu != gpu:
            return False
        return self.function in ("*", function)


@dataclass(frozen=True, slots=True)
class Health:
    """Health counters and states a simulated GPU reports (all quiet by default)."""

    ecc_corrected_volatile: int = 0
    ecc_corrected_aggregate: int = 0
    ecc_uncorrected_volatile: int = 0
    ecc_uncorrected_aggregate: int = 0
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failed: bool = False
    retired_pages_multiple_single_bit: int = 0
    retired_pages_double_bit: int = 0
    retired_pages_pending: bool = False
    pcie_replays: int = 0
    pcie_link_width: int | None = None  # the trained width, when below the card's maximum
    clocks_event_reasons: tuple[str, ...] = ()  # reported on top of the load's own

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> Health:
        known = {f.name for f in fields(cls)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"unknown health keys {sorted(unknown)}; known: {sorted(known)}")
        reasons = tuple(table.get("clocks_event_reasons", ()))
        for reason in reasons:
            if reason not in nvml.CLOCKS_EVENT_REASON_BITS:
                raise ValueError(f"unknown clocks event reason {reason!r}")
        return cls(**{**table, "clocks_event_reasons": reasons})


@dataclass(frozen=True, slots=True)
class XidEvent:
    gpu: int
    xid: int
    after_seconds: float = 0.0
    every_seconds: float | None = None  # None: once

    def due(self, t: float) -> int:
        """How many times this event should have happened by ``t``."""
        if t < self.after_seconds:
            return 0
        if self.every_seconds is None:
            return 1
        return int((t - self.after_seconds) // self.every_seconds) + 1


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


@dataclass(slots=True)
class SimGpu:
    index: int
    model_name: str
    load: Load
    unsupported: frozenset[str] = frozenset()
    energy_mj: float = 0.0
    energy_at: float | None = None
    mig: tuple[str, ...] = ()  # MIG profiles; non-empty = MIG mode on
    health: Health = field(default_factory=Health)
    compute_mode: str = "default"

    @property
    def model(self) -> Model:
        return MODELS[self.model_name]

    @property
    def uuid(self) -> str:
        i = self.index
        return f"GPU-{0x5A1E0000 + i:08x}-{i:04x}-4{i:03x}-8000-{0xC0FFEE000000 + i:012x}"

    @property
    def pci_bus_id(self) -> str:
        # Eight GPUs per PCI domain, like an 8-GPU baseboard per root complex.
        return f"{self.index // 8:08X}:{0x18 + 0x10 * (self.index % 8):02X}:00.0"

    def mig_uuid(self, slot: int) -> str:
        i = self.index
        return f"MIG-{0x5A1E0000 + i:08x}-{slot:04x}-4{i:03x}-9{slot:03x}-{0xC0FFEE000000 + i:012x}"

    def check_mig(self) -> None:
        profiles = self.model.mig_profiles
        for profile in self.mig:
            if profile not in profiles:
                raise ValueError(
                    f"GPU {self.index} ({self.model_name}): no MIG profile {profile!r}; "
                    f"known: {', '.join(profiles) or 'none (no MIG on this model)'}"
                )
        slices = sum(int(p.split("g.", 1)[0]) for p in self.mig)
        if slices > 7:
            raise ValueError(f"GPU {self.index}: MIG profiles use {slices} of 7 slices")


@dataclass(eq=False, slots=True)
class SimMig:
    """A MIG device handle: what nvmlDeviceGetMigDeviceHandleByIndex returns."""

    parent: SimGpu
    slot: int


@dataclass(eq=False, slots=True)
class SimEventSet:
    """What nvmlEventSetCreate returns: the GPUs registered, and events not yet waited for."""

    registered: dict[int, int] = field(default_factory=dict)  # GPU index → event mask
    queue: deque[SimpleNamespace] = field(default_factory=deque)
    freed: bool = False


def _int(v: float) -> int:
    return round(v)


class SimulatedNvml:
    """Implements the pynvml functions :class:`gpu_exporter.nvml.Nvml` calls."""

    def __init__(
        self,
        gpus: list[SimGpu],
        *,
        faults: list[Fault] | None = None,
        clock: Callable[[], float],
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        xid_events: list[XidEvent] | None = None,
        pcie_sample_seconds: float = 0.0,
    ) -> None:
        for gpu in gpus:
            gpu.check_mig()
        self.gpus = gpus
        self.faults = list(faults or [])
        self._clock = clock
        self._t0 = clock()
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.calls: dict[str, int] = {}
        # NVML counts nvmlInit/nvmlShutdown pairs: each background user holds a reference.
        self.init_count = 0
        self.xid_events = list(xid_events or [])
        self._xids_delivered = [0] * len(self.xid_events)
        # Real NVML blocks ~20 ms in nvmlDeviceGetPcieThroughput; tests can ask for that.
        self.pcie_sample_seconds = pcie_sample_seconds
        self.event_sets: list[SimEventSet] = []
        # Calls come from one worker thread per GPU and from background threads; counting
        # must not lose increments.
        self._lock = threading.Lock()
        self._events = threading.Condition(self._lock)
        self._mig_handles: dict[tuple[int, int], SimMig] = {}
        self._release = threading.Event()

    @property
    def initialised(self) -> bool:
        return self.init_count > 0

    # -- building --------------------------------------------------------------------------
    @classmethod
    def with_gpus(cls, count: int, *, clock: Callable[[], float]) -> SimulatedNvml:
        """``--simulate N``: N A100s with a mix of busy, idle and changing loads."""
        gpus = [
            SimGpu(i, DEFAULT_MODEL, Load(DEFAULT_LOADS[i % len(DEFAULT_LOADS)]))
            for i in range(count)
        ]
        return cls(gpus, clock=clock)

    @classmethod
    def from_scenario(cls, data: Mapping[str, Any], *, clock: Callable[[], float]) -> SimulatedNvml:
        gpus: list[SimGpu] = []
        for entry in data.get("gpus", []):
            model = entry.get("model", DEFAULT_MODEL)
            if model not in MODELS:
                raise ValueError(f"unknown GPU model {model!r}; known: {', '.join(MODELS)}")
            kind = entry.get("load", "idle")
            if kind not in LOADS:
                raise ValueError(f"unknown load {kind!r}; known: {', '.join(LOADS)}")
            load = Load(
                kind,
                float(entry.get("period_seconds", 120.0)),
                float(entry.get("utilization", 0.0)),
                float(entry.get("memory_used_ratio", 0.0)),
                int(entry.get("processes", 0)),
                int(entry.get("hidden_processes", 0)),
            )
            health = Health.from_table(entry.get("health", {}))
            mode = str(entry.get("compute_mode", "default"))
            if mode not in COMPUTE_MODES:
                raise ValueError(
                    f"unknown compute_mode {mode!r}; known: {', '.join(COMPUTE_MODES)}"
                )
            for _ in range(int(entry.get("count", 1))):
                unsupported = frozenset(entry.get("unsupported", ()))
                gpus.append(
                    SimGpu(
                        len(gpus),
                        model,
                        load,
                        unsupported,
                        mig=tuple(entry.get("mig", ())),
                        health=health,
                        compute_mode=mode,
                    )
                )
        faults = []
        for f in data.get("faults", []):
            if f["error"] == HANG:
                if float(f.get("hang_seconds", 0)) <= 0:
                    raise ValueError("a HANG fault needs hang_seconds > 0")
            else:
                nvml.error_code(f["error"])  # reject unknown names now, not at sample time
            faults.append(
                Fault(
                    f.get("function", "*"),
                    f["error"],
                    f.get("gpu"),
                    float(f.get("after_seconds", 0.0)),
                    float(f.get("for_seconds", math.inf)),
                    float(f.get("hang_seconds", 0.0)),
                )
            )
        xids = [
            XidEvent(
                int(x["gpu"]),
                int(x["xid"]),
                float(x.get("after_seconds", 0.0)),
                float(x["every_seconds"]) if "every_seconds" in x else None,
            )
            for x in data.get("xid_events", [])
        ]
        for x in xids:
            if not 0 <= x.gpu < len(gpus):
                raise ValueError(f"xid_events: no GPU {x.gpu}")
        return cls(
            gpus,
            faults=faults,
            clock=clock,
            driver_version=str(data.get("driver_version", "550.54.15")),
            cuda_driver_version=int(data.get("cuda_driver_version", 12040)),
            xid_events=xids,
            pcie_sample_seconds=float(data.get("pcie_sample_seconds", 0.0)),
        )

    @classmethod
    def from_argument(cls, arg: str, *, clock: Callable[[], float]) -> SimulatedNvml:
        """``--simulate``'s argument: a GPU count or the path of a TOML scenario."""
        if arg.isdigit():
            count = int(arg)
            if not 1 <= count <= 64:
                raise ValueError(f"--simulate takes 1 to 64 GPUs, got {count}")
            return cls.with_gpus(count, clock=clock)
        path = Path(arg)
        if not path.is_file():
            raise ValueError(f"--simulate: {arg!r} is neither a GPU count nor a scenario file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--simulate: {arg}: {exc}") from None
        return cls.from_scenario(data, clock=clock)

    # -- state -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self._clock() - self._t0

    def state(self, index: int) -> GpuState:
        gpu = self.gpus[index]
        m = gpu.model
        t = self.elapsed()
        util, mem_ratio, nprocs = gpu.load.at(t, phase=index / 8)
        usable = m.memory_total_bytes - m.memory_reserved_bytes
        used = _int(usable * mem_ratio)
        processes: tuple[tuple[int, int], ...]
        if gpu.mig:  # the whole card is the sum of its MIG devices
            migs = [self.mig_state(index, slot) for slot in range(len(gpu.mig))]
            used = sum(x.memory_used for x in migs)
            processes = tuple(p for x in migs for p in x.processes)
        else:
            hidden = gpu.load.hidden_processes if gpu.load.kind == "constant" else 0
            per_proc = used // (nprocs + hidden) if nprocs + hidden else 0
            processes = tuple((4000 + 100 * index + k, per_proc) for k in range(nprocs))
        busy = util > 0
        sm = _int(m.max_sm_clock_mhz * min(1.0, 0.5 + util)) if busy else 210
        reasons = 0
        if not busy:
            reasons |= nvml.CLOCKS_EVENT_REASON_BITS["gpu_idle"]
        elif util >= 0.9:
            reasons |= nvml.CLOCKS_EVENT_REASON_BITS["sw_power_cap"]
        for reason in gpu.health.clocks_event_reasons:
            reasons |= nvml.CLOCKS_EVENT_REASON_BITS[reason]
        return GpuState(
            memory_total=m.memory_total_bytes,
            memory_reserved=m.memory_reserved_bytes,
            memory_used=used,
            memory_free=usable - used,
            utilization_gpu=_int(util * 100),
            utilization_memory=_int(util * 60),
            power_usage_mw=_int(
                1000
                * (m.idle_power_watts + (m.power_limit_watts - m.idle_power_watts) * 0.9 * util)
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

    def mig_state(self, index: int, slot: int) -> MigState:
        gpu = self.gpus[index]
        profile = gpu.mig[slot]
        total = gpu.model.mig_profiles[profile]
        _util, mem_ratio, nprocs = gpu.load.at(self.elapsed(), phase=(index + slot) / 8)
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

    def energy_mj(self, index: int) -> int:
        """Energy counter: power integrated over the simulator's clock (trapezoids per call)."""
        gpu = self.gpus[index]
        now = self.elapsed()
        power_w = self.state(index).power_usage_mw / 1000
        if gpu.energy_at is not None:
            gpu.energy_mj += power_w * (now - gpu.energy_at) * 1000
        gpu.energy_at = now
        return int(gpu.energy_mj)

    # -- plumbing ------------------------------------------------------------------------------
    def release_hangs(self) -> None:
        """End every current and future HANG fault (tests call it before stopping)."""
        self._release.set()

    def _check(self, function: str, gpu: SimGpu | SimMig | None = None) -> None:
        with self._lock:
            self.calls[function] = self.calls.get(function, 0) + 1
        t = self.elapsed()
        parent = gpu.parent if isinstance(gpu, SimMig) else gpu
        index = parent.index if parent is not None else None
        for fault in self.faults:
            if fault.active(t) and fault.matches(function, index):
                if fault.error == HANG:
                    self._release.wait(fault.hang_seconds)
                    continue
                raise nvml.make_error(nvml.error_code(fault.error))
        if function != "nvmlInit" and not self.initialised:
            raise nvml.make_error(nvml.error_code("UNINITIALIZED"))
        if parent is None:
            return
        if function in parent.model.missing:
            raise nvml.make_error(nvml.error_code("FUNCTION_NOT_FOUND"))
        if function in parent.unsupported or function in parent.model.unsupported:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        if isinstance(gpu, SimMig) and function not in MIG_FUNCTIONS:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))

    def _gpu(self, function: str, handle: SimGpu | SimMig) -> SimGpu:
        """Check a call that only a whole GPU answers, and return that GPU."""
        self._check(function, handle)
        assert isinstance(handle, SimGpu)  # MIG handles were refused by _check
        return handle

    # -- injecting events --------------------------------------------------------------------
    def inject_xid(self, gpu: int, xid: int) -> int:
        """An Xid error on ``gpu`` now; returns how many event sets it was delivered to."""
        with self._events:
            return self._deliver_xid(gpu, xid)

    def _deliver_xid(self, gpu: int, xid: int) -> int:
        delivered = 0
        for event_set in self.event_sets:
            if not event_set.freed and event_set.registered.get(gpu, 0) & nvml.EVENT_TYPE_XID:
                event_set.queue.append(
                    SimpleNamespace(
                        device=self.gpus[gpu],
                        eventType=nvml.EVENT_TYPE_XID,
                        eventData=xid,
                        gpuInstanceId=nvml.NO_INSTANCE,
                        computeInstanceId=nvml.NO_INSTANCE,
                    )
                )
                delivered += 1
        self._events.notify_all()
        return delivered

    def _deliver_scheduled(self) -> None:
        """Scenario Xid events that are due by now (call with the lock held)."""
        t = self.elapsed()
        for k, event in enumerate(self.xid_events):
            while self._xids_delivered[k] < event.due(t):
                self._xids_delivered[k] += 1
                self._deliver_xid(event.gpu, event.xid)

    # -- the pynvml surface ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._check("nvmlInit")
        with self._lock:
            self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        with self._lock:
            self.init_count = max(0, self.init_count - 1)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimGpu:
        if not 0 <= index < len(self.gpus):
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        gpu = self.gpus[index]
        self._check("nvmlDeviceGetHandleByIndex", gpu)
        return gpu

    def nvmlDeviceGetUUID(self, handle: SimGpu | SimMig) -> str:
        self._check("nvmlDeviceGetUUID", handle)
        if isinstance(handle, SimMig):
            return handle.parent.mig_uuid(handle.slot)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: SimGpu | SimMig) -> bytes:
        self._check("nvmlDeviceGetName", handle)
        if isinstance(handle, SimMig):
            return self.mig_state(handle.parent.index, handle.slot).name.encode()
        return handle.model_name.encode()  # older pynvml returns bytes; the wrapper decodes both

    def nvmlDeviceGetPciInfo(self, gpu: SimGpu) -> SimpleNamespace:
        gpu = self._gpu("nvmlDeviceGetPciInfo", gpu)
        return SimpleNamespace(busId=gpu.pci_bus_id.encode())

    def nvmlDeviceGetMemoryInfo(
        self, handle: SimGpu | SimMig, version: int | None = None
    ) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(handle, SimMig):
            ms = self.mig_state(handle.parent.index, handle.slot)
            total, used, free, reserved = ms.memory_total, ms.memory_used, ms.memory_free, 0
        else:
            s = self.state(handle.index)
            total, used, free = s.memory_total, s.memory_used, s.memory_free
            reserved = s.memory_reserved
        if version is None:  # v1: "used" includes the driver's reservation
            return SimpleNamespace(total=total, used=used + reserved, free=free)
        return SimpleNamespace(
            version=version, total=total, reserved=reserved, used=used, free=free
        )

    def nvmlDeviceGetUtilizationRates(self, gpu: SimGpu) -> SimpleNamespace:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", gpu)
        if gpu.mig:  # NVML reports no utilization for a GPU in MIG mode
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        s = self.state(gpu.index)
        return SimpleNamespace(gpu=s.utilization_gpu, memory=s.utilization_memory)

    def nvmlDeviceGetPowerUsage(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetPowerUsage", gpu)
        return self.state(gpu.index).power_usage_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetEnforcedPowerLimit", gpu)
        return self.state(gpu.index).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetTotalEnergyConsumption", gpu)
        return self.energy_mj(gpu.index)

    def nvmlDeviceGetTemperature(self, gpu: SimGpu, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", gpu)
        if sensor != nvml.TEMPERATURE_GPU:
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        return self.state(gpu.index).temperature_c

    def nvmlDeviceGetFanSpeed(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetFanSpeed", gpu)
        return self.state(gpu.index).fan_percent

    def nvmlDeviceGetClockInfo(self, gpu: SimGpu, clock_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetClockInfo", gpu)
        return self.state(gpu.index).clocks_mhz[clock_type]

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: SimGpu | SimMig
    ) -> list[SimpleNamespace]:
        """The v3 struct: pid, usedGpuMemory, gpuInstanceId, computeInstanceId."""
        self._check("nvmlDeviceGetComputeRunningProcesses", handle)
        gpu = handle.parent if isinstance(handle, SimMig) else handle
        slots = [handle.slot] if isinstance(handle, SimMig) else range(len(gpu.mig))
        if not gpu.mig:
            return [
                SimpleNamespace(
                    pid=pid,
                    usedGpuMemory=used,
                    gpuInstanceId=nvml.NO_INSTANCE,
                    computeInstanceId=nvml.NO_INSTANCE,
                )
                for pid, used in self.state(gpu.index).processes
            ]
        out: list[SimpleNamespace] = []
        for slot in slots:
            ms = self.mig_state(gpu.index, slot)
            out.extend(
                SimpleNamespace(
                    pid=pid,
                    usedGpuMemory=used,
                    gpuInstanceId=ms.gpu_instance_id,
                    computeInstanceId=ms.compute_instance_id,
                )
                for pid, used in ms.processes
            )
        return out

    # -- health --------------------------------------------------------------------------------
    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetCurrentClocksEventReasons", gpu)
        return self.state(gpu.index).clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", gpu)
        return self.state(gpu.index).clocks_event_reasons

    def nvmlDeviceGetMaxClockInfo(self, gpu: SimGpu, clock_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxClockInfo", gpu)
        m = gpu.model
        return {
            nvml.CLOCK_TYPES["graphics"]: m.max_sm_clock_mhz,
            nvml.CLOCK_TYPES["sm"]: m.max_sm_clock_mhz,
            nvml.CLOCK_TYPES["memory"]: m.max_memory_clock_mhz,
            nvml.CLOCK_TYPES["video"]: _int(m.max_sm_clock_mhz * 0.85),
        }[clock_type]

    def nvmlDeviceGetTemperatureThreshold(self, gpu: SimGpu, threshold: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperatureThreshold", gpu)
        if not 0 <= threshold < 4:
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        return gpu.model.temperature_thresholds[threshold]

    def nvmlDeviceGetPerformanceState(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetPerformanceState", gpu)
        return self.state(gpu.index).performance_state

    def nvmlDeviceGetPersistenceMode(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetPersistenceMode", gpu)
        return 1 if gpu.model.persistence_mode else 0

    def nvmlDeviceGetComputeMode(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetComputeMode", gpu)
        return COMPUTE_MODES[gpu.compute_mode]

    def nvmlDeviceGetEccMode(self, gpu: SimGpu) -> list[int]:
        self._gpu("nvmlDeviceGetEccMode", gpu)
        return [1, 1]

    def nvmlDeviceGetTotalEccErrors(self, gpu: SimGpu, error_type: int, counter_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTotalEccErrors", gpu)
        errors = {v: k for k, v in nvml.ECC_ERROR_TYPES.items()}[error_type]
        counter = {v: k for k, v in nvml.ECC_COUNTERS.items()}[counter_type]
        value: int = getattr(gpu.health, f"ecc_{errors}_{counter}")
        return value

    def nvmlDeviceGetRemappedRows(self, gpu: SimGpu) -> tuple[int, int, int, int]:
        gpu = self._gpu("nvmlDeviceGetRemappedRows", gpu)
        h = gpu.health
        return (
            h.remapped_rows_correctable,
            h.remapped_rows_uncorrectable,
            int(h.remapped_rows_pending),
            int(h.remapped_rows_failed),
        )

    def nvmlDeviceGetRetiredPages(self, gpu: SimGpu, cause: int) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetRetiredPages", gpu)
        h = gpu.health
        count = (
            h.retired_pages_multiple_single_bit
            if cause == nvml.PAGE_RETIREMENT_CAUSES["multiple_single_bit"]
            else h.retired_pages_double_bit
        )
        return [0x1000 * (k + 1) for k in range(count)]  # page addresses

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetRetiredPagesPendingStatus", gpu)
        return int(gpu.health.retired_pages_pending)

    # -- PCIe ----------------------------------------------------------------------------------
    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetCurrPcieLinkGeneration", gpu)
        return self.state(gpu.index).pcie_generation

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxPcieLinkGeneration", gpu)
        return gpu.model.pcie_generation

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetCurrPcieLinkWidth", gpu)
        return self.state(gpu.index).pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxPcieLinkWidth", gpu)
        return gpu.model.pcie_width

    def nvmlDeviceGetPcieReplayCounter(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetPcieReplayCounter", gpu)
        return gpu.health.pcie_replays

    def nvmlDeviceGetPcieThroughput(self, gpu: SimGpu, counter: int) -> int:
        """KB/s over a 20 ms window; blocks for ``pcie_sample_seconds`` like the driver."""
        gpu = self._gpu("nvmlDeviceGetPcieThroughput", gpu)
        if self.pcie_sample_seconds:
            time.sleep(self.pcie_sample_seconds)
        s = self.state(gpu.index)
        if counter == nvml.PCIE_COUNTERS["tx"]:
            return s.pcie_tx_kb_per_second
        return s.pcie_rx_kb_per_second

    # -- power and engines ---------------------------------------------------------------------
    def nvmlDeviceGetPowerManagementDefaultLimit(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetPowerManagementDefaultLimit", gpu)
        return _int(gpu.model.power_limit_watts * 1000)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, gpu: SimGpu) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetPowerManagementLimitConstraints", gpu)
        limit = gpu.model.power_limit_watts
        return [_int(limit * 250), _int(limit * 1000)]  # a quarter of the limit … the limit

    def nvmlDeviceGetEncoderUtilization(self, gpu: SimGpu) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetEncoderUtilization", gpu)
        return [self.state(gpu.index).encoder_percent, 167000]

    def nvmlDeviceGetDecoderUtilization(self, gpu: SimGpu) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetDecoderUtilization", gpu)
        return [self.state(gpu.index).decoder_percent, 167000]

    # -- MIG -------------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, gpu: SimGpu) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", gpu)
        on = 1 if gpu.mig else 0
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: SimGpu) -> int:
        self._gpu("nvmlDeviceGetMaxMigDeviceCount", gpu)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: SimGpu, index: int) -> SimMig:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", gpu)
        if not gpu.mig:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        if not 0 <= index < 7:
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        if index >= len(gpu.mig):
            raise nvml.make_error(nvml.error_code("NOT_FOUND"))
        with self._lock:  # the same handle every time, as the driver's
            return self._mig_handles.setdefault((gpu.index, index), SimMig(gpu, index))

    def nvmlDeviceGetGpuInstanceId(self, handle: SimMig) -> int:
        self._check("nvmlDeviceGetGpuInstanceId", handle)
        if not isinstance(handle, SimMig):
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        return self.mig_state(handle.parent.index, handle.slot).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: SimMig) -> int:
        self._check("nvmlDeviceGetComputeInstanceId", handle)
        if not isinstance(handle, SimMig):
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        return self.mig_state(handle.parent.index, handle.slot).compute_instance_id

    # -- events ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> SimEventSet:
        self._check("nvmlEventSetCreate")
        event_set = SimEventSet()
        with self._events:
            self.event_sets.append(event_set)
        return event_set

    def nvmlEventSetFree(self, event_set: SimEventSet) -> None:
        self._check("nvmlEventSetFree")
        with self._events:
            event_set.freed = True
            self.event_sets.remove(event_set)
            self._events.notify_all()

    def nvmlDeviceGetSupportedEventTypes(self, gpu: SimGpu) -> int:
        gpu = self._gpu("nvmlDeviceGetSupportedEventTypes", gpu)
        return gpu.model.supported_events

    def nvmlDeviceRegisterEvents(
        self, gpu: SimGpu, event_types: int, event_set: SimEventSet
    ) -> None:
        gpu = self._gpu("nvmlDeviceRegisterEvents", gpu)
        if event_types & ~gpu.model.supported_events:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        with self._events:
            event_set.registered[gpu.index] = event_set.registered.get(gpu.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: SimEventSet, timeout_ms: int) -> SimpleNamespace:
        """The next event, waiting up to ``timeout_ms`` of real time; TIMEOUT otherwise."""
        self._check("nvmlEventSetWait_v2")
        deadline = time.monotonic() + timeout_ms / 1000
        with self._events:
            while True:
                if event_set.freed:
                    raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
                self._deliver_scheduled()
                if event_set.queue:
                    return event_set.queue.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise nvml.make_error(nvml.error_code("TIMEOUT"))
                # Wake now and then: scheduled events follow the simulator's own clock.
                self._events.wait(min(remaining, 0.05))
