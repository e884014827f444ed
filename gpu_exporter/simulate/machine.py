"""The simulated host behind :class:`~gpu_exporter.simulate.library.SimulatedNvml`.

It holds the GPUs and the clock, the faults applied to each call, the calls counted, NVML's
init reference count, and the event sets Xid errors are delivered to.

:class:`SimulatedMachine` holds the state and the rules every call goes through
(:meth:`SimulatedMachine._check`); the pynvml-named functions over it are in
:mod:`gpu_exporter.simulate.library`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

from gpu_exporter import nvml
from gpu_exporter.simulate.models import MIG_FUNCTIONS
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
from gpu_exporter.simulate.state import GpuState, MigState, gpu_state, mig_state

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
        self._release = threading.Event()

    @property
    def initialised(self) -> bool:
        return self.init_count > 0

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def of(cls: type[_M], scenario: Scenario, *, clock: Callable[[], float]) -> _M:
        return cls(
            list(scenario.gpus),
            faults=list(scenario.faults),
            clock=clock,
            driver_version=scenario.driver_version,
            cuda_driver_version=scenario.cuda_driver_version,
            xid_events=list(scenario.xid_events),
            pcie_sample_seconds=scenario.pcie_sample_seconds,
        )

    @classmethod
    def with_gpus(cls: type[_M], count: int, *, clock: Callable[[], float]) -> _M:
        """``--simulate N``: N A100s with a mix of busy, idle and changing loads."""
        return cls.of(Scenario.with_gpus(count), clock=clock)

    @classmethod
    def from_scenario(cls: type[_M], data: Mapping[str, Any], *, clock: Callable[[], float]) -> _M:
        """A scenario file's contents (see :mod:`gpu_exporter.simulate.scenario`)."""
        return cls.of(Scenario.from_table(data), clock=clock)

    @classmethod
    def from_argument(cls: type[_M], arg: str, *, clock: Callable[[], float]) -> _M:
        """``--simulate``'s argument: a GPU count or the path of a TOML scenario."""
        return cls.of(Scenario.from_argument(arg), clock=clock)

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

    # -- plumbing ------------------------------------------------------------------------------
    def release_hangs(self) -> None:
        """End every current and future HANG fault (tests call it before stopping)."""
        self._release.set()

    def _check(self, function: str, gpu: SimGpu | SimMig | None = None) -> None:
        """Count the call, apply the faults due now, and refuse what NVML would refuse:
        any call before nvmlInit, and what this card (or a MIG handle) does not answer."""
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
