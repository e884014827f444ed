"""Outbound HTTP over the standard library: one exchange, the client's and the fleet reader's.

``urllib.request`` is imported on the first exchange, not before, so ``gpu-exporter --help``
and ``import gpu_exporter.client`` stay cheap. A loopback address is never sent through a proxy.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
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

    Raises ValueError for a URL that is not HTTP(S), and OSError when nothing answers (a
    timeout is TimeoutError; http.client's errors come as ConnectionError: the request may
    have been received).
    """
    import http.client  # here, not at the top: `gpu-exporter --help` need not load them
    import urllib.error
    import urllib.request

    if not is_http(url):  # urllib would try FTP or read a file
        raise ValueError("not an http:// or https:// URL")
    data = b"" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    proxies = (
        [urllib.request.ProxyHandler({})]
        if is_loopback(urllib.parse.urlsplit(url).hostname)
        else []
    )
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
