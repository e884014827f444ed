"""From a parsed HTTP request to a WSGI call and back, on a bounded pool of threads; and
:data:`CONNECTED`, the environ's "is the client still there?" callable (:func:`client_connected`).

A path is logged only through :func:`without_secrets`, here and by every other log line.

The event loop (:mod:`gpu_exporter.web.connection`) hands a request to a worker only once its
head and body have fully arrived, so a worker never waits on a client: it builds the environ
(:func:`run_app`), runs the app to completion (:func:`call_app`: the whole body is
collected, as :class:`~gpu_exporter.web.limits.RequestLimits` does anyway) and gives the
:class:`Answer` back to the loop, which writes it.

:class:`Workers` are daemon threads: a request stuck in the app cannot keep the process from
ending on SIGTERM.
"""

from __future__ import annotations

import io
import logging
import queue
import select
import socket
import ssl
import sys
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11

log = logging.getLogger(__name__)

Headers = list[tuple[bytes, bytes]]
_INTERNAL_ERROR = b"error: internal error; see the exporter's log\n"
# The environ key of the "is the client still connected?" callable.
CONNECTED = "gpu_exporter.client_connected"
_POLLRDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the peer shut down its sending side
_GONE = _POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete response from the app."""

    status: int  # its reason phrase is the server's (connection.reason_phrase)
    headers: Headers
    body: bytes


class Workers:
    """Jobs run in the order submitted on at most ``size`` daemon threads, started on demand.

    The pool bounds threads, never requests (that is
    :class:`~gpu_exporter.web.limits.RequestLimits`' one job): a job that finds every thread
    busy waits for one. The pool is :attr:`Limits.worker_threads
    <gpu_exporter.web.limits.Limits.worker_threads>` large, so a thread is free for the
    request one too many, which waits at most ``slot_wait_seconds`` for a slot, then gets
    503; only credentials (``bcrypt_wait_seconds`` and one check at most) hold a thread
    outside the request limits.
    """

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = 0  # jobs submitted and not finished
        self._threads = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._busy += 1
            start = self._threads < min(self._busy, self.size)
            if start:
                self._threads += 1
                name = f"{self._name}-{self._threads}"
        if start:
            threading.Thread(target=self._run, name=name, daemon=True).start()
        self._jobs.put(job)

    def stop(self) -> None:
        """Let idle threads end (busy ones end after their job)."""
        for _ in range(self._threads):
            self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # the job answers its own errors; this is a last resort
                log.exception("request worker failed")
            finally:
                with self._lock:
                    self._busy -= 1


def client_connected(sock: Any) -> bool:
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
        return bool(sock.recv(1, socket.MSG_PEEK) != b"")
    except (BlockingIOError, InterruptedError, TimeoutError):
        return True
    except OSError:
        return False


def run_app(
    app: Callable[..., Any],
    request: h11.Request,
    body: bytes,
    scheme: str,
    server: tuple[str, int],
    peer: tuple[str, int],
    extra: dict[str, Any],
) -> Answer:
    """Run ``app`` for ``request`` with its WSGI environ (PEP 3333); 400 for a target that
    makes none (the target's form was checked by the caller)."""
    path, _, query = request.target.partition(b"?")
    if not path.startswith(b"/"):  # absolute form: http://host/path?query
        try:
            path = urllib.parse.urlsplit(path).path or b"/"
        except (ValueError, UnicodeError) as exc:
            return error_answer(400, f"error: malformed request target: {exc}\n".encode())
    environ: dict[str, Any] = {
        "REQUEST_METHOD": request.method.decode("ascii"),
        "SCRIPT_NAME": "",
        "PATH_INFO": urllib.parse.unquote_to_bytes(path).decode("latin-1"),
        "QUERY_STRING": query.decode("latin-1"),
        "SERVER_NAME": server[0],
        "SERVER_PORT": str(server[1]),
        "SERVER_PROTOCOL": f"HTTP/{request.http_version.decode('ascii')}",
        "REMOTE_ADDR": peer[0],
        "REMOTE_PORT": str(peer[1]),
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scheme,
        "wsgi.input": io.BytesIO(body),
        "wsgi.input_terminated": True,  # the body was de-chunked and counted here
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "CONTENT_LENGTH": str(len(body)) if body else "",
        **extra,
    }
    if scheme == "https":
        environ["HTTPS"] = "on"
    for name, value in request.headers:
        if name == b"content-type":
            environ["CONTENT_TYPE"] = value.decode("latin-1")
            continue
        if name in (b"content-length", b"transfer-encoding"):
            continue  # the body is complete: CONTENT_LENGTH above says how long
        key = "HTTP_" + name.decode("ascii").upper().replace("-", "_")
        text = value.decode("latin-1")
        environ[key] = f"{environ[key]},{text}" if key in environ else text
    return call_app(app, environ)


def call_app(app: Callable[..., Any], environ: dict[str, Any]) -> Answer:
    """Run ``app`` to completion; an exception is logged and answered 500 in one line."""
    started: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if exc_info is not None and started:
            raise exc_info[1].with_traceback(exc_info[2])
        started[:] = [status, headers]
        return _no_write

    try:
        result = app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, headers = started
        code = int(status[:3])
        encoded = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers]
    except Exception:
        method, path = environ.get("REQUEST_METHOD"), environ.get("PATH_INFO", "")
        log.exception("request failed: %s %s", method, without_secrets(path))
        return error_answer(500, _INTERNAL_ERROR)
    return Answer(code, encoded, body)


def error_answer(status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
    """One plain line (the error contract of :mod:`gpu_exporter.web.errors`)."""
    return Answer(
        status,
        [
            (b"Content-Type", b"text/plain; charset=utf-8"),
            (b"Cache-Control", b"no-store"),
            *headers,
        ],
        body,
    )


def _no_write(data: bytes) -> None:
    raise NotImplementedError("the app must return its body, not write() it")


def without_secrets(path: str) -> str:
    """``path`` with a lease token's secret cut off: ``/leases/<id>.<secret>/renew`` →
    ``/leases/<id>.…/renew``, in every form that reaches a lease route: repeated slashes (a
    base URL ending in ``/`` makes ``//leases/…``, which the router reads as ``/leases/…``),
    ``.`` segments, any case. The rest of the path is logged as it came.

    >>> without_secrets("/leases/3f2a.s3cr3t/renew"), without_secrets("/metrics")
    ('/leases/3f2a.…/renew', '/metrics')
    >>> without_secrets("//leases//3f2a.s3cr3t/renew"), without_secrets("/./LEASES/./3f2a.s3")
    ('//leases//3f2a.…/renew', '/./LEASES/./3f2a.…')
    """
    parts = path.split("/")
    previous = ""
    for i, part in enumerate(parts):
        if part in ("", ".", ".."):
            continue  # not a segment the router reads
        if previous.lower() == "leases" and "." in part:
            parts[i] = part.split(".", 1)[0] + ".…"
        previous = part
    return "/".join(parts)
