"""Background threads that call NVML off the main sampling path (Xid events, PCIe
throughput), and their base :class:`BackgroundThread` (also the kubelet poller's).

Each holds its own reference to NVML (``nvmlInit``/``nvmlShutdown`` are counted by the
library, so the sampler shutting NVML down after a failure does not pull it from under
them), re-initialises with backoff when NVML goes away, and stops within about one wait.
NVML itself is thread-safe; the wrapper's only shared state (error counts) is locked.
"""

from __future__ import annotations

import logging
import threading

from gpu_exporter.nvml import Nvml, NvmlError, NvmlUnavailable

log = logging.getLogger(__name__)

BACKOFF_INITIAL_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 300.0


class BackgroundThread:
    """A daemon thread that runs :meth:`_run` until :meth:`stop` (the Xid, PCIe and kubelet
    threads); :meth:`wait` sleeps and wakes at once on stop."""

    name = "background"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop without waiting: it ends after its current step."""
        self._stop.set()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if asked to stop meanwhile."""
        return self._stop.wait(seconds)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        raise NotImplementedError


class NvmlThread(BackgroundThread):
    """Run :meth:`step` repeatedly on a thread while NVML is initialised.

    Subclasses implement :meth:`setup` (after each ``nvmlInit``), :meth:`step` (one unit of
    work, returning within a bounded time) and :meth:`teardown` (before ``nvmlShutdown``).
    """

    name = "nvml-background"

    def __init__(self, nvml: Nvml) -> None:
        super().__init__()
        self.nvml = nvml
        self._backoff = BACKOFF_INITIAL_SECONDS

    # -- subclass hooks ---------------------------------------------------------------------
    def setup(self) -> None:
        """Called on the thread after NVML is initialised."""

    def step(self) -> None:
        """One unit of work; must return within a bounded time so that stop() is quick."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Called on the thread before NVML is shut down (after failures, and at stop)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.nvml.init()
            except NvmlError as exc:
                log.debug("%s: NVML not available (%s)", self.name, exc)
                self._retry_later()
                continue
            try:
                self.setup()
                self._backoff = BACKOFF_INITIAL_SECONDS
                while not self._stop.is_set():
                    self.step()
            except NvmlUnavailable as exc:
                log.warning("%s: NVML stopped working (%s); re-initialising", self.name, exc)
                self._stop.wait(0)  # fall through to teardown and backoff
            except Exception:  # a bug must not end the thread for good
                log.exception("%s failed", self.name)
            finally:
                try:
                    self.teardown()
                except NvmlError as exc:
                    log.debug("%s: teardown: %s", self.name, exc)
                self.nvml.shutdown()
            if not self._stop.is_set():
                self._retry_later()

    def _retry_later(self) -> None:
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_SECONDS)
