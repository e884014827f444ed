"""Reading NVML into snapshots, and the one background thread that does it.

* :func:`read_gpu` reads one GPU; every field is isolated, so one unsupported or failing
  field leaves the others in place, and a lost GPU is reported as ``up=False``.
* :class:`SnapshotCache` holds the latest snapshot (swapped atomically) plus a short history.
* :class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session: initialises it with
  backoff (1 s doubling to 5 min), samples every ``interval`` and publishes to the cache.
  Every NVML call runs on a worker thread with a deadline, so a hung driver call marks one
  GPU (or NVML) down instead of stopping sampling. Requests only ever read the cache; they
  never call NVML.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpu_exporter.model import CLOCKS, GpuSample, Snapshot, initial_snapshot
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)

INIT_BACKOFF_INITIAL_SECONDS = 1.0
INIT_BACKOFF_MAX_SECONDS = 300.0
HISTORY_LENGTH = 600  # snapshots kept: 10 minutes at the default 1 s interval
DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample

# GpuSample.down_reason values (the reason label of gpu_down_reason).
DOWN_LOST = "lost"  # GPU_IS_LOST and friends: fell off the bus, needs a reset
DOWN_TIMEOUT = "timeout"  # an NVML call for it did not return within the deadline
DOWN_ERROR = "error"  # any other failure to get a handle
DOWN_REASONS = (DOWN_LOST, DOWN_TIMEOUT, DOWN_ERROR)


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
        reason = DOWN_LOST if isinstance(exc, GpuLost) else DOWN_ERROR
        sample = GpuSample(
            index=index, uuid=known_uuid, up=False, error=str(exc), down_reason=reason
        )
        return sample, identity

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
        return _down(index, identity, DOWN_LOST, str(exc)), identity
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


class _Worker:
    """A daemon thread that runs NVML jobs one at a time, for one GPU (or the library).

    A driver call cannot be interrupted, so a job that overruns its deadline is left to
    finish on its own. Until it does, the worker is :attr:`busy` and takes no new job: one
    outstanding call per GPU, never a pile of threads stuck in the same call.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._current: Future[Any] | None = None
        self.submitted_at = 0.0  # monotonic, on the sampler's clock
        self.overran = False  # the current (or last) job ran past its deadline
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

    def submit(self, fn: Callable[[], Any], now: float) -> Future[Any]:
        if self.busy:
            raise RuntimeError(f"{self.name} is still busy")
        future: Future[Any] = Future()
        self._current, self.submitted_at = future, now
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class Sampler:
    """Owns NVML: initialises it (with backoff), samples it, publishes snapshots.

    The sampling thread itself never calls NVML. Library calls (init, device count) run on
    one worker thread and each GPU's reads on its own, one GPU after another, each with a
    deadline of ``nvml_timeout_seconds``. A GPU whose call overruns is published as down
    (``down_reason="timeout"``, no values) and skipped until the call returns; the other
    GPUs keep being sampled. A stuck library call marks NVML down the same way.
    """

    def __init__(
        self,
        nvml: Nvml,
        cache: SnapshotCache,
        *,
        interval_seconds: float = 1.0,
        nvml_timeout_seconds: float = DEFAULT_NVML_TIMEOUT_SECONDS,
        clock: Clock | None = None,
    ) -> None:
        self.nvml = nvml
        self.cache = cache
        self.interval_seconds = interval_seconds
        self.nvml_timeout_seconds = nvml_timeout_seconds
        self.clock: Clock = clock or SystemClock()
        self._initialised = False
        self._needs_shutdown = False
        self._init_error: str | None = None
        self._next_init_at = 0.0  # monotonic
        self._init_delay = INIT_BACKOFF_INITIAL_SECONDS
        self._driver_version: str | None = None
        self._cuda_version: str | None = None
        self._identities: dict[int, _Identity] = {}
        self._last_seen: dict[int, float] = {}  # GPU index → wall clock it last answered
        self._unsupported: set[tuple[str, str]] = set()
        self._library = _Worker("nvml-library")
        self._gpu_workers: dict[int, _Worker] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one pass ------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        """Initialise NVML if due, read every GPU, publish and return the snapshot."""
        wall, start = self.clock.time(), self.clock.monotonic()
        gpus: tuple[GpuSample, ...] = ()
        count, problem = self._library_step(start)
        if count is not None:
            try:
                gpus = self._read_all(count, wall)
            except NvmlUnavailable as exc:
                self._mark_unavailable(exc, start)
                problem = self._init_error
        snapshot = Snapshot(
            taken_at_seconds=wall,
            monotonic_seconds=start,
            sample_duration_seconds=max(0.0, self.clock.monotonic() - start),
            nvml_up=problem is None,
            simulated=self.nvml.simulated,
            gpus=gpus,
            nvml_error=problem,
            driver_version=self._driver_version,
            cuda_driver_version=self._cuda_version,
            nvml_errors=tuple(
                (fn, err, n) for (fn, err), n in sorted(self.nvml.error_counts().items())
            ),
        )
        return self.cache.publish(snapshot)

    def _library_step(self, now: float) -> tuple[int | None, str | None]:
        """(GPU count, None) when NVML is up, else (None, why not). Never blocks for long."""
        worker = self._library
        if not worker.busy:
            self._recovered(worker, "NVML")
            future = worker.submit(functools.partial(self._library_job, now), now)
            try:
                count: int | None = future.result(timeout=self.nvml_timeout_seconds)
            except concurrent.futures.TimeoutError:
                pass
            else:
                return count, None if count is not None else self._init_error
        return None, self._overran(worker, "NVML")

    def _library_job(self, now: float) -> int | None:
        """On the library worker: shut down / initialise as due, then count the GPUs."""
        if self._needs_shutdown:
            self._needs_shutdown = False
            self.nvml.shutdown()
        if not self._initialised and now >= self._next_init_at:
            self._try_init(now)
        if not self._initialised:
            return None
        try:
            return self.nvml.device_count()
        except NvmlError as exc:
            self._mark_unavailable(exc, now)
            return None

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

    def _mark_unavailable(self, exc: NvmlError, now: float) -> None:
        log.error("NVML stopped working: %s; re-initialising with backoff", exc)
        self._initialised = False
        self._needs_shutdown = True  # done on the library worker, before the next init
        self._init_error = str(exc)
        self._schedule_init(now)

    def _schedule_init(self, now: float) -> None:
        self._next_init_at = now + self._init_delay
        self._init_delay = min(self._init_delay * 2, INIT_BACKOFF_MAX_SECONDS)

    def _read_all(self, count: int, wall: float) -> tuple[GpuSample, ...]:
        samples = []
        for index in range(count):
            worker = self._gpu_workers.get(index)
            if worker is None:
                worker = self._gpu_workers[index] = _Worker(f"nvml-gpu{index}")
            identity = self._identities.get(index)
            sample: GpuSample | None = None
            if not worker.busy:
                self._recovered(worker, f"GPU {index}")
                job = functools.partial(read_gpu, self.nvml, index, identity, self._unsupported)
                future = worker.submit(job, self.clock.monotonic())
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    sample, identity = future.result(timeout=self.nvml_timeout_seconds)
            if sample is None:  # the call is stuck: down, no values, until it returns
                sample = _down(index, identity, DOWN_TIMEOUT, self._overran(worker, f"GPU {index}"))
            elif identity is not None:
                self._identities[index] = identity
            if sample.up:
                self._last_seen[index] = wall
            samples.append(replace(sample, last_seen_seconds=self._last_seen.get(index)))
        return tuple(samples)

    def _overran(self, worker: _Worker, what: str) -> str:
        """Why ``worker``'s job is late; counted and logged once per stuck call."""
        function = self.nvml.in_flight(worker.thread.ident or 0) or "an NVML call"
        seconds = self.clock.monotonic() - worker.submitted_at
        message = f"{function} has not returned for {seconds:.0f} s"
        if not worker.overran:
            worker.overran = True
            self.nvml.count_timeout(function)
            log.error(
                "%s: %s (deadline %g s); reported as down until it returns",
                what,
                message,
                self.nvml_timeout_seconds,
            )
        return message

    def _recovered(self, worker: _Worker, what: str) -> None:
        if worker.overran:
            worker.overran = False
            log.warning("%s: the stuck NVML call returned; sampling it again", what)

    # -- the background thread -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop sampling and shut NVML down, within about ``timeout_seconds`` in all.

        A worker stuck in a driver call is left alone (it is a daemon thread): killing or
        waiting forever on it is worse than exiting without ``nvmlShutdown``.
        """
        deadline = time.monotonic() + timeout_seconds
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        if self._initialised and not self._library.busy:
            self._initialised = False
            future = self._library.submit(self.nvml.shutdown, self.clock.monotonic())
            with contextlib.suppress(concurrent.futures.TimeoutError):
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        for worker in (self._library, *self._gpu_workers.values()):
            worker.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_once()
            except Exception:  # a bug must not kill sampling for good
                log.exception("sampling failed")
            elapsed = time.monotonic() - started
            self._stop.wait(max(0.0, self.interval_seconds - elapsed))


def _down(index: int, identity: _Identity | None, reason: str, error: str) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=identity.uuid if identity else "",
        up=False,
        name=identity.name if identity else None,
        pci_bus_id=identity.pci_bus_id if identity else None,
        error=error,
        down_reason=reason,
    )


def new_cache(nvml: Nvml, clock: Clock) -> SnapshotCache:
    return SnapshotCache(
        initial_snapshot(
            simulated=nvml.simulated, monotonic_now=clock.monotonic(), wall_now=clock.time()
        )
    )
