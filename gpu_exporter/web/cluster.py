"""``GET /cluster/choose``: choosing across the fleet on behalf of a caller (``--prometheus-url``).

The choosing itself is the client's (:func:`gpu_exporter.client.fleet.choose_fleet`): the
exporter reads the fleet from Prometheus and claims on the chosen host's ``/choose``, exactly as
``gpu-exporter choose --prometheus`` would. Waiting (``wait=``) is the same as ``/choose``'s:
it takes one of the shared ``--max-waiters`` slots (:class:`~gpu_exporter.choose.claim.Waiters`)
and ends at once with ``shutting_down`` when the exporter stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpu_exporter.choose.claim import Waiters
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.client.fleet import ClusterChoice, choose_fleet
from gpu_exporter.client.fleetread import Fetch, http_get_json
from gpu_exporter.client.transport import DEFAULT_TIMEOUT_SECONDS


@dataclass(frozen=True, slots=True)
class ClusterService:
    """What ``GET /cluster/choose`` runs on an exporter started with ``--prometheus-url``."""

    prometheus: str
    selector: str = ""  # label matchers narrowing the fleet (--prometheus-selector)
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    fetch: Fetch = http_get_json  # how Prometheus and the hosts are read
    # --choose-defaults: what "free" means here; each host re-applies its own when claiming.
    defaults: Mapping[str, str] = field(default_factory=lambda: dict(SHIPPED_DEFAULTS))
    rule_prefix: str = ""  # --fleet-rule-prefix: the recorded fleet view, where present

    def choose(self, args: Mapping[str, str], waiters: Waiters) -> ClusterChoice:
        """Choose and claim for ``args``; waits between fleet reads as a waiter of ``waiters``."""
        with contextlib.ExitStack() as slot:
            waiting = False

            def pause(seconds: float) -> None:
                nonlocal waiting
                waiters.check()
                if not waiting:  # the first pause: from now on this request waits for GPUs
                    slot.enter_context(waiters.slot())
                    waiting = True
                waiters.sleep(seconds)

            return choose_fleet(
                args,
                prometheus=self.prometheus,
                selector=self.selector,
                rule_prefix=self.rule_prefix,
                timeout=self.timeout,
                fetch=self.fetch,
                sleep=pause,
                defaults=self.defaults,
            )
