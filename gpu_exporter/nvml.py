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
import ctypes
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from gpu_exporter.model import Event, MemoryInfo, ProcessInfo
from gpu_exporter.readings import FIELD_NUMBERS

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
MEMORY_V2: int = pynvml.nvmlMemory_v2

COMPUTE_MODES: dict[int, str] = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "default",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "exclusive_thread",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "prohibited",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process",
}
PCIE_COUNTERS: dict[str, int] = {
    "tx": pynvml.NVML_PCIE_UTIL_TX_BYTES,
    "rx": pynvml.NVML_PCIE_UTIL_RX_BYTES,
}
PSTATE_UNKNOWN: int = pynvml.NVML_PSTATE_UNKNOWN
EVENT_TYPE_XID: int = pynvml.nvmlEventTypeXidCriticalError
# gpuInstanceId / computeInstanceId when a process or event is not inside a MIG instance.
NO_INSTANCE = 0xFFFFFFFF

# -- GPM --------------------------------------------------------------------------------------
# The GPM metrics read, by GpuSample attribute: (NVML_GPM_METRIC_* id, NVML's unit divided
# by the base unit). Percentages (0-100) become ratios; NVML's MiB/s become bytes/s. GPM
# answers rates over the interval between two samples, not counters: exported as such.
_PERCENT = 100.0
_MIB = 1.0 / (1024 * 1024)
GPM_METRICS: dict[str, tuple[int, float]] = {
    "graphics_active_ratio": (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, _PERCENT),
    "sm_active_ratio": (pynvml.NVML_GPM_METRIC_SM_UTIL, _PERCENT),
    "sm_occupancy_ratio": (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, _PERCENT),
    "tensor_active_ratio": (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, _PERCENT),
    "tensor_hmma_active_ratio": (pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL, _PERCENT),
    "tensor_imma_active_ratio": (pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL, _PERCENT),
    "tensor_dfma_active_ratio": (pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL, _PERCENT),
    "fp64_active_ratio": (pynvml.NVML_GPM_METRIC_FP64_UTIL, _PERCENT),
    "fp32_active_ratio": (pynvml.NVML_GPM_METRIC_FP32_UTIL, _PERCENT),
    "fp16_active_ratio": (pynvml.NVML_GPM_METRIC_FP16_UTIL, _PERCENT),
    "dram_active_ratio": (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, _PERCENT),
    "pcie_transmit_bytes_per_second": (pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, _MIB),
    "pcie_receive_bytes_per_second": (pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, _MIB),
    "nvlink_transmit_bytes_per_second": (pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, _MIB),
    "nvlink_receive_bytes_per_second": (pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, _MIB),
}
GPM_METRICS_GET_VERSION: int = pynvml.NVML_GPM_METRICS_GET_VERSION
GPM_SUPPORT_VERSION: int = pynvml.NVML_GPM_SUPPORT_VERSION


def _gpm_request() -> Any:
    """nvmlGpmMetricsGet_t with the version, count and metric ids filled in, copied for each
    read; and where each metric's (nvmlReturn, value) lies in it, per GpuSample attribute."""
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = GPM_METRICS_GET_VERSION
    request.numMetrics = len(GPM_METRICS)
    for i, (metric_id, _scale) in enumerate(GPM_METRICS.values()):
        request.metrics[i].metricId = metric_id
    metric = pynvml.c_nvmlGpmMetric_t
    base = pynvml.c_nvmlGpmMetricsGet_t.metrics.offset + metric.nvmlReturn.offset
    assert metric.value.offset == metric.nvmlReturn.offset + 4  # (nvml.h: no padding)
    layout = tuple(
        (name, scale, base + i * ctypes.sizeof(metric))
        for i, (name, (_id, scale)) in enumerate(GPM_METRICS.items())
    )
    return request, layout


_GPM_REQUEST, _GPM_LAYOUT = _gpm_request()
_GPM_METRIC = struct.Struct("=id")  # nvmlReturn_t, double value


# -- the NVLink fabric --------------------------------------------------------------------
class _FabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t as nvml.h lays it out: the bindings' own struct is missing
    before nvidia-ml-py 12.550, and wrong in layout or in its UUID before 13.580."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_int),  # nvmlReturn_t of the fabric probe
        ("cliqueId", ctypes.c_uint),
        ("state", ctypes.c_uint),  # nvmlGpuFabricState_t (a char in C, then padding)
        ("healthMask", ctypes.c_uint),
    ]


_FABRIC_INFO_V2 = ctypes.sizeof(_FabricInfo) | 2 << 24  # NVML_STRUCT_VERSION(GpuFabricInfo, 2)
FABRIC_STATE_NOT_SUPPORTED = 0  # NVML_GPU_FABRIC_STATE_*: 1 not started, 2 in progress, 3 done
_NOT_SUPPORTED_CODE = pynvml.NVML_ERROR_NOT_SUPPORTED


# -- field values: many values in one call (issue 31) ---------------------------------------
# nvmlDeviceGetFieldValues ids this exporter asks for, by the header's name: the rows' of
# gpu_exporter.readings (its FIELD_NUMBERS), and NVLink's per-link counters (scopeId = the
# link, each summed over the link's lanes), read by collect/fields.py's code. The header's
# numbers, not the bindings': older bindings lack some, and gave others other numbers.
FIELD_IDS: dict[str, int] = {
    **FIELD_NUMBERS,
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 38,
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": 45,
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 52,
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": 59,
    "NVML_FI_DEV_NVLINK_LINK_COUNT": 91,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138,  # KiB, per link
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_NVLINK_GET_STATE": 165,  # per link: NVML_NVLINK_STATE_ACTIVE = 1
}
FIELD_NAMES: dict[int, str] = {number: name for name, number in FIELD_IDS.items()}
FIELD_VALUES = "nvmlDeviceGetFieldValues"
# The union member nvmlFieldValue_t.value holds for each nvmlValueType_t.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT


def field_function(field_id: int) -> str:
    """The ``function`` label of an error in one entry of a batch: the call and the field.

    >>> field_function(82)
    'nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)'
    """
    return f"{FIELD_VALUES}({FIELD_NAMES.get(field_id, field_id)})"


def constant(name: str) -> int:
    """The value of one of pynvml's constants, by name: ``NVML_CLOCK_SM`` → 1."""
    value: int = getattr(pynvml, name)
    return value


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


_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
# The v3 process struct (pynvml >= 12.535), for process lists in one call; None: pynvml's own.
_PROCESSES_V3: Any = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None)
_NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
_FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND


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


def handle_key(handle: Any) -> int:
    """A stable number for a device handle, to match events to the GPU they came from.

    Real handles are ctypes pointers, whose equality is by object; the address they point to
    is what identifies the device. Anything else (the simulator's objects) is its identity.
    """
    if isinstance(handle, ctypes._Pointer):
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    return id(handle)


def _instance(value: Any) -> int | None:
    if value is None or int(value) == NO_INSTANCE:
        return None
    return int(value)


class Nvml:
    """A thin, typed session over pynvml (or anything with the same functions).

    The sampler calls it from one reader thread, one GPU after another (a GPU whose call
    hangs keeps that thread, so it blocks only that GPU); the Xid listener and the PCIe
    thread call it from their own threads. It remembers which function each thread is
    inside, so a call that does not return can be named in errors and counted.
    """

    def __init__(
        self, lib: Any = pynvml, *, simulated: bool = False, count_calls: bool = False
    ) -> None:
        self._lib = lib
        # Calls made, by function, when asked for (bench/real_gpu.py's probe: the exporter's
        # NVML calls per GPU and sample on a real driver, which counts nothing itself).
        self.calls: Counter[str] | None = Counter() if count_calls else None
        self.simulated = simulated
        self._errors: Counter[tuple[str, str]] = Counter()
        self._errors_lock = threading.Lock()
        self._memory_v2 = True
        self._clocks_event_reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        self._in_flight: dict[int, str | None] = {}  # thread id → NVML function it is inside
        self._process_capacity = 16  # entries of the process-list buffer (see _processes)

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, function: str, *args: Any, answer: int | None = None, **kwargs: Any) -> Any:
        """Call ``function``, recording which thread is inside it; errors mapped.

        ``answer``: an error code that is an answer, not a failure (``NOT_FOUND`` for an empty
        MIG slot, ``TIMEOUT`` of a wait): None is returned, nothing counted or raised.
        """
        fn: Callable[..., Any] | None = getattr(self._lib, function, None)
        if fn is None:  # bindings older than this function: same as a driver without it
            raise Unsupported(function, _FUNCTION_NOT_FOUND, "not in these NVML bindings")
        return self._call_with(function, fn, *args, answer=answer, **kwargs)

    def _call_with(
        self,
        function: str,
        fn: Callable[..., Any],
        *args: Any,
        answer: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """``fn(*args)`` as :meth:`_call` calls ``function``."""
        if self.calls is not None:
            with self._errors_lock:
                self.calls[function] += 1
        in_flight, thread = self._in_flight, threading.get_ident()
        in_flight[thread] = function
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not hasattr(exc, "value"):  # not an NVMLError: a bug, let it surface
                raise
            if exc.value == answer:
                return None
            raise self._failed(function, exc) from exc
        finally:
            in_flight[thread] = None

    def _failed(self, function: str, exc: Exception) -> NvmlError:
        error = _classify(function, exc)
        if not isinstance(error, Unsupported):
            self._count(function, error.error)
        return error

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
        self._clocks_event_reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"

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

    # -- values -------------------------------------------------------------------------
    def get(self, function: str, handle: Any, *constants: str) -> Any:
        """pynvml's ``function(handle, *constants)``, its answer as pynvml gives it: a row of
        :data:`gpu_exporter.readings.READINGS` names the getter, its constants by their
        pynvml names, and the conversion to the base unit."""
        return self._call(function, handle, *(constant(name) for name in constants))

    def memory(self, handle: Any, *, whole_gpu: bool = True) -> MemoryInfo:
        """Frame-buffer memory. ``used`` follows nvidia-smi ≥ 510: reserved memory excluded.

        ``whole_gpu`` False (a MIG device): a v2 refusal falls back to v1 for this call only,
        instead of concluding that the driver has no v2 at all.
        """
        if self._memory_v2:
            try:
                m = self._call("nvmlDeviceGetMemoryInfo", handle, version=MEMORY_V2)
                return MemoryInfo(int(m.total), int(m.used), int(m.free), int(m.reserved))
            except Unsupported:
                # Driver older than 510: only v1 exists, and its "used" includes reserved.
                if whole_gpu:
                    self._memory_v2 = False
        m = self._call("nvmlDeviceGetMemoryInfo", handle)
        return MemoryInfo(int(m.total), int(m.used), int(m.free), None)

    def compute_processes(self, handle: Any) -> tuple[ProcessInfo, ...]:
        """Compute processes with their memory and MIG instance ids (the v3 struct).

        Only processes in this process's PID namespace are listed (a driver rule).
        """
        if self._lib is pynvml and _PROCESSES_V3 is not None:  # one call, not pynvml's two
            procs = self._call_with("nvmlDeviceGetComputeRunningProcesses", self._processes, handle)
        else:
            procs = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        return tuple(
            ProcessInfo(
                int(p.pid),
                None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                _instance(getattr(p, "gpuInstanceId", None)),
                _instance(getattr(p, "computeInstanceId", None)),
            )
            for p in procs
        )

    def _processes(self, handle: Any) -> list[Any]:
        """``nvmlDeviceGetComputeRunningProcesses_v3`` in one call where the list fits a
        buffer sized by the longest list so far (pynvml always makes two when there is a
        process: the count, then the list); a longer list grows the buffer and asks again."""
        assert _PROCESSES_V3 is not None
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        while True:
            capacity = self._process_capacity
            count = ctypes.c_uint(capacity)
            infos = (_PROCESSES_V3 * capacity)()
            ret = fn(handle, ctypes.byref(count), infos)
            if ret == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value > capacity:
                self._process_capacity = count.value * 2 + 5  # as pynvml oversizes
                continue
            if ret != pynvml.NVML_SUCCESS:
                raise pynvml.NVMLError(ret)
            procs = []
            for i in range(count.value):
                p = pynvml.nvmlStructToFriendlyObject(infos[i])
                if p.usedGpuMemory == _NOT_AVAILABLE:  # WDDM: the driver cannot say
                    p.usedGpuMemory = None
                procs.append(p)
            return procs

    # -- health ----------------------------------------------------------------------------
    def clocks_event_reasons(self, handle: Any) -> int:
        """The bitmask of why clocks are held down (readings.CLOCKS_EVENT_REASON_BITS).

        Drivers before 535 only have the older name of the same call.
        """
        if self._clocks_event_reasons_fn == "nvmlDeviceGetCurrentClocksEventReasons":
            try:
                return int(self._call(self._clocks_event_reasons_fn, handle))
            except Unsupported as exc:
                if exc.code != _FUNCTION_NOT_FOUND:
                    raise
                # A missing symbol is missing for every GPU: use the old name from now on.
                self._clocks_event_reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
        return int(self._call(self._clocks_event_reasons_fn, handle))

    def performance_state(self, handle: Any) -> int:
        """P-state 0 (fastest) to 15; ``Unsupported`` when the driver says "unknown"."""
        state = int(self._call("nvmlDeviceGetPerformanceState", handle))
        if state == PSTATE_UNKNOWN:
            raise Unsupported(
                "nvmlDeviceGetPerformanceState", pynvml.NVML_ERROR_NOT_SUPPORTED, "unknown"
            )
        return state

    def compute_mode(self, handle: Any) -> str:
        mode = int(self._call("nvmlDeviceGetComputeMode", handle))
        return COMPUTE_MODES.get(mode, str(mode))

    def gpu_fabric_info(self, handle: Any) -> _FabricInfo:
        """The GPU's registration with the NVLink fabric (NVSwitch systems: state, status,
        clique id); :class:`Unsupported` where there is none, whether the call refuses
        (before Hopper, a lone GPU) or answers the state NOT_SUPPORTED (an H100 PCIe)."""
        info = _FabricInfo(version=_FABRIC_INFO_V2)
        self._call("nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info))
        if info.state == FABRIC_STATE_NOT_SUPPORTED:
            raise Unsupported("nvmlDeviceGetGpuFabricInfoV", _NOT_SUPPORTED_CODE, "no fabric")
        return info

    # -- PCIe ------------------------------------------------------------------------------
    def pcie_throughput_bytes_per_second(self, handle: Any, direction: str) -> float:
        """PCIe traffic over NVML's 20 ms sample window: the call blocks for about that long.

        NVML reports KB/s (1 KB = 1024 bytes).
        """
        kb = int(self._call("nvmlDeviceGetPcieThroughput", handle, PCIE_COUNTERS[direction]))
        return kb * 1024.0

    # -- MIG -------------------------------------------------------------------------------
    def max_mig_device_count(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))

    def mig_device_handle(self, handle: Any, index: int) -> Any | None:
        """The MIG device in slot ``index`` of a parent GPU, or None if that slot is empty."""
        return self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, index, answer=_NOT_FOUND)

    def gpu_instance_id(self, mig_handle: Any) -> int:
        return int(self._call("nvmlDeviceGetGpuInstanceId", mig_handle))

    def compute_instance_id(self, mig_handle: Any) -> int:
        return int(self._call("nvmlDeviceGetComputeInstanceId", mig_handle))

    # -- events ----------------------------------------------------------------------------
    def event_set_create(self) -> Any:
        return self._call("nvmlEventSetCreate")

    def event_set_free(self, event_set: Any) -> None:
        self._call("nvmlEventSetFree", event_set)

    def supported_event_types(self, handle: Any) -> int:
        return int(self._call("nvmlDeviceGetSupportedEventTypes", handle))

    def register_events(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._call("nvmlDeviceRegisterEvents", handle, event_types, event_set)

    def event_wait(self, event_set: Any, timeout_ms: int) -> Event | None:
        """The next event, or None when ``timeout_ms`` passed without one (no exception for
        that usual answer: the listener asks every few seconds for the process's life)."""
        data = self._call("nvmlEventSetWait_v2", event_set, timeout_ms, answer=_TIMEOUT)
        if data is None:
            return None
        return Event(
            handle_key(data.device),
            int(data.eventType),
            int(data.eventData),
            _instance(getattr(data, "gpuInstanceId", None)),
            _instance(getattr(data, "computeInstanceId", None)),
        )

    # -- field values (issue 31) ---------------------------------------------------------
    def field_values(self, handle: Any, entries: Sequence[tuple[int, int]]) -> list[Any]:
        """One ``nvmlDeviceGetFieldValues`` call for ``(field id, scope id)`` entries: per entry,
        its value (an int, or a float for a double) or the :class:`NvmlError` of its own
        ``nvmlReturn``, which fails that entry alone.

        An entry's ``INVALID_ARGUMENT`` is :class:`Unsupported` (the batch itself is well formed,
        so the driver does not know that id); an entry's failure other than unsupported is
        counted under :func:`field_function`, once per field and call; a lost GPU in an entry
        raises :class:`GpuLost`. The call failing as a whole raises as any call does.
        """
        values = self._call(FIELD_VALUES, handle, list(entries))
        out: list[Any] = []
        counted: set[int] = set()
        for v in values:
            code = int(v.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                member = _VALUE_MEMBERS[int(v.valueType)] if 0 <= v.valueType < 7 else "ullVal"
                value = getattr(v.value, member)
                out.append(float(value) if member == "dVal" else int(value))
                continue
            function = field_function(int(v.fieldId))
            if code == _INVALID_ARGUMENT:
                code = pynvml.NVML_ERROR_NOT_SUPPORTED
            error = _classify(function, pynvml.NVMLError(code))
            if isinstance(error, GpuLost | NvmlUnavailable):
                self._count(function, error.error)
                raise error
            if not isinstance(error, Unsupported) and v.fieldId not in counted:
                counted.add(int(v.fieldId))
                self._count(function, error.error)
            out.append(error)
        return out

    # -- GPM (GPU Performance Monitoring, Hopper and later) --------------------------------
    # Kept in one block: GPM is read by collect/gpm.py at its own cadence, two samples apart.
    def gpm_supported(self, handle: Any) -> bool:
        """Whether this GPU answers GPM (``nvmlGpmQueryDeviceSupport``); older cards say no."""
        support = self._call("nvmlGpmQueryDeviceSupport", handle)
        return bool(support.isSupportedDevice)

    def gpm_sample_alloc(self) -> Any:
        """One GPM sample buffer, owned by the caller until :meth:`gpm_sample_free`."""
        return self._call("nvmlGpmSampleAlloc")

    def gpm_sample_free(self, sample: Any) -> None:
        self._call("nvmlGpmSampleFree", sample)

    def gpm_sample_get(self, handle: Any, sample: Any, gpu_instance_id: int | None = None) -> None:
        """Fill ``sample`` with the counters of a whole GPU now, or (``gpu_instance_id``) of
        one of its MIG GPU instances, read through the parent's handle."""
        if gpu_instance_id is None:
            self._call("nvmlGpmSampleGet", handle, sample)
        else:
            self._call("nvmlGpmMigSampleGet", handle, gpu_instance_id, sample)

    def gpm_metrics(self, older: Any, newer: Any) -> dict[str, float]:
        """The :data:`GPM_METRICS` between two samples of one device, in base units, by
        GpuSample attribute: a metric the device does not report (its own return code) is
        left out, never 0."""
        make = getattr(self._lib, "c_nvmlGpmMetricsGet_t", None)
        if make is None or make is pynvml.c_nvmlGpmMetricsGet_t:
            # pynvml's ctypes struct: copied from a filled-in template and read as bytes;
            # a metric at a time through ctypes took 35 of a read's 50 µs.
            request = pynvml.c_nvmlGpmMetricsGet_t.from_buffer_copy(_GPM_REQUEST)
            request.sample1, request.sample2 = older, newer
            self._call("nvmlGpmMetricsGet", request)
            answers = bytes(request)
            return {
                name: value / scale
                for name, scale, offset in _GPM_LAYOUT
                for code, value in (_GPM_METRIC.unpack_from(answers, offset),)
                if code == 0
            }
        request = make()  # the simulator's: plain attributes
        request.version = GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = older, newer
        for i, (metric_id, _scale) in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric_id
        self._call("nvmlGpmMetricsGet", request)
        out: dict[str, float] = {}
        for i, (name, (_metric_id, scale)) in enumerate(GPM_METRICS.items()):
            metric = request.metrics[i]
            if int(metric.nvmlReturn) == 0:
                out[name] = float(metric.value) / scale
        return out

    # -- per-process utilization -----------------------------------------------------------
    def process_utilization(self, handle: Any, since_us: int) -> dict[int, tuple[float, float]]:
        """pid → (SM, memory-controller) utilization ratios of its latest sample after
        ``since_us`` (Unix time in µs). NVML lists only processes with some utilization, and
        answers ``NOT_FOUND`` when none had any: an empty answer, not a failure."""
        samples = self._call("nvmlDeviceGetProcessUtilization", handle, since_us, answer=_NOT_FOUND)
        latest: dict[int, tuple[int, float, float]] = {}
        for s in samples or ():
            pid, stamp = int(s.pid), int(s.timeStamp)
            if pid not in latest or stamp >= latest[pid][0]:
                latest[pid] = (stamp, int(s.smUtil) / 100.0, int(s.memUtil) / 100.0)
        return {pid: (sm, mem) for pid, (_stamp, sm, mem) in latest.items()}
