"""The front door: :func:`choose` GPUs from one exporter or across a fleet, :func:`choose_cluster`.

One exporter is :mod:`gpu_exporter.client.hostapi`'s, a fleet :mod:`gpu_exporter.client.fleet`'s;
both answer with the same :class:`~gpu_exporter.client.hostapi.Choice`, so a job script need
not care which it asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

from gpu_exporter.choose.params import ApiError
from gpu_exporter.client.fleet import ClusterChoice, choose_fleet
from gpu_exporter.client.hostapi import DEFAULT_LEASE, Choice, choose_host
from gpu_exporter.client.query import Duration, FilterValue, choose_params, format_duration
from gpu_exporter.client.transport import (
    DEFAULT_TIMEOUT_SECONDS,
    GpuExporterWarning,
    NoGpusAvailable,
    ServerError,
)


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
    fleet_rule_prefix: str | None = None,
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
            fleet_rule_prefix=fleet_rule_prefix,
            timeout=timeout,
            filters=filters,
            stacklevel=3,
        )
        return fleet.placements[0]
    return choose_host(n, url, lease=lease, wait=wait, owner=owner, timeout=timeout, **filters)


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
    fleet_rule_prefix: str | None = None,
    **filters: FilterValue,
) -> ClusterChoice:
    """Choose and lease ``n`` GPUs across hosts, reading the fleet from Prometheus.

    The figures come from ``prometheus`` (its HTTP API); if it cannot be asked and ``hosts``
    are named (``"node1,node2:9401"`` or a list), those exporters are asked directly, with a
    :class:`GpuExporterWarning`. All ``n`` GPUs come from one host unless ``spread``; each
    host's own exporter grants the lease. ``max_age`` (default 60 s): figures older than this
    are never used. ``selector`` (label matchers, ``'job="gpu-shared"'``) narrows the fleet
    Prometheus shows to those targets. ``fleet_rule_prefix`` (``"gpu_fleet"``) reads the
    recorded fleet view of deploy/prometheus/gpu-exporter.fleet.rules.yml where the store has
    it (one query), the raw series otherwise. Filters as for :func:`choose`.

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
        fleet_rule_prefix=fleet_rule_prefix,
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
    fleet_rule_prefix: str | None = None,
) -> ClusterChoice:
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
            prometheus=prometheus,
            hosts=host_list,
            selector=selector or "",
            rule_prefix=fleet_rule_prefix or "",
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
