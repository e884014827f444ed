"""The production HTTP server: one process, an asyncio front end, a bounded pool of workers.

The cache and lease table live in one process, so a pre-fork server would add a master
process for nothing and invite NVML initialisation before a fork. One event-loop thread holds
every connection (:mod:`gpu_exporter.web.connection`): a slow, idle or hostile client costs a
file descriptor and a little memory, never a worker thread, because the app runs on a worker
(:mod:`gpu_exporter.web.gateway`) only once a whole request has arrived. Connections are
capped globally, shared fairly per peer and limited per peer while waiting
(:mod:`gpu_exporter.web.admission`); probes (``/healthz``, ``/readyz``) have workers and
connections of their own. Every limit comes in one
:class:`~gpu_exporter.web.limits.Limits`. Why this design and not cheroot,
waitress or a Rust server: docs/server-choice.md.

Binding happens in :meth:`Server.bind`, separately from serving, so a busy port is reported at
once. TLS uses the standard :mod:`ssl` module; the context is asked for on every connection,
so a reloaded certificate or client CA applies to the next connection without a restart.

Every request's WSGI environ carries :data:`~gpu_exporter.web.gateway.CONNECTED`, a callable
that says whether the client is still connected, so a request that waits (``/choose`` with
``wait=``) can give up as soon as its client does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import resource
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import h11

from gpu_exporter.counters import TOO_MANY_CONNECTIONS, RequestCounter
from gpu_exporter.web.admission import Admitted, ConnectionSlots
from gpu_exporter.web.connection import HttpConnection, Site, reason_phrase
from gpu_exporter.web.gateway import Workers, error_answer
from gpu_exporter.web.limits import DEFAULT_LIMITS, DEFAULT_TIMEOUTS, Limits, Timeouts
from gpu_exporter.web.peers import PeerIdentities
from gpu_exporter.web.tlslayer import TlsLayer

log = logging.getLogger(__name__)

# Connections the kernel queues before accept(): a backlog of 5 made a burst of 32 job
# scripts wait up to ~2 s (bench/servers.py, docs/server-choice.md).
LISTEN_BACKLOG = 1024
SHUTDOWN_SECONDS = 3.0  # stop(): requests in hand get this long (SIGTERM → exit within 5 s)
FD_RESERVE = 64  # file descriptors kept for everything but connections (state file, /proc)
ACCEPT_BURST = 64  # connections accepted per wake-up before other connections get a turn


def _busy() -> bytes:
    """The one 503 a connection over the cap gets (plain HTTP), written through h11 once."""
    body = b"error: too many connections; retry in a second\n"
    headers = error_answer(503, body, ((b"Retry-After", b"1"),)).headers
    headers += [(b"Content-Length", b"%d" % len(body)), (b"Connection", b"close")]
    conn = h11.Connection(h11.SERVER)
    response = h11.Response(status_code=503, headers=headers, reason=reason_phrase(503))
    events = (response, h11.Data(data=body))
    return b"".join(conn.send(event) or b"" for event in (*events, h11.EndOfMessage()))


_BUSY = _busy()


class ListenError(Exception):
    """The address could not be bound; the message says what to do about it."""


class Server:
    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        limits: Limits = DEFAULT_LIMITS,
        tls: Callable[[], ssl.SSLContext] | None = None,
        rejections: RequestCounter | None = None,
        timeouts: Timeouts = DEFAULT_TIMEOUTS,
        peers: PeerIdentities | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._app = app
        self._limits = limits
        self._tls = tls
        self._rejections = rejections if rejections is not None else RequestCounter()
        self._timeouts = timeouts
        self._peers = peers if peers is not None else PeerIdentities()
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_future: asyncio.Future[None] | None = None
        self._stop_requested = False
        self._stopped = threading.Event()
        self.site: Site | None = None  # while serving: the connections' shared state

    @property
    def address(self) -> str:
        """Where it listens, for people: ``every interface, port 9400`` or
        ``127.0.0.1:9400``."""
        if not self.host:
            return f"every interface, port {self.port}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self._tls is not None else "http"

    def bind(self) -> None:
        """Bind and listen now; raises :class:`ListenError` with a helpful message."""
        # An empty host means every interface: IPv6 and IPv4 on one dual-stack socket where
        # the kernel has IPv6, else IPv4 only.
        hosts = [self.host] if self.host else ["::", "0.0.0.0"]
        last: OSError | None = None
        for host in hosts:
            try:
                self._listener = _listen(host, self.port, dual_stack=not self.host)
            except OSError as exc:
                last = exc
                if _in_use(exc):
                    break
                continue
            self.port = self._listener.getsockname()[1]  # the real port when 0 was asked for
            return
        where = f"{self.host or ''}:{self.port}"
        if last is not None and _in_use(last):
            raise ListenError(
                f"cannot listen on {where}: the port is already in use "
                "(another gpu-exporter, or dcgm-exporter, which also defaults to 9400?); "
                "choose another with --listen-address"
            )
        raise ListenError(f"cannot listen on {where}: {_why(last)}")

    def serve(self) -> None:
        """Serve until :meth:`stop`; blocks (the event loop runs on this thread)."""
        if self._listener is None:
            self.bind()
        listener = self._listener
        assert listener is not None
        loop = asyncio.new_event_loop()
        with self._lock:
            if self._stop_requested:
                loop.close()
                self._close_listener()
                return
            self._loop = loop
            self._stop_future = loop.create_future()
        try:
            loop.run_until_complete(self._run(loop, listener, self._stop_future))
        finally:
            with self._lock:
                self._loop = None
            loop.close()
            self._close_listener()
            self._stopped.set()

    def stop(self) -> None:
        """Stop accepting, answer the requests in hand (up to :data:`SHUTDOWN_SECONDS`),
        close every connection; returns once :meth:`serve` has (or at once if not serving)."""
        with self._lock:
            self._stop_requested = True
            loop, future = self._loop, self._stop_future
        if loop is None or future is None:
            self._close_listener()
            return
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop closed meanwhile
            return
        self._stopped.wait(SHUTDOWN_SECONDS + 2.0)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _run(
        self,
        loop: asyncio.AbstractEventLoop,
        listener: socket.socket,
        stop: asyncio.Future[None],
    ) -> None:
        limits, room = self._limits, raise_fd_limit() - FD_RESERVE
        site = Site(
            loop=loop,
            app=self._app,
            scheme=self.scheme,
            workers=Workers(limits.worker_threads, "http"),
            probe_workers=Workers(limits.probe_threads, "probe"),
            slots=ConnectionSlots(
                max(1, min(limits.max_connections, room - limits.probe_connections)),
                limits.max_waiting_per_peer,
                limits.probe_connections,
            ),
            rejections=self._rejections,
            limits=limits,
            timeouts=self._timeouts,
        )
        self.site = site
        loop.add_reader(listener.fileno(), self._accept, listener, site)
        await stop
        loop.remove_reader(listener.fileno())
        self._close_listener()  # new connections are refused from now on
        site.stopping = True
        site.slots.evict_waiting()
        for conn in site.slots.connections():
            conn.finish()
        deadline = loop.time() + SHUTDOWN_SECONDS
        while site.slots.held and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in site.slots.connections():
            conn.evict()
        await asyncio.sleep(0)  # the aborted transports' callbacks
        site.workers.stop()
        site.probe_workers.stop()

    def _accept(self, listener: socket.socket, site: Site) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of file descriptors or memory: accept later
                log.warning("cannot accept connections: %s", exc.strerror or exc)
                fd = listener.fileno()
                site.loop.remove_reader(fd)
                site.loop.call_later(0.1, site.loop.add_reader, fd, self._accept, listener, site)
                return
            self._open(sock, peer, site)

    def _open(self, sock: socket.socket, peer: Any, site: Site) -> None:
        sock.setblocking(False)
        them, us = (str(peer[0]), int(peer[1])), sock.getsockname()[:2]
        # Named now, while the peer's socket is surely in the kernel's table; caps count by it.
        conn = HttpConnection(site, them, us, self._peers.identify(them, us))
        admitted = site.slots.admit(conn)
        if admitted is None:
            site.rejections.inc(TOO_MANY_CONNECTIONS)
            if self._tls is None:
                with contextlib.suppress(OSError):
                    sock.send(_BUSY)
            sock.close()
            return
        conn.probe_only = admitted is Admitted.PROBE_ONLY
        protocol: asyncio.Protocol = conn
        if self._tls is not None:
            protocol = conn.layer = TlsLayer(
                conn,
                self._tls(),
                loop=site.loop,
                handshake_seconds=self._timeouts.handshake_seconds,
                failed=conn.lost_before_start,
            )
        conn.opening = site.loop.create_task(_connect(site, conn, sock, protocol))


async def _connect(
    site: Site, conn: HttpConnection, sock: socket.socket, protocol: asyncio.Protocol
) -> None:
    """Give ``sock`` a transport, with ``protocol`` (``conn``, or TLS in front of it)."""
    try:
        await site.loop.connect_accepted_socket(lambda: protocol, sock)
    except (Exception, asyncio.CancelledError) as exc:  # evicted before it started
        log.debug("connection from %s ended before it started: %r", conn.peer[0], exc)
        sock.close()
        conn.lost_before_start()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _listen(host: str, port: int, *, dual_stack: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Connections just closed (TIME_WAIT) must not keep a restarted server off its port;
        # on Linux this never lets two servers listen on one port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one, as Go programs do; the soft limit now.

    systemd and most shells start services with a soft limit of 1024, each connection takes
    one descriptor, and nothing here opens many files.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY:
        return 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _in_use(exc: OSError) -> bool:
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    return cause.errno == errno.EADDRINUSE or "in use" in str(exc).lower()


# Some errors fold the errno into one string: "... [Errno -2] Name or service not known".
_ERRNO = re.compile(r"\[Errno (-?\d+)\] ([^)]*)")
_ADVICE = {
    errno.EADDRNOTAVAIL: "no interface of this machine has that address "
    "(`ip -brief address` lists them; ':9400' is every interface)",
    errno.EACCES: "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
}


def _why(exc: OSError | None) -> str:
    """One line for people instead of a nested tuple and an errno."""
    if exc is None:
        return "no usable address"
    code, text = exc.errno, exc.strerror
    match = _ERRNO.search(str(exc))
    if match:
        code, text = int(match.group(1)), match.group(2)
    if code is not None and code < 0:  # getaddrinfo's EAI_* codes are negative
        return (
            f"cannot resolve the host name ({text}); give an IP address of this machine, "
            "e.g. --listen-address 127.0.0.1:9400"
        )
    if code in _ADVICE:
        return _ADVICE[code]
    return text or str(exc)
