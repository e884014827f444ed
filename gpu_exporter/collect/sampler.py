"""The one background thread that samples NVML into snapshots.

:class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session: it initialises it with
backoff (1 s doubling to 5 min), reads every GPU (:func:`~gpu_exporter.collect.read.read_gpu`)
every ``interval`` and publishes the snapshot to the
:class:`~gpu_exporter.collect.cache.SnapshotCache`. Every NVML call runs on a worker thread
with a deadline, so a hung driver call marks one GPU (or NVML) down instead of stopping
sampling. Requests only ever read the cache; they never call NVML.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.fields import UnsupportedFields
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.collect.read import DOWN_TIMEOUT, GpuIdentity, down_sample, optional, read_gpu
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.nvml import Nvml, NvmlError, NvmlUnavailable

log = logging.getLogger(__name__)

INIT_BACKOFF_INITIAL_SECONDS = 1.0
INIT_BACKOFF_MAX_SECONDS = 300.0
DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample


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
        self._identities: dict[int, GpuIdentity] = {}
        self._last_seen: dict[int, float] = {}  # GPU index → wall clock it last answered
        self._unsupported: UnsupportedFields = set()
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
                sample = down_sample(
                    index, identity, DOWN_TIMEOUT, self._overran(worker, f"GPU {index}")
                )
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

    def stuck(self) -> tuple[str, ...]:
        """The workers whose NVML call is still running past its deadline or in flight now:
        ``"library"`` and ``"gpu<index>"``. A stuck one takes no new call until it returns."""
        workers = {"library": self._library}
        workers.update((f"gpu{index}", w) for index, w in sorted(self._gpu_workers.items()))
        return tuple(name for name, worker in workers.items() if worker.busy)

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
