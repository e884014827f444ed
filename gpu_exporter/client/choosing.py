"""The front door: :func:`choose` GPUs from one exporter or across a fleet, :func:`choose_cluster`.

One exporter is :mod:`gpu_exporter.client.hostapi`'s, a fleet :mod:`gpu_exporter.fleet`'s, which
claims on the chosen host through :func:`http_claimer` here; both answer with the same
:class:`~gpu_exporter.client.hostapi.Choice`, so a job script need not care which it asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpu_exporter.choose.params import POINT_FILTERS
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import ClusterRequest
from gpu_exporter.client.hostapi import DEFAULT_LEASE, Choice, choose_host, release
from gpu_exporter.client.query import Duration, FilterValue, choose_params, format_duration
from gpu_exporter.client.transport import (
    DEFAULT_TIMEOUT_SECONDS,
    GpuExporterError,
    GpuExporterWarning,
    NoGpusAvailable,
    ServerError,
)
from gpu_exporter.fleet.inventory import Fleet, Host
from gpu_exporter.fleet.placing import Claim, ClaimRefused, ClusterChoice, choose_fleet
from gpu_exporter.outbound import AnswerTooLarge, Bounds


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
    ignore_mask: bool = False,
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
    :func:`~gpu_exporter.client.use_gpus` does both and renews it meanwhile.

    ``prometheus="http://prom:9090"`` (and/or ``hosts=["node1", "node2:9401"]``) chooses
    across a fleet instead of asking one host: all ``n`` GPUs on one host, leased by that
    host's exporter; the Choice's ``host`` says which, ``url`` is its exporter (renew and
    release go there). See :func:`choose_cluster`.

    Inside a job a launcher gave GPUs (Slurm, a container, ``CUDA_VISIBLE_DEVICES``), only
    those are chosen from; ``ignore_mask=True`` chooses among every GPU of the host.
    """
    if "format" in filters:
        raise TypeError("format is not a filter: choose() reads JSON; see choose_raw()")
    if prometheus or hosts:
        if url is not None:
            raise TypeError("give url (one host) or prometheus/hosts (a fleet), not both")
        fleet = choose_cluster(
            n, prometheus=prometheus, hosts=hosts, spread=False, lease=lease, wait=wait,
            owner=owner, max_age=max_age, selector=selector, timeout=timeout, _stacklevel=3,
            **filters,
        )  # fmt: skip
        return fleet.placements[0]
    return choose_host(
        n, url, lease=lease, wait=wait, owner=owner, timeout=timeout,
        ignore_mask=ignore_mask, **filters,
    )  # fmt: skip


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
    _stacklevel: int = 2,  # where a warning points: the caller's line
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
    params = choose_params(n, "json", lease, wait, owner, filters)
    if spread:
        params["spread"] = "1"
    if max_age is not None:
        params["max_age"] = format_duration(max_age)
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    host_list = [h.strip() for h in hosts or () if h.strip()]
    try:
        result = choose_fleet(
            params,
            claimer=http_claimer,
            release=release,
            prometheus=prometheus,
            hosts=host_list,
            selector=selector or "",
            timeout=timeout,
        )
    except ApiError as exc:
        cls = (
            NoGpusAvailable if exc.status == 503 and exc.code == "not_enough_gpus" else ServerError
        )
        where = prometheus or ",".join(host_list)
        raise cls(exc.status, exc.message, code=exc.code, param=exc.param, url=where) from None
    for note in result.notes:
        warnings.warn(note, GpuExporterWarning, stacklevel=_stacklevel)
    return result


CLAIM_ANSWER_BYTES = 2**20  # a claim's answer names n GPUs: far less than this


def http_claimer(
    args: Mapping[str, str],
    req: ClusterRequest,
    fleet: Fleet,
    timeout: float,
    *,
    choose_on_host: Callable[..., Choice] = choose_host,
) -> Claim:
    """Claims through the host's own ``/choose`` (``choose_on_host``), which re-checks the
    point filters. ``idle_for`` goes to the host only when the fleet could not judge it
    (``--hosts``): the store's history may reach further back than a host's own."""
    passed_on: dict[str, Any] = {k: args[k] for k in POINT_FILTERS if k in args}
    if "idle_for" in args and not fleet.window_checked:
        passed_on["idle_for"] = args["idle_for"]
    if "sort" in args:
        passed_on["sort"] = args["sort"]

    def claim(host: Host, n: int, include: tuple[str, ...]) -> Choice:
        lease = args.get("lease", DEFAULT_LEASE)
        # One deadline for the whole exchange: a host trickling its answer is cut at it.
        bounds = Bounds(timeout, CLAIM_ANSWER_BYTES)
        try:
            with bounds.enforced(f"no answer within {timeout:g} s (the claim's deadline)"):
                return choose_on_host(  # this job's mask names this host's cards, not host's
                    n, host.url, lease=lease, wait=None, owner=req.choose.owner,
                    timeout=timeout, include=include, ignore_mask=True, **passed_on,
                )  # fmt: skip
        except ServerError as exc:
            if exc.status == 400:
                raise ApiError(400, exc.code or "invalid_parameter", str(exc), exc.param) from None
            raise ClaimRefused(str(exc)) from None
        except GpuExporterError as exc:
            raise ClaimRefused(bounds.cut_because or str(exc)) from None
        except AnswerTooLarge as exc:
            raise ClaimRefused(str(exc)) from None

    return claim
