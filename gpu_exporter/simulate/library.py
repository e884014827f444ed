"""pynvml's functions over a simulated host: :class:`SimulatedNvml`, which ``gpu-exporter
serve --simulate`` hands to :class:`~gpu_exporter.nvml.Nvml` in place of the ``pynvml`` module.

:class:`SimulatedMachine` is the host: the GPUs and the clock, the faults applied to each
call, the calls counted, NVML's init reference count, and the event sets Xid errors are
delivered to. Each function of :class:`SimulatedNvml` checks the call first (faults,
``NOT_SUPPORTED``, ``UNINITIALIZED``: :meth:`SimulatedMachine._check`), then answers from the
GPU's :class:`~gpu_exporter.simulate.state.GpuState` at this moment, its model, or its health.
Errors are genuine pynvml exceptions (:func:`gpu_exporter.nvml.make_error`), so they travel
the same path as the driver's. Signatures and return types are pynvml's (bytes names, KB/s,
milliwatts, structs as namespaces).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

from gpu_exporter import nvml
from gpu_exporter.readings import READINGS
from gpu_exporter.simulate.models import COMPUTE_MODES, MIG_FUNCTIONS
from gpu_exporter.simulate.scenario import (
    DEFAULT_CUDA_DRIVER_VERSION,
    DEFAULT_DRIVER_VERSION,
    HANG,
    Fault,
    Scenario,
    SimGpu,
    SimMig,
    XidEvent,
)
from gpu_exporter.simulate.state import GpuState, MigState, gpm_values, gpu_state, mig_state
from gpu_exporter.valuerow import Reading, Simulated

_M = TypeVar("_M", bound="SimulatedMachine")


@dataclass(eq=False, slots=True)
class SimEventSet:
    """What nvmlEventSetCreate returns: the GPUs registered, and events not yet waited for."""

    registered: dict[int, int] = field(default_factory=dict)  # GPU index → event mask
    queue: deque[SimpleNamespace] = field(default_factory=deque)
    freed: bool = False


class SimulatedMachine:
    """Simulated GPUs, the clock their values follow, and what happens to calls on them."""

    def __init__(
        self,
        gpus: list[SimGpu],
        *,
        faults: list[Fault] | None = None,
        clock: Callable[[], float],
        driver_version: str = DEFAULT_DRIVER_VERSION,
        cuda_driver_version: int = DEFAULT_CUDA_DRIVER_VERSION,
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
        self.gpm_samples: set[int] = set()  # ids of GPM sample buffers allocated, not freed
        self._release = threading.Event()

    @property
    def initialised(self) -> bool:
        return self.init_count > 0

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def of(cls: type[_M], scenario: Scenario, *, clock: Callable[[], float]) -> _M:
        """The host ``scenario`` describes (``Scenario.from_argument`` reads ``--simulate``'s
        argument: a GPU count or a scenario file)."""
        return cls(
            list(scenario.gpus),
            faults=list(scenario.faults),
            clock=clock,
            driver_version=scenario.driver_version,
            cuda_driver_version=scenario.cuda_driver_version,
            xid_events=list(scenario.xid_events),
            pcie_sample_seconds=scenario.pcie_sample_seconds,
        )

    # -- state -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self._clock() - self._t0

    def state(self, index: int) -> GpuState:
        return gpu_state(self.gpus[index], self.elapsed())

    def mig_state(self, index: int, slot: int) -> MigState:
        return mig_state(self.gpus[index], slot, self.elapsed())

    def energy_mj(self, index: int) -> int:
        """Energy counter: power integrated over the simulator's clock (trapezoids per call)."""
        gpu = self.gpus[index]
        now = self.elapsed()
        power_w = self.state(index).power_usage_mw / 1000
        if gpu.energy_at is not None:
            gpu.energy_mj += power_w * (now - gpu.energy_at) * 1000
        gpu.energy_at = now
        return int(gpu.energy_mj)

    def utilization(self, gpu: SimGpu) -> SimpleNamespace | None:
        """nvmlDeviceGetUtilizationRates' struct; None in MIG mode (NVML reports none)."""
        if gpu.mig:
            return None
        s = self.state(gpu.index)
        return SimpleNamespace(gpu=s.utilization_gpu, memory=s.utilization_memory)

    def max_clock_mhz(self, gpu: SimGpu, clock_type: int) -> int:
        m = gpu.model
        return {
            nvml.CLOCK_TYPES["graphics"]: m.max_sm_clock_mhz,
            nvml.CLOCK_TYPES["sm"]: m.max_sm_clock_mhz,
            nvml.CLOCK_TYPES["memory"]: m.max_memory_clock_mhz,
            nvml.CLOCK_TYPES["video"]: round(m.max_sm_clock_mhz * 0.85),
        }[clock_type]

    def temperature_threshold(self, gpu: SimGpu, threshold: int) -> int:
        return gpu.model.temperature_thresholds[threshold]

    # -- plumbing ------------------------------------------------------------------------------
    def release_hangs(self) -> None:
        """End every current and future HANG fault (tests call it before stopping)."""
        self._release.set()

    def _check(self, function: str, gpu: SimGpu | SimMig | None = None) -> None:
        """Count the call, apply the faults due now, and refuse what NVML would refuse:
        any call before nvmlInit, and what this card (or a MIG handle) does not answer."""
        with self._lock:
            self.calls[function] = self.calls.get(function, 0) + 1
        parent = gpu.parent if isinstance(gpu, SimMig) else gpu
        self._faults(function, parent.index if parent is not None else None)
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

    def _faults(self, function: str, index: int | None) -> None:
        """Apply the faults due now to ``function`` on GPU ``index``: hang, or raise."""
        t = self.elapsed()
        for fault in self.faults:
            if fault.active(t) and fault.matches(function, index):
                if fault.error == HANG:
                    self._release.wait(fault.hang_seconds)
                    continue
                raise nvml.make_error(nvml.error_code(fault.error))

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

    def _next_xid_due(self) -> float:
        """When the next scenario Xid event is due (simulated seconds; inf when none is to
        come). Call with the lock held."""
        due = (event.at(self._xids_delivered[k]) for k, event in enumerate(self.xid_events))
        return min((t for t in due if t is not None), default=math.inf)

    def _deliver_scheduled(self) -> None:
        """Scenario Xid events that are due by now (call with the lock held)."""
        t = self.elapsed()
        for k, event in enumerate(self.xid_events):
            while self._xids_delivered[k] < event.due(t):
                self._xids_delivered[k] += 1
                self._deliver_xid(event.gpu, event.xid)


class SimulatedNvml(SimulatedMachine):
    """Implements the pynvml functions :class:`gpu_exporter.nvml.Nvml` calls."""

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

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: SimGpu | SimMig
    ) -> list[SimpleNamespace]:
        """The v3 struct: pid, usedGpuMemory, gpuInstanceId, computeInstanceId."""
        self._check("nvmlDeviceGetComputeRunningProcesses", handle)
        gpu = handle.parent if isinstance(handle, SimMig) else handle
        if gpu.mig:  # the MIG devices' processes, each with its instance ids
            slots = [handle.slot] if isinstance(handle, SimMig) else range(len(gpu.mig))
            states = [self.mig_state(gpu.index, slot) for slot in slots]
            found = [(m.processes, m.gpu_instance_id, m.compute_instance_id) for m in states]
        else:
            found = [(self.state(gpu.index).processes, nvml.NO_INSTANCE, nvml.NO_INSTANCE)]
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi, computeInstanceId=ci)
            for processes, gi, ci in found
            for pid, used in processes
        ]

    def nvmlDeviceGetPcieThroughput(self, gpu: SimGpu, counter: int) -> int:
        """KB/s over a 20 ms window; blocks for ``pcie_sample_seconds`` like the driver."""
        gpu = self._gpu("nvmlDeviceGetPcieThroughput", gpu)
        if self.pcie_sample_seconds:
            time.sleep(self.pcie_sample_seconds)
        s = self.state(gpu.index)
        if counter == nvml.PCIE_COUNTERS["tx"]:
            return s.pcie_tx_kb_per_second
        return s.pcie_rx_kb_per_second

    # -- field values (issue 31) -------------------------------------------------------------
    def nvmlDeviceGetFieldValues(
        self, handle: SimGpu | SimMig, field_ids: list[tuple[int, int]]
    ) -> list[SimpleNamespace]:
        """Each (field id, scope id) entry answered alone, as the driver does: its value, or
        the error of the getter the model refuses for the same value."""
        gpu = self._gpu("nvmlDeviceGetFieldValues", handle)
        out = []
        for field_id, scope in field_ids:
            try:
                value_type, value = self._field_value(gpu, field_id, scope)
                code = 0
            except Exception as exc:  # a pynvml error: that entry's nvmlReturn
                if not hasattr(exc, "value"):
                    raise
                value_type, value, code = 3, 0, int(exc.value)
            member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[value_type]
            out.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=scope,
                    nvmlReturn=code,
                    valueType=value_type,
                    value=SimpleNamespace(**{member: value}),
                )
            )
        return out

    def _field_value(self, gpu: SimGpu, field_id: int, scope: int) -> tuple[int, float]:
        """(nvmlValueType_t, value) of one field of ``gpu``; raises a pynvml error."""
        name = nvml.FIELD_NAMES.get(field_id, "")
        row = _ROW_OF_FIELD.get(name)
        if row is not None:
            if row.getter is not None:  # the same value: the getter's faults and refusals apply
                self._faults(row.getter, gpu.index)
                if row.getter in gpu.model.unsupported or row.getter in gpu.unsupported:
                    raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
            answer = row.simulate_field or _SIMULATED[row.getter, row.args]
            value = answer(self, gpu, *(nvml.constant(c) for c in row.args))
            if value is None:
                raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
            return (0, value) if isinstance(value, float) else (3, value)
        links = gpu.model.nvlinks
        if name == "NVML_FI_DEV_NVLINK_LINK_COUNT" and links:
            return 1, links
        if name.startswith("NVML_FI_DEV_NVLINK_") and links:
            if scope >= links:
                raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
            if name == "NVML_FI_DEV_NVLINK_GET_STATE":
                return 1, 1
            if "THROUGHPUT" in name:  # KiB since the start: ~0.2 GB/s a link, rx a bit more
                rate = 200_000 + 1_000 * scope + (50_000 if name.endswith("RX") else 0)
                return 3, int(self.elapsed() * rate)
            return 3, 0  # error counters: a healthy link
        raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))

    # -- MIG -------------------------------------------------------------------------------------
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
                # Scheduled events follow the simulator's clock: wake when the next is due
                # (on a real clock; a test's clock moves on its own, the wait is short there).
                until = self._next_xid_due() - self.elapsed()
                self._events.wait(min(remaining, max(until, 0.001)))


# -- GPM and per-process utilization -----------------------------------------------------------


@dataclass(eq=False, slots=True)
class SimGpmSample:
    """What nvmlGpmSampleAlloc returns: whose figures it holds (GPU, GPU instance) and when."""

    gpu: SimGpu | None = None
    gpu_instance_id: int | None = None
    values: dict[int, float] = field(default_factory=dict)
    freed: bool = False


class SimGpmMetricsGet:
    """pynvml's c_nvmlGpmMetricsGet_t, as plain attributes (the simulator's samples are not
    ctypes pointers)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: SimGpmSample | None = None
        self.sample2: SimGpmSample | None = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(32)]


class _GpmFunctions:
    """The GPM functions and nvmlDeviceGetProcessUtilization, mixed into SimulatedNvml."""

    c_nvmlGpmMetricsGet_t = SimGpmMetricsGet

    def nvmlGpmQueryDeviceSupport(self: Any, gpu: SimGpu) -> SimpleNamespace:
        gpu = self._gpu("nvmlGpmQueryDeviceSupport", gpu)
        return SimpleNamespace(version=1, isSupportedDevice=int(gpu.model.gpm))

    def nvmlGpmSampleAlloc(self: Any) -> SimGpmSample:
        self._check("nvmlGpmSampleAlloc")
        sample = SimGpmSample()
        with self._lock:
            self.gpm_samples.add(id(sample))
        return sample

    def nvmlGpmSampleFree(self: Any, sample: SimGpmSample) -> None:
        self._check("nvmlGpmSampleFree")
        with self._lock:
            if sample.freed or id(sample) not in self.gpm_samples:
                raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
            sample.freed = True
            self.gpm_samples.discard(id(sample))

    def nvmlGpmSampleGet(self: Any, gpu: SimGpu, sample: SimGpmSample) -> SimGpmSample:
        gpu = self._gpu("nvmlGpmSampleGet", gpu)
        return _fill(self, gpu, None, sample)

    def nvmlGpmMigSampleGet(
        self: Any, gpu: SimGpu, gpu_instance_id: int, sample: SimGpmSample
    ) -> SimGpmSample:
        gpu = self._gpu("nvmlGpmMigSampleGet", gpu)
        if not 1 <= gpu_instance_id <= len(gpu.mig):  # mig_state: instance id = slot + 1
            raise nvml.make_error(nvml.error_code("NOT_FOUND"))
        return _fill(self, gpu, gpu_instance_id, sample)

    def nvmlGpmMetricsGet(self: Any, request: SimGpmMetricsGet) -> SimGpmMetricsGet:
        """Each metric the mean of the two samples' figures, or NOT_SUPPORTED in its entry."""
        one, two = request.sample1, request.sample2
        gpu = one.gpu if one is not None else None
        self._check("nvmlGpmMetricsGet", gpu)
        if (
            request.version != nvml.GPM_METRICS_GET_VERSION
            or one is None
            or two is None
            or one.gpu is None
            or (one.gpu, one.gpu_instance_id) != (two.gpu, two.gpu_instance_id)
        ):
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        for metric in request.metrics[: request.numMetrics]:
            a, b = one.values.get(metric.metricId), two.values.get(metric.metricId)
            if a is None or b is None:
                metric.nvmlReturn, metric.value = nvml.error_code("NOT_SUPPORTED"), 0.0
            else:
                metric.nvmlReturn, metric.value = 0, (a + b) / 2
        return request

    def nvmlDeviceGetProcessUtilization(self: Any, gpu: SimGpu, since_us: int) -> list[Any]:
        """One sample per process that used the card: its share of the card's utilization;
        NOT_FOUND when none did, as the driver. NVML reports none in MIG mode."""
        gpu = self._gpu("nvmlDeviceGetProcessUtilization", gpu)
        if gpu.mig:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        s = self.state(gpu.index)
        if not s.processes or not s.utilization_gpu:
            raise nvml.make_error(nvml.error_code("NOT_FOUND"))
        n = len(s.processes)
        stamp = max(int(time.time() * 1e6), since_us + 1)
        return [
            SimpleNamespace(
                pid=pid,
                timeStamp=stamp,
                smUtil=s.utilization_gpu // n,
                memUtil=s.utilization_memory // n,
                encUtil=0,
                decUtil=0,
            )
            for pid, _used in s.processes
        ]


def _fill(
    m: SimulatedNvml, gpu: SimGpu, gpu_instance_id: int | None, sample: SimGpmSample
) -> SimGpmSample:
    if not gpu.model.gpm:
        raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
    if sample.freed:
        raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
    sample.gpu, sample.gpu_instance_id = gpu, gpu_instance_id
    sample.values = gpm_values(gpu, m.elapsed(), gpu_instance_id)
    return sample


for _name in dir(_GpmFunctions):
    if _name.startswith(("nvml", "c_nvml")):
        setattr(SimulatedNvml, _name, getattr(_GpmFunctions, _name))


def _reading(function: str, read: Callable[[SimulatedNvml, SimGpu], Any]) -> Callable[..., Any]:
    """The pynvml function ``function(gpu)``: the call checked, then ``read`` answers it."""

    def call(self: SimulatedNvml, gpu: SimGpu) -> Any:
        return read(self, self._gpu(function, gpu))

    call.__name__ = call.__qualname__ = function
    return call


# The functions that take a whole GPU and answer one figure of its state now, its model or
# its health, that no row of gpu_exporter.readings answers (code of their own).
_READINGS: dict[str, Callable[[SimulatedNvml, SimGpu], Any]] = {
    "nvmlDeviceGetPciInfo": lambda m, g: SimpleNamespace(busId=g.pci_bus_id.encode()),
    "nvmlDeviceGetCurrentClocksThrottleReasons": lambda m, g: m.state(g.index).clocks_event_reasons,
    "nvmlDeviceGetComputeMode": lambda m, g: COMPUTE_MODES[g.compute_mode],
    "nvmlDeviceGetMaxMigDeviceCount": lambda m, g: 7,
    "nvmlDeviceGetSupportedEventTypes": lambda m, g: g.model.supported_events,
}
for _name, _read in _READINGS.items():
    setattr(SimulatedNvml, _name, _reading(_name, _read))

# What a row of gpu_exporter.readings says the simulated GPU answers: its getter's answer by
# (getter, constants), and the row of each field id.
_SIMULATED: dict[tuple[str | None, tuple[str, ...]], Simulated] = {
    (r.getter, r.args): r.simulate for r in READINGS if r.simulate is not None
}
_ROW_OF_FIELD: dict[str, Reading] = {name: r for r in READINGS for name in r.fields}


def _answering(function: str) -> Callable[..., Any]:
    """The pynvml function ``function(gpu, *constants, *rest)``: the call checked, then the
    row of those constants answers it (another constant is an invalid argument, as the
    driver's); what follows the constants (a struct to fill) is the row's too."""
    rows = {
        tuple(nvml.constant(c) for c in args): simulate
        for (getter, args), simulate in _SIMULATED.items()
        if getter == function
    }
    n = len(next(iter(rows)))  # the rows of one getter name as many constants

    def call(self: SimulatedNvml, handle: SimGpu, *constants: Any) -> Any:
        gpu = self._gpu(function, handle)
        simulate = rows.get(tuple(constants[:n]))
        if simulate is None:
            raise nvml.make_error(nvml.error_code("INVALID_ARGUMENT"))
        value = simulate(self, gpu, *constants)
        if value is None:
            raise nvml.make_error(nvml.error_code("NOT_SUPPORTED"))
        return value

    call.__name__ = call.__qualname__ = function
    return call


for _getter in {getter for getter, _ in _SIMULATED if getter is not None}:
    setattr(SimulatedNvml, _getter, _answering(_getter))
