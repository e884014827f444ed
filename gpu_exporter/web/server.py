"""The production HTTP server: cheroot, one process, a pool of threads.

Why cheroot (see docs/design.md for the measurements): the cache and lease table live in
one process, so a pre-fork server would add a master process for nothing and invite NVML
initialisation before a fork; cheroot is a mature, pure-Python threaded WSGI server (the one
under CherryPy) with TLS through the standard ``ssl`` module, and binding happens in a
separate step, so a busy port is reported at once instead of after retries.

Every request's WSGI environ carries :data:`CONNECTED`, a callable that says whether the
client is still connected (:func:`client_connected`), so a request that waits (``/choose``
with ``wait=``) can give up as soon as its client does.
"""

from __future__ import annotations

import errno
import functools
import logging
import re
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any, cast

from cheroot import errors, wsgi
from cheroot.server import HTTPConnection
from cheroot.ssl.builtin import BuiltinSSLAdapter

log = logging.getLogger(__name__)

THREADS = 16  # request threads; scrapes and /choose take well under a millisecond each
# Connections the kernel queues before accept(): cheroot's default of 5 made a burst of 32
# job scripts wait up to ~2 s (bench/servers.py, docs/server-choice.md).
LISTEN_BACKLOG = 1024
# A TLS handshake must finish within this; it runs on a request thread, never the accept loop.
HANDSHAKE_TIMEOUT_SECONDS = 5.0
# Nothing here needs more: cheroot answers 413 beyond these instead of buffering them.
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
# The environ key of the "is the client still connected?" callable (:class:`Gateway`).
CONNECTED = "gpu_exporter.client_connected"
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its sending side
_GONE = _POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def client_connected(sock: socket.socket) -> bool:
    """False once the client closed or reset the connection (never blocks; never reads).

    Linux says so with ``POLLRDHUP`` even when unread bytes wait (a pipelined request) and on
    the TCP socket under TLS, whose ``close_notify`` is such a byte. Elsewhere, a readable
    plain socket is peeked for end-of-file; a TLS one then counts as connected. A client that
    only half-closes (shuts down writing, still reading) counts as gone, as with Go's
    ``net/http``: HTTP clients do not do that while awaiting an answer.
    """
    try:
        fd = sock.fileno()
    except OSError:
        return False
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN | _POLLRDHUP)
    events = poller.poll(0)
    if not events:
        return True
    revents = events[0][1]
    if revents & _GONE:
        return False
    if _POLLRDHUP or isinstance(sock, ssl.SSLSocket):
        return True  # readable but not closed: bytes of a pipelined request
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return True
    except OSError:
        return False


class Gateway(wsgi.Gateway_10):
    """cheroot's WSGI 1.0 gateway, adding :data:`CONNECTED` to each request's environ."""

    def get_environ(self) -> dict[str, Any]:  # type: ignore[override]  # stubs say None
        environ = cast(dict[str, Any], super().get_environ())  # type: ignore[no-untyped-call]
        environ[CONNECTED] = functools.partial(client_connected, self.req.conn.socket)
        return environ


class ListenError(Exception):
    """The address could not be bound; the message says what to do about it."""


class _TlsSocket(ssl.SSLSocket):
    """A client that hangs up mid-response is a reset connection, as on plain TCP.

    cheroot quietly drops ECONNRESET but logs a traceback for ``SSLEOFError`` (a scrape
    that timed out while the exporter was still writing, say).
    """

    def send(self, data: Any, flags: int = 0) -> int:
        try:
            return super().send(data, flags)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise ConnectionResetError(
                errno.ECONNRESET, "the client closed the connection"
            ) from exc

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        try:
            return super().recv_into(buffer, nbytes, flags)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise ConnectionResetError(
                errno.ECONNRESET, "the client closed the connection"
            ) from exc


class TlsAdapter(BuiltinSSLAdapter):
    """cheroot's stdlib-``ssl`` adapter, with two changes.

    * The context comes from a callable, asked on every connection, so a reloaded
      certificate or client CA applies to the next connection without a restart.
    * The handshake is deferred to the request thread (:class:`TlsConnection`). cheroot's
      own adapter handshakes in the accept loop, where one client that connects and sends
      nothing stalls every other connection for the whole socket timeout.
    """

    def __init__(self, context: Callable[[], ssl.SSLContext]) -> None:
        # Not BuiltinSSLAdapter.__init__: it wants certificate files and handshakes with itself.
        self.certificate = self.private_key = self.certificate_chain = self.ciphers = None
        self.private_key_password = None
        self._get_context = context
        self._context = None
        self._server_env: dict[str, str] = {}

    @property
    def context(self) -> ssl.SSLContext:
        return self._get_context()

    @context.setter
    def context(self, context: ssl.SSLContext | None) -> None:  # cheroot's base class sets it
        pass

    def wrap(self, sock: socket.socket) -> tuple[ssl.SSLSocket, dict[str, str]]:
        context = self.context
        context.sslsocket_class = _TlsSocket
        try:
            wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except OSError as exc:  # the client is already gone
            raise errors.FatalSSLAlert(*exc.args) from exc
        return wrapped, {"wsgi.url_scheme": "https", "HTTPS": "on"}


class TlsConnection(HTTPConnection):
    """Finishes the TLS handshake on the request thread before reading the first request."""

    _handshaken = False

    def communicate(self) -> bool:
        if not self._handshaken and isinstance(self.socket, ssl.SSLSocket):
            try:
                self.socket.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
                self.socket.do_handshake()
                self.socket.settimeout(self.server.timeout)
            except (OSError, ValueError) as exc:  # ssl.SSLError, timeouts, resets
                log.debug("TLS handshake with %s failed: %s", self.remote_addr, exc)
                return False  # cheroot closes the connection
            self._handshaken = True
        return bool(super().communicate())  # type: ignore[no-untyped-call]


class Server:
    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        threads: int = THREADS,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._app = app
        self._threads = threads
        self._tls = tls
        self._server: wsgi.Server | None = None

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
            server = wsgi.Server(
                (host, self.port),
                self._app,
                numthreads=self._threads,
                request_queue_size=LISTEN_BACKLOG,
            )
            server.server_name = "gpu-exporter"
            server.gateway = Gateway
            server.max_request_header_size = MAX_HEADER_BYTES
            server.max_request_body_size = MAX_BODY_BYTES
            if self._tls is not None:
                server.ssl_adapter = TlsAdapter(self._tls)
                server.ConnectionClass = TlsConnection
            try:
                server.prepare()
            except OSError as exc:
                last = exc
                if _in_use(exc):
                    break
                continue
            self._server = server
            self.port = server.bind_addr[1]  # the real port when 0 was asked for
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
        if self._server is None:
            self.bind()
        assert self._server is not None
        self._server.serve()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def _in_use(exc: OSError) -> bool:
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    return cause.errno == errno.EADDRINUSE or "in use" in str(exc).lower()


# cheroot folds the socket error into one string: "No socket could be created -- ((host,
# port): [Errno -2] Name or service not known)". The errno is all that is worth keeping.
_ERRNO = re.compile(r"\[Errno (-?\d+)\] ([^)]*)")
_ADVICE = {
    errno.EADDRNOTAVAIL: "no interface of this machine has that address "
    "(`ip -brief address` lists them; ':9400' is every interface)",
    errno.EACCES: "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
}


def _why(exc: OSError | None) -> str:
    """One line for people instead of cheroot's nested tuple and errno."""
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
