"""NVML's initialisation with backoff: the step that runs first in every sample.

:class:`NvmlSession` initialises NVML when due (retrying after 1 s, doubling to 5 min, as
the background threads do), shuts it down before the next try once it stopped working, and
counts the GPUs. It remembers the driver's versions and why NVML is down. The sampler runs
:meth:`NvmlSession.device_count` on its reader thread, like every other NVML call, with a
deadline.
"""

from __future__ import annotations

import logging

from gpu_exporter.collect.background import BACKOFF_INITIAL_SECONDS, BACKOFF_MAX_SECONDS
from gpu_exporter.collect.read import optional
from gpu_exporter.nvml import Nvml, NvmlError

log = logging.getLogger(__name__)


class NvmlSession:
    """Whether NVML is initialised, and when to try again if not."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.initialised = False
        self.error: str | None = None  # why NVML is down
        self.driver_version: str | None = None
        self.cuda_version: str | None = None
        # Successful initialisations so far: what was read before the last one is stale.
        self.generation = 0
        self._needs_shutdown = False
        self._next_init_at = 0.0  # monotonic
        self._delay = BACKOFF_INITIAL_SECONDS

    def device_count(self, now: float) -> int | None:
        """Shut down / initialise as due, then count the GPUs: None while NVML is down."""
        if self._needs_shutdown:
            self._needs_shutdown = False
            self.nvml.shutdown()
        if not self.initialised and now >= self._next_init_at:
            self._try_init(now)
        if not self.initialised:
            return None
        try:
            return self.nvml.device_count()
        except NvmlError as exc:
            self.unavailable(exc, now)
            return None

    def _try_init(self, now: float) -> None:
        try:
            self.nvml.init()
            self.driver_version = optional(lambda _: self.nvml.driver_version(), None)
            self.cuda_version = optional(lambda _: self.nvml.cuda_driver_version(), None)
        except NvmlError as exc:
            self.error = str(exc)
            log.warning("NVML is not available (%s); retrying in %.0f s", exc, self._delay)
            self._schedule(now)
            return
        log.info("NVML initialised: driver %s, CUDA %s", self.driver_version, self.cuda_version)
        self.initialised = True
        self.error = None
        self._delay = BACKOFF_INITIAL_SECONDS
        self.generation += 1

    def unavailable(self, exc: NvmlError, now: float) -> None:
        """NVML stopped working: shut down before the next try, which is after the backoff."""
        log.error("NVML stopped working: %s; re-initialising with backoff", exc)
        self.initialised = False
        self._needs_shutdown = True  # done on the reader, before the next init
        self.error = str(exc)
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        self._next_init_at = now + self._delay
        self._delay = min(self._delay * 2, BACKOFF_MAX_SECONDS)
