"""``GET /cluster/choose``: choosing across the fleet on behalf of a caller (``--prometheus-url``).

The choosing itself is the client's (:func:`gpu_exporter.client.fleet.choose_fleet`): the
exporter reads the fleet from Prometheus and claims on the chosen host's ``/choose``, exactly as
``gpu-exporter choose --prometheus`` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_exporter.client.fleet import ClusterChoice, choose_fleet
from gpu_exporter.client.transport import DEFAULT_TIMEOUT_SECONDS


@dataclass(frozen=True, slots=True)
class ClusterService:
    """What ``GET /cluster/choose`` runs on an exporter started with ``--prometheus-url``."""

    prometheus: str
    selector: str = ""  # label matchers narrowing the fleet (--prometheus-selector)
    timeout: float = DEFAULT_TIMEOUT_SECONDS

    def choose(self, args: Mapping[str, str]) -> ClusterChoice:
        return choose_fleet(
            args, prometheus=self.prometheus, selector=self.selector, timeout=self.timeout
        )
