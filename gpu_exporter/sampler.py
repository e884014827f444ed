"""Reading NVML into snapshots, and the one background thread that does it.

* :func:`read_gpu` reads one GPU; every field is isolated, so one unsupported or failing
  field leaves the others in place, and a lost GPU is reported as ``up=False``.
* :class:`SnapshotCache` holds the latest snapshot (swapped atomically) plus a short history.
* :class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session: initialises it with
  backoff (1 s doubling to 5 min), samples every ``interval`` and publishes to the cache.
  Requests only ever read the cache; they never call NVML.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpu_exporter.model import CLOCKS, GpuSample, Snapshot, initial_snapshot
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)

INIT_BACKOFF_INITIAL_SECONDS = 1.0
INIT_BACKOFF_MAX_SECONDS = 300.0
HISTORY_LENGTH = 600  # snapshots kept: 10 minutes at the default 1 s interval


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass(frozen=True, slots=True)
class _Identity:
    uuid: str
    name: str | None
    pci_bus_id: str | None


class _FieldReader:
    """Reads fields of one GPU, remembering which (GPU, field) pairs are unsupported."""

    def __init__(self, handle: Any, uuid: str, unsupported: set[tuple[str, str]]) -> None:
        self.handle = handle
        self.uuid = uuid
        self.unsupported = unsupported
        self.values: dict[str, Any] = {}
        self.last_error: str | None = None

    def read(self, fields: tuple[str, ...], fn: Callable[[Any], Any]) -> None:
        """Store ``fn(handle)`` under ``fields`` (a tuple result fills several fields)."""
        key = fields[0]
        if (self.uuid, key) in self.unsupported:
            return
        try:
            value = fn(self.handle)
        except Unsupported:
            self.unsupported.add((self.uuid, key))
            log.info("GPU %s does not support %s; not asking again", self.uuid, key)
            return
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            self.last_error = str(exc)
            return
        if len(fields) == 1:
            self.values[key] = value
        else:
            self.values.update(zip(fields, value, strict=True))


def read_gpu(
    nvml: Nvml, index: int, identity: _Identity | None, unsupported: set[tuple[str, str]]
) -> tuple[GpuSample, _Identity | None]:
    """One GPU's sample, and its identity for next time. Never raises for GPU-level errors."""
    known_uuid = identity.uuid if identity else ""
    try:
        handle = nvml.handle(index)
        if identity is None:
            identity = _Identity(
                nvml.uuid(handle), _optional(nvml.name, handle), _optional(nvml.pci_bus_id, handle)
            )
    except NvmlUnavailable:
        raise
    except NvmlError as exc:
        return GpuSample(index=index, uuid=known_uuid, up=False, error=str(exc)), identity

    r = _FieldReader(handle, identity.uuid, unsupported)
    try:
        r.read(
            (
                "memory_total_bytes",
                "memory_used_bytes",
                "memory_free_bytes",
                "memory_reserved_bytes",
            ),
            lambda h: _astuple_memory(nvml, h),
        )
        r.read(("utilization_ratio", "memory_utilization_ratio"), nvml.utilization)
        r.read(("power_draw_watts",), nvml.power_draw_watts)
        r.read(("power_limit_watts",), nvml.power_limit_watts)
        r.read(("energy_joules",), nvml.energy_joules)
        r.read(("temperature_celsius",), nvml.temperature_celsius)
        r.read(("fan_speed_ratio",), nvml.fan_speed_ratio)
        for clock in CLOCKS:
            r.read((f"clock_{clock}_hz",), functools.partial(nvml.clock_hz, clock=clock))
        r.read(("compute_processes",), lambda h: len(nvml.compute_processes(h)))
    except GpuLost as exc:
        # Whatever was read before the GPU went away is dropped: no stale values that look fresh.
        sample = GpuSample(
            index=index,
            uuid=identity.uuid,
            up=False,
            name=identity.name,
            pci_bus_id=identity.pci_bus_id,
            error=str(exc),
        )
        return sample, identity
    sample = GpuSample(
        index=index,
        uuid=identity.uuid,
        up=True,
        name=identity.name,
        pci_bus_id=identity.pci_bus_id,
        error=r.last_error,
        **r.values,
    )
    return sample, identity


def _astuple_memory(nvml: Nvml, handle: Any) -> tuple[int, int, int, int | None]:
    m = nvml.memory(handle)
    return m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes


def _optional(fn: Callable[[Any], str], handle: Any) -> str | None:
    try:
        return fn(handle)
    except (GpuLost, NvmlUnavailable):
        raise
    except NvmlError:
        return None


class SnapshotCache:
    """The latest snapshot plus a bounded history, shared by every request thread.

    Readers get an immutable :class:`Snapshot`; publishing replaces it in one assignment.
    """

    def __init__(self, initial: Snapshot, history_length: int = HISTORY_LENGTH) -> None:
        self._latest = initial
        self._history: collections.deque[Snapshot] = collections.deque(maxlen=history_length)
        self._changed = threading.Condition()

    def get(self) -> Snapshot:
        return self._latest

    def history(self) -> tuple[Snapshot, ...]:
        """Published snapshots, oldest first (at most ``history_length``)."""
        with self._changed:
            return tuple(self._history)

    def publish(self, snapshot: Snapshot) -> Snapshot:
        with self._changed:
            snapshot = replace(snapshot, sequence=self._latest.sequence + 1)
            self._latest = snapshot
            self._history.append(snapshot)
            self._changed.notify_all()
        return snapshot

    def wait_for_newer(self, sequence: int, timeout_seconds: float) -> Snapshot:
        """Block until a snapshot newer than ``sequence`` is published, or the timeout ends."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest.sequence > sequence, timeout_seconds)
            return self._latest


class Sampler:
    """Owns NVML: initialises it (with backoff), samples it, publishes snapshots."""

    def __init__(
        self,
        nvml: Nvml,
        cache: SnapshotCache,
        *,
        interval_seconds: float = 1.0,
        clock: Clock | None = None,
    ) -> None:
        self.nvml = nvml
        self.cache = cache
        self.interval_seconds = interval_seconds
        self.clock: Clock = clock or SystemClock()
        self._initialised = False
        self._init_error: str | None = None
        self._next_init_at = 0.0  # monotonic
        self._init_delay = INIT_BACKOFF_INITIAL_SECONDS
        self._driver_version: str | None = None
        self._cuda_version: str | None = None
        self._identities: dict[int, _Identity] = {}
        self._unsupported: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one pass ------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        """Initialise NVML if due, read every GPU, publish and return the snapshot."""
        wall, start = self.clock.time(), self.clock.monotonic()
        if not self._initialised and start >= self._next_init_at:
            self._try_init(start)
        gpus: tuple[GpuSample, ...] = ()
        if self._initialised:
            try:
                gpus = self._read_all()
            except NvmlUnavailable as exc:
                log.error("NVML stopped working: %s; re-initialising with backoff", exc)
                self._initialised = False
                self._init_error = str(exc)
                self.nvml.shutdown()
                self._schedule_init(start)
        snapshot = Snapshot(
            taken_at_seconds=wall,
            monotonic_seconds=start,
            sample_duration_seconds=max(0.0, self.clock.monotonic() - start),
            nvml_up=self._initialised,
            simulated=self.nvml.simulated,
            gpus=gpus,
            nvml_error=None if self._initialised else self._init_error,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_version,
            nvml_errors=tuple(
                (fn, err, n) for (fn, err), n in sorted(self.nvml.error_counts().items())
            ),
        )
        return self.cache.publish(snapshot)

    def _try_init(self, now: float) -> None:
        try:
            self.nvml.init()
            self._driver_version = _optional(lambda _: self.nvml.driver_version(), None)
            self._cuda_version = _optional(lambda _: self.nvml.cuda_driver_version(), None)
        except NvmlError as exc:
            self._init_error = str(exc)
            log.warning("NVML is not available (%s); retrying in %.0f s", exc, self._init_delay)
            self._schedule_init(now)
            return
        log.info("NVML initialised: driver %s, CUDA %s", self._driver_version, self._cuda_version)
        self._initialised = True
        self._init_error = None
        self._init_delay = INIT_BACKOFF_INITIAL_SECONDS
        self._identities.clear()
        self._unsupported.clear()

    def _schedule_init(self, now: float) -> None:
        self._next_init_at = now + self._init_delay
        self._init_delay = min(self._init_delay * 2, INIT_BACKOFF_MAX_SECONDS)

    def _read_all(self) -> tuple[GpuSample, ...]:
        samples = []
        for index in range(self.nvml.device_count()):
            sample, identity = read_gpu(
                self.nvml, index, self._identities.get(index), self._unsupported
            )
            if identity is not None:
                self._identities[index] = identity
            samples.append(sample)
        return tuple(samples)

    # -- the background thread -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        if self._initialised:
            self.nvml.shutdown()
            self._initialised = False

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_once()
            except Exception:  # a bug must not kill sampling for good
                log.exception("sampling failed")
            elapsed = time.monotonic() - started
            self._stop.wait(max(0.0, self.interval_seconds - elapsed))


def new_cache(nvml: Nvml, clock: Clock) -> SnapshotCache:
    return SnapshotCache(
        initial_snapshot(
            simulated=nvml.simulated, monotonic_now=clock.monotonic(), wall_now=clock.time()
        )
    )
