"""The threads the sampler's NVML calls run on, and how their deadlines are watched.

:class:`Worker` runs jobs one at a time on a daemon thread; :class:`Batch` is one sample's
library step and GPUs read in order on one worker, with a deadline for the library step and
each GPU. The reader runs batches in its own sampling loop while the sampling thread only
checks the step running (:meth:`Batch.check`); after a hang the sampler hands each batch
over and waits for it (:meth:`Batch.wait`). A driver call cannot be interrupted, so a worker
stuck in one is left to finish on its own.
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_exporter.model import GpuSample

if TYPE_CHECKING:
    from gpu_exporter.collect.read import GpuIdentity


class Job:
    """One job handed to a :class:`Worker`: done once its lock is free, then holding the
    job's result or the exception it raised. A bare lock, not a ``Future``: waiting for it
    is one C call, which matters on a path that runs every second for the process's life."""

    __slots__ = ("_done", "error", "result")

    def __init__(self) -> None:
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return not self._done.locked()

    def wait(self, timeout_seconds: float) -> bool:
        """Whether the job finished within ``timeout_seconds``."""
        if self._done.acquire(True, max(0.0, timeout_seconds)):
            self._done.release()
            return True
        return False

    def value(self) -> Any:
        """The job's result (raising its exception); call once :meth:`done`."""
        if self.error is not None:
            raise self.error
        return self.result

    def finish(self) -> None:
        self._done.release()


class Worker:
    """A daemon thread that runs NVML jobs one at a time: the library's, or the GPU reads.

    A driver call cannot be interrupted, so a job that overruns its deadline is left to
    finish on its own. Until it does, the worker is :attr:`busy` and takes no new job: one
    outstanding call per worker, never a pile of threads stuck in the same call.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Job] | None] = queue.SimpleQueue()
        self._current: Job | None = None
        self.submitted_at = 0.0  # monotonic, on the sampler's clock
        self.overran = False  # the current (or last) job ran past its deadline
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

    def submit(self, fn: Callable[[], Any], now: float) -> Job:
        if self.busy:
            raise RuntimeError(f"{self.name} is still busy")
        job = Job()
        self._current, self.submitted_at = job, now
        self._jobs.put((fn, job))
        return job

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Whether the current job (if any) finished within ``timeout_seconds``."""
        return self._current is None or self._current.wait(timeout_seconds)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            fn, job = item
            try:
                job.result = fn()
            except BaseException as exc:  # handed to whoever waits on the job
                job.error = exc
            finally:
                job.finish()


MAX_SPARES = 2  # idle reader threads kept after stuck calls returned
# One GPU as read on the reader thread: its sample, its identity for next time, and whether
# the slow fields were read (the sampler applies these; a thread that overran applies nothing).
Read = tuple[GpuSample, "GpuIdentity | None", bool]


LIBRARY = -1  # Batch.current while the library step runs


class Batch:
    """GPUs for the reader thread to read in order, and how far it got; optionally the
    library step first (``library``: initialise or shut down as due, then the GPU count;
    None when NVML is down), then every GPU below that count but those in ``skip``.

    Whoever watches it (:meth:`check`, or :meth:`wait` for a batch handed over as a job)
    gives up on it once the library step or a GPU's reads take longer than the deadline; a
    batch given up on reads no further GPU (``abandoned``).
    """

    def __init__(
        self,
        read: Callable[[int], Read],
        indexes: list[int] | None = None,
        *,
        library: Callable[[], int | None] | None = None,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        self.indexes = indexes or []
        self.read = read
        self.library = library
        self.skip = skip
        self.count: int | None = None  # what the library step answered
        self.results: dict[int, Read] = {}
        self.current: int | None = None  # the GPU being read, or LIBRARY
        self.started = 0.0  # time.monotonic() when it was started: deadlines are real time
        self.abandoned = False
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            self._run()
        finally:
            with self.lock:  # a step that raised is over: no deadline to watch for it
                if not self.abandoned:
                    self.current = None

    def _run(self) -> None:
        if self.library is not None:
            with self.lock:
                if self.abandoned:
                    return
                self.current, self.started = LIBRARY, time.monotonic()
            count = self.library()
            with self.lock:
                if self.current != LIBRARY:  # abandoned: NVML was reported down meanwhile
                    return
                self.current, self.count = None, count
                if count is None:
                    return
                self.indexes = [i for i in range(count) if i not in self.skip]
        for index in self.indexes:
            with self.lock:
                if self.abandoned:
                    return
                self.current, self.started = index, time.monotonic()
            result = self.read(index)
            with self.lock:
                if self.current != index:  # abandoned: what it read is dropped (GPU was down)
                    return
                self.results[index] = result
                self.current = None

    def wait(self, job: Job, deadline_seconds: float) -> int | None:
        """None once every GPU is read, else the GPU whose read overran the deadline, or
        :data:`LIBRARY` (then the batch is abandoned: the thread stuck in it reads nothing
        more)."""
        stuck, left = self.check(deadline_seconds)
        while stuck is None:
            if job.wait(left):
                job.value()  # a bug in the batch surfaces in sample_once's caller
                return None
            stuck, left = self.check(deadline_seconds)
        return stuck

    def check(self, deadline_seconds: float) -> tuple[int | None, float]:
        """Whether the step running now has overrun ``deadline_seconds``: (that GPU, or
        :data:`LIBRARY`, 0) once it has, and the batch is abandoned; else (None, seconds
        until its deadline, or the whole deadline between steps)."""
        with self.lock:
            current = self.current
            if current is None:
                return None, deadline_seconds
            left = self.started + deadline_seconds - time.monotonic()
            if left > 0:
                return None, left
            self.abandoned = True
            self.current = None
            return current, 0.0
