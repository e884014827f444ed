"""The fleet as data (pure): every host as the store or its own exporter showed it, its GPUs
as the :class:`~gpu_exporter.model.GpuSample` objects ``/choose`` ranks, or why it is not used.

A host's exporter URL is ``http://<instance>``, unless the scrape config sets the target label
``gpu_exporter_url`` (docs/cluster.md); its host name (``GPU_HOST``) is that URL's host.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from gpu_exporter.choose.filters import Window
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.model import READING_NAMES, GpuSample
from gpu_exporter.outbound import base_url, is_http

URL_LABEL: Final = "gpu_exporter_url"
TARGET_DOWN: Final = "target down: Prometheus' last scrape failed (up 0)"


@dataclass(frozen=True, slots=True)
class Host:
    """One exporter as the fleet's reader saw it."""

    url: str  # the exporter's base URL: where claims go
    instance: str  # the target's instance label (or the host as named in --hosts)
    gpus: tuple[GpuSample, ...] = ()
    leased: tuple[str, ...] = ()  # UUIDs a lease held when the figures were taken
    problem: str | None = None  # why this host is not used at all
    window: Window | None = None  # idle_for, from the store's range functions
    age_seconds: float | None = None  # how old its figures are
    # (UUID, why) for cards the kubelet allocated to pods (gpu_pod_info): never handed out
    allocated: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """The host name of the exporter's URL: what ``GPU_HOST`` says."""
        return urllib.parse.urlsplit(self.url).hostname or self.instance


@dataclass(frozen=True, slots=True)
class Fleet:
    hosts: tuple[Host, ...]
    source: str  # "prometheus" or "hosts"
    evaluated_at: float  # Unix time the figures describe
    window_checked: bool = False  # idle_for was judged from the fleet's history
    # The packed read: each host holds only the GPUs that passed the request's filters in
    # the store, so ranking orders them and filters nothing.
    filtered: bool = False


def exporter_url(labels: Mapping[str, str]) -> str:
    """The exporter behind a series: its ``gpu_exporter_url`` label, else ``http://<instance>``.

    >>> exporter_url({"instance": "node1:9400"}), exporter_url(
    ...     {"instance": "node1", "gpu_exporter_url": "https://node1.lab:9443/"}
    ... )
    ('http://node1:9400', 'https://node1.lab:9443')
    """
    return base_url(labels.get(URL_LABEL) or labels.get("instance", ""))


def check_sources(prometheus: str | None, hosts: Sequence[str]) -> None:
    """Refuse (400) a Prometheus or host that is not an http:// or https:// address.

    >>> check_sources("prom:9090", ["a", "b:9401", "https://c"])
    >>> check_sources(None, ["ftp://a"])
    Traceback (most recent call last):
    ...
    gpu_exporter.choose.refusal.ApiError: ftp://a: not an http:// or https:// URL
    """
    named = [("prometheus", prometheus)] if prometheus else []
    for param, where in [*named, *(("hosts", h) for h in hosts)]:
        if not is_http(base_url(where)):
            message = f"{where}: not an http:// or https:// URL"
            raise ApiError(400, "invalid_parameter", message, param)


def host_labels(urls: Sequence[str], default_port: int) -> dict[str, str]:
    """How to name each exporter in output: its host name, with the port when it is not
    ``default_port`` or when another exporter shares the host name (``a:9400``, ``a:9401``).

    >>> host_labels(["http://a:9400", "http://b:9401"], 9400)
    {'http://a:9400': 'a', 'http://b:9401': 'b:9401'}
    >>> list(host_labels(["http://a:9400", "http://a:9401"], 9400).values())
    ['a:9400', 'a:9401']
    """
    split = {url: urllib.parse.urlsplit(url) for url in urls}
    names = Counter(s.hostname for s in split.values())
    labels = {}
    for url, s in split.items():
        plain = s.port in (None, default_port) and names[s.hostname] == 1
        labels[url] = (s.hostname or url) if plain else s.netloc.rpartition("@")[2]
    return labels


def host_problem(
    nvml_up: float | None, lag: float | None, age: float | None, max_age_seconds: float
) -> str | None:
    """Why a host's figures cannot be used (``lag``: how old the exporter's last sample was
    when the store scraped it), or None."""
    if age is None:
        return "the age of its figures is unknown (no gpu_exporter_last_sample_timestamp_seconds)"
    if age > max_age_seconds:
        return f"figures are {age:.0f} s old (max_age {max_age_seconds:g} s)"
    if nvml_up == 0:
        return "NVML is down there (gpu_exporter_nvml_up 0)"
    if lag is not None and lag > max_age_seconds:
        # A stuck sampler (its clock and the store's may differ a little; max_age is meant
        # to be far larger than that).
        return (
            f"its exporter's last sample was {lag:.0f} s old when scraped "
            f"(max_age {max_age_seconds:g} s)"
        )
    return None


def host_from_snapshot(
    url: str, name: str, snapshot: Any, held: Any, max_age_seconds: float
) -> Host:
    """A :class:`Host` from an exporter's ``/gpus`` and ``/leases`` answers."""
    known = {f.name for f in fields(GpuSample)} | set(READING_NAMES)
    gpus = tuple(
        GpuSample.from_values(**{k: v for k, v in g.items() if k in known})
        for g in snapshot["gpus"]
        if not str(g.get("uuid", "")).startswith("MIG-")
    )
    leased = tuple(u for lease in held.get("leases", ()) for u in lease.get("gpus", ()))
    age = snapshot.get("snapshot_age_seconds")
    problem = None
    if not snapshot.get("nvml_up"):
        problem = f"NVML is down there: {snapshot.get('nvml_error')}"
    elif age is None or age > max_age_seconds:
        problem = f"its last sample is {age} s old (max_age {max_age_seconds:g} s)"
    elif not gpus:
        problem = "no GPUs"
    return Host(url, name, gpus, leased, problem, age_seconds=age)
