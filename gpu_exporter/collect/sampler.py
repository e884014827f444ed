"""Sampling NVML into snapshots: one reader thread reads and publishes, a watchdog gives up on
a call that overruns its deadline.

:class:`Sampler` owns the :class:`~gpu_exporter.nvml.Nvml` session (initialised with backoff
by :class:`~gpu_exporter.collect.nvmlsession.NvmlSession`) and reads every GPU
(:func:`~gpu_exporter.collect.read.read_gpu`) every ``interval`` (slow fields every
``slow_interval``) into the :class:`~gpu_exporter.collect.cache.SnapshotCache`. A hung driver
call marks one GPU (or NVML) down instead of stopping sampling. Requests only ever read the
cache; they never call NVML.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import cast

from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.fields import FIELDS, GPM_FIELD, UnsupportedFields
from gpu_exporter.collect.gpm import (
    DEFAULT_GPM_INTERVAL_SECONDS,
    MIN_GPM_INTERVAL_SECONDS,
    GpmReader,
)
from gpu_exporter.collect.groups import OFF_BY_DEFAULT
from gpu_exporter.collect.nvmlsession import NvmlSession
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.collect.read import DOWN_TIMEOUT, GpuIdentity, down_sample, read_gpu
from gpu_exporter.counters import MonotonicCounters
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.nvml import Nvml, NvmlUnavailable

log = logging.getLogger(__name__)

DEFAULT_NVML_TIMEOUT_SECONDS = 5.0  # per GPU (and per library step) and sample
DEFAULT_SLOW_INTERVAL_SECONDS = 30.0  # health fields (fields.SLOW)
# One GPU as read: its sample, its identity for next time, whether the slow fields were read.
_Read = tuple[GpuSample, "GpuIdentity | None", bool]
LIBRARY = -1  # the step before the GPUs: initialise or shut down as due, count the GPUs


@dataclass(slots=True, eq=False)
class _Pass:
    """One sample in progress: its times, the library step's count, the GPUs read so far.
    Whoever takes over from a stuck reader goes on with it from the next step."""

    wall: float
    start: float  # on the sampler's clock
    skip: frozenset[int]  # GPUs (or LIBRARY) stuck in a call when the pass began
    library_done: bool = False
    count: int | None = None
    next_index: int = 0
    samples: dict[int, GpuSample] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    snapshot: Snapshot | None = None
    error: BaseException | None = None  # a bug, raised to sample_once's caller


class _Reader(threading.Thread):
    """A daemon thread running passes: one (``once``, for sample_once) or every interval
    until stop(). ``current`` is the step it is in and since when (``time.monotonic()``: the
    deadline is real time); a reader the watchdog gave up on is ``abandoned`` and ends once
    its call returns, without touching anything."""

    def __init__(self, sampler: Sampler, work: _Pass | None, name: str) -> None:
        super().__init__(target=sampler._loop, args=(self,), name=name, daemon=True)
        self.work = work
        self.once = work is not None and not sampler.running
        self.current: tuple[int, float] | None = None
        self.abandoned = False
        self.call = "an NVML call"  # once abandoned: the call it is stuck in, and since when
        self.since = 0.0  # (sampler's clock)


class Sampler:
    """Owns NVML: initialises it (with backoff), samples it, publishes snapshots.

    One reader thread makes every NVML call, one step after another (the library step,
    then each GPU), and publishes each snapshot itself: one thread wakes per sample. A
    watchdog (the sampling thread, or :meth:`sample_once`'s caller) sleeps until the
    deadline (``nvml_timeout_seconds``) of the step running; once a step overruns it, that
    reader is left in its call and a new reader goes on with the same sample, that GPU
    published as down (``down_reason="timeout"``, no values) until the call returns (then
    the stuck thread ends). A stuck library step marks NVML down the same way.
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
        disabled: frozenset[str] = frozenset(OFF_BY_DEFAULT),
        gpm_interval_seconds: float = DEFAULT_GPM_INTERVAL_SECONDS,
    ) -> None:
        self.nvml = nvml
        self.cache = cache
        self.procinfo = procinfo
        self.interval_seconds = interval_seconds
        self.nvml_timeout_seconds = nvml_timeout_seconds
        self.slow_interval_seconds = slow_interval_seconds
        self.disabled = disabled  # --no-collect.<group>
        # GPM's two samples per device (None: --no-collect.gpm), never closer than a sample
        # (nor than NVML's 100 ms).
        self.gpm: GpmReader | None = None
        if GPM_FIELD.group not in disabled:
            gpm_interval = max(gpm_interval_seconds, interval_seconds, MIN_GPM_INTERVAL_SECONDS)
            self.gpm = GpmReader(gpm_interval, tolerance_seconds=interval_seconds / 2)
        self.clock: Clock = clock or SystemClock()
        self.session = NvmlSession(nvml)
        self.running = False  # start() was called: readers loop until stop()
        self._fields_updated = tuple(
            (name, "off" if f.group in disabled else f.when) for name, f in FIELDS.items()
        )
        # What is read once and reused, reset when NVML is initialised again.
        self._generation = 0
        self._identities: dict[int, GpuIdentity] = {}
        self._unsupported: UnsupportedFields = set()
        self._slow_read_at: dict[int, float] = {}  # GPU index → sampler clock of its slow read
        self._last_seen: dict[int, float] = {}  # GPU index → wall clock it last answered
        # NVLink counters as exported: never backwards, for the process's life.
        self._counters = MonotonicCounters()
        # The threads: the reader making calls now, those stuck in one by GPU (or LIBRARY).
        self._reader: _Reader | None = None
        self._stuck: dict[int, _Reader] = {}
        self._lock = threading.Lock()  # a step's end against the watchdog giving up on it
        self._names = itertools.count()
        self._next_at = 0.0  # time.monotonic() of the next pass
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the watchdog --------------------------------------------------------------------
    def sample_once(self) -> Snapshot:
        """Initialise NVML if due, read every GPU, publish and return the snapshot: the
        reads on a reader thread, which this thread watches with the deadline."""
        work = self._begin()
        self._start_reader(work)
        self._watch(work.done)
        if work.error is not None:
            raise work.error
        assert work.snapshot is not None
        return work.snapshot

    def start(self) -> None:
        self.running = True
        self._next_at = time.monotonic()
        self._start_reader(None)
        self._thread = threading.Thread(
            target=self._watch, args=(self._stop,), name="nvml-sampler", daemon=True
        )
        self._thread.start()

    def _start_reader(self, work: _Pass | None) -> None:
        self._reader = _Reader(self, work, f"nvml-reader{next(self._names)}")
        self._reader.start()

    def _watch(self, until: threading.Event) -> None:
        """Until ``until`` is set: sleep to the deadline of the reader's step (a whole
        deadline between steps), and take over from a reader whose step overran it."""
        while True:
            reader = self._reader
            current = reader.current if reader is not None else None
            wait = self.nvml_timeout_seconds
            if current is not None:
                wait += current[1] - time.monotonic()
                if wait <= 0:
                    self._take_over(reader, current)  # type: ignore[arg-type]
                    continue
            if until.wait(wait):
                return

    def _take_over(self, reader: _Reader, current: tuple[int, float]) -> None:
        """Leave ``reader`` in its overdue call; a new reader goes on with its pass."""
        step, started = current
        with self._lock:
            if reader.current is not current:  # the step ended meanwhile
                return
            reader.abandoned = True
            work = reader.work
            assert work is not None
            reader.call = self.nvml.in_flight(reader.ident or 0) or "an NVML call"
            reader.since = self.clock.monotonic() - (time.monotonic() - started)
            self._stuck[step] = reader
            if step == LIBRARY:
                work.library_done = True
            else:
                work.next_index = step + 1
                self._slow_read_at.pop(step, None)
                if step in self._identities:
                    self._identities[step] = self._identities[step].forget_values()
        self.nvml.count_timeout(reader.call)
        message, deadline = self._overran(reader), self.nvml_timeout_seconds
        log.error("%s: %s (deadline %g s); down until it returns", _what(step), message, deadline)
        if reader.once or not self._stop.is_set():
            self._start_reader(work)

    def stuck(self) -> tuple[str, ...]:
        """What has a call running past its deadline, and takes no new one until it returns:
        ``"library"``, and ``"gpu<index>"`` for each GPU whose call overran."""
        stuck = sorted(self._stuck.copy().items())
        names = {k: "library" if k == LIBRARY else f"gpu{k}" for k, r in stuck if r.current}
        return tuple(names.values())

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop sampling and shut NVML down, within about ``timeout_seconds`` in all. A reader
        stuck in a driver call is left alone (a daemon thread): killing or waiting forever
        on it is worse than exiting without ``nvmlShutdown``."""
        deadline = time.monotonic() + timeout_seconds
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
        reader = self._reader
        if reader is not None:  # its loop ends at its next sleep
            reader.join(max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                return
        if self.session.initialised and "library" not in self.stuck():
            self.session.initialised = False
            closer = threading.Thread(target=self._shutdown, name="nvml-shutdown", daemon=True)
            closer.start()
            closer.join(max(0.0, deadline - time.monotonic()))

    def _shutdown(self) -> None:
        """GPM's buffers freed (but a stuck GPU's: its call may still write to one), then
        NVML shut down."""
        if self.gpm is not None:
            self.gpm.close(self.nvml, keep=self._stuck_gpus())
        self.nvml.shutdown()

    def _stuck_gpus(self) -> frozenset[int]:
        return frozenset(k for k in self._stuck.copy() if k != LIBRARY)

    # -- the reader ----------------------------------------------------------------------
    def _loop(self, me: _Reader) -> None:
        """On a reader: its pass, or one every interval until stop(); ends if abandoned."""
        while True:
            work = me.work
            if work is None:
                if self._stop.wait(max(0.0, self._next_at - time.monotonic())):
                    return
                self._next_at = time.monotonic() + self.interval_seconds
                work = me.work = self._begin()
            try:
                self._run(me, work)
            except Exception as exc:  # a bug must not kill sampling for good
                if me.abandoned:
                    return
                if me.once:
                    work.error = exc
                    work.done.set()
                    return
                log.exception("sampling failed")
            if me.abandoned or me.once:
                return
            me.work = None

    def _begin(self) -> _Pass:
        """A new pass, once the process cache knows it began and returned calls are seen."""
        if self.procinfo is not None:
            self.procinfo.next_pass()
        with self._lock:
            for key, reader in list(self._stuck.items()):
                if reader.current is None:  # its call returned: sample it again
                    del self._stuck[key]
                    log.warning("%s: the stuck NVML call returned; sampling it again", _what(key))
            skip = frozenset(self._stuck)
        return _Pass(self.clock.time(), self.clock.monotonic(), skip)

    def _run(self, me: _Reader, work: _Pass) -> None:
        """The steps of ``work`` still to do, then its snapshot published."""
        unavailable: NvmlUnavailable | None = None
        while (step := self._next_step(work)) is not None:
            me.current = (step, time.monotonic())
            result: object = None
            try:
                if step == LIBRARY:
                    result = self.session.device_count(work.start)
                else:
                    result = self._read_one(step, work)
            except NvmlUnavailable as exc:
                unavailable, result = exc, None
            finally:
                with self._lock:
                    me.current = None
                    if not me.abandoned:
                        self._apply(work, step, result)
            if me.abandoned:
                return
            if unavailable is not None:
                if self.gpm is not None:  # freed before NVML is shut down and initialised again
                    self.gpm.close(self.nvml, keep=self._stuck_gpus())
                self.session.unavailable(unavailable, work.start)
                work.count = None
                break
        self._publish(work)

    def _next_step(self, work: _Pass) -> int | None:
        if not work.library_done:
            if LIBRARY not in work.skip:
                return LIBRARY
            work.library_done = True
        if work.count is None:
            return None
        index = work.next_index
        while index in work.skip:
            index += 1
        work.next_index = index
        return index if index < work.count else None

    def _apply(self, work: _Pass, step: int, result: object) -> None:
        """What a step returned, into ``work`` and what is kept for next time."""
        if step == LIBRARY:
            work.library_done, work.count = True, result  # type: ignore[assignment]
            if self.gpm is not None and not self.session.initialised:
                # NVML is down: GPM's buffers go before it is shut down and initialised again
                self.gpm.close(self.nvml, keep=self._stuck_gpus())
            if self.session.generation != self._generation:  # (re)initialised: read afresh
                self._generation = self.session.generation
                self._identities.clear()
                self._slow_read_at.clear()
                self._unsupported.clear()
                if self.gpm is not None:  # what GPM knew of the last initialisation
                    self.gpm.close(self.nvml, keep=self._stuck_gpus())
            return
        work.next_index = step + 1
        if result is None:
            return
        sample, identity, slow_read = cast("_Read", result)
        work.samples[step] = sample
        if identity is not None:
            self._identities[step] = identity
        if not sample.up:
            self._slow_read_at.pop(step, None)
            if self.gpm is not None:  # lost: its GPM buffers go (its call has returned)
                self.gpm.forget(self.nvml, step)
        elif slow_read:
            self._slow_read_at[step] = work.start

    def _read_one(self, index: int, work: _Pass) -> _Read:
        """One GPU, its slow fields if due (half an interval early rather than one late:
        jitter must not stretch the period)."""
        read_at = self._slow_read_at.get(index)
        slow_due = read_at is None or work.start - read_at >= self.slow_interval_seconds - (
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
            seen_at=work.wall,
            counters=self._counters,
            gpm=self.gpm,
            now=work.start,
        )
        return sample, identity, slow_due

    def _publish(self, work: _Pass) -> None:
        """Every GPU below the count (a stuck one down), or none and why NVML is down."""
        gpus: list[GpuSample] = []
        problem = self.session.error
        library = self._stuck.get(LIBRARY)
        if work.count is None and library is not None:
            problem = self._overran(library)
        elif work.count is not None:
            problem = None
            for index in range(work.count):
                sample = work.samples.get(index)
                if sample is None:
                    reader = self._stuck[index]
                    sample = down_sample(
                        index, self._identities.get(index), DOWN_TIMEOUT, self._overran(reader)
                    )
                if sample.up:  # read_gpu gave it last_seen_seconds=wall
                    self._last_seen[index] = work.wall
                else:
                    sample = replace(sample, last_seen_seconds=self._last_seen.get(index))
                gpus.append(sample)
        snapshot = Snapshot(
            taken_at_seconds=work.wall,
            monotonic_seconds=work.start,
            sample_duration_seconds=max(0.0, self.clock.monotonic() - work.start),
            nvml_up=problem is None,
            simulated=self.nvml.simulated,
            gpus=tuple(gpus),
            nvml_error=problem,
            driver_version=self.session.driver_version,
            cuda_driver_version=self.session.cuda_version,
            nvml_errors=tuple(
                (fn, err, n) for (fn, err), n in sorted(self.nvml.error_counts().items())
            ),
            process_labels=self.procinfo.fields if self.procinfo is not None else (),
            fields_updated=self._fields_updated,
        )
        work.snapshot = self.cache.publish(snapshot)
        work.done.set()

    def _overran(self, reader: _Reader) -> str:
        return f"{reader.call} has not returned for {self.clock.monotonic() - reader.since:.0f} s"


def _what(step: int) -> str:
    return "NVML" if step == LIBRARY else f"GPU {step}"
