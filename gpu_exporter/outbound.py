"""Outbound HTTP over the standard library: one exchange, the client's and the fleet reader's.

``urllib.request`` is imported on the first exchange, not before, so ``gpu-exporter --help``
and ``import gpu_exporter.client`` stay cheap. A loopback address is never sent through a proxy.

An exchange made under :meth:`Bounds.applied` is bounded as a whole, whatever the other end
does: its socket is shut down at the deadline or when :meth:`Bounds.cut` is called (a per-read
socket timeout alone is reset by every byte a trickling server sends), and an answer longer
than ``max_bytes`` is refused, unread, past the limit (:class:`AnswerTooLarge`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_CHUNK = 64 * 1024
_current = threading.local()  # the Bounds an exchange on this thread is under, if any


class AnswerTooLarge(Exception):
    """The answer is longer than the :class:`Bounds`' ``max_bytes``; it was not read."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the answer is over {max_bytes:,} bytes")
        self.max_bytes = max_bytes


class Bounds:
    """The bounds of one piece of outbound work (several exchanges, on several threads): one
    deadline for all of it, at most ``max_bytes`` an answer, and :meth:`cut` to end it early.

    Whoever waits for the work watches :meth:`remaining` and calls :meth:`cut` at the
    deadline (or when its own client left): every socket of an exchange in progress is shut
    down, so the exchange ends at once with an OSError, and later ones are refused.
    """

    def __init__(self, seconds: float, max_bytes: int | None = None) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        self.deadline = time.monotonic() + seconds
        self.cut_because: str | None = None
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Exchanges this thread makes inside the block are bounded by these bounds."""
        outer = getattr(_current, "bounds", None)
        _current.bounds = self
        try:
            yield
        finally:
            _current.bounds = outer

    @contextlib.contextmanager
    def enforced(self, why: str) -> Iterator[None]:
        """:meth:`applied`, for work nobody else watches: a timer cuts it at the deadline,
        saying ``why``, so an exchange on this thread ends by then however the other end
        trickles."""
        timer = threading.Timer(max(0.0, self.remaining()), self.cut, (why,))
        timer.daemon = True
        timer.start()
        try:
            with self.applied():
                yield
        finally:
            timer.cancel()

    def cut(self, why: str) -> None:
        """End every exchange in progress now (and refuse later ones), saying ``why``."""
        with self._lock:
            self.cut_because = self.cut_because or why
            held, self._sockets = self._sockets, set()
        for sock in held:
            _shut(sock)

    def hold(self, sock: socket.socket) -> None:
        """Watch ``sock`` (for as long as these bounds live); shut at once if already cut. A
        socket closed meanwhile is left alone: its descriptor is gone, never reused here."""
        with self._lock:
            if self.cut_because is None:
                self._sockets.add(sock)
                return
        _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Shut ``sock`` down from another thread: its blocked read returns at once. The plain
    socket's method, also for TLS: the TLS layer's own would unwrap it under the reader."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        """A header's value (any case), None when absent or empty."""
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value.strip() or None
        return None


def is_loopback(host: str | None) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: yes; every interface ("", None) and names: no.

    >>> [is_loopback(h) for h in ("127.0.0.2", "::1", "localhost", "", None, "node1")]
    [True, True, True, False, False, False]
    """
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_url(text: str, default_port: int | None = None) -> str:
    """``host``, ``host:port`` or a URL → a base URL without a trailing slash.

    >>> base_url("node1", 9400), base_url("node1:9401", 9400), base_url("http://p:9090/")
    ('http://node1:9400', 'http://node1:9401', 'http://p:9090')
    """
    text = text.strip().rstrip("/")
    if "://" in text:
        return text
    if default_port is not None and urllib.parse.urlsplit("//" + text).port is None:
        text = f"{text}:{default_port}"
    return "http://" + text


def is_http(url: str) -> bool:
    """Whether ``url`` is an http:// or https:// URL."""
    return urllib.parse.urlsplit(url).scheme.lower() in ("http", "https")


def exchange(method: str, url: str, *, headers: Mapping[str, str], timeout: float) -> Response:
    """One exchange; every status comes back as a :class:`Response`.

    ``timeout`` bounds each socket operation; under :meth:`Bounds.applied`, also the whole
    exchange (at most the time remaining), and the answer's length.

    Raises ValueError for a URL that is not HTTP(S), :class:`AnswerTooLarge`, and OSError when
    nothing answers (a timeout is TimeoutError; http.client's errors, and an exchange cut by
    its bounds, come as ConnectionError: the request may have been received).
    """
    import http.client  # here, not at the top: `gpu-exporter --help` need not load them
    import urllib.error
    import urllib.request

    if not is_http(url):  # urllib would try FTP or read a file
        raise ValueError("not an http:// or https:// URL")
    bounds: Bounds | None = getattr(_current, "bounds", None)
    if bounds is not None:
        if bounds.cut_because is not None or bounds.remaining() <= 0:
            raise TimeoutError(bounds.cut_because or f"no answer within {bounds.seconds:g} s")
        timeout = min(timeout, bounds.remaining())
    data = b"" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    handlers: list[Any] = _bounded_handlers(bounds) if bounds is not None else []
    if is_loopback(urllib.parse.urlsplit(url).hostname):
        handlers.append(urllib.request.ProxyHandler({}))
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=timeout) as resp:
            return Response(resp.status, dict(resp.headers.items()), _body(resp, bounds))
    except urllib.error.HTTPError as exc:
        try:
            body = _body(exc, bounds)
        except OSError:
            body = b""
        finally:
            exc.close()
        return Response(exc.code, dict(exc.headers.items()) if exc.headers else {}, body)
    except urllib.error.URLError as exc:  # what urllib wraps: the socket's own error
        reason = exc.reason
        raise reason if isinstance(reason, OSError) else OSError(str(reason)) from None
    except http.client.HTTPException as exc:  # a bad or cut-off answer
        raise ConnectionError(str(exc) or type(exc).__name__) from None


def _body(resp: Any, bounds: Bounds | None) -> bytes:
    """The answer's body, refused (:class:`AnswerTooLarge`) as soon as it is known to be over
    the bounds' ``max_bytes``: from its Content-Length, or once that much has arrived."""
    most = bounds.max_bytes if bounds is not None else None
    if most is None:
        return bytes(resp.read())
    length = resp.headers.get("Content-Length") if resp.headers else None
    if length is not None and length.strip().isdigit() and int(length) > most:
        raise AnswerTooLarge(most)
    parts, size = [], 0
    while chunk := resp.read1(_CHUNK):
        size += len(chunk)
        if size > most:
            raise AnswerTooLarge(most)
        parts.append(chunk)
    return b"".join(parts)


def _bounded_handlers(bounds: Bounds) -> list[Any]:
    """urllib handlers whose connections put their socket in ``bounds``' hands."""
    import http.client
    import urllib.request

    def watched(base: type[http.client.HTTPConnection]) -> Any:
        class Watched(base):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                super().connect()
                bounds.hold(self.sock)

        return Watched

    plain, tls = watched(http.client.HTTPConnection), watched(http.client.HTTPSConnection)

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(plain, req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(tls, req, context=self._context)  # type: ignore[attr-defined]

    return [Http(), Https()]


def failure(exc: BaseException, timeout: float) -> str:
    """Why an exchange got no answer, in a few words."""
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
