"""Outbound HTTP over the standard library: one exchange, the client's and the fleet reader's.

``urllib.request`` is imported on the first exchange, not before, so ``gpu-exporter --help``
and ``import gpu_exporter.client`` stay cheap. A loopback address is never sent through a proxy.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass


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


def exchange(method: str, url: str, *, headers: Mapping[str, str], timeout: float) -> Response:
    """One exchange; every status comes back as a :class:`Response`.

    Raises ValueError for a URL that is not HTTP(S) (urllib would try FTP or read a file), and
    OSError when nothing answers (a timeout is TimeoutError; http.client's errors come as
    ConnectionError: the request may have been received).
    """
    import http.client  # here, not at the top: `gpu-exporter --help` need not load them
    import urllib.error
    import urllib.parse
    import urllib.request

    split = urllib.parse.urlsplit(url)
    if split.scheme.lower() not in ("http", "https"):
        raise ValueError("not an http:// or https:// URL")
    data = b"" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    proxies = [urllib.request.ProxyHandler({})] if is_loopback(split.hostname) else []
    try:
        with urllib.request.build_opener(*proxies).open(req, timeout=timeout) as resp:
            return Response(resp.status, dict(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read()
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


def failure(exc: BaseException, timeout: float) -> str:
    """Why an exchange got no answer, in a few words."""
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
