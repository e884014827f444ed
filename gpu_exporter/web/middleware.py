"""The WSGI middleware around the app, in the one order that is decided here.

From the outside in::

    RequestLog           at debug level, one line per request, whatever answered it
    SecurityHeaders      the configured headers, on every answer (the 503/414/401 below too)
    BasicAuthMiddleware  credentials, checked outside the limits: a flood of wrong passwords
                         never takes the request slots good clients need. Cached successes
                         cost no bcrypt; failing addresses are throttled (429) before any
                         bcrypt, and bcrypt has its own few slots
    RequestLimits        in-flight slots and the query-string limit; the probes exempt
                         (every limit: web/limits.py)
    DispatcherMiddleware /metrics (or --web.telemetry-path, and then only there) to the
                         exposition, everything else to Flask
    MetricsParams        /metrics: unknown query parameters are a 400, as on every other
                         endpoint; ``name[]`` is prometheus_client's documented name filter;
                         HEAD is served as GET (the server sends no body for HEAD)

Headers and auth exist only with ``--web-config-file``. :func:`install` sets
``app.wsgi_app`` once, as prometheus_client's Flask example does, so the server, Flask's
test client and the benchmarks all serve the same stack.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask
from prometheus_client import make_wsgi_app
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.wrappers import Request

from gpu_exporter.clock import Clock
from gpu_exporter.counters import RequestCounter
from gpu_exporter.web.auth import BasicAuthMiddleware
from gpu_exporter.web.errors import error_response
from gpu_exporter.web.gateway import without_secrets
from gpu_exporter.web.limits import RequestLimits, StartResponse, WsgiApp
from gpu_exporter.web.services import Services
from gpu_exporter.web.webconfig import SecurityHeaders

log = logging.getLogger("gpu_exporter.requests")


def install(app: Flask, services: Services) -> None:
    """Wrap ``app.wsgi_app`` in the middleware ``services`` asks for."""
    registry, exposition, watcher = services.registry, services.exposition, services.watcher
    metrics = make_wsgi_app(registry) if exposition is None else exposition.wsgi_app(registry)
    path = services.telemetry_path
    wsgi: WsgiApp = DispatcherMiddleware(app.wsgi_app, {path: MetricsParams(metrics, path)})
    rejections = services.rejections if services.rejections is not None else RequestCounter()
    limits = services.limits
    wsgi = RequestLimits(wsgi, limits, rejections)
    if watcher is not None:
        wsgi = BasicAuthMiddleware(
            wsgi,
            watcher,
            services.auth_scope,
            limits=limits,
            clock=services.clock,
            rejections=rejections,
            telemetry_path=path,
        )
        wsgi = SecurityHeaders(wsgi, watcher)
    app.wsgi_app = RequestLog(wsgi, services.clock)  # type: ignore[method-assign]


class MetricsParams:
    """``/metrics?x=1`` answered 200 while ``/gpus?x=1`` answered 400: a typo in a scrape
    config's ``params`` went unnoticed. Only ``name[]`` (repeatable) is understood."""

    ALLOWED = ("name[]",)

    def __init__(self, app: WsgiApp, path: str = "/metrics") -> None:
        self.app = app
        self.path = path

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") == "HEAD":  # prometheus_client answers HEAD 405
            environ = {**environ, "REQUEST_METHOD": "GET"}
        if not environ.get("QUERY_STRING"):  # every scrape: no parsing on the hot path
            return self.app(environ, start_response)
        req = Request(environ)
        for name in req.args:
            if name not in self.ALLOWED:
                message = (
                    f"unknown parameter {name!r}; {self.path} takes only name[] "
                    "(repeatable: serve only these metric names)"
                )
                answer = error_response(req, 400, "unknown_parameter", message, name)
                return answer(environ, start_response)
        return self.app(environ, start_response)


class RequestLog:
    """At debug level (``--log.level=debug``), one line per request: method, path, status,
    duration and client address.

    Never a credential: no header is logged (``Authorization``, ``Idempotency-Key``), a
    lease token in the path keeps only its id (``/leases/3f2a….…``), and the query string
    is not logged (``/choose`` parameters are in the answer's ``format=json``).
    """

    def __init__(self, app: WsgiApp, clock: Clock) -> None:
        self.app = app
        self._clock = clock

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Any:
        if not log.isEnabledFor(logging.DEBUG):
            return self.app(environ, start_response)
        started = self._clock.monotonic()
        status: list[str] = []
        # Read now: the dispatcher moves the mount point from PATH_INFO to SCRIPT_NAME.
        method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")

        def noting(code: str, headers: Any, exc_info: Any = None) -> Any:
            status[:] = [code]
            return start_response(code, headers, exc_info)

        try:
            return self.app(environ, noting)
        finally:
            log.debug(
                "request",
                extra={
                    "fields": {
                        "method": method,
                        "path": without_secrets(path),
                        "status": status[0].split(" ", 1)[0] if status else "-",
                        "duration_seconds": f"{self._clock.monotonic() - started:.6f}",
                        "remote": environ.get("REMOTE_ADDR", ""),
                    }
                },
            )
