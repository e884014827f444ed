"""Every limit of the request path in one place (:class:`Limits`), and every deadline.

Built once (:func:`gpu_exporter.daemon.build`, from the flags) and handed to what enforces
each limit; nothing else sizes one limit against another. In the order a request meets them:
connections (:class:`~gpu_exporter.web.admission.ConnectionSlots`), head and body size and
the deadlines (:class:`~gpu_exporter.web.connection.HttpConnection`), failed logins and bcrypt
(:class:`~gpu_exporter.web.auth.BasicAuthMiddleware`), requests in flight and the query
length (:class:`RequestLimits`, here), waiting ``/choose`` requests
(:class:`~gpu_exporter.choose.claim.Waiters`). What a client sees for each: docs/design.md,
"The request path".

:class:`RequestLimits` is WSGI middleware in front of the whole app (``/metrics`` included),
and the one bound on requests in flight (the server's worker pool only bounds threads), so the
server, Flask's test client and the benchmarks enforce the same request limits. The
probes (``/healthz``, ``/readyz``) are exempt and have :attr:`Limits.probe_threads` workers of
their own: a busy exporter is never restarted for a missed probe. Rejections are counted by
reason for ``gpu_exporter_requests_rejected_total``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from werkzeug.wrappers import Request, Response

from gpu_exporter.counters import TOO_MANY_REQUESTS, URI_TOO_LONG, RequestCounter
from gpu_exporter.units import plural
from gpu_exporter.web.errors import error_response

# The probes: never limited, never asked for credentials (kubelet and load balancers rarely
# have them, and their answers say only "ok"/"ready" or why not).
EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclass(frozen=True, slots=True)
class Limits:
    """What one exporter lets its clients take; the defaults are the flags' defaults."""

    # Connections held at once (file descriptors, memory); lowered at start to the open-files
    # limit less a reserve. At the cap a new connection evicts the oldest one whose answer
    # goes unread, else the oldest still waiting for its request, else the oldest of the peer
    # holding the most (a fair share each), or is refused (503 on plain HTTP).
    max_connections: int = 1024
    # Beyond max_connections: connections held for /healthz and /readyz only (a probe always
    # gets one; any other request on one is 503 too many connections).
    probe_connections: int = 8
    # Connections of one peer (web.peers: a remote address, or a local user) still waiting
    # for their request; beyond it that peer's oldest waiting one is evicted (a slowloris only
    # churns its own).
    max_waiting_per_peer: int = 512
    # --max-requests-in-flight: requests handled at once, the probes exempt. One more waits
    # up to slot_wait_seconds for a slot (a burst of short requests queues rather than
    # failing: a scrape takes about a millisecond), then gets 503.
    max_in_flight: int = 32
    slot_wait_seconds: float = 0.5
    # Threads of their own for /healthz and /readyz; as many app threads beyond max_in_flight.
    probe_threads: int = 4
    # --max-waiters: /choose?wait= requests waiting at once (503); below max_in_flight, so
    # waiting clients never take every worker.
    max_waiters: int = 8
    # --max-waiters-per-requester: waiting requests of one requester (web.peers; 429); 0: any.
    max_waiters_per_requester: int = 2
    max_query_bytes: int = 4096  # 414 beyond
    max_header_bytes: int = 16 * 1024  # the request line and headers: 431 beyond
    max_body_bytes: int = 64 * 1024  # 413 beyond: nothing here needs more
    # Buffered answer bytes before a connection stops reading its next request.
    write_buffer_bytes: int = 256 * 1024
    # Basic auth: failed checks an address may make before it must wait (429) the base
    # delay, doubling per further failure up to the maximum; forgotten after the forget
    # time without a failure, at most max_addresses remembered.
    auth_free_failures: int = 5
    auth_base_delay_seconds: float = 1.0
    auth_max_delay_seconds: float = 60.0
    auth_forget_seconds: float = 600.0
    auth_max_addresses: int = 4096
    # bcrypt checks at once, from every client together (about 70 ms of a core each); a
    # request waits at most bcrypt_wait_seconds for one, then 503 auth_busy.
    bcrypt_slots: int = 4
    bcrypt_wait_seconds: float = 0.25

    @property
    def store_reads(self) -> int:
        """``/cluster/choose`` reads of the store at once (an eighth of the request slots, at
        least one): clients of a store that trickles can hold no more request slots than
        this, and the rest serve scrapes and ``/choose``."""
        return max(1, self.max_in_flight // 8)

    @property
    def worker_threads(self) -> int:
        """App threads: one per request in flight and :attr:`probe_threads` more, so that the
        request one too many finds a thread and :class:`RequestLimits` answers it 503 after at
        most :attr:`slot_wait_seconds` (a busy pool queues requests, it never refuses one)."""
        return self.max_in_flight + self.probe_threads


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every deadline of a connection (:mod:`gpu_exporter.web.connection`; tests shorten them)."""

    request_seconds: float = 10.0  # a whole request, from its first byte (Go: ReadTimeout)
    keepalive_seconds: float = 90.0  # idle between requests: longer than a 60 s scrape interval
    write_seconds: float = 10.0  # an answer nobody reads (or a close) is dropped after this
    handshake_seconds: float = 5.0  # the whole TLS handshake (kubelet's probe timeout is 1 s)
    # After refusing a request its unread rest is dropped for this long, so that the client
    # reads the refusal instead of a reset (its body may still be on the way).
    linger_seconds: float = 2.0


DEFAULT_LIMITS = Limits()
DEFAULT_TIMEOUTS = Timeouts()


class RequestLimits:
    """In-flight slots and the query-string limit, as WSGI middleware."""

    def __init__(
        self, app: WsgiApp, limits: Limits, rejections: RequestCounter | None = None
    ) -> None:
        self.app = app
        self.limits = limits
        self.rejections = rejections if rejections is not None else RequestCounter()
        self._slots = threading.BoundedSemaphore(limits.max_in_flight)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        query, most = environ.get("QUERY_STRING", ""), self.limits.max_query_bytes
        if len(query) > most:
            message = f"the query string is {len(query)} bytes; at most {most}"
            answer = refusal(environ, 414, URI_TOO_LONG, message, None, self.rejections)
            return answer(environ, start_response)
        if environ.get("PATH_INFO", "") in EXEMPT_PATHS:
            return self.app(environ, start_response)
        if not self._slots.acquire(timeout=self.limits.slot_wait_seconds):
            n = self.limits.max_in_flight
            message = (
                f"{plural(n, 'request')} {'is' if n == 1 else 'are'} already being handled; "
                "retry in a second"
            )
            answer = refusal(environ, 503, TOO_MANY_REQUESTS, message, 1, self.rejections)
            return answer(environ, start_response)
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


def refusal(
    environ: dict[str, Any],
    status: int,
    code: str,
    message: str,
    retry_after: int | None,
    rejections: RequestCounter,
) -> Response:
    """A limit's refusal by the error contract, counted in ``rejections`` by ``code``."""
    rejections.inc(code)
    resp = error_response(Request(environ), status, code, message)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(retry_after)
    return resp
