"""The WSGI middleware around the app, in the one order that is decided here.

From the outside in::

    SecurityHeaders      the configured headers, on every answer (the 503/414/401 below too)
    RequestLimits        in-flight slots and the query-string limit; the probes exempt
    BasicAuthMiddleware  credentials, checked inside the limits: a flood of wrong passwords
                         (one bcrypt each) takes request slots, never the probes' threads
    DispatcherMiddleware /metrics to the exposition, everything else to Flask
    MetricsParams        /metrics: unknown query parameters are a 400, as on every other
                         endpoint; ``name[]`` is prometheus_client's documented name filter;
                         HEAD is served as GET (the server sends no body for HEAD)

Headers and auth exist only with ``--web-config-file``. :func:`install` sets
``app.wsgi_app`` once, as prometheus_client's Flask example does, so the server, Flask's
test client and the benchmarks all serve the same stack.
"""

from __future__ import annotations

from typing import Any

from flask import Flask
from prometheus_client import make_wsgi_app
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.wrappers import Request

from gpu_exporter.web.auth import BasicAuthMiddleware
from gpu_exporter.web.errors import error_response
from gpu_exporter.web.limits import RequestLimits, WsgiApp
from gpu_exporter.web.services import Services
from gpu_exporter.web.webconfig import SecurityHeaders


def install(app: Flask, services: Services) -> None:
    """Wrap ``app.wsgi_app`` in the middleware ``services`` asks for."""
    registry, exposition, watcher = services.registry, services.exposition, services.watcher
    metrics = make_wsgi_app(registry) if exposition is None else exposition.wsgi_app(registry)
    wsgi: WsgiApp = DispatcherMiddleware(app.wsgi_app, {"/metrics": MetricsParams(metrics)})
    if watcher is not None:
        wsgi = BasicAuthMiddleware(wsgi, watcher, services.auth_scope)
    wsgi = RequestLimits(wsgi, max_in_flight=services.max_in_flight, rejections=services.rejections)
    if watcher is not None:
        wsgi = SecurityHeaders(wsgi, watcher)
    app.wsgi_app = wsgi  # type: ignore[method-assign]


class MetricsParams:
    """``/metrics?x=1`` answered 200 while ``/gpus?x=1`` answered 400: a typo in a scrape
    config's ``params`` went unnoticed. Only ``name[]`` (repeatable) is understood."""

    ALLOWED = ("name[]",)

    def __init__(self, app: WsgiApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") == "HEAD":  # prometheus_client answers HEAD 405
            environ = {**environ, "REQUEST_METHOD": "GET"}
        if not environ.get("QUERY_STRING"):  # every scrape: no parsing on the hot path
            return self.app(environ, start_response)
        req = Request(environ)
        for name in req.args:
            if name not in self.ALLOWED:
                message = (
                    f"unknown parameter {name!r}; /metrics takes only name[] "
                    "(repeatable: serve only these metric names)"
                )
                answer = error_response(req, 400, "unknown_parameter", message, name)
                return answer(environ, start_response)
        return self.app(environ, start_response)
