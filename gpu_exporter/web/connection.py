"""One client connection on the event loop: HTTP/1.1 framing (``h11``), deadlines, hand-off.

A connection costs no worker thread until its whole request (head and body) has arrived;
then :mod:`gpu_exporter.web.gateway` runs the app on a worker and the answer comes back here
to be written. Every wait on the client has a deadline for the whole wait, never per
``recv``:

* the request (head and body): :data:`REQUEST_SECONDS` from the connection's start (after
  the TLS handshake) or from the first byte of a keep-alive request;
* idle between keep-alive requests: :data:`KEEPALIVE_SECONDS`;
* an answer the client does not read: once more than :data:`WRITE_BUFFER_BYTES` are buffered,
  no further request of that connection is read, and it is closed unless the client drains
  the buffer within :data:`WRITE_SECONDS`.

Framing errors are answered with one plain line (:mod:`gpu_exporter.web.errors`' contract)
and the connection is closed: 400 for bad request lines, headers and chunk sizes and for
``Transfer-Encoding`` with ``Content-Length``; 413 for a body over :data:`MAX_BODY_BYTES`;
431 for a head over :data:`MAX_HEADER_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

from gpu_exporter.counters import TOO_MANY_REQUESTS, RequestCounter
from gpu_exporter.web.admission import Admission, address_key
from gpu_exporter.web.gateway import (
    CONNECTED,
    Answer,
    Workers,
    call_app,
    client_connected,
    environ_for,
    error_answer,
)
from gpu_exporter.web.limits import EXEMPT_PATHS

log = logging.getLogger(__name__)

REQUEST_SECONDS = 10.0  # a whole request head and body, from its first byte (Go: ReadTimeout)
KEEPALIVE_SECONDS = 90.0  # idle between requests: longer than a 60 s scrape interval
WRITE_SECONDS = 10.0  # an answer nobody reads is dropped after this
HANDSHAKE_SECONDS = 5.0  # a whole TLS handshake (kubelet's probe timeout is 1 s; TLS takes ms)
# After refusing a request, its unread rest is read and dropped for this long, so that the
# client reads the refusal instead of a reset (its body may still be on the way).
LINGER_SECONDS = 2.0
WRITE_BUFFER_BYTES = 256 * 1024  # buffered answer bytes before a connection stops reading
MAX_HEADER_BYTES = 16 * 1024  # a request head beyond this is 431
MAX_BODY_BYTES = 64 * 1024  # nothing here needs more: 413
_REASONS = {400: "Bad Request", 413: "Content Too Large", 431: "Request Header Fields Too Large"}
_SERVER = (b"Server", b"gpu-exporter")
_NO_PARSER = h11.Connection(h11.SERVER)  # never fed: a placeholder until connection_made


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Every deadline of a connection (the defaults above; tests shorten them)."""

    request_seconds: float = REQUEST_SECONDS
    keepalive_seconds: float = KEEPALIVE_SECONDS
    write_seconds: float = WRITE_SECONDS
    handshake_seconds: float = HANDSHAKE_SECONDS
    linger_seconds: float = LINGER_SECONDS


DEFAULT_TIMEOUTS = Timeouts()


@dataclass
class Site:
    """What every connection of one server shares (used on the event loop only)."""

    loop: asyncio.AbstractEventLoop
    app: Callable[..., Any]
    scheme: str
    workers: Workers
    probe_workers: Workers
    admission: Admission[HttpConnection]
    rejections: RequestCounter
    timeouts: Timeouts = DEFAULT_TIMEOUTS
    stopping: bool = False


@functools.lru_cache(maxsize=2)
def _date(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode("ascii")


class HttpConnection(asyncio.Protocol):
    def __init__(self, site: Site, peer: tuple[str, int], server: tuple[str, int]) -> None:
        self.site = site
        self.peer = peer
        self.server = server
        self.address = address_key(peer[0])
        self.opening: asyncio.Task[Any] | None = None  # until connection_made
        self.layer: asyncio.Transport | None = None  # TLS: until connection_made
        self.gone = False
        self._h11: h11.Connection = _NO_PARSER  # its own at connection_made: floods cost less
        self._transport: asyncio.Transport | None = None
        self._sock: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._request: h11.Request | None = None
        self._body = bytearray()
        self._busy = False  # a worker has the request
        self._write_paused = False
        self._closing = False
        self._idle = False  # between keep-alive requests, nothing received yet
        self._lingering = False  # refused: what the client still sends is dropped

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.opening = self.layer = None
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self._sock = transport.get_extra_info("socket")
        self._arm(self.site.timeouts.request_seconds, self._close)
        if self.gone:  # evicted during the handshake
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._idle:  # the first byte of a keep-alive request: its deadline starts now
            self._idle = False
            self._arm(self.site.timeouts.request_seconds, self._close)
        self._h11.receive_data(data)
        self._advance()

    def eof_received(self) -> bool:
        if self._lingering:
            return False  # the client read the refusal and is done: close
        self._h11.receive_data(b"")
        self._advance()
        # Plain TCP: stay open to answer a request sent before the client shut its side down.
        # (Under TLS the transport closes regardless and warns about a True here.)
        return self.site.scheme == "http" and not self._closing

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._cancel_timer()
        self.site.admission.release(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._arm(self.site.timeouts.write_seconds, self.evict)
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._cancel_timer()
        if not self._busy and not self._closing:
            self._next()

    # ------------------------------------------------------------------ for the front end

    def evict(self) -> None:
        """Close at once (a cap, a deadline, shutdown): nothing more is written."""
        self.gone = self._closing = True
        self._cancel_timer()
        if self._transport is not None:
            self._transport.abort()
        elif self.layer is not None:
            self.layer.abort()
        elif self.opening is not None:
            self.opening.cancel()

    def lost_before_start(self) -> None:
        """The connection ended before :meth:`connection_made` (a failed TLS handshake)."""
        self.gone = True
        self.site.admission.release(self)

    def finish(self) -> None:
        """Shutdown: close once the request in hand (if any) is answered."""
        if not self._busy:
            self._close()

    def connected(self) -> bool:
        """:data:`CONNECTED`; called from a worker thread."""
        return not self.gone and client_connected(self._sock)

    # ------------------------------------------------------------------ reading requests

    def _advance(self) -> None:
        while not (self._busy or self._closing or self._write_paused):
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint if exc.error_status_hint in (413, 431) else 400
                self._refuse(status, _describe(exc))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > MAX_BODY_BYTES:
                    self._refuse(413, f"the request body is over {MAX_BODY_BYTES} bytes")
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()

    def _start(self, request: h11.Request) -> None:
        headers = dict(request.headers)  # h11 gives lower-case names, one Content-Length
        if b"transfer-encoding" in headers and b"content-length" in headers:
            self._refuse(400, "Transfer-Encoding and Content-Length together")
            return
        head_bytes = len(request.target) + sum(len(n) + len(v) + 4 for n, v in request.headers)
        if head_bytes > MAX_HEADER_BYTES:  # h11 only limits a head that arrives in pieces
            self._refuse(431, f"the request head is over {MAX_HEADER_BYTES} bytes")
            return
        if int(headers.get(b"content-length", 0)) > MAX_BODY_BYTES:
            self._refuse(413, f"the request body is over {MAX_BODY_BYTES} bytes")
            return
        target = request.target
        if not target.startswith((b"/", b"http://", b"https://")):
            self._refuse(400, "the request target must be a path")
            return
        self._request = request
        self._body = bytearray()
        if self._h11.they_are_waiting_for_100_continue:
            self._write(self._h11.send(h11.InformationalResponse(status_code=100, headers=[])))

    def _dispatch(self) -> None:
        request, body = self._request, bytes(self._body)
        assert request is not None and self._transport is not None
        self._busy = True
        self._cancel_timer()
        self._transport.pause_reading()
        self.site.admission.working(self)
        path = request.target.partition(b"?")[0].decode("latin-1")
        is_probe = path in EXEMPT_PATHS
        loop, app = self.site.loop, self.site.app
        extra = {CONNECTED: self.connected}

        def job() -> Callable[[], None]:
            try:
                environ = environ_for(
                    method=request.method,
                    target=request.target,
                    headers=list(request.headers),
                    body=body,
                    http_version=request.http_version,
                    scheme=self.site.scheme,
                    server=self.server,
                    peer=self.peer,
                    extra=extra,
                )
            except (ValueError, UnicodeError) as exc:
                answer = error_answer(400, f"error: malformed request target: {exc}\n".encode())
            else:
                answer = call_app(app, environ)

            def hand_back() -> None:
                # RuntimeError: the loop is closed, the server stopped meanwhile.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._respond, answer)

            return hand_back

        workers = self.site.workers
        if workers.submit(job, owner=address_key(self.peer[0])):
            return
        if is_probe:  # never starved: the probes' own workers, queued behind other probes
            self.site.probe_workers.submit(job, queue_when_busy=True)
            return
        self.site.rejections.inc(TOO_MANY_REQUESTS)
        message = (
            f"error: too many requests being handled ({workers.size} at most, "
            f"{workers.share} from one address); retry in a second\n"
        )
        self._respond(error_answer(503, message.encode(), ((b"Retry-After", b"1"),)))

    # ------------------------------------------------------------------ writing answers

    def _respond(self, answer: Answer) -> None:
        request = self._request
        if self._transport is None or self.gone or request is None:
            self._busy = False
            return
        headers = [_SERVER, (b"Date", _date(int(time.time()))), *answer.headers]
        head_only = request.method == b"HEAD"
        if not head_only and not any(n.lower() == b"content-length" for n, _ in answer.headers):
            headers.append((b"Content-Length", str(len(answer.body)).encode()))
        if self.site.stopping:
            headers.append((b"Connection", b"close"))
        # The head is written here, not by h11: its checks of headers the app already made
        # valid cost ~30 µs a request (about a third of a keep-alive scrape's server time).
        # h11 keeps the parsing; a new parser per request takes the bytes already received.
        keep_alive = self._h11.their_state is h11.DONE and not any(
            n.lower() == b"connection" and v.lower() == b"close" for n, v in headers
        )
        if not keep_alive and not any(n.lower() == b"connection" for n, _ in headers):
            headers.append((b"Connection", b"close"))
        if any(b"\r" in n + v or b"\n" in n + v for n, v in headers):  # as h11 refused them
            log.error("cannot send the answer to %s: a header holds a line break", _path(request))
            self.evict()
            return
        reason = answer.reason or _REASONS.get(answer.status, "Unknown").encode()
        head = b"HTTP/1.1 %d %s\r\n%s\r\n" % (
            answer.status,
            reason,
            b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers),
        )
        if answer.body and not head_only:
            head += answer.body
        self._transport.write(head)  # one send(): head and body in one packet
        self._busy = False
        self._request = None
        if not keep_alive:
            self._close()  # Connection: close, HTTP/1.0, shutting down, or the client is done
            return
        received, closed = self._h11.trailing_data
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        if received:  # (b"" would tell h11 the client closed)
            self._h11.receive_data(bytes(received))
        if closed:
            self._h11.receive_data(b"")
        if not self._write_paused:
            self._next()

    def _next(self) -> None:
        """Wait for the next request, or read one already received (pipelined)."""
        assert self._transport is not None
        self.site.admission.waiting(self)
        self._idle = not self._h11.trailing_data[0]
        timeouts = self.site.timeouts
        wait = timeouts.keepalive_seconds if self._idle else timeouts.request_seconds
        self._arm(wait, self._close)
        self._transport.resume_reading()
        self._advance()

    def _write(self, data: bytes | None) -> None:
        if data and self._transport is not None:
            self._transport.write(data)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a framing error in one plain line and close."""
        body = f"error: {message}\n".encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            "Content-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nConnection: close\r\n"
            "Server: gpu-exporter\r\n\r\n"
        ).encode()
        head_only = self._request is not None and self._request.method == b"HEAD"
        self._write(head if head_only else head + body)
        transport = self._transport
        if transport is None or not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()
        self._closing = self._lingering = True
        self._arm(self.site.timeouts.linger_seconds, self.evict)
        transport.resume_reading()

    def _close(self) -> None:
        """Close after writing what is buffered (bounded by the write deadline)."""
        self._closing = True
        if self._transport is None:
            self.evict()
            return
        self._arm(self.site.timeouts.write_seconds, self.evict)
        self._transport.close()

    # ------------------------------------------------------------------ timers

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self.site.loop.call_later(seconds, then)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _describe(exc: h11.RemoteProtocolError) -> str:
    text = str(exc) or "malformed request"
    return text.replace("\n", " ")[:200]


def _path(request: h11.Request) -> str:
    return request.target.decode("latin-1", "replace")[:200]
