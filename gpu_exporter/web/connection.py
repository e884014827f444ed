"""One client connection on the event loop: a state machine (:class:`State`) over ``h11``.

A connection costs no worker thread until its whole request (head and body) has arrived;
then :mod:`gpu_exporter.web.gateway` runs the app on a worker and the answer comes back here
to be written through h11. Every wait on the client has a deadline for the whole wait, never
per ``recv`` (:class:`~gpu_exporter.web.limits.Timeouts`): the request from its first byte
(READING), the pause between keep-alive requests (IDLE), an answer the client does not read
once over ``write_buffer_bytes`` (DRAINING: no further request is read meanwhile), and a
refusal's linger (LINGERING). Only :meth:`HttpConnection._to` changes the state, and only
along :data:`_NEXT`.

Framing errors are answered with one plain line (:mod:`gpu_exporter.web.errors`' contract)
and the connection is closed: 400 for bad request lines, headers and chunk sizes and for
``Transfer-Encoding`` with ``Content-Length``; 413 for a body over ``max_body_bytes``; 431
for a head over ``max_header_bytes`` (:class:`~gpu_exporter.web.limits.Limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import enum
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11

from gpu_exporter.counters import TOO_MANY_CONNECTIONS, RequestCounter
from gpu_exporter.web.admission import ConnectionSlots
from gpu_exporter.web.gateway import (
    CONNECTED,
    Answer,
    Headers,
    Workers,
    client_connected,
    error_answer,
    run_app,
    without_secrets,
)
from gpu_exporter.web.limits import EXEMPT_PATHS, Limits, Timeouts
from gpu_exporter.web.peers import PEER

log = logging.getLogger(__name__)

_SERVER = (b"Server", b"gpu-exporter")
_NO_PARSER = h11.Connection(h11.SERVER)  # never fed: a placeholder until connection_made


class State(enum.Enum):
    """Where a connection is; :data:`_NEXT` lists the moves each state allows."""

    OPENING = "accepted; no transport yet (the TLS handshake)"
    READING = "a request arriving, within the request deadline"
    IDLE = "between keep-alive requests, nothing received yet"
    WORKING = "a worker has the request; reading paused"
    DRAINING = "the answer is over the write buffer; reading paused until the client reads"
    LINGERING = "refused and shut for writing; what the client still sends is dropped"
    CLOSING = "closing once what is buffered is written"
    CLOSED = "gone"


_S = State
_NEXT: dict[State, frozenset[State]] = {
    _S.OPENING: frozenset({_S.READING, _S.CLOSED}),
    _S.READING: frozenset({_S.WORKING, _S.DRAINING, _S.LINGERING, _S.CLOSING, _S.CLOSED}),
    _S.IDLE: frozenset({_S.READING, _S.DRAINING, _S.LINGERING, _S.CLOSING, _S.CLOSED}),
    _S.WORKING: frozenset({_S.READING, _S.IDLE, _S.DRAINING, _S.CLOSING, _S.CLOSED}),
    _S.DRAINING: frozenset({_S.READING, _S.IDLE, _S.LINGERING, _S.CLOSING, _S.CLOSED}),
    _S.LINGERING: frozenset({_S.CLOSING, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset({_S.CLOSED}),
}
_WAITING = frozenset({_S.OPENING, _S.READING, _S.IDLE, _S.DRAINING, _S.LINGERING})


@dataclass
class Site:
    """What every connection of one server shares (used on the event loop only)."""

    loop: asyncio.AbstractEventLoop
    app: Callable[..., Any]
    scheme: str
    workers: Workers
    probe_workers: Workers
    slots: ConnectionSlots[HttpConnection]
    rejections: RequestCounter
    limits: Limits
    timeouts: Timeouts
    stopping: bool = False


@functools.lru_cache(maxsize=2)
def _date(second: int) -> bytes:
    return email.utils.formatdate(second, usegmt=True).encode("ascii")


class HttpConnection(asyncio.Protocol):
    def __init__(
        self, site: Site, peer: tuple[str, int], server: tuple[str, int], identity: str
    ) -> None:
        self.site = site
        self.peer = peer
        self.server = server
        self.address = identity  # who is at the other end (web.peers): the caps count by it
        self.probe_only = False  # held beyond the cap: a probe is answered, nothing else
        self.state = State.OPENING
        self.opening: asyncio.Task[Any] | None = None  # OPENING: the task connecting it
        self.layer: asyncio.Transport | None = None  # OPENING under TLS: the TLS layer
        self._h11: h11.Connection = _NO_PARSER  # its own at connection_made: floods cost less
        self._transport: asyncio.Transport | None = None
        self._sock: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._request: h11.Request | None = None
        self._body = bytearray()

    def _to(self, state: State) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"connection from {self.peer[0]}: {self.state.name} → {state.name}")
        self.state = state

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.opening = self.layer = None
        if self.state is State.CLOSED:  # evicted during the handshake
            transport.abort()
            return
        self._to(State.READING)
        self._h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.site.limits.max_header_bytes
        )
        transport.set_write_buffer_limits(high=self.site.limits.write_buffer_bytes)
        self._sock = transport.get_extra_info("socket")
        self._arm(self.site.timeouts.request_seconds, self._close)

    def data_received(self, data: bytes) -> None:
        if self.state in (State.LINGERING, State.CLOSED):
            return
        if self.state is State.IDLE:  # the first byte of a keep-alive request: its deadline
            self._to(State.READING)
            self._arm(self.site.timeouts.request_seconds, self._close)
        self._h11.receive_data(data)
        self._advance()

    def eof_received(self) -> bool:
        if self.state in (State.LINGERING, State.CLOSED):
            return False  # the client read the refusal and is done: close
        self._h11.receive_data(b"")
        self._advance()
        # Plain TCP: stay open to answer a request sent before the client shut its side down.
        # (Under TLS the transport closes regardless and warns about a True here.)
        return self.site.scheme == "http" and self.state not in (State.CLOSING, State.LINGERING)

    def connection_lost(self, exc: Exception | None) -> None:
        self._to(State.CLOSED)
        self._cancel_timer()
        self.site.slots.release(self)

    def pause_writing(self) -> None:
        if self.state in (State.READING, State.IDLE, State.WORKING):
            self._to(State.DRAINING)  # WORKING: while its answer is being written
            self.site.slots.stalled(self)  # its client is not reading: the first to go
        if self.state is not State.CLOSED:
            self._arm(self.site.timeouts.write_seconds, self.evict)
            if self._transport is not None:
                self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self.state is State.DRAINING:
            self._cancel_timer()
            self._next()
        elif self.state is State.LINGERING:
            self._arm(self.site.timeouts.linger_seconds, self.evict)

    # ------------------------------------------------------------------ for the front end

    def evict(self) -> None:
        """Close at once (a cap, a deadline, shutdown): nothing more is written."""
        self._to(State.CLOSED)
        self._cancel_timer()
        if self._transport is not None:
            self._transport.abort()
        elif self.layer is not None:
            self.layer.abort()
        elif self.opening is not None:
            self.opening.cancel()

    def lost_before_start(self) -> None:
        """The connection ended before :meth:`connection_made` (a failed TLS handshake)."""
        self._to(State.CLOSED)
        self.site.slots.release(self)

    def finish(self) -> None:
        """Shutdown: close once the request in hand (if any) is answered."""
        if self.state in _WAITING:
            self._close()

    def connected(self) -> bool:
        """:data:`CONNECTED`; called from a worker thread."""
        return self.state is not State.CLOSED and client_connected(self._sock)

    # ------------------------------------------------------------------ reading requests

    def _advance(self) -> None:
        while self.state in (State.READING, State.IDLE):
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
                if len(self._body) > self.site.limits.max_body_bytes:
                    most = self.site.limits.max_body_bytes
                    self._refuse(413, f"the request body is over {most} bytes")
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()

    def _start(self, request: h11.Request) -> None:
        limits = self.site.limits
        headers = dict(request.headers)  # h11 gives lower-case names, one Content-Length
        if b"transfer-encoding" in headers and b"content-length" in headers:
            self._refuse(400, "Transfer-Encoding and Content-Length together")
            return
        head_bytes = len(request.target) + sum(len(n) + len(v) + 4 for n, v in request.headers)
        if head_bytes > limits.max_header_bytes:  # h11 only limits a head arriving in pieces
            self._refuse(431, f"the request head is over {limits.max_header_bytes} bytes")
            return
        if int(headers.get(b"content-length", 0)) > limits.max_body_bytes:
            self._refuse(413, f"the request body is over {limits.max_body_bytes} bytes")
            return
        if not request.target.startswith((b"/", b"http://", b"https://")):
            self._refuse(400, "the request target must be a path")
            return
        self._request = request
        self._body = bytearray()
        if self._h11.they_are_waiting_for_100_continue and self._transport is not None:
            continue_ = self._h11.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=reason_phrase(100))
            )
            self._transport.write(continue_ or b"")

    def _dispatch(self) -> None:
        request, body = self._request, bytes(self._body)
        assert request is not None and self._transport is not None
        path = request.target.partition(b"?")[0].decode("latin-1")
        # The probes have threads of their own: never behind a queue of other requests.
        probe = path in EXEMPT_PATHS
        if self.probe_only and not probe:  # held beyond the cap for the probes
            self.site.rejections.inc(TOO_MANY_CONNECTIONS)
            self._refuse(503, "too many connections; retry in a second")
            return
        self._to(State.WORKING)
        self._cancel_timer()
        self._transport.pause_reading()
        self.site.slots.working(self)
        loop, app = self.site.loop, self.site.app
        extra = {CONNECTED: self.connected, PEER: self.address}

        def job() -> None:
            answer = run_app(app, request, body, self.site.scheme, self.server, self.peer, extra)
            # RuntimeError: the loop is closed, the server stopped meanwhile.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._respond, answer)

        (self.site.probe_workers if probe else self.site.workers).submit(job)

    # ------------------------------------------------------------------ writing answers

    def _respond(self, answer: Answer) -> None:
        """Write the app's answer through h11; then the next request, or close."""
        request = self._request
        if self.state is not State.WORKING or request is None:  # evicted meanwhile
            return
        headers = [_SERVER, (b"Date", _date(int(time.time()))), *answer.headers]
        if not any(n.lower() == b"content-length" for n, _ in answer.headers):
            headers.append((b"Content-Length", b"%d" % len(answer.body)))
        if self.site.stopping or self.probe_only:
            headers.append((b"Connection", b"close"))
        self._request = None
        body = b"" if request.method == b"HEAD" else answer.body
        if not self._send(answer.status, reason_phrase(answer.status), headers, body):
            log.error("cannot send the answer to %s: h11 refused it", _path(request))
            self.evict()
            return
        if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
            self._close()  # Connection: close, HTTP/1.0, shutting down, or the client is done
            return
        self._h11.start_next_cycle()
        if self.state is State.WORKING:  # else DRAINING: the next request once it drains
            self._next()

    def _next(self) -> None:
        """Wait for the next request, or read one already received (pipelined)."""
        assert self._transport is not None
        self.site.slots.waiting(self)
        pending = bool(self._h11.trailing_data[0])
        self._to(State.READING if pending else State.IDLE)
        timeouts = self.site.timeouts
        self._arm(timeouts.request_seconds if pending else timeouts.keepalive_seconds, self._close)
        self._transport.resume_reading()
        self._advance()

    def _send(self, status: int, reason: bytes, headers: Headers, body: bytes) -> bool:
        """Write one whole response through h11, in one ``write()`` (head and body in one
        packet); False if h11 refuses it (a header with a line break, a wrong length)."""
        assert self._transport is not None
        try:
            data = self._h11.send(h11.Response(status_code=status, headers=headers, reason=reason))
            if body:
                data += self._h11.send(h11.Data(data=body)) or b""
            data += self._h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            return False
        assert data is not None
        self._transport.write(data)
        return True

    def _refuse(self, status: int, message: str) -> None:
        """Answer a framing error in one plain line and close."""
        body = f"error: {message}\n".encode()
        length = (b"Content-Length", b"%d" % len(body))
        headers = [*error_answer(status, body).headers, length, (b"Connection", b"close"), _SERVER]
        head_only = self._request is not None and self._request.method == b"HEAD"
        if not self._send(status, reason_phrase(status), headers, b"" if head_only else body):
            self.evict()
            return
        transport = self._transport
        if transport is None or not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()
        self._to(State.LINGERING)
        self._arm(self.site.timeouts.linger_seconds, self.evict)
        transport.resume_reading()

    def _close(self) -> None:
        """Close after writing what is buffered (bounded by the write deadline)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        if self._transport is None:
            self.evict()
            return
        self._to(State.CLOSING)
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


# RFC 9110's names where Python 3.11 still has the old ones, and nginx's for the client
# that left before its answer (written only if it somehow reads it).
_PHRASES = {
    413: b"Content Too Large",
    414: b"URI Too Long",
    422: b"Unprocessable Content",
    499: b"Client Closed Request",
}
_CLASSES = {
    1: b"Informational",
    2: b"Successful",
    3: b"Redirection",
    4: b"Client Error",
    5: b"Server Error",
}


@functools.lru_cache(maxsize=64)
def reason_phrase(status: int) -> bytes:
    """The reason phrase of every status line this server writes (the app's own, such as
    werkzeug's ``SERVICE UNAVAILABLE``, is not used).

    >>> reason_phrase(503), reason_phrase(499), reason_phrase(299)
    (b'Service Unavailable', b'Client Closed Request', b'Successful')
    """
    if status in _PHRASES:
        return _PHRASES[status]
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:  # a status no RFC names: its class's name (RFC 9110 15)
        return _CLASSES.get(status // 100, b"Unknown")


def _describe(exc: h11.RemoteProtocolError) -> str:
    text = str(exc) or "malformed request"
    return text.replace("\n", " ")[:200]


def _path(request: h11.Request) -> str:
    return without_secrets(request.target.decode("latin-1", "replace"))[:200]
