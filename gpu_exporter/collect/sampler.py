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

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from gpu_exporter import nvml as nvml_mod
from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.model import (
    CLOCKS,
    CLOCKS_EVENT_REASONS,
    ECC_COUNTERS,
    ECC_ERRORS,
    RETIREMENT_CAUSES,
    TEMPERATURE_THRESHOLDS,
    GpuSample,
    ProcessSample,
    Snapshot,
    process_visibility,
)
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)
_T = TypeVar("_T")

INIT_BACKOFF_INITIAL_SECONDS = 1.0
INIT_BACKOFF_MAX_SECONDS = 300.0
DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample

# GpuSample.down_reason values (the reason label of gpu_down_reason).
DOWN_LOST = "lost"  # GPU_IS_LOST and friends: fell off the bus, needs a reset
DOWN_TIMEOUT = "timeout"  # an NVML call for it did not return within the deadline
DOWN_ERROR = "error"  # any other failure to get a handle
DOWN_REASONS = (DOWN_LOST, DOWN_TIMEOUT, DOWN_ERROR)


@dataclass(frozen=True, slots=True)
class _MigIdentity:
    name: str | None
    profile: str | None
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True, slots=True)
class _Identity:
    """What is read once per GPU after each initialisation, and kept while the GPU lives."""

    uuid: str
    name: str | None
    pci_bus_id: str | None
    # Values that do not change while the driver runs (max clocks, thresholds, power
    # constraints, maximum PCIe link), by field name, once read successfully.
    static: tuple[tuple[str, Any], ...] = ()
    mig: tuple[tuple[str, _MigIdentity], ...] = ()  # MIG devices seen, by MIG uuid


class _FieldReader:
    """Reads fields of one device, remembering which (device, field) pairs are unsupported."""

    def __init__(
        self,
        handle: Any,
        uuid: str,
        unsupported: set[tuple[str, str]],
        static: dict[str, Any] | None = None,
    ) -> None:
        self.handle = handle
        self.uuid = uuid
        self.unsupported = unsupported
        self.static: dict[str, Any] = dict(static or {})
        self.values: dict[str, Any] = {}
        self.asked: dict[str, bool] = {}  # field → supported
        self.last_error: str | None = None

    def read(self, field: str, names: tuple[str, ...], fn: Callable[[Any], Any]) -> bool:
        """Store ``fn(handle)`` under ``names`` (a tuple result fills several). True if read."""
        if (self.uuid, field) in self.unsupported:
            self.asked[field] = False
            return False
        try:
            value = fn(self.handle)
        except Unsupported:
            self.unsupported.add((self.uuid, field))
            self.asked[field] = False
            log.info("GPU %s does not support %s; not asking again", self.uuid, field)
            return False
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            self.asked[field] = True
            self.last_error = str(exc)
            return False
        self.asked[field] = True
        if len(names) == 1:
            self.values[names[0]] = value
        elif names:
            self.values.update(zip(names, value, strict=True))
        return True

    def read_static(self, field: str, names: tuple[str, ...], fn: Callable[[Any], Any]) -> None:
        """Like :meth:`read`, but a value once read is reused instead of asked again."""
        if field in self.static:
            self.asked[field] = True
            value = self.static[field]
            if len(names) == 1:
                self.values[names[0]] = value
            else:
                self.values.update(zip(names, value, strict=True))
            return
        if self.read(field, names, fn):
            self.static[field] = (
                self.values[names[0]] if len(names) == 1 else tuple(self.values[n] for n in names)
            )


def _reasons(mask: int) -> tuple[str, ...]:
    return _interned(
        tuple(r for r in CLOCKS_EVENT_REASONS if mask & nvml_mod.CLOCKS_EVENT_REASONS[r])
    )


_INTERNED: dict[Any, Any] = {}


def _interned(value: _T) -> _T:
    """One shared object for equal tuples that repeat in every sample (which fields a GPU
    supports, active throttle reasons), so the 600-snapshot history does not hold copies."""
    if len(_INTERNED) > 4096:  # only ever a handful of distinct values; never grow unbounded
        _INTERNED.clear()
    found: _T = _INTERNED.setdefault(value, value)
    return found


def _processes(
    nvml: Nvml, handle: Any, procinfo: ProcInfoCache | None
) -> tuple[ProcessSample, ...]:
    """The compute processes on one device, one entry per pid (memory summed), attributed
    from /proc when enabled."""
    memory: dict[int, int | None] = {}
    for p in nvml.compute_processes(handle):
        if p.pid in memory:
            known = [m for m in (memory[p.pid], p.used_memory_bytes) if m is not None]
            memory[p.pid] = sum(known) if known else None
        else:
            memory[p.pid] = p.used_memory_bytes
    out = []
    for pid, used in memory.items():
        info = procinfo.get(pid) if procinfo is not None else None
        if info is None:
            out.append(ProcessSample(pid, used))
        else:
            out.append(
                ProcessSample(
                    pid, used, info.user, info.command, info.container, info.slurm_job, info.pod
                )
            )
    return tuple(out)


def _read_values(
    nvml: Nvml, r: _FieldReader, procinfo: ProcInfoCache | None, *, whole_gpu: bool
) -> None:
    """Every field of one device into ``r.values``; ``whole_gpu`` False for a MIG device,
    which answers only memory, utilization (not at all, in practice) and processes."""
    r.read("memory", _MEMORY_FIELDS, lambda h: _astuple_memory(nvml, h, whole_gpu))
    r.read("utilization", ("utilization_ratio", "memory_utilization_ratio"), nvml.utilization)
    if not whole_gpu:
        r.read("processes", ("processes",), lambda h: _processes(nvml, h, procinfo))
        return
    r.read("mig_mode", ("mig_mode_enabled",), nvml.mig_mode_enabled)
    r.read("power_draw", ("power_draw_watts",), nvml.power_draw_watts)
    r.read("power_limit", ("power_limit_watts",), nvml.power_limit_watts)
    r.read("energy", ("energy_joules",), nvml.energy_joules)
    r.read("temperature", ("temperature_celsius",), nvml.temperature_celsius)
    r.read("fan_speed", ("fan_speed_ratio",), nvml.fan_speed_ratio)
    for clock in CLOCKS:
        r.read(
            f"clock_{clock}", (f"clock_{clock}_hz",), functools.partial(nvml.clock_hz, clock=clock)
        )
    if not r.values.get("mig_mode_enabled"):  # in MIG mode, processes are read per MIG device
        r.read("processes", ("processes",), lambda h: _processes(nvml, h, procinfo))
    r.read(
        "clocks_event_reasons",
        ("clocks_event_reasons",),
        lambda h: _reasons(nvml.clocks_event_reasons(h)),
    )
    r.read("performance_state", ("performance_state",), nvml.performance_state)
    r.read("persistence_mode", ("persistence_mode_enabled",), nvml.persistence_mode_enabled)
    r.read("compute_mode", ("compute_mode",), nvml.compute_mode)
    r.read("ecc_mode", ("ecc_mode_enabled",), nvml.ecc_mode_enabled)
    for error in ECC_ERRORS:
        for counter in ECC_COUNTERS:
            r.read(
                f"ecc_errors_{error}_{counter}",
                (f"ecc_errors_{error}_{counter}",),
                functools.partial(nvml.ecc_errors, error=error, counter=counter),
            )
    r.read(
        "remapped_rows",
        (
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "remapped_rows_pending",
            "remapped_rows_failed",
        ),
        lambda h: dataclasses.astuple(nvml.remapped_rows(h)),
    )
    for cause in RETIREMENT_CAUSES:
        r.read(
            f"retired_pages_{cause}",
            (f"retired_pages_{cause}",),
            functools.partial(nvml.retired_pages, cause=cause),
        )
    r.read("retired_pages_pending", ("retired_pages_pending",), nvml.retired_pages_pending)
    r.read(
        "pcie_link_generation_current",
        ("pcie_link_generation_current",),
        functools.partial(nvml.pcie_link_generation, link="current"),
    )
    r.read(
        "pcie_link_width_current",
        ("pcie_link_width_current",),
        functools.partial(nvml.pcie_link_width, link="current"),
    )
    r.read("pcie_replay_errors", ("pcie_replay_errors",), nvml.pcie_replay_errors)
    r.read("encoder_utilization", ("encoder_utilization_ratio",), nvml.encoder_utilization_ratio)
    r.read("decoder_utilization", ("decoder_utilization_ratio",), nvml.decoder_utilization_ratio)
    # Read once per GPU and initialisation: these do not change while the driver runs.
    for clock in CLOCKS:
        r.read_static(
            f"clock_max_{clock}",
            (f"clock_max_{clock}_hz",),
            functools.partial(nvml.max_clock_hz, clock=clock),
        )
    for threshold in TEMPERATURE_THRESHOLDS:
        r.read_static(
            f"temperature_threshold_{threshold}",
            (f"temperature_{threshold}_celsius",),
            functools.partial(nvml.temperature_threshold_celsius, threshold=threshold),
        )
    r.read_static(
        "power_limit_default", ("power_limit_default_watts",), nvml.power_limit_default_watts
    )
    r.read_static(
        "power_limit_constraints",
        ("power_limit_min_watts", "power_limit_max_watts"),
        nvml.power_limit_constraints_watts,
    )
    r.read_static(
        "pcie_link_generation_max",
        ("pcie_link_generation_max",),
        functools.partial(nvml.pcie_link_generation, link="max"),
    )
    r.read_static(
        "pcie_link_width_max",
        ("pcie_link_width_max",),
        functools.partial(nvml.pcie_link_width, link="max"),
    )


_MEMORY_FIELDS = (
    "memory_total_bytes",
    "memory_used_bytes",
    "memory_free_bytes",
    "memory_reserved_bytes",
)


def _with_processes(values: dict[str, Any]) -> dict[str, Any]:
    """Fill compute_processes and process_visibility from the process list."""
    procs = values.get("processes")
    if procs is not None:
        values["compute_processes"] = len(procs)
    values["process_visibility"] = process_visibility(values.get("memory_used_bytes"), procs)
    return values


def _read_mig_devices(
    nvml: Nvml,
    parent: Any,
    index: int,
    r: _FieldReader,
    known: dict[str, _MigIdentity],
    unsupported: set[tuple[str, str]],
    procinfo: ProcInfoCache | None,
    pci_bus_id: str | None,
) -> tuple[tuple[GpuSample, ...], dict[str, _MigIdentity]]:
    """The MIG devices of a GPU in MIG mode, each a GpuSample with the parent's index."""
    r.read_static("mig_device_count", ("mig_device_count",), nvml.max_mig_device_count)
    slots = r.values.pop("mig_device_count", 0)
    devices = []
    seen: dict[str, _MigIdentity] = {}
    for slot in range(slots):
        try:
            handle = nvml.mig_device_handle(parent, slot)
            if handle is None:  # an empty slot
                continue
            uuid = nvml.uuid(handle)
            ident = known.get(uuid)
            if ident is None:
                name = _optional(nvml.name, handle)
                ident = _MigIdentity(
                    name,
                    name.rsplit("MIG ", 1)[1] if name and "MIG " in name else None,
                    _optional_int(nvml.gpu_instance_id, handle),
                    _optional_int(nvml.compute_instance_id, handle),
                )
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            r.last_error = str(exc)
            continue
        seen[uuid] = ident
        m = _FieldReader(handle, uuid, unsupported)
        _read_values(nvml, m, procinfo, whole_gpu=False)
        devices.append(
            GpuSample(
                index=index,
                uuid=uuid,
                up=True,
                name=ident.name,
                pci_bus_id=pci_bus_id,
                error=m.last_error,
                parent_uuid=r.uuid,
                gpu_instance_id=ident.gpu_instance_id,
                compute_instance_id=ident.compute_instance_id,
                mig_profile=ident.profile,
                fields_supported=_interned(tuple(m.asked.items())),
                **_with_processes(m.values),
            )
        )
    return tuple(devices), seen


def read_gpu(
    nvml: Nvml,
    index: int,
    identity: _Identity | None,
    unsupported: set[tuple[str, str]],
    *,
    procinfo: ProcInfoCache | None = None,
) -> tuple[GpuSample, _Identity | None]:
    """One GPU's sample (with its MIG devices and processes), and its identity for next
    time. Never raises for GPU-level errors.

    ``procinfo`` attributes processes from /proc (``--process-labels``); None reads nothing.
    """
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

    r = _FieldReader(handle, identity.uuid, unsupported, dict(identity.static))
    mig_devices: tuple[GpuSample, ...] = ()
    mig_seen = dict(identity.mig)
    try:
        _read_values(nvml, r, procinfo, whole_gpu=True)
        if r.values.get("mig_mode_enabled"):
            mig_devices, mig_seen = _read_mig_devices(
                nvml, handle, index, r, mig_seen, unsupported, procinfo, identity.pci_bus_id
            )
            procs = [d.processes for d in mig_devices]
            if mig_devices and all(p is not None for p in procs):
                r.values["processes"] = tuple(p for ps in procs if ps for p in ps)
    except GpuLost as exc:
        # Whatever was read before the GPU went away is dropped: no stale values that look fresh.
        return _down(index, identity, DOWN_LOST, str(exc)), identity
    identity = dataclasses.replace(
        identity, static=tuple(r.static.items()), mig=tuple(mig_seen.items())
    )
    sample = GpuSample(
        index=index,
        uuid=identity.uuid,
        up=True,
        name=identity.name,
        pci_bus_id=identity.pci_bus_id,
        error=r.last_error,
        mig_devices=mig_devices,
        fields_supported=_interned(tuple(r.asked.items())),
        **_with_processes(r.values),
    )
    return sample, identity


def _astuple_memory(
    nvml: Nvml, handle: Any, whole_gpu: bool = True
) -> tuple[int, int, int, int | None]:
    m = nvml.memory(handle, whole_gpu=whole_gpu)
    return m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes


def _optional(fn: Callable[[Any], str], handle: Any) -> str | None:
    try:
        return fn(handle)
    except (GpuLost, NvmlUnavailable):
        raise
    except NvmlError:
        return None


def _optional_int(fn: Callable[[Any], int], handle: Any) -> int | None:
    try:
        return fn(handle)
    except (GpuLost, NvmlUnavailable):
        raise
    except NvmlError:
        return None


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
        procinfo: ProcInfoCache | None = None,
    ) -> None:
        self.nvml = nvml
        self.cache = cache
        self.procinfo = procinfo
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
            process_labels=self.procinfo.fields if self.procinfo is not None else (),
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
                job = functools.partial(
                    read_gpu,
                    self.nvml,
                    index,
                    identity,
                    self._unsupported,
                    procinfo=self.procinfo,
                )
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
