"""How much of the server one burst of clients may take.

:class:`RequestLimits` is WSGI middleware in front of the whole app (``/metrics`` included):

* at most ``max_in_flight`` requests are handled at once; one more is answered at once with
  503 and ``Retry-After: 1`` instead of queueing behind the others. Liveness and readiness
  probes (``/healthz``, ``/readyz``) are exempt, and the server runs a few more threads than
  the limit, so a probe always finds one free: a busy exporter is never restarted for it.
* a query string longer than ``max_query_bytes`` is answered with 414.

Long-polling ``/choose?wait=`` requests have their own, smaller cap
(:class:`gpu_exporter.choose.claim.Waiters`), so waiting clients can never take every thread.
Rejections are counted by reason for ``gpu_exporter_requests_rejected_total``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.wrappers import Request

from gpu_exporter.counters import TOO_MANY_REQUESTS, URI_TOO_LONG, RequestCounter
from gpu_exporter.units import plural
from gpu_exporter.web.errors import error_response

DEFAULT_MAX_IN_FLIGHT = 32
PROBE_THREADS = 4  # server threads beyond max_in_flight, for the exempt probes
MAX_QUERY_BYTES = 4096
EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class RequestLimits:
    def __init__(
        self,
        app: WsgiApp,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_query_bytes: int = MAX_QUERY_BYTES,
        rejections: RequestCounter | None = None,
    ) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.max_query_bytes = max_query_bytes
        self.rejections = rejections if rejections is not None else RequestCounter()
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        query = environ.get("QUERY_STRING", "")
        if len(query) > self.max_query_bytes:
            return self._reject(
                environ,
                start_response,
                414,
                URI_TOO_LONG,
                f"the query string is {len(query)} bytes; at most {self.max_query_bytes}",
            )
        if environ.get("PATH_INFO", "") in EXEMPT_PATHS:
            return self.app(environ, start_response)
        if not self._slots.acquire(blocking=False):
            return self._reject(
                environ,
                start_response,
                503,
                TOO_MANY_REQUESTS,
                f"{plural(self.max_in_flight, 'request')} "
                f"{'is' if self.max_in_flight == 1 else 'are'} already being handled; "
                "retry in a second",
                retry_after=1,
            )
        try:
            # Reading the body before releasing the slot keeps the count honest without
            # wrapping every response iterable. Its chunks are kept as they are: /metrics
            # serves the same cached chunks to every scrape of one snapshot.
            result = self.app(environ, start_response)
            try:
                return list(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
        finally:
            self._slots.release()

    def _reject(
        self,
        environ: dict[str, Any],
        start_response: StartResponse,
        status: int,
        code: str,
        message: str,
        retry_after: int | None = None,
    ) -> Iterable[bytes]:
        self.rejections.inc(code)
        resp = error_response(Request(environ), status, code, message)
        if retry_after is not None:
            resp.headers["Retry-After"] = str(retry_after)
        return resp(environ, start_response)
