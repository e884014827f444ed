"""The Xid listener: counts every critical Xid error the driver reports, as it happens.

An NVML event set is registered for ``nvmlEventTypeXidCriticalError`` on every GPU that
supports it (GPUs or drivers that answer ``NOT_SUPPORTED`` / ``FUNCTION_NOT_FOUND`` are
skipped, once, with a log line), and waited on with ``nvmlEventSetWait_v2`` and a short
timeout, so the thread notices a stop request within that timeout. Each event adds one to
``gpu_xid_errors_total{gpu,uuid,xid}`` (a :class:`~gpu_exporter.counters.XidCounter`): repeats
of the same code are all counted, and nothing is reset while the process lives. Xid events
of a MIG device are counted on its parent GPU.
"""

from __future__ import annotations

import logging
from typing import Any

from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.background import NvmlThread
from gpu_exporter.counters import XidCounter
from gpu_exporter.nvml import (
    EVENT_TYPE_XID,
    GpuLost,
    Nvml,
    NvmlError,
    NvmlUnavailable,
    Unsupported,
    error_code,
    handle_key,
)
from gpu_exporter.units import plural

log = logging.getLogger(__name__)

# How long one wait may block: the longest stop() waits for the thread. An event ends the
# wait at once; each timeout wakes the thread (about 0.1 ms of CPU here), so not too often.
WAIT_TIMEOUT_MS = 2000
IDLE_SECONDS = 1.0


class XidListener(NvmlThread):
    name = "nvml-xid-events"

    def __init__(
        self,
        nvml: Nvml,
        counter: XidCounter,
        *,
        clock: Clock | None = None,
        timeout_ms: int = WAIT_TIMEOUT_MS,
    ) -> None:
        super().__init__(nvml)
        self.counter = counter
        self.clock: Clock = clock or SystemClock()
        self.timeout_ms = timeout_ms
        self._event_set: Any = None
        self._gpus: dict[int, tuple[int, str]] = {}  # handle key → (index, uuid)
        # UUIDs of the GPUs registered for Xid events, in index order: what the listener
        # covers (the start-up log line counts them); empty while idle.
        self.listening: tuple[str, ...] = ()
        self._told: set[str] = set()  # GPUs already logged as unable to report Xids

    def setup(self) -> None:
        self._gpus = {}
        try:
            self._event_set = self.nvml.event_set_create()
        except Unsupported as exc:  # a driver without event sets: stay idle, say so once
            if "" not in self._told:
                self._told.add("")
                log.info("this driver has no NVML event sets (%s); not listening for Xids", exc)
            self.listening = ()
            return
        for index in range(self.nvml.device_count()):
            try:
                handle = self.nvml.handle(index)
                uuid = self.nvml.uuid(handle)
            except NvmlUnavailable:
                raise
            except NvmlError as exc:
                log.warning("Xid events: cannot open GPU %d: %s", index, exc)
                continue
            try:
                if not self.nvml.supported_event_types(handle) & EVENT_TYPE_XID:
                    raise Unsupported(
                        "nvmlDeviceGetSupportedEventTypes", error_code("NOT_SUPPORTED"), "no Xid"
                    )
                self.nvml.register_events(handle, EVENT_TYPE_XID, self._event_set)
            except Unsupported as exc:
                if uuid not in self._told:
                    self._told.add(uuid)
                    log.info("GPU %s cannot report Xid errors (%s); not listening", uuid, exc)
                continue
            except NvmlUnavailable:
                raise
            except NvmlError as exc:
                log.warning("Xid events: cannot register GPU %s: %s", uuid, exc)
                continue
            self._gpus[handle_key(handle)] = (index, uuid)
        self.listening = tuple(uuid for _, uuid in sorted(self._gpus.values()))
        log.info("listening for Xid errors on %s", plural(len(self.listening), "GPU"))

    def step(self) -> None:
        if not self._gpus:  # nothing to listen on: stay idle until stopped
            self.wait(IDLE_SECONDS)
            return
        try:
            event = self.nvml.event_wait(self._event_set, self.timeout_ms)
        except GpuLost as exc:  # the wait itself reports the loss; the Xid came as an event
            log.warning("Xid events: %s", exc)
            self.wait(1.0)
            return
        except NvmlUnavailable:
            raise
        except NvmlError as exc:
            log.warning("Xid events: wait failed: %s", exc)
            self.wait(1.0)
            return
        if event is None or not event.event_type & EVENT_TYPE_XID:
            return
        gpu = self._gpus.get(event.device_key)
        if gpu is None:
            log.warning("Xid %d from an unknown device", event.data)
            return
        index, uuid = gpu
        log.warning("GPU %d (%s): Xid %d", index, uuid, event.data)
        self.counter.record(index, uuid, event.data, self.clock.time())

    def teardown(self) -> None:
        if self._event_set is not None:
            event_set, self._event_set = self._event_set, None
            self.nvml.event_set_free(event_set)
