"""Build and drive the fake ``libnvidia-ml.so.1`` (``fakenvml.c``).

Used by the end-to-end tests (``tests/test_fakenvml.py``) and by the benchmarks (``bench/``):

* :func:`build` compiles ``fakenvml.c`` with the system C compiler against the real
  ``nvml.h`` from the ``nvidia-nvml-dev`` wheel, exporting only what it implements;
* :class:`FakeGpu` and :func:`write_config` write the configuration file the library reads
  (``$FAKENVML_CONFIG``), atomically, so the library never sees half a file;
* :func:`read_stats` reads the per-function call counts (``$FAKENVML_STATS``);
* :func:`environment` is what a process needs to load it instead of the driver's library.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SOURCE = Path(__file__).resolve().parent / "fakenvml.c"
LIBRARY_NAME = "libnvidia-ml.so.1"
SYNTHETIC_PID_BASE = 4_000_000  # as in fakenvml.c


# nvmlDeviceGetFieldValues ids of the clock event reason durations (ns since the driver
# loaded), by fakenvml.c's reason names. The last three are nvml.h's since nvidia-nvml-dev
# 13.0.87 and nvidia-ml-py's since 13.580.82; nvml.h 13.0.39 and nvidia-ml-py 12.575.51 to
# 13.580.65 say 251, 252, 253 (config_text's clocks_event_slowdown_ids). 75,
# NVML_FI_DEV_PERF_POLICY_THERMAL, answers as sw_therm_slowdown too.
CLOCKS_EVENT_FIELDS = {
    "sw_power_cap": 74,  # NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP = ..._PERF_POLICY_POWER
    "sync_boost": 76,  # = NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
    "sw_therm_slowdown": 269,
    "hw_therm_slowdown": 270,
    "hw_power_brake_slowdown": 271,
}
# What a reason not given a rate grows at on a GPU with utilization_gpu > 0 (as fakenvml.c).
LOADED_SW_POWER_CAP_NS_PER_S = 5_000_000

# nvmlGpuFabricState_t
FABRIC_STATE_NOT_SUPPORTED = 0
FABRIC_STATE_NOT_STARTED = 1
FABRIC_STATE_IN_PROGRESS = 2
FABRIC_STATE_COMPLETED = 3


@dataclass(frozen=True)
class Fabric:
    """What ``nvmlDeviceGetGpuFabricInfo``/``...InfoV`` answer for a GPU; the defaults are an
    H100/H200 SXM board registered with its fabric manager."""

    state: int = FABRIC_STATE_COMPLETED
    status: str | int = "SUCCESS"  # nvmlReturn_t: SUCCESS, an error name as in errors, a number
    clique_id: int = 1
    cluster_uuid: str = "8c3f2a6e-51d4-4b7e-9a10-2f6c0d9e7b34"  # 16 bytes, as hex text
    health_mask: int = 0  # NVML_GPU_FABRIC_HEALTH_MASK_*: 0 = every part NOT_SUPPORTED
    health_summary: int = 0  # v3 only: NVML_GPU_FABRIC_HEALTH_SUMMARY_*

    def line(self) -> str:
        return (
            f"{self.state} {self.status} {self.clique_id} {self.cluster_uuid} "
            f"{self.health_mask} {self.health_summary}"
        )


class BuildUnavailable(Exception):
    """No C compiler or no nvml.h: the message says which, and how to get it."""


def nvml_header_dir() -> Path:
    """The directory holding ``nvml.h`` from the ``nvidia-nvml-dev`` wheel."""
    try:
        files = importlib.metadata.files("nvidia-nvml-dev") or []
    except importlib.metadata.PackageNotFoundError:
        raise BuildUnavailable(
            "nvidia-nvml-dev is not installed (it is in the test extras: pip install -e '.[test]')"
        ) from None
    for f in files:
        if f.name == "nvml.h":
            return Path(str(f.locate())).resolve().parent
    raise BuildUnavailable("nvidia-nvml-dev is installed but has no nvml.h")


def compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise BuildUnavailable(
        "no C compiler (cc, gcc or clang); scripts/test.sh installs gcc when run as root"
    )


def exported_functions() -> list[str]:
    """The NVML functions ``fakenvml.c`` defines with ``EXPORT``: exactly its symbol table."""
    text = SOURCE.read_text()
    names = re.findall(r"^EXPORT [^(]*?\b(nvml\w+)\(", text, re.M)
    names += re.findall(r"^UINT_GETTER\((nvml\w+),", text, re.M)
    return sorted(names)


def build(dest_dir: Path) -> Path:
    """Compile the fake library into ``dest_dir``; returns that directory."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / LIBRARY_NAME
    command = [
        compiler(),
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Wno-deprecated-declarations",  # nvmlDeviceGetTemperature is deprecated in CUDA 13
        "-fvisibility=hidden",  # only EXPORT-marked functions are in the symbol table
        "-DNVML_NO_UNVERSIONED_FUNC_DEFS",
        f"-I{nvml_header_dir()}",
        f"-Wl,-soname,{LIBRARY_NAME}",
        "-o",
        str(out),
        str(SOURCE),
        "-lpthread",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"building {LIBRARY_NAME} failed:\n{result.stderr}")
    return dest_dir


def environment(
    lib_dir: Path, config: Path, stats: Path | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment variables for a process that should load the fake library."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(lib_dir), env.get("LD_LIBRARY_PATH")) if p
    )
    env["FAKENVML_CONFIG"] = str(config)
    if stats is not None:
        env["FAKENVML_STATS"] = str(stats)
    else:
        env.pop("FAKENVML_STATS", None)
    return env


@dataclass
class FakeGpu:
    """One fake GPU; ``None`` keeps the library's default (an idle 80 GiB A100)."""

    name: str | None = None
    uuid: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_reserved: int | None = None
    utilization_gpu: int | None = None  # percent
    utilization_memory: int | None = None
    power_usage_mw: int | None = None
    power_limit_mw: int | None = None
    energy_mj: int | None = None
    temperature_c: int | None = None
    fan_percent: int | None = None
    processes: tuple[tuple[int, int], ...] | None = None  # (pid, bytes)
    synthetic_processes: tuple[int, int] | None = None  # (count, bytes each)
    errors: dict[str, str] = field(default_factory=dict)  # function or "*" → "GPU_IS_LOST"
    hangs: dict[str, float] = field(default_factory=dict)  # function or "*" → seconds
    # What an A100 reports besides, by fakenvml.c's key (ecc_corrected_volatile,
    # remapped_pending, clocks_event_reasons, pcie_width, retired_pages "2 1 0" …); the
    # library's defaults are a healthy A100-SXM4-80GB.
    health: dict[str, int | str] = field(default_factory=dict)
    xids: tuple[int, ...] = ()  # Xid events, each delivered once to a waiting event set
    # NVLinks (field values only): link → (state, tx KiB, rx KiB, CRC flit, CRC data, replay,
    # recovery); with ``health={"nvlink_links": N}``, links not listed are active and at 0.
    nvlinks: dict[int, tuple[int, int, int, int, int, int, int]] = field(default_factory=dict)
    # GPM: None = not supported (an A100); else NVML_GPM_METRIC_* id → value (percent, MiB/s)
    gpm: dict[int, float] | None = None
    gpm_instances: dict[int, int] = field(default_factory=dict)  # MIG GPU instance → SM %
    process_utilization: tuple[tuple[int, int, int], ...] = ()  # (pid, SM %, memory %)
    # Clock event reason durations (CLOCKS_EVENT_FIELDS), ns since the library loaded in the
    # reading process: reason → ns held down per second. A reason not given grows at 1e9 while
    # its bit is in clocks_event_reasons (health), sw_power_cap at LOADED_SW_POWER_CAP_NS_PER_S
    # while utilization_gpu > 0, the rest not at all. A new rate counts from when the library
    # notices the new file: a duration never goes backwards.
    clocks_event_rates: dict[str, float] = field(default_factory=dict)
    clocks_event_ns: dict[str, int] = field(default_factory=dict)  # reason → ns at load (0)
    clocks_event_durations: bool | None = None  # False: each of those entries NOT_SUPPORTED
    # nvmlDeviceGetGpuFabricInfo(V): None keeps the default, NOT_SUPPORTED (an A100)
    fabric: Fabric | Literal["NOT_SUPPORTED"] | None = None

    def lines(self, index: int | str) -> list[str]:
        out = []
        for key in (
            "name",
            "uuid",
            "memory_total",
            "memory_used",
            "memory_reserved",
            "utilization_gpu",
            "utilization_memory",
            "power_usage_mw",
            "power_limit_mw",
            "energy_mj",
            "temperature_c",
            "fan_percent",
        ):
            value = getattr(self, key)
            if value is not None:
                out.append(f"{index} {key} {value}")
        if self.processes is not None:
            listed = " ".join(f"{pid}:{used}" for pid, used in self.processes)
            out.append(f"{index} processes {listed}")
        if self.synthetic_processes is not None:
            n, used = self.synthetic_processes
            out.append(f"{index} synthetic_processes {n} {used}")
        out += [f"{index} {key} {value}" for key, value in self.health.items()]
        out += [f"{index} xid {xid}" for xid in self.xids]
        out += [f"{index} nvlink {k} {' '.join(map(str, v))}" for k, v in self.nvlinks.items()]
        if self.gpm is not None:
            out.append(f"{index} gpm_supported 1")
            out += [f"{index} gpm {metric} {value:g}" for metric, value in self.gpm.items()]
        if self.gpm_instances:
            listed = " ".join(f"{gi}:{sm}" for gi, sm in self.gpm_instances.items())
            out.append(f"{index} gpm_instances {listed}")
        if self.process_utilization:
            listed = " ".join(f"{p}:{sm}:{mem}" for p, sm, mem in self.process_utilization)
            out.append(f"{index} process_utilization {listed}")
        out += [
            f"{index} clocks_event_rate {r} {v:.17g}" for r, v in self.clocks_event_rates.items()
        ]
        out += [f"{index} clocks_event_ns {r} {v}" for r, v in self.clocks_event_ns.items()]
        if self.clocks_event_durations is not None:
            out.append(f"{index} clocks_event_durations {int(self.clocks_event_durations)}")
        if self.fabric == "NOT_SUPPORTED":
            out.append(f"{index} fabric none")
        elif self.fabric is not None:
            out.append(f"{index} fabric {self.fabric.line()}")
        out += [f"{index} error {fn} {err}" for fn, err in self.errors.items()]
        out += [f"{index} hang {fn} {seconds:g}" for fn, seconds in self.hangs.items()]
        return out


# An A100-SXM4-80GB's answers where the library's defaults are not what one reports: no fan.
# (Retired pages are NOT_SUPPORTED by default already: an A100 remaps rows instead.)
A100_SXM_ERRORS = {"nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"}


def config_text(
    gpus: Iterable[FakeGpu],
    *,
    driver_version: str = "550.54.15",
    cuda_driver_version: int = 12040,
    errors: Mapping[str, str] | None = None,
    every_gpu: FakeGpu | None = None,
    clocks_event_slowdown_ids: tuple[int, int, int] | None = None,
) -> str:
    """``clocks_event_slowdown_ids``: the field ids the SW thermal, HW thermal and HW power
    brake durations answer at, instead of CLOCKS_EVENT_FIELDS' 269-271 (e.g. 251-253)."""
    gpus = list(gpus)
    lines = [
        f"gpus {len(gpus)}",
        f"driver_version {driver_version}",
        f"cuda_driver_version {cuda_driver_version}",
    ]
    if clocks_event_slowdown_ids is not None:
        lines.append("clocks_event_slowdown_ids " + " ".join(map(str, clocks_event_slowdown_ids)))
    lines += [f"error {fn} {err}" for fn, err in (errors or {}).items()]
    if every_gpu is not None:
        lines += every_gpu.lines("*")
    for index, gpu in enumerate(gpus):
        lines += gpu.lines(index)
    return "\n".join(lines) + "\n"


def write_config(path: Path, gpus: Iterable[FakeGpu], **kwargs: object) -> None:
    """Write the configuration atomically (a new inode, so the library always notices)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config_text(gpus, **kwargs))  # type: ignore[arg-type]
    os.replace(tmp, path)


def read_stats(path: Path) -> dict[str, int]:
    """Calls so far by NVML function name (functions never called are left out)."""
    data = path.read_bytes()
    counts = {}
    for offset in range(0, len(data) - 63, 64):
        name = data[offset : offset + 56].rstrip(b"\0").decode()
        (calls,) = struct.unpack_from("<Q", data, offset + 56)
        if calls:
            counts[name] = calls
    return counts
