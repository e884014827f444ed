"""The Flask app factory: the HTTP API over one :class:`Services`, whose requests never call NVML.

* ``/metrics`` — Prometheus exposition of the latest snapshot (private registry).
* ``/choose`` — the best free GPUs for a job script, as text or JSON, claimed with a lease;
  ``/leases`` to list, release and renew them; ``/cluster/choose`` across the fleet
  (:mod:`gpu_exporter.web.leaseapi`).
* ``/gpus`` — the snapshot as JSON; ``/healthz`` liveness; ``/readyz`` readiness;
  ``/`` a status page; ``/openapi.json`` (:mod:`gpu_exporter.web.pages`).

Errors are never tracebacks or HTML debug pages: a JSON body
``{"error": {"code", "message", "param"}}`` when JSON was asked for, otherwise one plain line
(:mod:`gpu_exporter.web.errors`). The middleware in front is set by
:func:`gpu_exporter.web.middleware.install`.
"""

from __future__ import annotations

from flask import Flask

from gpu_exporter.web import errors, middleware
from gpu_exporter.web.leaseapi import api
from gpu_exporter.web.pages import pages
from gpu_exporter.web.services import EXTENSION, Services


def create_app(services: Services) -> Flask:
    """Build the app. Everything it reads comes in through ``services``."""
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions[EXTENSION] = services
    errors.register(app)
    app.register_blueprint(pages)
    app.register_blueprint(api)
    middleware.install(app, services)
    return app
