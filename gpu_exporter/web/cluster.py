"""``GET /cluster/choose``: choosing across the fleet on behalf of a caller (``--prometheus-url``).

The choosing is :func:`gpu_exporter.fleet.placing.choose_fleet`'s, exactly as ``gpu-exporter
choose --prometheus`` runs it; the claim and release on the chosen host are given by the
composition root (the client's HTTP calls). Waiting (``wait=``) is the same as ``/choose``'s:
it takes one of the shared ``--max-waiters`` slots (:class:`~gpu_exporter.choose.claim.Waiters`)
and ends at once with ``shutting_down`` when the exporter stops. The store's read is bounded
by the reader (:class:`~gpu_exporter.fleet.reading.PrometheusReader`: one deadline, a size
cap) and given up, with every exchange still in progress cut, when the exporter stops or the
requesting client hangs up (``client_closed``): a slow store holds no request slot for long.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpu_exporter.choose.claim import Waiters
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.fleet.placing import Claimer, ClusterChoice, Release, choose_fleet
from gpu_exporter.fleet.reading import PrometheusReader


@dataclass(frozen=True, slots=True)
class ClusterService:
    """What ``GET /cluster/choose`` runs on an exporter started with ``--prometheus-url``."""

    reader: PrometheusReader  # the store (and --prometheus-selector); remembers its size
    claimer: Claimer
    release: Release
    # --choose-defaults: what "free" means here; each host re-applies its own when claiming.
    defaults: Mapping[str, str] = field(default_factory=lambda: dict(SHIPPED_DEFAULTS))

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

            def pause(seconds: float) -> None:
                nonlocal waiting
                check()
                if not waiting:  # the first pause: from now on this request waits for GPUs
                    slot.enter_context(waiters.slot())
                    waiting = True
                waiters.sleep(seconds)

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
