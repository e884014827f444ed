"""TLS for one connection, over memory BIOs, between the socket and the HTTP connection.

Why not asyncio's own ``ssl=``: a listening server takes one context for all connections,
while the web config's context is asked for on every connection (a reloaded certificate or
client CA applies to the next one); and asyncio drops the TLS alert when a handshake fails,
so a client with a wrong or missing certificate, or a refused TLS version, saw a bare EOF
instead of "certificate required" or "protocol version". Here the alert is sent before the
connection closes, the handshake has a deadline for the whole handshake, and the HTTP
connection (:class:`~gpu_exporter.web.connection.HttpConnection`) sees an ordinary
transport once the handshake is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024  # decrypted bytes read at a time


class TlsLayer(asyncio.Transport, asyncio.Protocol):
    """The socket's protocol, and the transport of ``inner`` once the handshake is done."""

    def __init__(
        self,
        inner: asyncio.Protocol,
        context: ssl.SSLContext,
        *,
        loop: asyncio.AbstractEventLoop,
        handshake_seconds: float,
        failed: Callable[[], None],
    ) -> None:
        super().__init__()
        self._inner = inner
        self._loop = loop
        self._handshake_seconds = handshake_seconds
        self._failed = failed  # the connection ended before the handshake did
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._raw: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ready = False
        self._closed = False
        self._paused = False
        self._eof = False

    # ------------------------------------------------------------------ from the socket

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._raw = transport
        self._timer = self._loop.call_later(self._handshake_seconds, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self._incoming.write(data)
        if self._ready or self._handshake():
            self._read()

    def eof_received(self) -> bool:
        self._incoming.write_eof()
        if self._ready and not self._closed:
            self._read()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._ready:
            self._inner.connection_lost(exc)
        else:
            self._failed()

    def pause_writing(self) -> None:
        if self._ready:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._ready:
            self._inner.resume_writing()

    def _handshake(self) -> bool:
        assert self._raw is not None
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        except (ssl.SSLError, OSError, ValueError) as exc:  # refused version, certificate…
            log.debug("TLS handshake with %s failed: %s", self._peer(), exc)
            self._flush()  # the alert tells the client why
            self._closed = True
            self._raw.close()
            return False
        self._flush()
        if self._timer is not None:
            self._timer.cancel()
        self._ready = True
        self._inner.connection_made(self)
        return True

    def _too_slow(self) -> None:
        log.debug("TLS handshake with %s timed out", self._peer())
        self.abort()

    def _read(self) -> None:
        chunks: list[bytes] = []
        eof = False
        while not self._paused and not self._closed:
            try:
                chunk = self._ssl.read(READ_BYTES)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                eof = True
                break
            except ssl.SSLError as exc:
                log.debug("TLS error from %s: %s", self._peer(), exc)
                self.abort()
                return
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
        self._flush()  # TLS 1.3 session tickets, key updates
        if chunks:
            self._inner.data_received(b"".join(chunks))
        if eof and not self._eof and not self._closed:
            self._eof = True
            if not self._inner.eof_received():
                self.close()

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data and self._raw is not None:
            self._raw.write(data)

    def _peer(self) -> str:
        peer = self._raw.get_extra_info("peername") if self._raw is not None else None
        return str(peer[0]) if peer else "a client"

    # ------------------------------------------------------------------ for the connection

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            return
        self._ssl.write(data)
        self._flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # close_notify, then close without waiting for the client's
        with contextlib.suppress(ssl.SSLError, OSError, ValueError):
            self._ssl.unwrap()
        self._flush()
        if self._raw is not None:
            self._raw.close()

    def abort(self) -> None:
        self._closed = True
        if self._raw is not None:
            self._raw.abort()

    def is_closing(self) -> bool:
        return self._closed

    def pause_reading(self) -> None:
        self._paused = True
        if self._raw is not None:
            self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._paused = False
        if self._raw is not None:
            self._raw.resume_reading()
        self._loop.call_soon(self._read_if_ready)  # bytes already decrypted or buffered

    def is_reading(self) -> bool:
        return not self._paused

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self._raw is not None:
            self._raw.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size() if self._raw is not None else 0

    def can_write_eof(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        return self._raw.get_extra_info(name, default) if self._raw is not None else default

    def _read_if_ready(self) -> None:
        if self._ready and not self._closed:
            self._read()
