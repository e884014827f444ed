"""Sampling NVML into snapshots, every GPU on one reader thread, with a deadline per call.

:class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session (initialised with backoff
by :class:`~gpu_exporter.collect.session.Session`), reads every GPU
(:func:`~gpu_exporter.collect.read.read_gpu`) every ``interval`` (slow fields every
``slow_interval``) into the :class:`~gpu_exporter.collect.cache.SnapshotCache`. A hung driver
call marks one GPU (or NVML) down instead of stopping sampling. Requests only ever read the
cache; they never call NVML.
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
from gpu_exporter.collect.read import DOWN_TIMEOUT, GpuIdentity, down_sample, read_gpu
from gpu_exporter.collect.session import Session
from gpu_exporter.collect.workers import LIBRARY, MAX_SPARES, Batch, Read, Worker
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.nvml import Nvml, NvmlUnavailable

log = logging.getLogger(__name__)

DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample
DEFAULT_SLOW_INTERVAL_SECONDS = 30.0  # health fields (groups.SLOW)


class Sampler:
    """Owns NVML: initialises it (with backoff), samples it, publishes snapshots.

    The sampling thread never calls NVML. The library step (init, device count) and every
    GPU's reads run on one reader thread, one after another, each with a deadline of
    ``nvml_timeout_seconds``. While calls return in time, the reader samples and publishes
    on its own (one thread wakes per sample) and the sampling thread only checks deadlines.
    A GPU whose call overruns keeps that thread and is published as down
    (``down_reason="timeout"``, no values) until the call returns; meanwhile the sampling
    thread samples with :meth:`sample_once`, a spare thread reading the other GPUs. A stuck
    library call marks NVML down the same way.
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
        self.session = Session(nvml)
        self._generation = 0  # the session's generation that _identities were read in
        self._identities: dict[int, GpuIdentity] = {}
        self._last_seen: dict[int, float] = {}  # GPU index → wall clock it last answered
        self._unsupported: UnsupportedFields = set()
        self._library_stuck: Worker | None = None  # a reader stuck in a library call
        self._slow_read_at: dict[int, float] = {}  # GPU index → monotonic, last slow read
        self._reader: Worker | None = None  # reads every GPU that is not stuck
        self._stuck: dict[int, Worker] = {}  # GPU index → the reader stuck in its call
        self._live: Batch | None = None  # the reader's sample in progress (its own loop)
        self._next_at = 0.0  # monotonic: when the reader's own loop samples next
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
        """Initialise NVML if due, read every GPU, publish and return the snapshot: the
        reads on a reader thread, which this thread waits for, up to the deadline of each."""
        wall, start = self._begin()
        try:
            gpus, problem = self._read_all(start, wall)
        except NvmlUnavailable as exc:
            self.session.unavailable(exc, start)
            gpus, problem = (), self.session.error
        return self._publish(wall, start, gpus, problem)

    def _sample_here(self) -> bool:
        """One sample read and published on this (the reader) thread, while the sampling
        thread watches its deadlines; False if it gave up on a call of it (and publishes)."""
        wall, start = self._begin()
        batch = self._live = self._batch(start, wall, frozenset())
        unavailable: NvmlUnavailable | None = None
        try:
            batch.run()
        except NvmlUnavailable as exc:
            unavailable = exc
        except Exception:
            if not batch.abandoned:
                raise
        finally:
            self._live = None
        if batch.abandoned:
            return False
        if unavailable is None:
            gpus, problem = self._assemble(batch.count, self._apply(batch, {}, start), wall)
        else:
            self.session.unavailable(unavailable, start)
            gpus, problem = (), self.session.error
        self._publish(wall, start, gpus, problem)
        return True

    def _begin(self) -> tuple[float, float]:
        """A sample's wall and monotonic time, once the process cache knows a pass began."""
        if self.procinfo is not None:
            self.procinfo.next_pass()
        return self.clock.time(), self.clock.monotonic()

    def _publish(
        self, wall: float, start: float, gpus: tuple[GpuSample, ...], problem: str | None
    ) -> Snapshot:
        snapshot = Snapshot(
            taken_at_seconds=wall,
            monotonic_seconds=start,
            sample_duration_seconds=max(0.0, self.clock.monotonic() - start),
            nvml_up=problem is None,
            simulated=self.nvml.simulated,
            gpus=gpus,
            nvml_error=problem,
            driver_version=self.session.driver_version,
            cuda_driver_version=self.session.cuda_version,
            nvml_errors=tuple(
                (fn, err, n) for (fn, err), n in sorted(self.nvml.error_counts().items())
            ),
            process_labels=self.procinfo.fields if self.procinfo is not None else (),
            fields_updated=self._fields_updated,
        )
        return self.cache.publish(snapshot)

    def _library_job(self, now: float) -> int | None:
        """On the reader, first: shut down / initialise as due, then count the GPUs."""
        count = self.session.device_count(now)
        if self.session.generation != self._generation:  # (re)initialised: read afresh
            self._generation = self.session.generation
            self._identities.clear()
            self._slow_read_at.clear()
            self._unsupported.clear()
        return count

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
        batch = first = self._batch(start, wall, frozenset(self._stuck))
        samples: dict[int, GpuSample] = {}
        while True:
            reader = self._free_reader()
            stuck_at = batch.wait(reader.submit(batch.run, start), self.nvml_timeout_seconds)
            self._apply(batch, samples, start)
            if stuck_at is None:
                break
            stuck = self._keep_stuck(stuck_at)
            if stuck_at == LIBRARY:
                return (), self._overran(stuck, "NVML")
            rest = batch.indexes[batch.indexes.index(stuck_at) + 1 :]
            if not rest:
                break
            batch = Batch(first.read, rest)
        del self._spares[MAX_SPARES:]  # more stuck calls returned than will be needed
        return self._assemble(first.count, samples, wall)

    def _free_reader(self) -> Worker:
        """The reader, else a spare, else a new thread: the one that takes the next job."""
        if self._reader is None:
            spare = self._spares.pop() if self._spares else None
            self._reader = spare or Worker(f"nvml-reader{next(self._names)}")
        return self._reader

    def _batch(self, start: float, wall: float, skip: frozenset[int]) -> Batch:
        """The library step, then every GPU but those in ``skip``."""
        read = functools.partial(self._read_one, now=start, wall=wall)
        return Batch(read, library=functools.partial(self._library_job, start), skip=skip)

    def _apply(
        self, batch: Batch, samples: dict[int, GpuSample], start: float
    ) -> dict[int, GpuSample]:
        """What ``batch`` read, into ``samples`` (returned) and what is kept for next time."""
        for index, (sample, identity, slow_read) in batch.results.items():
            samples[index] = sample
            if identity is not None:
                self._identities[index] = identity
            if not sample.up:
                self._slow_read_at.pop(index, None)
            elif slow_read:
                self._slow_read_at[index] = start
        return samples

    def _keep_stuck(self, stuck_at: int) -> Worker:
        """The reader keeps its call stuck for GPU ``stuck_at`` (or LIBRARY) until it returns."""
        reader, self._reader = self._reader, None
        assert reader is not None  # the one that ran the batch
        if stuck_at == LIBRARY:
            self._library_stuck = reader
            return reader
        self._stuck[stuck_at] = reader
        self._slow_read_at.pop(stuck_at, None)
        if stuck_at in self._identities:
            self._identities[stuck_at] = self._identities[stuck_at].forget_values()
        return reader

    def _assemble(
        self, count: int | None, samples: dict[int, GpuSample], wall: float
    ) -> tuple[tuple[GpuSample, ...], str | None]:
        """Every GPU below ``count`` (a stuck one down), or ((), why not)."""
        if count is None:
            return (), self.session.error
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
        """What has a call running past its deadline, and takes no new one until it returns:
        ``"library"``, and ``"gpu<index>"`` for each GPU whose call overran."""
        workers = {"library": self._library_stuck}
        workers.update((f"gpu{index}", w) for index, w in sorted(self._stuck.items()))
        return tuple(name for name, worker in workers.items() if worker and worker.busy)

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop sampling and shut NVML down, within about ``timeout_seconds`` in all. A worker
        stuck in a driver call is left alone (a daemon thread): killing or waiting forever
        on it is worse than exiting without ``nvmlShutdown``."""
        deadline = time.monotonic() + timeout_seconds
        self._stop.set()
        with contextlib.suppress(RuntimeError):  # released already: stop() ran before
            self._asleep.release()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        reader = self._reader
        if reader is not None:  # its sampling loop ends at its next sleep
            reader.wait_idle(deadline - time.monotonic())
        idle = reader is None or not reader.busy
        if self.session.initialised and self._library_stuck is None and idle:
            self.session.initialised = False
            if reader is None:  # the last reader is stuck in a GPU's call
                reader = self._free_reader()
            reader.submit(self.nvml.shutdown, self.clock.monotonic()).wait(
                deadline - time.monotonic()
            )
        readers = [w for w in (self._reader, self._library_stuck) if w is not None]
        for worker in (*readers, *self._stuck.values(), *self._spares):
            worker.close()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            if not self._stuck and self._library_stuck is None:
                next_at = self._watch(next_at)
                continue
            if self._sleep_until(next_at):
                break
            next_at = time.monotonic() + self.interval_seconds
            try:
                self.sample_once()  # until the stuck calls return
            except Exception:  # a bug must not kill sampling for good
                log.exception("sampling failed")

    def _watch(self, first_at: float) -> float:
        """Sampling handed to a reader thread from monotonic ``first_at`` on, and the
        deadline of each of its steps watched: returns on stop(), or once a step overran
        (then the stuck call keeps that thread), with when to sample next."""
        reader = self._free_reader()
        self._next_at = first_at
        job = reader.submit(functools.partial(self._sample_loop, first_at), 0.0)
        deadline = self.nvml_timeout_seconds
        while True:
            batch = self._live
            if batch is None:  # asleep between samples (or about to be)
                stuck_at, wait = None, max(0.0, self._next_at - time.monotonic()) + deadline
            else:
                stuck_at, wait = batch.check(deadline)
            if stuck_at is not None:
                late = time.monotonic() - batch.started  # type: ignore[union-attr]
                reader.submitted_at = self.clock.monotonic() - late  # for _overran's message
                self._keep_stuck(stuck_at)
                return time.monotonic()  # at once: a spare thread reads the others
            if self._sleep_until(time.monotonic() + wait):
                return self._next_at
            if job.done():  # only stop() or a gave-up step ends it; log anything else
                try:
                    job.value()
                except BaseException:
                    log.exception("the sampling loop ended")
                return self._next_at

    def _sample_loop(self, next_at: float) -> None:
        """On the reader: sample every interval until stop() or a call of it is given up on."""
        while True:
            self._next_at = next_at
            if self._sleep_until(next_at):
                return
            next_at = time.monotonic() + self.interval_seconds
            try:
                if not self._sample_here():
                    return
            except Exception:  # a bug must not kill sampling for good
                log.exception("sampling failed")

    def _sleep_until(self, at: float) -> bool:
        """Sleep until monotonic ``at``, or until stop() (then True; every sleeper sees it)."""
        if self._asleep.acquire(True, max(0.0, at - time.monotonic())):
            self._asleep.release()
            return True
        return self._stop.is_set()
