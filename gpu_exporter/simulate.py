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
    unsupported = ["nvmlDeviceGetFanSpeed"]   # raise NOT_SUPPORTED

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


_NO_FAN = frozenset({"nvmlDeviceGetFanSpeed"})
MODELS: dict[str, Model] = {
    "NVIDIA A100-SXM4-80GB": Model(80 * GIB, 534 * MIB, 400.0, 55.0, 1410, 1593, _NO_FAN),
    "NVIDIA A100-PCIE-40GB": Model(40 * GIB, 446 * MIB, 250.0, 35.0, 1410, 1215, _NO_FAN),
    "NVIDIA H100 80GB HBM3": Model(80 * GIB, 567 * MIB, 700.0, 70.0, 1980, 2619, _NO_FAN),
    "NVIDIA L4": Model(23034 * MIB, 374 * MIB, 72.0, 16.0, 2040, 6251, _NO_FAN),
    "Tesla V100-SXM2-16GB": Model(16 * GIB, 305 * MIB, 300.0, 40.0, 1530, 877, _NO_FAN),
    "NVIDIA GeForce RTX 4090": Model(24 * GIB, 400 * MIB, 450.0, 20.0, 2520, 10501),
    # A consumer card on which half of NVML says NOT_SUPPORTED.
    "NVIDIA GeForce GTX 1080": Model(
        8 * GIB,
        120 * MIB,
        180.0,
        8.0,
        1733,
        5005,
        frozenset(
            {
                "nvmlDeviceGetTotalEnergyConsumption",
                "nvmlDeviceGetComputeRunningProcesses",
                "nvmlDeviceGetClockInfo",
            }
        ),
    ),
}
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


@dataclass(slots=True)
class SimGpu:
    index: int
    model_name: str
    load: Load
    unsupported: frozenset[str] = frozenset()
    energy_mj: float = 0.0
    energy_at: float | None = None

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
    ) -> None:
        self.gpus = gpus
        self.faults = list(faults or [])
        self._clock = clock
        self._t0 = clock()
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.initialised = False
        self.calls: dict[str, int] = {}
        # Calls come from one worker thread per GPU; counting must not lose increments.
        self._calls_lock = threading.Lock()
        self._release = threading.Event()

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
            )
            for _ in range(int(entry.get("count", 1))):
                unsupported = frozenset(entry.get("unsupported", ()))
                gpus.append(SimGpu(len(gpus), model, load, unsupported))
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
        return cls(
            gpus,
            faults=faults,
            clock=clock,
            driver_version=str(data.get("driver_version", "550.54.15")),
            cuda_driver_version=int(data.get("cuda_driver_version", 12040)),
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
        util, mem_ratio, nprocs = gpu.load.at(self.elapsed(), phase=index / 8)
        usable = m.memory_total_bytes - m.memory_reserved_bytes
        used = _int(usable * mem_ratio)
        busy = util > 0
        sm = _int(m.max_sm_clock_mhz * min(1.0, 0.5 + util)) if busy else 210
        per_proc = used // nprocs if nprocs else 0
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
            processes=tuple((4000 + 100 * index + k, per_proc) for k in range(nprocs)),
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

    def _check(self, function: str, gpu: SimGpu | None = None) -> None:
        with self._calls_lock:
            self.calls[function] = self.calls.get(function, 0) + 1
        t = self.elapsed()
        index = gpu.index if gpu is not None else None
        for fault in self.faults:
            if fault.active(t) and fault.matches(function, index):
                if fault.error == HANG:
                    self._release.wait(fault.hang_seconds)
                    continue
                raise nvml.make_error(nvml.error_code(fault.error))
        if function != "nvmlInit" and not self.initialised:
            raise nvml.make_error(nvml.error_code("UNINITIALIZED"))
        if gpu is not None and (function in gpu.unsupported or function in gpu.model.unsupported):
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))

    # -- the pynvml surface ------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._check("nvmlInit")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialised = False

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

    def nvmlDeviceGetUUID(self, gpu: SimGpu) -> str:
        self._check("nvmlDeviceGetUUID", gpu)
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: SimGpu) -> bytes:
        self._check("nvmlDeviceGetName", gpu)
        return gpu.model_name.encode()  # older pynvml returns bytes; the wrapper decodes both

    def nvmlDeviceGetPciInfo(self, gpu: SimGpu) -> SimpleNamespace:
        self._check("nvmlDeviceGetPciInfo", gpu)
        return SimpleNamespace(busId=gpu.pci_bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, gpu: SimGpu, version: int | None = None) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo", gpu)
        s = self.state(gpu.index)
        if version is None:  # v1: "used" includes the driver's reservation
            return SimpleNamespace(
                total=s.memory_total, used=s.memory_used + s.memory_reserved, free=s.memory_free
            )
        return SimpleNamespace(
            version=version,
            total=s.memory_total,
            reserved=s.memory_reserved,
            used=s.memory_used,
            free=s.memory_free,
        )

    def nvmlDeviceGetUtilizationRates(self, gpu: SimGpu) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates", gpu)
        s = self.state(gpu.index)
        return SimpleNamespace(gpu=s.utilization_gpu, memory=s.utilization_memory)

    def nvmlDeviceGetPowerUsage(self, gpu: SimGpu) -> int:
        self._check("nvmlDeviceGetPowerUsage", gpu)
        return self.state(gpu.index).power_usage_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: SimGpu) -> int:
        self._check("nvmlDeviceGetEnforcedPowerLimit", gpu)
        return self.state(gpu.index).power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: SimGpu) -> int:
        self._check("nvmlDeviceGetTotalEnergyConsumption", gpu)
        return self.energy_mj(gpu.index)

    def nvmlDeviceGetTemperature(self, gpu: SimGpu, sensor: int) -> int:
        self._check("nvmlDeviceGetTemperature", gpu)
        if sensor != nvml.TEMPERATURE_GPU:
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        return self.state(gpu.index).temperature_c

    def nvmlDeviceGetFanSpeed(self, gpu: SimGpu) -> int:
        self._check("nvmlDeviceGetFanSpeed", gpu)
        return self.state(gpu.index).fan_percent

    def nvmlDeviceGetClockInfo(self, gpu: SimGpu, clock_type: int) -> int:
        self._check("nvmlDeviceGetClockInfo", gpu)
        return self.state(gpu.index).clocks_mhz[clock_type]

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: SimGpu) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetComputeRunningProcesses", gpu)
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in self.state(gpu.index).processes
        ]
