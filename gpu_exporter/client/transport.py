"""The client's HTTP to an exporter: where the server is, one exchange with it, and its errors.

An exporter's endpoints are asked through :func:`request` (over :mod:`gpu_exporter.outbound`,
the standard library's HTTP), with basic auth from ``$GPU_EXPORTER_USER``/
``$GPU_EXPORTER_PASSWORD``, and an error status raised as the matching :class:`ServerError`;
reading a fleet (Prometheus, the hosts' ``/gpus``) is :mod:`gpu_exporter.fleet.reading`'s.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from gpu_exporter.outbound import Response, base_url, exchange, failure, is_http

DEFAULT_URL: Final = "http://localhost:9400"
URL_ENV: Final = "GPU_EXPORTER_URL"
USER_ENV: Final = "GPU_EXPORTER_USER"
PASSWORD_ENV: Final = "GPU_EXPORTER_PASSWORD"
DEFAULT_TIMEOUT_SECONDS: Final = 10.0
USER_AGENT: Final = "gpu-exporter-client"


# -- errors ------------------------------------------------------------------------------


class GpuExporterError(Exception):
    """Anything that kept GPUs from being chosen, renewed or released."""


class GpuExporterWarning(RuntimeWarning):
    """A choice was made, but something about it deserves attention (no lease, CUDA already up)."""


class ServerUnreachable(GpuExporterError):
    """No answer from the server: not running, wrong URL, or too slow.

    ``maybe_received``: the request may have reached the server although no answer came
    back (a timeout, a reset or closed connection), so a claim may have been granted; a claim
    with an ``Idempotency-Key`` can then be retried safely.
    """

    def __init__(self, url: str, reason: str, *, maybe_received: bool = False) -> None:
        self.url = url
        self.reason = reason
        self.maybe_received = maybe_received
        super().__init__(
            f"cannot reach gpu-exporter at {url}: {reason} "
            f"(is it running? the URL comes from --url, ${URL_ENV} or {DEFAULT_URL})"
        )


class ServerError(GpuExporterError):
    """The server answered with an error. ``str()`` is the server's message."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        url: str | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.url = url
        super().__init__(message)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status}, code={self.code!r}, "
            f"message={self.message!r}, param={self.param!r})"
        )


class NotAnExporter(ServerError):
    """Something answered, but not as a gpu-exporter does (an HTML page, a web server's 404):
    the URL points elsewhere. ``status`` is the answer's, ``url`` the address asked."""


class NoGpusAvailable(ServerError):
    """Fewer GPUs qualify than were asked for (503 ``not_enough_gpus``); the message says why."""


class LeaseNotFound(ServerError):
    """The lease is not (or no longer) held: released already, or expired (404)."""


def error_from_response(
    status: int,
    body: bytes,
    *,
    url: str | None = None,
    lease_endpoint: bool = False,
    asked: str | None = None,
) -> ServerError:
    """The exception for an error answer: a JSON ``{"error": {...}}`` body or one plain line.

    A body that is neither (a web page, "404 page not found") is :class:`NotAnExporter`,
    naming ``asked`` (the URL requested; default ``url``, the server).

    >>> e = error_from_response(503, b'{"error": {"code": "not_enough_gpus", "message": "0 of 2"}}')
    >>> type(e).__name__, e.status, e.code, str(e)
    ('NoGpusAvailable', 503, 'not_enough_gpus', '0 of 2')
    >>> e = error_from_response(400, b"error: n must be a whole number\\n")
    >>> type(e).__name__, e.code, e.message
    ('ServerError', None, 'n must be a whole number')
    >>> str(error_from_response(404, b"<!DOCTYPE HTML>\\n<html>", url="http://h:80"))
    'http://h:80 does not look like a gpu-exporter (HTTP 404 Not Found from http://h:80)'
    """
    code = param = None
    message = ""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        code = str_or_none(error.get("code"))
        param = str_or_none(error.get("param"))
        message = str(error.get("message") or "")
    elif text.startswith("error:") and "\n" not in text:  # our plain line
        message = text.removeprefix("error:").strip()
    elif data is None and text:  # a web page, "404 page not found": not an exporter's
        return NotAnExporter(status, not_an_exporter(status, url, asked), url=url)
    if not message:
        message = f"HTTP {status} {_phrase(status)}".strip()
    cls: type[ServerError] = ServerError
    if status == 503 and code == "not_enough_gpus":
        cls = NoGpusAvailable
    elif status == 404 and lease_endpoint:
        cls = LeaseNotFound
    return cls(status, message, code=code, param=param, url=url)


def str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def not_an_exporter(
    status: int, url: str | None, asked: str | None = None, detail: str = ""
) -> str:
    """One line for an answer that is not a gpu-exporter's: who answered, what, to which URL."""
    server = url or "the server"
    answer = f"HTTP {status} {_phrase(status)}".strip()
    return f"{server} does not look like a gpu-exporter ({answer} from {asked or server}{detail})"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


# -- where, and one exchange -------------------------------------------------------------


def resolve_url(url: str | None = None) -> str:
    """The server to ask: ``url``, else ``$GPU_EXPORTER_URL``, else ``http://localhost:9400``.

    A bare ``host:port`` gets ``http://``; a trailing slash is dropped.

    >>> resolve_url("gpuhost:9400/")
    'http://gpuhost:9400'

    Anything but ``http://`` and ``https://`` is refused at once (urllib would try FTP):

    >>> try:
    ...     resolve_url("ftp://gpuhost")
    ... except GpuExporterError as exc:
    ...     print(exc)
    ftp://gpuhost: not an http:// or https:// URL (from --url, $GPU_EXPORTER_URL or http://localhost:9400)
    """
    chosen = base_url(url or os.environ.get(URL_ENV) or DEFAULT_URL)
    check_scheme(chosen, f"from --url, ${URL_ENV} or {DEFAULT_URL}")
    return chosen


def check_scheme(url: str, origin: str) -> None:
    """Refuse a URL that is not HTTP(S), naming ``origin`` (where the URL came from)."""
    if not is_http(url):
        raise GpuExporterError(f"{url}: not an http:// or https:// URL ({origin})")


def request(
    method: str,
    base: str,
    path: str,
    params: Mapping[str, str] | None = None,
    *,
    timeout: float,
    lease_endpoint: bool = False,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """One exchange with the exporter at ``base``, with basic auth from the environment and
    ``headers`` (e.g. ``Idempotency-Key``); an error status raises a :class:`ServerError`, no
    answer in ``timeout`` seconds :class:`ServerUnreachable`."""
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    check_scheme(base, "gpu-exporter and Prometheus speak HTTP")  # urllib would try FTP
    sent = {"Accept": "application/json", "User-Agent": USER_AGENT, **_credentials()}
    try:
        resp = exchange(method, url, headers={**sent, **(headers or {})}, timeout=timeout)
    except OSError as exc:
        received = _maybe_received(exc)
        raise ServerUnreachable(base, failure(exc, timeout), maybe_received=received) from None
    if resp.status >= 400:
        raise error_from_response(
            resp.status, resp.body, url=base, lease_endpoint=lease_endpoint, asked=base + path
        )
    content_type = (resp.header("Content-Type") or "").lower()
    if "html" in content_type or resp.body.lstrip()[:1] == b"<":  # none of ours is HTML
        message = not_an_exporter(resp.status, base, base + path)
        raise NotAnExporter(resp.status, message, url=base)
    return resp


def json_body(resp: Response, what: str) -> Any:
    """The answer's JSON; anything else is a :class:`GpuExporterError` naming ``what``."""
    try:
        return json.loads(resp.body)
    except ValueError:
        detail = f": expected JSON, got {resp.body[:60]!r}"
        message = not_an_exporter(resp.status, None, what, detail)
        raise NotAnExporter(resp.status, message) from None


def _credentials() -> dict[str, str]:
    """An ``Authorization`` header from ``$GPU_EXPORTER_USER``/``$GPU_EXPORTER_PASSWORD``."""
    import base64

    user = os.environ.get(USER_ENV)
    if not user:
        return {}
    token = f"{user}:{os.environ.get(PASSWORD_ENV, '')}".encode()
    return {"Authorization": "Basic " + base64.b64encode(token).decode("ascii")}


def _maybe_received(exc: OSError) -> bool:
    """Could the server have got the request? After a timeout or a dropped connection, yes;
    after a refused connection or an unknown name, no."""
    refused = isinstance(exc, ConnectionRefusedError)
    return isinstance(exc, (TimeoutError, ConnectionError)) and not refused
