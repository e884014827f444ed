"""A client for a gpu-exporter's ``/choose`` and ``/leases``: claim GPUs, keep them, let go.

Standard library only, so a job can import it before (and without) any framework::

    from gpu_exporter import use_gpus

    with use_gpus(2, min_free="20GiB") as gpus:  # sets CUDA_VISIBLE_DEVICES, holds a lease
        import torch  # only now: CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises

        model = torch.nn.Linear(8, 8).to("cuda:0")  # the first of the two GPUs chosen
    # the lease is released and the environment is as it was

Device numbering: the chosen GPUs are named by UUID (``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b``),
which means the same cards whatever ``CUDA_DEVICE_ORDER`` says; inside the process CUDA
renumbers them from 0, so PyTorch sees ``cuda:0`` and ``cuda:1`` and TensorFlow ``/GPU:0`` and
``/GPU:1``. :attr:`Choice.indices` are NVML (``nvidia-smi``) indices, for people and logs.

A lease (``lease="60s"``, the default) makes the server hand these GPUs to nobody else until
it is released or expires; :func:`use_gpus` renews it in the background while the block runs.
``lease=0`` asks for advice only: nothing is reserved.

The server is found from the ``url`` argument, else ``$GPU_EXPORTER_URL``, else
``http://localhost:9400``. A server with basic auth (``--web-config-file``) gets
``$GPU_EXPORTER_USER`` and ``$GPU_EXPORTER_PASSWORD``; an ``https://`` server's certificate
is checked against the system CAs, or the file in ``$SSL_CERT_FILE``. Every failure is a
:class:`GpuExporterError`:

* :class:`ServerUnreachable` — nothing answered (or not in time);
* :class:`ServerError` — the server said no; ``status``, ``code``, ``message``, ``param``;

  * :class:`NoGpusAvailable` — 503 ``not_enough_gpus``: fewer GPUs qualify than asked for;
  * :class:`LeaseNotFound` — 404 from a lease endpoint: the lease has ended (released,
    expired, or let go by the server once the job's work showed on its GPUs).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from http import HTTPStatus
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeAlias

if TYPE_CHECKING:
    from gpu_exporter.choose.params import ApiError
    from gpu_exporter.choose.rank import Filters as LocalFilters
    from gpu_exporter.client.fleet import ClusterChoice
    from gpu_exporter.nvml import Nvml

log = logging.getLogger(__name__)

DEFAULT_URL: Final = "http://localhost:9400"
URL_ENV: Final = "GPU_EXPORTER_URL"
USER_ENV: Final = "GPU_EXPORTER_USER"
PASSWORD_ENV: Final = "GPU_EXPORTER_PASSWORD"
DEFAULT_LEASE: Final = "60s"
DEFAULT_TIMEOUT_SECONDS: Final = 10.0
LEASE_HEADER: Final = "X-GPU-Lease"
Duration: TypeAlias = str | float | timedelta
"""``"90s"``, ``"10m"``, ``"500ms"``, a number of seconds, or a :class:`~datetime.timedelta`."""
FilterValue: TypeAlias = str | int | float | Iterable[str | int] | None
"""A ``/choose`` filter value; an iterable is sent comma-separated, ``None`` not at all."""


# -- errors ------------------------------------------------------------------------------


class GpuExporterError(Exception):
    """Anything that kept GPUs from being chosen, renewed or released."""


class GpuExporterWarning(RuntimeWarning):
    """A choice was made, but something about it deserves attention (no lease, CUDA already up)."""


class ServerUnreachable(GpuExporterError):
    """No answer from the server: not running, wrong URL, or too slow."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
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


class NoGpusAvailable(ServerError):
    """Fewer GPUs qualify than were asked for (503 ``not_enough_gpus``); the message says why."""


class LeaseNotFound(ServerError):
    """The lease is not (or no longer) held: released already, or expired (404)."""


def error_from_response(
    status: int, body: bytes, *, url: str | None = None, lease_endpoint: bool = False
) -> ServerError:
    """The exception for an error answer: a JSON ``{"error": {...}}`` body or one plain line.

    >>> e = error_from_response(503, b'{"error": {"code": "not_enough_gpus", "message": "0 of 2"}}')
    >>> type(e).__name__, e.status, e.code, str(e)
    ('NoGpusAvailable', 503, 'not_enough_gpus', '0 of 2')
    >>> e = error_from_response(400, b"error: n must be a whole number\\n")
    >>> type(e).__name__, e.code, e.message
    ('ServerError', None, 'n must be a whole number')
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
        code = _str_or_none(error.get("code"))
        param = _str_or_none(error.get("param"))
        message = str(error.get("message") or "")
    elif text:
        message = text.splitlines()[0].removeprefix("error:").strip()
    if not message:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        message = f"HTTP {status} {phrase}".strip()
    cls: type[ServerError] = ServerError
    if status == 503 and code == "not_enough_gpus":
        cls = NoGpusAvailable
    elif status == 404 and lease_endpoint:
        cls = LeaseNotFound
    return cls(status, message, code=code, param=param, url=url)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


# -- results -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lease:
    """A claim on GPUs, as the server keeps it. Times are Unix seconds."""

    id: str
    gpus: tuple[str, ...]  # UUIDs
    created_at: float
    expires_at: float
    owner: str | None = None
    requester: str | None = None

    @property
    def ttl_seconds(self) -> float:
        """How long the server granted (it may cap what was asked for)."""
        return max(0.0, self.expires_at - self.created_at)

    @classmethod
    def from_json(cls, data: Any) -> Lease:
        try:
            return cls(
                id=str(data["id"]),
                gpus=tuple(str(u) for u in data.get("gpus") or ()),
                created_at=float(data["created_at"]),
                expires_at=float(data["expires_at"]),
                owner=_str_or_none(data.get("owner")),
                requester=_str_or_none(data.get("requester")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GpuExporterError(f"malformed lease in the server's answer: {data!r}") from exc


@dataclass(frozen=True, slots=True)
class Choice:
    """GPUs chosen for this job, best first, and the lease that reserves them.

    ``uuids`` name the cards for ``CUDA_VISIBLE_DEVICES``; ``indices`` are their NVML
    (``nvidia-smi``) indices. ``lease_id`` is ``None`` when nothing reserves them (``lease=0``,
    or ``local``: chosen from this host's NVML because no server answered).
    """

    uuids: tuple[str, ...]
    indices: tuple[int, ...]
    lease_id: str | None
    expires_at: float | None  # Unix time; None without a lease
    url: str  # the server asked (and to renew and release at)
    lease: Lease | None = field(default=None, compare=False)
    local: bool = False
    details: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The server's whole JSON answer: every chosen GPU's figures, why others were passed over."""
    host: str | None = None
    """Set when chosen across a fleet (``prometheus=``/``hosts=``): the host the GPUs are on."""

    @property
    def cuda_visible_devices(self) -> str:
        """``"GPU-a,GPU-b"``: CUDA then numbers these cards 0, 1, … in this order."""
        return ",".join(self.uuids)

    def env(self) -> dict[str, str]:
        """The environment variables a process needs to use exactly these GPUs.

        >>> Choice(("GPU-a", "GPU-b"), (0, 3), "l1", None, "http://h:9400").env()
        ... # doctest: +NORMALIZE_WHITESPACE
        {'CUDA_DEVICE_ORDER': 'PCI_BUS_ID', 'CUDA_VISIBLE_DEVICES': 'GPU-a,GPU-b',
         'GPU_LEASE': 'l1'}
        """
        env = {}
        if self.host is not None:  # chosen across a fleet: where to run, and whom to ask
            env["GPU_HOST"] = self.host
            env[URL_ENV] = self.url
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        if self.lease_id is not None:
            env["GPU_LEASE"] = self.lease_id
        return env

    @classmethod
    def from_json(cls, data: Any, *, url: str, lease_header: str | None = None) -> Choice:
        """Build from ``/choose?format=json``'s answer (and its ``X-GPU-Lease`` header)."""
        try:
            chosen = data["chosen"]
            uuids = tuple(str(g["uuid"]) for g in chosen)
            indices = tuple(int(g["index"]) for g in chosen)
            raw_lease = data.get("lease")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GpuExporterError(f"unexpected answer from {url}/choose: {data!r}") from exc
        lease = Lease.from_json(raw_lease) if raw_lease else None
        lease_id = lease.id if lease is not None else lease_header
        return cls(
            uuids=uuids,
            indices=indices,
            lease_id=lease_id,
            expires_at=lease.expires_at if lease is not None else None,
            url=url,
            lease=lease,
            details=data,
        )


@dataclass(frozen=True, slots=True)
class ChooseAnswer:
    """``/choose``'s answer as the server wrote it (for ``gpu-exporter choose``)."""

    body: str  # e.g. "GPU-a,GPU-b" and a newline, exactly as sent
    lease_id: str | None  # the X-GPU-Lease header
    url: str


# -- plumbing ----------------------------------------------------------------------------


def resolve_url(url: str | None = None) -> str:
    """The server to ask: ``url``, else ``$GPU_EXPORTER_URL``, else ``http://localhost:9400``.

    A bare ``host:port`` gets ``http://``; a trailing slash is dropped.

    >>> resolve_url("gpuhost:9400/")
    'http://gpuhost:9400'
    """
    chosen = url or os.environ.get(URL_ENV) or DEFAULT_URL
    chosen = chosen.strip().rstrip("/")
    if "://" not in chosen:
        chosen = "http://" + chosen
    return chosen


def format_duration(value: Duration) -> str:
    """A duration as a query value: strings pass through, numbers are seconds.

    >>> [format_duration(d) for d in (60, 0.3, timedelta(minutes=2), "10m")]
    ['60', '0.3', '120', '10m']
    """
    if isinstance(value, str):
        return value.strip()
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration of 0 seconds or more, got {value!r}")
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return text or "0"


def duration_seconds(value: Duration) -> float | None:
    """Seconds in ``value``, or None where this client cannot tell (the server will judge)."""
    if isinstance(value, str):
        from gpu_exporter.units import parse_duration

        try:
            return parse_duration(value)
        except ValueError:
            return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _filter_value(name: str, value: FilterValue) -> str:
    if isinstance(value, bool):
        raise TypeError(f"filter {name}: expected a number or text, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return format(value, "g") if isinstance(value, float) else str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in value)
    raise TypeError(f"filter {name}: unsupported value {value!r}")


def _choose_params(
    n: int,
    fmt: str,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    filters: Mapping[str, FilterValue],
) -> dict[str, str]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number of 1 or more, got {n!r}")
    params = {"n": str(n), "format": fmt}
    if lease is not None:
        params["lease"] = format_duration(lease)
    if wait is not None:
        params["wait"] = format_duration(wait)
    if owner is not None:
        params["owner"] = owner
    for name, value in filters.items():
        if name in ("n", "format", "lease", "wait", "owner"):
            raise TypeError(f"{name} is not a filter")
        if value is not None:
            params[name] = _filter_value(name, value)
    return params


def is_loopback(host: str | None) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: yes; every interface ("", None) and names: no."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    headers: Mapping[str, str]
    body: bytes


def _request(
    method: str,
    base: str,
    path: str,
    params: Mapping[str, str] | None = None,
    *,
    timeout: float,
    lease_endpoint: bool = False,
) -> _Response:
    """One HTTP exchange; an error status becomes the matching :class:`ServerError`."""
    import http.client  # here, not at the top: `gpu-exporter --help` need not load them
    import urllib.error
    import urllib.request

    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    req = urllib.request.Request(
        url,
        data=b"" if method in ("POST", "PUT") else None,
        method=method,
        headers={
            "Accept": "application/json",
            "User-Agent": "gpu-exporter-client",
            **_credentials(),
        },
    )
    handlers: list[urllib.request.BaseHandler] = []
    if is_loopback(urllib.parse.urlsplit(base).hostname):
        handlers.append(urllib.request.ProxyHandler({}))  # never send localhost to a proxy
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(req, timeout=timeout) as resp:
            return _Response(resp.status, dict(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read()
        except OSError:
            body = b""
        finally:
            exc.close()
        raise error_from_response(exc.code, body, url=base, lease_endpoint=lease_endpoint) from None
    except urllib.error.URLError as exc:
        raise ServerUnreachable(base, _reason(exc.reason, timeout)) from None
    except (OSError, http.client.HTTPException) as exc:
        raise ServerUnreachable(base, _reason(exc, timeout)) from None


def _credentials() -> dict[str, str]:
    """An ``Authorization`` header from ``$GPU_EXPORTER_USER``/``$GPU_EXPORTER_PASSWORD``."""
    import base64

    user = os.environ.get(USER_ENV)
    if not user:
        return {}
    token = f"{user}:{os.environ.get(PASSWORD_ENV, '')}".encode()
    return {"Authorization": "Basic " + base64.b64encode(token).decode("ascii")}


def _reason(exc: object, timeout: float) -> str:
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _json(resp: _Response, what: str) -> Any:
    try:
        return json.loads(resp.body)
    except ValueError:
        raise GpuExporterError(f"{what}: expected JSON, got {resp.body[:200]!r}") from None


def _lease_ref(choice_or_id: Choice | Lease | str, url: str | None) -> tuple[str | None, str]:
    if isinstance(choice_or_id, Choice):
        return choice_or_id.lease_id, url or choice_or_id.url
    if isinstance(choice_or_id, Lease):
        return choice_or_id.id, resolve_url(url)
    return choice_or_id, resolve_url(url)


def _lease_path(lease_id: str, suffix: str = "") -> str:
    return "/leases/" + urllib.parse.quote(lease_id, safe="") + suffix


# -- the API -----------------------------------------------------------------------------


def choose_raw(
    n: int = 1,
    url: str | None = None,
    *,
    format: str = "uuid",
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    **filters: FilterValue,
) -> ChooseAnswer:
    """Ask ``/choose`` and return its body untouched (``"GPU-a,GPU-b\\n"``) and lease id.

    Same arguments as :func:`choose`, plus ``format`` (``uuid``, ``index``, ``env``, ``json``).
    """
    base = resolve_url(url)
    params = _choose_params(n, format, lease, wait, owner, filters)
    waited = duration_seconds(wait) if wait is not None else None
    resp = _request("POST", base, "/choose", params, timeout=timeout + (waited or 0.0))
    body = resp.body.decode("utf-8", "replace")
    return ChooseAnswer(body, _header(resp.headers, LEASE_HEADER), base)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name.lower():
            return value.strip() or None
    return None


def choose(
    n: int = 1,
    url: str | None = None,
    *,
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    prometheus: str | None = None,
    hosts: Iterable[str] | str | None = None,
    max_age: Duration | None = None,
    selector: str | None = None,
    **filters: FilterValue,
) -> Choice:
    """Choose ``n`` GPUs and lease them for ``lease`` (``0``: advice only, nothing reserved).

    ``wait`` lets the server hold the request until enough GPUs qualify (``"10m"``);
    without it, too few raises :class:`NoGpusAvailable` at once. Filters are ``/choose``'s
    query parameters under the same names: ``min_free="20GiB"``, ``max_util=0.1``,
    ``exclude=[0]``, ``model="A100"``, ``max_procs=0`` … ``None`` leaves one out.

    >>> gpus = choose(2, min_free="20GiB")  # doctest: +SKIP
    >>> os.environ.update(gpus.env())  # before anything initialises CUDA  # doctest: +SKIP
    >>> release(gpus)  # doctest: +SKIP

    With ``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b`` PyTorch sees ``cuda:0`` and ``cuda:1``,
    TensorFlow ``/GPU:0`` and ``/GPU:1``. Release the lease when done (or let it expire);
    :func:`use_gpus` does both and renews it meanwhile.

    ``prometheus="http://prom:9090"`` (and/or ``hosts=["node1", "node2:9401"]``) chooses
    across a fleet instead of asking one host: all ``n`` GPUs on one host, leased by that
    host's exporter; the Choice's ``host`` says which, ``url`` is its exporter (renew and
    release go there). See :func:`choose_cluster`.
    """
    if "format" in filters:
        raise TypeError("format is not a filter: choose() reads JSON; see choose_raw()")
    if prometheus or hosts:
        if url is not None:
            raise TypeError("give url (one host) or prometheus/hosts (a fleet), not both")
        fleet = _choose_cluster(
            n,
            prometheus=prometheus,
            hosts=hosts,
            spread=False,
            lease=lease,
            wait=wait,
            owner=owner,
            max_age=max_age,
            selector=selector,
            timeout=timeout,
            filters=filters,
            stacklevel=3,
        )
        return fleet.placements[0]
    return _choose_host(n, url, lease=lease, wait=wait, owner=owner, timeout=timeout, **filters)


def _choose_host(
    n: int,
    url: str | None,
    *,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    timeout: float,
    **filters: FilterValue,
) -> Choice:
    answer = choose_raw(
        n, url, format="json", lease=lease, wait=wait, owner=owner, timeout=timeout, **filters
    )
    try:
        data = json.loads(answer.body)
    except ValueError:
        raise GpuExporterError(
            f"{answer.url}/choose: expected JSON, got {answer.body[:200]!r}"
        ) from None
    return Choice.from_json(data, url=answer.url, lease_header=answer.lease_id)


def choose_cluster(
    n: int = 1,
    *,
    prometheus: str | None = None,
    hosts: Iterable[str] | str | None = None,
    spread: bool = False,
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    max_age: Duration | None = None,
    selector: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    **filters: FilterValue,
) -> ClusterChoice:
    """Choose and lease ``n`` GPUs across hosts, reading the fleet from Prometheus.

    The figures come from ``prometheus`` (its HTTP API); if it cannot be asked and ``hosts``
    are named (``"node1,node2:9401"`` or a list), those exporters are asked directly, with a
    :class:`GpuExporterWarning`. All ``n`` GPUs come from one host unless ``spread``; each
    host's own exporter grants the lease. ``max_age`` (default 60 s): figures older than this
    are never used. ``selector`` (label matchers, ``'job="gpu-shared"'``) narrows the fleet
    Prometheus shows to those targets. Filters as for :func:`choose`.

    Raises :class:`NoGpusAvailable` (the message has every host's reason) and
    :class:`ServerError` (400 bad argument, 503 ``prometheus_unavailable``).
    """
    return _choose_cluster(
        n,
        prometheus=prometheus,
        hosts=hosts,
        spread=spread,
        lease=lease,
        wait=wait,
        owner=owner,
        max_age=max_age,
        selector=selector,
        timeout=timeout,
        filters=filters,
        stacklevel=3,
    )


def _choose_cluster(
    n: int,
    *,
    prometheus: str | None,
    hosts: Iterable[str] | str | None,
    spread: bool,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    max_age: Duration | None,
    selector: str | None,
    timeout: float,
    filters: Mapping[str, FilterValue],
    stacklevel: int,
) -> ClusterChoice:
    from gpu_exporter.choose.params import ApiError
    from gpu_exporter.client import fleet as cluster

    params = _choose_params(n, "json", lease, wait, owner, filters)
    if spread:
        params["spread"] = "1"
    if max_age is not None:
        params["max_age"] = format_duration(max_age)
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    host_list = [h.strip() for h in hosts or () if h.strip()]
    try:
        result = cluster.choose_fleet(
            params,
            prometheus=prometheus,
            hosts=host_list,
            selector=selector or "",
            timeout=timeout,
        )
    except ApiError as exc:
        raise _from_api_error(exc, prometheus or ",".join(host_list)) from None
    for note in result.notes:
        warnings.warn(note, GpuExporterWarning, stacklevel=stacklevel)
    return result


def _from_api_error(exc: ApiError, url: str) -> ServerError:
    cls = NoGpusAvailable if exc.status == 503 and exc.code == "not_enough_gpus" else ServerError
    return cls(exc.status, exc.message, code=exc.code, param=exc.param, url=url)


def release(
    choice_or_id: Choice | Lease | str,
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> None:
    """Give the GPUs back now. A :class:`Choice` without a lease is a no-op.

    Raises :class:`LeaseNotFound` if the server no longer holds it (released, expired, or
    let go once the job's work showed on its GPUs).
    """
    lease_id, base = _lease_ref(choice_or_id, url)
    if lease_id is None:
        return
    _request("DELETE", base, _lease_path(lease_id), timeout=timeout, lease_endpoint=True)


def renew(
    choice_or_id: Choice | Lease | str,
    ttl: Duration | None = None,
    url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> Lease:
    """Extend the lease to ``ttl`` from now (the server's default when None); the new lease.

    Raises :class:`LeaseNotFound` once the lease has ended; if it expired, its GPUs may be
    someone else's by then (see :class:`LeaseKeeper`).
    """
    lease_id, base = _lease_ref(choice_or_id, url)
    if lease_id is None:
        raise GpuExporterError("nothing to renew: this choice holds no lease")
    params = {"ttl": format_duration(ttl)} if ttl is not None else None
    resp = _request(
        "POST",
        base,
        _lease_path(lease_id, "/renew"),
        params,
        timeout=timeout,
        lease_endpoint=True,
    )
    return Lease.from_json(_json(resp, f"{base}/leases/{lease_id}/renew"))


def leases(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> list[Lease]:
    """Every lease the server holds now."""
    base = resolve_url(url)
    data = _json(_request("GET", base, "/leases", timeout=timeout), f"{base}/leases")
    try:
        return [Lease.from_json(item) for item in data["leases"]]
    except (KeyError, TypeError) as exc:
        raise GpuExporterError(f"unexpected answer from {base}/leases: {data!r}") from exc


# -- keeping a lease ---------------------------------------------------------------------


class LeaseKeeper:
    """Renews a lease from a daemon thread every third of its TTL until :meth:`stop`.

    A failed renewal is logged and retried at the next turn (two more chances before the
    lease runs out). Once the server no longer knows the lease, renewing stops and
    :attr:`ended` says why:

    * ``"dropped"`` — it ended before its expiry: the server lets a lease go once the job's
      work shows on its GPUs (NVML's figures keep others away from then on), or someone
      released it. Normal; logged at INFO.
    * ``"expired"`` — renewals failed until it ran out: its GPUs may be handed to someone
      else. Logged as an error.

    If this process dies, renewals stop and the lease simply expires.
    """

    def __init__(self, choice: Choice, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        if choice.lease_id is None:
            raise ValueError("nothing to keep: this choice holds no lease")
        self.lease_id: str = choice.lease_id
        self.url = choice.url
        ttl = choice.lease.ttl_seconds if choice.lease is not None else 0.0
        self.ttl_seconds = ttl if ttl > 0 else 60.0
        self.interval_seconds = max(0.05, self.ttl_seconds / 3)
        self.expires_at = choice.expires_at
        self.renewals = 0
        self.ended: str | None = None  # "dropped" or "expired", once the server lost it
        self._timeout = min(timeout, max(1.0, self.interval_seconds))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"gpu-lease-{self.lease_id}", daemon=True
        )

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop renewing; waits for a renewal in flight (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout + 1.0 if timeout is None else timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def lost(self) -> bool:
        """The lease ran out while this process still wanted it."""
        return self.ended == "expired"

    def _run(self) -> None:
        ttl = format_duration(round(self.ttl_seconds, 3))
        while not self._stop.wait(self.interval_seconds):
            try:
                lease = renew(self.lease_id, ttl, self.url, timeout=self._timeout)
            except LeaseNotFound:
                if not self._stop.is_set():
                    self._gone()
                return
            except GpuExporterError as exc:
                if not self._stop.is_set():
                    log.warning("could not renew lease %s (will retry): %s", self.lease_id, exc)
                continue
            self.expires_at = lease.expires_at
            self.renewals += 1

    def _gone(self) -> None:
        if self.expires_at is not None and time.time() < self.expires_at:
            self.ended = "dropped"
            log.info(
                "lease %s ended before it expired (the job's work reached its GPUs, or it was "
                "released elsewhere); no longer renewing it",
                self.lease_id,
            )
        else:
            self.ended = "expired"
            log.error(
                "lease %s expired before it could be renewed: its GPUs may now be handed to "
                "someone else",
                self.lease_id,
            )


# -- choosing with a fallback, and use_gpus ---------------------------------------------

# What choosing locally can apply: every /choose filter but idle_for, which needs the history
# only a running exporter has.
_LOCAL_FILTERS = (
    "min_free",
    "min_total",
    "max_util",
    "max_mem_util",
    "max_procs",
    "model",
    "include",
    "exclude",
    "sort",
)


def _open_local_nvml() -> Nvml:
    """This host's NVML (through :mod:`gpu_exporter.nvml`; tests replace this)."""
    from gpu_exporter.nvml import Nvml

    return Nvml()


def choose_locally(n: int, filters: Mapping[str, FilterValue], *, url: str = "") -> Choice:
    """Rank this host's GPUs through NVML, as the server would, but with no lease.

    Takes every ``/choose`` filter except ``idle_for``. Raises :class:`GpuExporterError` when
    NVML cannot be loaded or sees no GPU, and :class:`NoGpusAvailable` when too few qualify —
    never an empty choice.
    """
    from gpu_exporter.choose.rank import NotEnoughGpus
    from gpu_exporter.choose.rank import choose as rank_and_choose
    from gpu_exporter.collect.read import read_gpu
    from gpu_exporter.nvml import NvmlError

    given = {k: v for k, v in filters.items() if v is not None}
    if "idle_for" in given:
        raise GpuExporterError(
            "choosing locally cannot apply idle_for: it needs the history only a running "
            "gpu-exporter keeps"
        )
    unknown = sorted(set(given) - set(_LOCAL_FILTERS))
    if unknown:
        raise GpuExporterError(f"unknown filter {', '.join(unknown)}")
    try:
        local_filters, sort = _local_filters(given)
    except (ValueError, TypeError) as exc:
        raise GpuExporterError(f"choosing locally: {exc}") from None

    try:
        nvml = _open_local_nvml()
        nvml.init()
    except (NvmlError, OSError, ImportError) as exc:
        raise GpuExporterError(
            f"no NVIDIA driver to choose GPUs with ({exc}); refusing to run without a GPU"
        ) from None
    try:
        count = nvml.device_count()
        unsupported_fields: set[tuple[str, str]] = set()
        samples = [read_gpu(nvml, i, None, unsupported_fields)[0] for i in range(count)]
    except NvmlError as exc:
        raise GpuExporterError(f"NVML failed while reading the GPUs: {exc}") from None
    finally:
        nvml.shutdown()
    if not samples:
        raise GpuExporterError("NVML sees no GPU on this host; refusing to run without a GPU")
    try:
        picked = rank_and_choose(samples, n, local_filters, sort=sort).chosen
    except NotEnoughGpus as exc:
        raise NoGpusAvailable(503, str(exc), code="not_enough_gpus") from None
    return Choice(
        uuids=tuple(g.uuid for g in picked),
        indices=tuple(g.index for g in picked),
        lease_id=None,
        expires_at=None,
        url=url,
        local=True,
        details={"n": n, "chosen": [g.to_json() for g in picked], "lease": None},
    )


def _local_filters(given: Mapping[str, FilterValue]) -> tuple[LocalFilters, str]:
    """``/choose``'s filter parameters, parsed as the server parses them, and the sort."""
    from gpu_exporter.choose.params import ApiError, parse_choose_args

    args = {name: _filter_value(name, value) for name, value in given.items()}
    try:
        req = parse_choose_args(args, allowed=(*_LOCAL_FILTERS, "n"))
    except ApiError as exc:
        raise ValueError(exc.message) from None
    return req.filters, req.sort


def choose_or_fallback(
    n: int,
    url: str | None,
    *,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    timeout: float,
    local_fallback: bool,
    filters: Mapping[str, FilterValue],
    stacklevel: int = 2,
) -> Choice:
    """:func:`choose`; if no server answers and ``local_fallback``, :func:`choose_locally`."""
    try:
        return _choose_host(n, url, lease=lease, wait=wait, owner=owner, timeout=timeout, **filters)
    except ServerUnreachable as exc:
        if not local_fallback:
            raise
        unreachable = exc
    try:
        choice = choose_locally(n, filters, url=unreachable.url)
    except NoGpusAvailable:
        raise
    except GpuExporterError as exc:
        raise GpuExporterError(f"{unreachable}; and cannot choose locally: {exc}") from None
    warnings.warn(
        f"{unreachable}; chose GPU {','.join(map(str, choice.indices))} from this host's "
        "NVML instead. No lease protects this choice: another job may pick the same GPUs.",
        GpuExporterWarning,
        stacklevel=stacklevel,
    )
    return choice


def cuda_initialised_by() -> list[str]:
    """Frameworks already imported here that have initialised CUDA (where one can tell).

    Once CUDA is initialised in a process, changing ``CUDA_VISIBLE_DEVICES`` has no effect.
    Only looks: never imports a framework or touches a GPU.
    """
    found = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                found.append("torch")
        except Exception:  # an odd build or a stub: cannot tell
            log.debug("cannot tell whether torch has initialised CUDA", exc_info=True)
    context = sys.modules.get("tensorflow.python.eager.context")
    ctx = getattr(context, "_context", None) if context is not None else None
    if ctx is not None and getattr(ctx, "_context_handle", None) is not None:
        found.append("tensorflow")
    return found


_ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPU_LEASE")


def replaced_visible_devices(choice: Choice) -> str | None:
    """A warning when ``choice`` would replace a different CUDA_VISIBLE_DEVICES already set.

    Slurm and the Kubernetes device plugin set it to the GPUs they allocated; replacing it
    silently would put a job on cards the scheduler gave someone else.
    """
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not previous or previous == choice.cuda_visible_devices:
        return None
    return (
        f"replacing CUDA_VISIBLE_DEVICES={previous} with the chosen GPUs; if a scheduler "
        "(Slurm, Kubernetes) set it, choose among its GPUs with include= (or don't choose)"
    )


class GpuSession:
    """What :func:`use_gpus` returns: a context manager; ``with … as gpus`` gives the Choice."""

    def __init__(
        self,
        n: int,
        url: str | None,
        *,
        lease: Duration | None,
        wait: Duration | None,
        owner: str | None,
        timeout: float,
        local_fallback: bool,
        filters: Mapping[str, FilterValue],
    ) -> None:
        self._args = (n, url)
        self._kwargs: dict[str, Any] = {
            "lease": lease,
            "wait": wait,
            "owner": owner,
            "timeout": timeout,
            "local_fallback": local_fallback,
            "filters": dict(filters),
        }
        self._timeout = timeout
        self.choice: Choice | None = None
        self.keeper: LeaseKeeper | None = None
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> Choice:
        if self.choice is not None:
            raise RuntimeError("use_gpus(...) is not reentrant; make a new one")
        initialised = cuda_initialised_by()
        if initialised:
            warnings.warn(
                f"{' and '.join(initialised)} already initialised CUDA in this process, so "
                "setting CUDA_VISIBLE_DEVICES now has no effect here; enter use_gpus() before "
                "the first CUDA call (or import the framework inside the block)",
                GpuExporterWarning,
                stacklevel=2,
            )
        choice = choose_or_fallback(*self._args, **self._kwargs, stacklevel=3)
        self.choice = choice
        try:
            if choice.lease_id is not None:
                self.keeper = LeaseKeeper(choice, timeout=self._timeout).start()
            replacing = replaced_visible_devices(choice)
            if replacing is not None:
                warnings.warn(replacing, GpuExporterWarning, stacklevel=2)
            self._saved = {key: os.environ.get(key) for key in _ENV_KEYS}
            for key in _ENV_KEYS:
                os.environ.pop(key, None)
            os.environ.update(choice.env())
        except BaseException:
            self._finish()
            raise
        return choice

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved = {}
        if self.keeper is not None:
            self.keeper.stop()
        choice = self.choice
        if choice is None or choice.lease_id is None:
            return
        try:
            release(choice, timeout=self._timeout)
        except LeaseNotFound:  # ended already: see LeaseKeeper.ended
            log.debug("lease %s had already ended", choice.lease_id)
        except GpuExporterError as exc:
            log.warning(
                "could not release lease %s (it expires by itself): %s", choice.lease_id, exc
            )


def use_gpus(
    n: int = 1,
    url: str | None = None,
    *,
    lease: Duration | None = DEFAULT_LEASE,
    wait: Duration | None = None,
    owner: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    local_fallback: bool = True,
    **filters: FilterValue,
) -> GpuSession:
    """Run a block on ``n`` GPUs that nobody else is handed meanwhile.

    On entry: chooses (same arguments as :func:`choose`), sets ``CUDA_VISIBLE_DEVICES`` to the
    chosen UUIDs, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``GPU_LEASE``, and renews the lease in
    a daemon thread every third of its TTL. On exit, even by an exception: stops renewing,
    releases the lease, and restores those variables as they were. ::

        with use_gpus(2, min_free="20GiB", wait="10m") as gpus:
            import torch  # CUDA must not be initialised before the block

            print(gpus.uuids, torch.cuda.device_count())  # (...), 2: cuda:0 and cuda:1

    With ``CUDA_VISIBLE_DEVICES=GPU-a,GPU-b``, PyTorch sees ``cuda:0`` and ``cuda:1`` and
    TensorFlow ``/GPU:0`` and ``/GPU:1``. A framework that initialised CUDA before the block
    ignores the variable; that is warned about where it can be detected (PyTorch, TensorFlow).

    If no server answers and ``local_fallback`` is true, the GPUs are chosen from this host's
    NVML instead, with a :class:`GpuExporterWarning` — no lease protects such a choice. With
    no driver or no GPU it raises :class:`GpuExporterError`: it never silently runs on CPU.
    """
    return GpuSession(
        n,
        url,
        lease=lease,
        wait=wait,
        owner=owner,
        timeout=timeout,
        local_fallback=local_fallback,
        filters=filters,
    )
