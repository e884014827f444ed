"""The one background thread that samples NVML into snapshots.

:class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session: it initialises it with
backoff (1 s doubling to 5 min), reads every GPU (:func:`~gpu_exporter.collect.read.read_gpu`)
every ``interval`` (its slow fields every ``slow_interval``) and publishes the snapshot to the
:class:`~gpu_exporter.collect.cache.SnapshotCache`. Every NVML call runs on a worker thread
with a deadline, so a hung driver call marks one GPU (or NVML) down instead of stopping
sampling. Requests only ever read the cache; they never call NVML.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import itertools
import logging
import threading
import time
from dataclasses import replace

from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect import groups
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.fields import UnsupportedFields
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.collect.read import DOWN_TIMEOUT, GpuIdentity, down_sample, optional, read_gpu
from gpu_exporter.collect.workers import LIBRARY, MAX_SPARES, Batch, Read, Worker
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.nvml import Nvml, NvmlError, NvmlUnavailable

log = logging.getLogger(__name__)

INIT_BACKOFF_INITIAL_SECONDS = 1.0
INIT_BACKOFF_MAX_SECONDS = 300.0
DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample
DEFAULT_SLOW_INTERVAL_SECONDS = 30.0  # health fields (groups.SLOW)


class Sampler:
    """Owns NVML: initialises it (with backoff), samples it, publishes snapshots.

    The sampling thread itself never calls NVML. Library calls (init, device count) and
    every GPU's reads run on one reader thread, one after another, in one hand-over per
    sample, each step with a deadline of ``nvml_timeout_seconds``. A GPU whose call
    overruns keeps that thread and is published as down (``down_reason="timeout"``, no
    values) until the call returns; a spare thread reads the other GPUs. A stuck library
    call marks NVML down the same way.
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
        slow_interval_seconds: float = DEFAULT_SLOW_INTERVAL_SECONDS,
        disabled: frozenset[str] = frozenset(),
    ) -> None:
        self.nvml = nvml
        self.slow_interval_seconds = slow_interval_seconds
        self.disabled = disabled  # --no-collect.<group>
        self._fields_updated = tuple(
            (field, "off" if group in disabled else when)
            for field, (when, group) in groups.FIELDS.items()
        )
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
        self._identities: dict[int, GpuIdentity] = {}
        self._last_seen: dict[int, float] = {}  # GPU index → wall clock it last answered
        self._unsupported: UnsupportedFields = set()
        self._library_stuck: Worker | None = None  # a reader stuck in a library call
        self._slow_read_at: dict[int, float] = {}  # GPU index → monotonic, last slow read
        self._reader: Worker | None = None  # reads every GPU that is not stuck
        self._stuck: dict[int, Worker] = {}  # GPU index → the reader stuck in its call
        self._spares: list[Worker] = []  # readers whose stuck call returned
        self._names = itertools.count()
        self._stop = threading.Event()
        # Held until stop(): the sampling thread sleeps between samples in one timed acquire
        # of it (a C call; Event.wait runs a Condition's Python code twice a sample).
        self._asleep = _thread.allocate_lock()
        self._asleep.acquire()
        self._thread: threading.Thread | None = None

    # -- one pass ------------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        """Initialise NVML if due, read every GPU, publish and return the snapshot."""
        wall, start = self.clock.time(), self.clock.monotonic()
        if self.procinfo is not None:  # every sample, read or not: a pid unseen is rechecked
            self.procinfo.next_pass()
        try:
            gpus, problem = self._read_all(start, wall)
        except NvmlUnavailable as exc:
            self._mark_unavailable(exc, start)
            gpus, problem = (), self._init_error
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
            fields_updated=self._fields_updated,
        )
        return self.cache.publish(snapshot)

    def _library_job(self, now: float) -> int | None:
        """On the reader, first: shut down / initialise as due, then count the GPUs."""
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
            self._driver_version = optional(lambda _: self.nvml.driver_version(), None)
            self._cuda_version = optional(lambda _: self.nvml.cuda_driver_version(), None)
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
        self._slow_read_at.clear()
        self._unsupported.clear()

    def _mark_unavailable(self, exc: NvmlError, now: float) -> None:
        log.error("NVML stopped working: %s; re-initialising with backoff", exc)
        self._initialised = False
        self._needs_shutdown = True  # done on the reader, before the next init
        self._init_error = str(exc)
        self._schedule_init(now)

    def _schedule_init(self, now: float) -> None:
        self._next_init_at = now + self._init_delay
        self._init_delay = min(self._init_delay * 2, INIT_BACKOFF_MAX_SECONDS)

    def _read_all(self, start: float, wall: float) -> tuple[tuple[GpuSample, ...], str | None]:
        """The library step and every GPU, one after another on one reader thread: (GPUs,
        None), or ((), why not) when NVML is down. A GPU whose call overruns the deadline
        keeps that thread (it is stuck in the driver) and a spare one reads the rest; until
        the stuck call returns, that GPU is down and not asked again. A stuck library call
        keeps its thread the same way, and NVML is down until it returns."""
        if self._library_stuck is not None:
            if self._library_stuck.busy:
                return (), self._overran(self._library_stuck, "NVML")
            self._recovered(self._library_stuck, "NVML")
            self._spares.append(self._library_stuck)
            self._library_stuck = None
        for index, worker in list(self._stuck.items()):
            if not worker.busy:
                self._recovered(worker, f"GPU {index}")
                self._spares.append(self._stuck.pop(index))
        read = functools.partial(self._read_one, now=start, wall=wall)
        library = functools.partial(self._library_job, start)
        batch = first = Batch(read, library=library, skip=frozenset(self._stuck))
        samples: dict[int, GpuSample] = {}
        while True:
            reader = self._reader or (self._spares.pop() if self._spares else None)
            self._reader = reader or Worker(f"nvml-reader{next(self._names)}")
            stuck_at = batch.wait(self._reader.submit(batch.run, start), self.nvml_timeout_seconds)
            if stuck_at == LIBRARY:
                self._library_stuck, self._reader = self._reader, None
                return (), self._overran(self._library_stuck, "NVML")
            for index, (sample, identity, slow_read) in batch.results.items():
                samples[index] = sample
                if identity is not None:
                    self._identities[index] = identity
                if not sample.up:
                    self._slow_read_at.pop(index, None)
                elif slow_read:
                    self._slow_read_at[index] = start
            if stuck_at is None:
                break
            self._stuck[stuck_at], self._reader = self._reader, None
            self._slow_read_at.pop(stuck_at, None)
            if stuck_at in self._identities:
                self._identities[stuck_at] = self._identities[stuck_at].forget_values()
            rest = batch.indexes[batch.indexes.index(stuck_at) + 1 :]
            if not rest:
                break
            batch = Batch(read, rest)
        del self._spares[MAX_SPARES:]  # more stuck calls returned than will be needed
        count = first.count
        if count is None:
            return (), self._init_error
        out = []
        for index in range(count):
            sample = samples.get(index) or self._timed_out(index)
            if sample.up:  # read_gpu gave it last_seen_seconds=wall
                self._last_seen[index] = wall
            else:
                sample = replace(sample, last_seen_seconds=self._last_seen.get(index))
            out.append(sample)
        return tuple(out), None

    def _read_one(self, index: int, now: float, wall: float) -> Read:
        """On the reader thread: one GPU, its slow fields if due."""
        read_at = self._slow_read_at.get(index)
        # Half an interval early rather than one late: jitter must not stretch the period.
        slow_due = read_at is None or now - read_at >= self.slow_interval_seconds - (
            self.interval_seconds / 2
        )
        sample, identity = read_gpu(
            self.nvml,
            index,
            self._identities.get(index),
            self._unsupported,
            procinfo=self.procinfo,
            slow_due=slow_due,
            disabled=self.disabled,
            seen_at=wall,
        )
        return sample, identity, slow_due

    def _timed_out(self, index: int) -> GpuSample:
        message = self._overran(self._stuck[index], f"GPU {index}")
        return down_sample(index, self._identities.get(index), DOWN_TIMEOUT, message)

    def _overran(self, worker: Worker, what: str) -> str:
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

    def _recovered(self, worker: Worker, what: str) -> None:
        if worker.overran:
            worker.overran = False
            log.warning("%s: the stuck NVML call returned; sampling it again", what)

    # -- the background thread -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stuck(self) -> tuple[str, ...]:
        """What has an NVML call running past its deadline: ``"library"`` and ``"gpu<index>"``
        for each GPU whose call overran and has not returned yet. A stuck one takes no new
        call until it returns."""
        workers = {"library": self._library_stuck}
        workers.update((f"gpu{index}", w) for index, w in sorted(self._stuck.items()))
        return tuple(name for name, worker in workers.items() if worker and worker.busy)

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop sampling and shut NVML down, within about ``timeout_seconds`` in all.

        A worker stuck in a driver call is left alone (it is a daemon thread): killing or
        waiting forever on it is worse than exiting without ``nvmlShutdown``.
        """
        deadline = time.monotonic() + timeout_seconds
        self._stop.set()
        with contextlib.suppress(RuntimeError):  # released already: stop() ran before
            self._asleep.release()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        reader = self._reader
        idle = reader is None or not reader.busy
        if self._initialised and self._library_stuck is None and idle:
            self._initialised = False
            if reader is None:  # the last reader is stuck in a GPU's call
                reader = self._reader = Worker(f"nvml-reader{next(self._names)}")
            reader.submit(self.nvml.shutdown, self.clock.monotonic()).wait(
                deadline - time.monotonic()
            )
        readers = [w for w in (self._reader, self._library_stuck) if w is not None]
        for worker in (*readers, *self._stuck.values(), *self._spares):
            worker.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample_once()
            except Exception:  # a bug must not kill sampling for good
                log.exception("sampling failed")
            elapsed = time.monotonic() - started
            if self._asleep.acquire(True, max(0.0, self.interval_seconds - elapsed)):
                break  # stop() released it
