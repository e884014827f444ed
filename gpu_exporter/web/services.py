"""What the web app reads: one :class:`Services` object, built by :func:`gpu_exporter.daemon.build`.

:func:`gpu_exporter.web.app.create_app` keeps it in ``app.extensions``; the blueprints reach
it with :func:`services`, so a view has no globals of its own and the tests wire the same
objects production does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from flask import current_app
from prometheus_client import CollectorRegistry

from gpu_exporter.choose.claim import Claimer, Waiters
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.counters import RequestCounter, XidCounter
from gpu_exporter.export.exposition import Exposition
from gpu_exporter.web.limits import Limits

if TYPE_CHECKING:
    from gpu_exporter.web.cluster import ClusterService
    from gpu_exporter.web.webconfig import WebConfigWatcher

EXTENSION = "gpu_exporter"  # the key in app.extensions


@dataclass
class Services:
    """Everything the app and its middleware read.

    The same ``leases``, ``requests`` and ``rejections`` go to the metrics collector, which
    exports them. ``claimer`` serves ``/choose`` over ``cache`` and ``leases``; ``waiters``
    holds the ``--max-waiters`` slots and the shutdown event (:attr:`stopping`) every waiting
    request shares. ``cluster`` (from ``--prometheus-url``) serves ``/cluster/choose``.
    With ``exposition``, ``/metrics`` serves its per-snapshot cached rendering (which must
    cover the same collectors as ``registry``); without, ``registry`` is rendered per scrape.
    With ``watcher`` (``--web-config-file``), basic auth in ``auth_scope`` and the configured
    headers are in front of every request.
    """

    cache: SnapshotCache
    registry: CollectorRegistry
    leases: LeaseTable
    claimer: Claimer
    waiters: Waiters
    clock: Clock = field(default_factory=SystemClock)
    max_age_seconds: float = 10.0
    requests: RequestCounter = field(default_factory=RequestCounter)
    rejections: RequestCounter | None = None
    limits: Limits = field(default_factory=Limits)  # every limit; the server's too
    cluster: ClusterService | None = None
    exposition: Exposition | None = None
    xids: XidCounter | None = None
    watcher: WebConfigWatcher | None = None
    auth_scope: str = "all"  # "all", or "writes": only lease-taking requests need credentials
    # --choose-defaults, parsed: the filters /choose applies when a request does not give them.
    choose_defaults: Mapping[str, str] = field(default_factory=dict)
    max_idle_for_seconds: float | None = None  # how far back the sample history reaches
    # Users (authenticated by ``watcher``'s basic auth) who may renew or release any lease.
    lease_admins: frozenset[str] = frozenset()
    telemetry_path: str = "/metrics"  # --web.telemetry-path: the metrics are served only here

    @property
    def stopping(self) -> threading.Event:
        """Set on shutdown: waiting requests give up at once."""
        return self.waiters.stopping


def services() -> Services:
    """The current app's :class:`Services` (inside a request)."""
    return cast(Services, current_app.extensions[EXTENSION])
