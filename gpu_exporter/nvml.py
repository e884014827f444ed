"""The only module that imports ``pynvml`` (the ``nvidia-ml-py`` distribution).

Everything NVML-specific stops here: callers get plain Python values in base units
(bytes, watts, joules, hertz, ratios 0–1) and the project's own exceptions.

* ``NOT_SUPPORTED`` and ``FUNCTION_NOT_FOUND`` (an older driver without that entry point)
  become :class:`Unsupported`, which the sampler turns into an absent field — never 0, never NaN.
* ``GPU_IS_LOST`` and its relatives become :class:`GpuLost`: that one GPU is down.
* Library-level failures (driver not loaded, driver/library version mismatch, not initialised)
  become :class:`NvmlUnavailable`: every GPU is unknown until NVML is initialised again.
* Anything else is an :class:`NvmlError` for that one call.

The module behind the wrapper is injectable: :class:`Nvml` takes any object with pynvml's
functions, which is how :mod:`gpu_exporter.simulate` drives this same code without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

# Error names as used in the ``error`` label of gpu_exporter_nvml_errors_total: "GPU_IS_LOST".
ERROR_NAMES: dict[int, str] = {
    getattr(pynvml, name): name.removeprefix("NVML_ERROR_")
    for name in dir(pynvml)
    if name.startswith("NVML_ERROR_")
}
_CODES_BY_NAME = {name: code for code, name in ERROR_NAMES.items()}
# Not an NVML code: the ``error`` label for a call that did not return within the deadline.
TIMEOUT = "TIMEOUT"

_UNSUPPORTED_CODES = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
)
# The GPU itself is gone or unusable until reset (Xid 79 "fallen off the bus" and friends).
_LOST_CODES = frozenset(
    {
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_RESET_REQUIRED,
        pynvml.NVML_ERROR_GPU_NOT_FOUND,
    }
)
# The library as a whole is unusable; re-initialising is the only way back.
_LIBRARY_CODES = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

CLOCK_TYPES: dict[str, int] = {
    "graphics": pynvml.NVML_CLOCK_GRAPHICS,
    "sm": pynvml.NVML_CLOCK_SM,
    "memory": pynvml.NVML_CLOCK_MEM,
    "video": pynvml.NVML_CLOCK_VIDEO,
}
TEMPERATURE_GPU: int = pynvml.NVML_TEMPERATURE_GPU
MEMORY_V2: int = pynvml.nvmlMemory_v2


def error_code(name: str) -> int:
    """The NVML return code for a name such as ``"GPU_IS_LOST"`` (``NVML_ERROR_`` optional).

    >>> error_code("GPU_IS_LOST")
    15
    """
    key = name.upper().removeprefix("NVML_ERROR_")
    try:
        return _CODES_BY_NAME[key]
    except KeyError:
        raise ValueError(f"unknown NVML error {name!r}") from None


def make_error(code: int) -> Exception:
    """A pynvml exception for ``code``, exactly as the real bindings raise it.

    The simulator raises these so that its errors travel the same path as the driver's.
    """
    exc: Exception = pynvml.NVMLError(code)
    return exc


class NvmlError(Exception):
    """An NVML call failed. ``function`` is the NVML function, ``error`` its error name."""

    def __init__(self, function: str, code: int, message: str) -> None:
        self.function = function
        self.code = code
        self.error = ERROR_NAMES.get(code, str(code))
        super().__init__(f"{function}: {message} ({self.error})")


class Unsupported(NvmlError):
    """This GPU or driver cannot report that value. Not a failure: the value is absent."""


class GpuLost(NvmlError):
    """The GPU stopped answering (fell off the bus, needs a reset)."""


class NvmlUnavailable(NvmlError):
    """NVML itself is unusable: no driver, a version mismatch, not initialised."""


def _classify(function: str, exc: Exception) -> NvmlError:
    code = int(getattr(exc, "value", pynvml.NVML_ERROR_UNKNOWN))
    message = str(exc)
    if code in _UNSUPPORTED_CODES:
        return Unsupported(function, code, message)
    if code in _LOST_CODES:
        return GpuLost(function, code, message)
    if code in _LIBRARY_CODES:
        return NvmlUnavailable(function, code, message)
    return NvmlError(function, code, message)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_bytes: int
    used_bytes: int
    free_bytes: int
    # Driver-reserved memory; None where only the v1 call exists (then used includes it).
    reserved_bytes: int | None


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    used_memory_bytes: int | None


class Nvml:
    """A thin, typed session over pynvml (or anything with the same functions).

    The sampler calls it from one worker thread per GPU (so a hung call blocks only that
    GPU), one GPU after another; it remembers which function each thread is inside, so a
    call that does not return can be named in errors and counted.
    """

    def __init__(self, lib: Any = pynvml, *, simulated: bool = False) -> None:
        self._lib = lib
        self.simulated = simulated
        self._errors: Counter[tuple[str, str]] = Counter()
        self._errors_lock = threading.Lock()
        self._memory_v2 = True
        self._in_flight: dict[int, str] = {}  # thread id → NVML function it is inside

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        fn: Callable[..., Any] = getattr(self._lib, function)
        thread = threading.get_ident()
        self._in_flight[thread] = function
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not hasattr(exc, "value"):  # not an NVMLError: a bug, let it surface
                raise
            error = _classify(function, exc)
            if not isinstance(error, Unsupported):
                self._count(function, error.error)
            raise error from exc
        finally:
            self._in_flight.pop(thread, None)

    def _count(self, function: str, error: str) -> None:
        with self._errors_lock:
            self._errors[(function, error)] += 1

    def in_flight(self, thread_id: int) -> str | None:
        """The NVML function thread ``thread_id`` is inside right now, if any."""
        return self._in_flight.get(thread_id)

    def count_timeout(self, function: str) -> None:
        """Record a call that did not return within the sampler's deadline (once per hang)."""
        self._count(function, TIMEOUT)

    def error_counts(self) -> dict[tuple[str, str], int]:
        """Failed calls so far, by (NVML function, error name). Unsupported is not failure."""
        with self._errors_lock:
            return dict(self._errors)

    # -- library -------------------------------------------------------------------------
    def init(self) -> None:
        """Initialise NVML; raises :class:`NvmlError` (usually :class:`NvmlUnavailable`)."""
        try:
            self._call("nvmlInit")
        except NvmlError as exc:
            if isinstance(exc, NvmlUnavailable):
                raise
            raise NvmlUnavailable(exc.function, exc.code, str(exc)) from exc
        self._memory_v2 = True

    def shutdown(self) -> None:
        with contextlib.suppress(NvmlError):
            self._call("nvmlShutdown")

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> str:
        """The CUDA version the driver supports, as ``"12.4"``."""
        version = int(self._call("nvmlSystemGetCudaDriverVersion"))
        return f"{version // 1000}.{version % 1000 // 10}"

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    # -- identity ------------------------------------------------------------------------
    def uuid(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetUUID", handle))

    def name(self, handle: Any) -> str:
        return _text(self._call("nvmlDeviceGetName", handle))

    def pci_bus_id(self, handle: Any) -> str:
        """The PCI bus id as nvidia-smi prints it: ``00000000:3B:00.0``."""
        return _text(self._call("nvmlDeviceGetPciInfo", handle).busId)

    # -- values, in base units -----------------------------------------------------------
    def memory(self, handle: Any) -> MemoryInfo:
        """Frame-buffer memory. ``used`` follows nvidia-smi ≥ 510: reserved memory excluded."""
        if self._memory_v2:
            try:
                m = self._call("nvmlDeviceGetMemoryInfo", handle, version=MEMORY_V2)
                return MemoryInfo(int(m.total), int(m.used), int(m.free), int(m.reserved))
            except Unsupported:
                # Driver older than 510: only v1 exists, and its "used" includes reserved.
                self._memory_v2 = False
        m = self._call("nvmlDeviceGetMemoryInfo", handle)
        return MemoryInfo(int(m.total), int(m.used), int(m.free), None)

    def utilization(self, handle: Any) -> tuple[float, float]:
        """(GPU busy, memory-controller busy), each a ratio 0–1 over the driver's last period."""
        u = self._call("nvmlDeviceGetUtilizationRates", handle)
        return u.gpu / 100.0, u.memory / 100.0

    def power_draw_watts(self, handle: Any) -> float:
        return int(self._call("nvmlDeviceGetPowerUsage", handle)) / 1000.0

    def power_limit_watts(self, handle: Any) -> float:
        return int(self._call("nvmlDeviceGetEnforcedPowerLimit", handle)) / 1000.0

    def energy_joules(self, handle: Any) -> float:
        """Energy since the driver was loaded (NVML counts millijoules)."""
        return int(self._call("nvmlDeviceGetTotalEnergyConsumption", handle)) / 1000.0

    def temperature_celsius(self, handle: Any) -> float:
        return float(self._call("nvmlDeviceGetTemperature", handle, TEMPERATURE_GPU))

    def fan_speed_ratio(self, handle: Any) -> float:
        return int(self._call("nvmlDeviceGetFanSpeed", handle)) / 100.0

    def clock_hz(self, handle: Any, clock: str) -> float:
        return int(self._call("nvmlDeviceGetClockInfo", handle, CLOCK_TYPES[clock])) * 1e6

    def compute_processes(self, handle: Any) -> tuple[ProcessInfo, ...]:
        procs = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        return tuple(
            ProcessInfo(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs
        )
