"""A simulation scenario: the GPUs, what happens to them over time, and the TOML that says so.

Each GPU has a load, a health, faults and Xid events; a scenario file describes a fleet of them.

Scenario files are TOML::

    driver_version = "550.54.15"     # optional
    cuda_driver_version = 12040      # optional, NVML's integer form

    [[gpus]]
    model = "NVIDIA A100-SXM4-80GB"  # one of MODELS
    count = 2                        # optional, default 1
    load = "sine"                    # idle | busy | light | sine | steps | hidden | constant | grow
    period_seconds = 120             # sine and steps; grow: time to fill the card
    utilization = 0.3                # constant and grow (0–1)
    memory_used_ratio = 0.5          # constant and hidden (0–1); grow: where it starts
    processes = 2                    # constant and grow
    pids = [4242, 4243]              # optional: the listed processes' pids
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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpu_exporter import nvml
from gpu_exporter.readings import CLOCKS_EVENT_REASON_BITS
from gpu_exporter.simulate.models import COMPUTE_MODES, DEFAULT_MODEL, MODELS, Model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HANG = "HANG"  # a fault that blocks the call instead of failing it
DEFAULT_DRIVER_VERSION = "550.54.15"
DEFAULT_CUDA_DRIVER_VERSION = 12040  # NVML's integer form of 12.4
GROW_TO = 0.95  # the memory ratio a "grow" load ends at
LOADS = ("idle", "busy", "light", "sine", "steps", "hidden", "constant", "grow")
# --simulate N cycles through these, so a demo box has busy, idle and changing cards.
DEFAULT_LOADS = ("busy", "idle", "sine", "light", "steps", "idle", "hidden", "sine")
# Shipped as package data (pyproject.toml), so a wheel install has them too.
_SCENARIOS = Path(__file__).parent / "scenarios"


@dataclass(frozen=True, slots=True)
class Load:
    """What a GPU is doing: a pure function of time → (utilization, memory ratio, processes)."""

    kind: str = "idle"
    period_seconds: float = 120.0
    utilization: float = 0.0
    memory_used_ratio: float = 0.0
    processes: int = 0
    hidden_processes: int = 0  # constant only: they use memory but are not listed
    pids: tuple[int, ...] = ()  # the listed processes' pids (default 4000 + 100·index + k)

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
        if self.kind == "grow":  # a job whose memory keeps growing until the card is full
            start = self.memory_used_ratio
            grown = start + (GROW_TO - start) * min(1.0, t / self.period_seconds)
            return self.utilization, round(grown, 4), max(1, self.processes)
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
            if reason not in CLOCKS_EVENT_REASON_BITS:
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

    def at(self, n: int) -> float | None:
        """When its occurrence after the first ``n`` is due; None when there is none.

        >>> XidEvent(0, 13, 60, 600).at(2), XidEvent(0, 79, 300).at(1)
        (1260.0, None)
        """
        if self.every_seconds is None:
            return self.after_seconds if n == 0 else None
        return self.after_seconds + n * self.every_seconds


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


@dataclass(frozen=True, slots=True)
class Scenario:
    """What one simulator runs: its GPUs (fresh, mutable — hand them to one simulator), the
    faults and Xid events to apply, and what the driver reports about itself."""

    gpus: tuple[SimGpu, ...]
    faults: tuple[Fault, ...] = ()
    xid_events: tuple[XidEvent, ...] = ()
    driver_version: str = DEFAULT_DRIVER_VERSION
    cuda_driver_version: int = DEFAULT_CUDA_DRIVER_VERSION
    pcie_sample_seconds: float = 0.0  # how long nvmlDeviceGetPcieThroughput blocks

    @classmethod
    def with_gpus(cls, count: int) -> Scenario:
        """``--simulate N``: N A100s with a mix of busy, idle and changing loads."""
        return cls(
            tuple(
                SimGpu(i, DEFAULT_MODEL, Load(DEFAULT_LOADS[i % len(DEFAULT_LOADS)]))
                for i in range(count)
            )
        )

    @classmethod
    def from_table(cls, data: Mapping[str, Any]) -> Scenario:
        """A scenario file's contents (the format is at the top of this module)."""
        gpus = _gpus(data.get("gpus", []))
        faults = tuple(_fault(f) for f in data.get("faults", []))
        xids = tuple(
            XidEvent(
                int(x["gpu"]),
                int(x["xid"]),
                float(x.get("after_seconds", 0.0)),
                float(x["every_seconds"]) if "every_seconds" in x else None,
            )
            for x in data.get("xid_events", [])
        )
        for x in xids:
            if not 0 <= x.gpu < len(gpus):
                raise ValueError(f"xid_events: no GPU {x.gpu}")
        return cls(
            gpus,
            faults=faults,
            xid_events=xids,
            driver_version=str(data.get("driver_version", DEFAULT_DRIVER_VERSION)),
            cuda_driver_version=int(data.get("cuda_driver_version", DEFAULT_CUDA_DRIVER_VERSION)),
            pcie_sample_seconds=float(data.get("pcie_sample_seconds", 0.0)),
        )

    @classmethod
    def from_argument(cls, arg: str) -> Scenario:
        """``--simulate``'s argument: a GPU count or the path of a TOML scenario."""
        if arg.isascii() and arg.isdigit():
            count = int(arg)
            if not 1 <= count <= 64:
                raise ValueError(f"--simulate takes 1 to 64 GPUs, got {count}")
            return cls.with_gpus(count)
        path = Path(arg)
        if not path.is_file():
            path = _bundled(arg)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--simulate: {arg}: {exc}") from None
        return cls.from_table(data)


def bundled_scenarios() -> tuple[str, ...]:
    """Names of the scenarios shipped inside the package (``--simulate lab``)."""
    return tuple(sorted(p.stem for p in _SCENARIOS.glob("*.toml")))


def _bundled(arg: str) -> Path:
    """A bundled scenario by name, with or without ``.toml``: an installed wheel has no
    repository checkout to point a path at, so the name is the only way to reach them."""
    name = arg.removesuffix(".toml")
    path = _SCENARIOS / f"{name}.toml"
    if "/" in arg or not path.is_file():
        raise ValueError(
            f"--simulate: {arg!r} is neither a GPU count, a scenario file nor a bundled "
            f"scenario ({', '.join(bundled_scenarios())})"
        )
    return path


def _gpus(entries: list[Mapping[str, Any]]) -> tuple[SimGpu, ...]:
    gpus: list[SimGpu] = []
    for entry in entries:
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
            tuple(int(p) for p in entry.get("pids", ())),
        )
        health = Health.from_table(entry.get("health", {}))
        mode = str(entry.get("compute_mode", "default"))
        if mode not in COMPUTE_MODES:
            raise ValueError(f"unknown compute_mode {mode!r}; known: {', '.join(COMPUTE_MODES)}")
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
    return tuple(gpus)


def _fault(f: Mapping[str, Any]) -> Fault:
    if f["error"] == HANG:
        if float(f.get("hang_seconds", 0)) <= 0:
            raise ValueError("a HANG fault needs hang_seconds > 0")
    else:
        nvml.error_code(f["error"])  # reject unknown names now, not at sample time
    return Fault(
        f.get("function", "*"),
        f["error"],
        f.get("gpu"),
        float(f.get("after_seconds", 0.0)),
        float(f.get("for_seconds", math.inf)),
        float(f.get("hang_seconds", 0.0)),
    )
