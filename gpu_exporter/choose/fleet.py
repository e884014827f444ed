"""The fleet as data, and its ranking: pure, no I/O (the client reads the fleet and claims).

A fleet is every host's GPUs as the same :class:`~gpu_exporter.model.GpuSample` objects
``/choose`` ranks, built from Prometheus' answers (:func:`gpu_exporter.choose.promql.parse_fleet`)
or, without Prometheus, from each exporter's own ``/gpus`` and ``/leases``
(:func:`host_from_snapshot`). :func:`rank_fleet` then puts every host's GPUs through the same
pure functions ``/choose`` uses (:func:`gpu_exporter.choose.rank.rank`). By default all ``n``
GPUs must be on ONE host; hosts are ordered by their n-th best GPU (then the better ones), so a
host whose weakest pick is best wins. ``spread`` lets the GPUs come from several hosts, filling
the best host first.

A host whose figures are older than ``max_age`` is never used to hand out GPUs: it is passed
over with the reason (its :attr:`Host.problem`). Reading the fleet and claiming GPUs on the
chosen host are :mod:`gpu_exporter.client.fleet`'s.
"""

from __future__ import annotations

import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from gpu_exporter.choose.filters import Filters, Window
from gpu_exporter.choose.params import ApiError
from gpu_exporter.choose.rank import (
    NotEnoughGpus,
    Ranking,
    SortKey,
    how_many_qualify,
    rank,
    sort_key,
)
from gpu_exporter.model import GpuSample
from gpu_exporter.units import plural

SHORT_REASONS = 3  # a host's shortfall names this many rejected GPUs, then counts the rest


@dataclass(frozen=True, slots=True)
class Host:
    """One exporter as the fleet view saw it."""

    url: str  # the exporter's base URL: where claims go
    instance: str  # the target's instance label (or the host as named in --hosts)
    gpus: tuple[GpuSample, ...] = ()
    leased: tuple[str, ...] = ()  # UUIDs a lease held when the figures were taken
    problem: str | None = None  # why this host is not used at all
    window: Window | None = None  # idle_for, from Prometheus' range functions
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
    # The store kept only the GPUs that pass the request's filters (choose.fleetsieve): each
    # host holds its qualifying GPUs only, so ranking orders them and filters nothing.
    sieved: bool = False


@dataclass(frozen=True, slots=True)
class Candidate:
    """A host that can serve the request, with its qualifying GPUs best first."""

    host: Host
    qualified: tuple[GpuSample, ...]
    key: tuple[Any, ...]
    # How many qualify there and why not the others (shortened): formatted only when asked
    # (a spread refusal), not for each of a large fleet's candidates.
    why_not_others: Callable[[], str] = str

    @property
    def shortfall(self) -> str:
        return self.why_not_others()


@dataclass(frozen=True, slots=True)
class FleetRanking:
    candidates: tuple[Candidate, ...]  # best first
    passed_over: tuple[tuple[Host, str], ...]  # hosts that cannot serve it, and why


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


def check_sources(prometheus: str | None, hosts: Sequence[str]) -> None:
    """Refuse (400) a Prometheus or host that is not an http:// or https:// address.

    >>> check_sources("prom:9090", ["a", "b:9401", "https://c"])
    >>> check_sources(None, ["ftp://a"])
    Traceback (most recent call last):
    ...
    gpu_exporter.choose.params.ApiError: ftp://a: not an http:// or https:// URL
    """
    named = [("prometheus", prometheus)] if prometheus else []
    for param, where in [*named, *(("hosts", h) for h in hosts)]:
        if urllib.parse.urlsplit(base_url(where)).scheme.lower() not in ("http", "https"):
            message = f"{where}: not an http:// or https:// URL"
            raise ApiError(400, "invalid_parameter", message, param)


# -- ranking ---------------------------------------------------------------------------------


def rank_fleet(
    fleet: Fleet, n: int, filters: Filters, *, sort: str = "free", spread: bool = False
) -> FleetRanking:
    """Hosts that can serve ``n`` GPUs (any host with one, with ``spread``), best first.

    Each host's GPUs go through :func:`gpu_exporter.choose.rank.rank` exactly as ``/choose`` ranks
    them; a GPU a lease held at the last scrape is passed over like a leased one there.
    """
    candidates: list[Candidate] = []
    passed: list[tuple[Host, str]] = []
    held = "leased (at the last scrape)" if fleet.source == "prometheus" else "leased"
    needed = 1 if spread else n
    if fleet.sieved:  # the store applied the filters; the figures left are for ordering only
        filters = Filters(mig=filters.mig)
    for host in fleet.hosts:
        if host.problem is not None:
            passed.append((host, host.problem))
            continue
        if fleet.sieved and len(host.gpus) < needed:  # skip ranking what cannot serve
            passed.append((host, sieved_shortfall(len(host.gpus), needed)))
            continue
        leased = {u: held for u in host.leased}
        leased.update(host.allocated)
        ranked = partial(rank, filters=filters, sort=sort, window=host.window, leased=leased)
        qualified: tuple[GpuSample, ...]
        if fleet.sieved and filters.mig != "only" and not leased and host.window is None:
            # Every GPU passed the store's filters: rank() would reject none, only order them
            # (by index, then by key), which is a third of ranking 100,000 GPUs.
            qualified = tuple(sorted(host.gpus, key=partial(sort_key, sort=sort)))
        else:
            # The GPUs that surely fail are left out first: formatting why would cost a third
            # of ranking 100,000 GPUs (bench/cluster.py), and only a host passed over shows it.
            maybe = (
                host.gpus
                if filters.mig != "deny"
                else [g for g in host.gpus if _may_pass(g, filters)]
            )
            qualified = ranked(maybe).qualified
        if len(qualified) < needed:
            passed.append((host, str(NotEnoughGpus(needed, ranked(host.gpus)))))
            continue
        keys: tuple[SortKey, ...]
        if spread:
            keys = (sort_key(qualified[0], sort),)
        else:  # the weakest of the n picks decides, then the stronger ones
            keys = tuple(sort_key(g, sort) for g in reversed(qualified[:n]))
        why = (
            partial(sieved_shortfall, len(qualified), 0)
            if fleet.sieved
            else partial(_shortfall_of, ranked, host.gpus)
        )
        candidates.append(Candidate(host, qualified, (keys, host.url), why))
    candidates.sort(key=lambda c: c.key)
    return FleetRanking(tuple(candidates), tuple(passed))


def _may_pass(gpu: GpuSample, filters: Filters) -> bool:
    """False only where :func:`~gpu_exporter.choose.filters.rejection_reasons` surely rejects
    the GPU (down, or a known figure past a limit), without formatting why; the GPUs left are
    ranked as ever."""
    if not gpu.up:
        return False
    free, util, procs = gpu.memory_free_bytes, gpu.utilization_ratio, gpu.compute_processes
    mem, f = gpu.memory_utilization_ratio, filters
    return not (
        (f.min_free_bytes is not None and free is not None and free < f.min_free_bytes)
        or (f.max_util_ratio is not None and util is not None and util > f.max_util_ratio)
        or (f.max_procs is not None and procs is not None and procs > f.max_procs)
        or (f.max_mem_util_ratio is not None and mem is not None and mem > f.max_mem_util_ratio)
    )


def _shortfall_of(
    ranked: Callable[[Sequence[GpuSample]], Ranking], gpus: Sequence[GpuSample]
) -> str:
    return shortfall(ranked(gpus))


def shortfall(ranking: Ranking) -> str:
    """How many GPUs qualify on a host and why the first few others do not, in one short
    clause: a fleet's "not enough" message names every host this way."""
    rejected = ranking.rejected
    why = [f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in rejected[:SHORT_REASONS]]
    if len(rejected) > SHORT_REASONS:
        why.append(f"{len(rejected) - SHORT_REASONS} more")
    return how_many_qualify(ranking) + (f" ({'; '.join(why)})" if why else "")


def sieved_shortfall(qualifying: int, needed: int) -> str:
    """What a sieved host had (the store names no rejected GPU).

    >>> sieved_shortfall(0, 2), sieved_shortfall(1, 2)
    ('no GPU passes the filters there', '1 GPU passes the filters, 2 requested')
    """
    if not qualifying:
        return "no GPU passes the filters there"
    verb = "passes" if qualifying == 1 else "pass"
    text = f"{plural(qualifying, 'GPU')} {verb} the filters"
    return text + (f", {needed} requested" if needed else "")


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


def host_from_snapshot(
    url: str, name: str, snapshot: Any, held: Any, max_age_seconds: float
) -> Host:
    """A :class:`Host` from an exporter's ``/gpus`` and ``/leases`` answers."""
    known = {f.name for f in fields(GpuSample)}
    gpus = tuple(
        GpuSample(**{k: v for k, v in g.items() if k in known})
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
