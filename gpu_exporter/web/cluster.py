"""``GET /cluster/choose``: choosing across the fleet on behalf of a caller (``--prometheus-url``).

The choosing is :func:`gpu_exporter.fleet.placing.choose_fleet`'s, exactly as ``gpu-exporter
choose --prometheus`` runs it; the claim and release on the chosen host are given by the
composition root (the client's HTTP calls). Waiting (``wait=``) is the same as ``/choose``'s:
it takes one of the shared ``--max-waiters`` slots (:class:`~gpu_exporter.choose.claim.Waiters`)
and ends at once with ``shutting_down`` when the exporter stops. The store's read is bounded
by the reader (:class:`~gpu_exporter.fleet.reading.PrometheusReader`: one deadline, a size
cap) and given up, with every exchange still in progress cut, when the exporter stops or the
requesting client hangs up (``client_closed``). Patient clients of a slow store hold at most
:attr:`~gpu_exporter.web.limits.Limits.store_reads` request slots (one per read in progress;
none between the reads of a ``wait=``): the next waits up to ``slot_wait_seconds`` for one,
then 503 ``store_busy``, so a trickling store can never take every request slot.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from gpu_exporter.choose.claim import Waiters
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.counters import STORE_BUSY, RequestCounter
from gpu_exporter.fleet.placing import Claimer, ClusterChoice, Release, choose_fleet
from gpu_exporter.fleet.reading import PrometheusReader
from gpu_exporter.units import plural
from gpu_exporter.web.limits import DEFAULT_LIMITS, Limits


@dataclass(frozen=True, slots=True)
class ClusterService:
    """What ``GET /cluster/choose`` runs on an exporter started with ``--prometheus-url``."""

    reader: PrometheusReader  # the store (and --prometheus-selector); remembers its size
    claimer: Claimer
    release: Release
    # --choose-defaults: what "free" means here; each host re-applies its own when claiming.
    defaults: Mapping[str, str] = field(default_factory=lambda: dict(SHIPPED_DEFAULTS))
    limits: Limits = DEFAULT_LIMITS  # store_reads, slot_wait_seconds
    rejections: RequestCounter = field(default_factory=RequestCounter)  # store_busy counted
    _reads: threading.BoundedSemaphore = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_reads", threading.BoundedSemaphore(self.limits.store_reads))

    @contextlib.contextmanager
    def _read_slot(self, wait_seconds: float) -> Iterator[None]:
        """One of the :attr:`Limits.store_reads` slots, for a read of the store and the claim
        after it; 503 ``store_busy`` when none frees within ``wait_seconds``."""
        if not self._reads.acquire(timeout=wait_seconds):
            self.rejections.inc(STORE_BUSY)
            n = self.limits.store_reads
            are = "is" if n == 1 else "are"
            message = f"{plural(n, 'fleet read')} {are} in progress already; retry in a few seconds"
            raise ApiError(503, STORE_BUSY, message)
        try:
            yield
        finally:
            self._reads.release()

    def choose(
        self,
        args: Mapping[str, str],
        waiters: Waiters,
        connected: Callable[[], bool] | None = None,
    ) -> ClusterChoice:
        """Choose and claim for ``args``; waits between fleet reads as a waiter of ``waiters``.
        ``connected`` (the server's, from the environ) says whether the client is still there."""

        def check() -> None:
            waiters.check()
            if connected is not None and not connected():
                raise ApiError(499, "client_closed", "the client closed the connection")

        with contextlib.ExitStack() as slot:
            waiting = False
            reading = contextlib.ExitStack()  # the read slot, given back for every pause
            reading.enter_context(self._read_slot(self.limits.slot_wait_seconds))
            slot.push(reading)

            def pause(seconds: float) -> None:
                nonlocal waiting
                check()
                if not waiting:  # the first pause: from now on this request waits for GPUs
                    slot.enter_context(waiters.slot())
                    waiting = True
                reading.close()
                waiters.sleep(seconds)
                check()  # a waiter waits for a read slot as long as it slept
                reading.enter_context(self._read_slot(max(seconds, self.limits.slot_wait_seconds)))

            return choose_fleet(
                args,
                claimer=self.claimer,
                release=self.release,
                prometheus=self.reader,
                timeout=self.reader.timeout,
                fetch=self.reader.fetch,
                sleep=pause,
                defaults=self.defaults,
                check=check,
            )
