"""Choosing GPUs across hosts: Prometheus is the fleet view, each host's exporter the authority.

1. **Read the fleet** from the Prometheus HTTP API in a few instant queries, evaluated at one
   moment: the per-GPU series this choice needs (``gpu_up``, ``gpu_leased``, free memory,
   utilization, ``gpu_info`` …), the scrape time of every exporter
   (``timestamp(gpu_exporter_last_sample_timestamp_seconds)``), the targets that are down
   (``up == 0``) and, for ``idle_for``, the worst figure of the window from range functions
   (``max_over_time``, ``min_over_time``). Without Prometheus (or when it cannot be reached)
   the named ``hosts`` are asked directly for ``/gpus`` and ``/leases``.
2. **Rank** every host's GPUs with the same pure functions ``/choose`` uses
   (:func:`gpu_exporter.choose.rank.rank`): the candidates are built as the same
   :class:`~gpu_exporter.model.GpuSample` objects. By default all ``n`` GPUs must be on ONE
   host; hosts are ordered by their n-th best GPU (then the better ones), so a host whose
   weakest pick is best wins. ``spread`` lets the GPUs come from several hosts, filling the
   best host first.
3. **Claim** on the chosen host's own ``/choose`` with ``include=<the GPUs that qualified
   there>``, ``n`` and a lease; the host checks the point filters again on its own fresh
   sample and refuses if someone just took them. A refusal (taken, host down, stale,
   429) moves on to the next host.

Figures older than ``max_age`` (by Prometheus' own sample timestamps, and by the exporter's
``gpu_exporter_last_sample_timestamp_seconds``) are never used to hand out GPUs: such a host
is passed over with the reason.

A host's exporter URL is ``http://<instance>``, unless the scrape config sets the target label
``gpu_exporter_url`` (see docs/cluster.md). Its host name (``GPU_HOST``) is that URL's host.

Standard library only (no Flask), so the client and the command line can use it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shlex
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, Final

from gpu_exporter import client
from gpu_exporter.choose.params import (
    POINT_FILTERS,
    ApiError,
    ClusterRequest,
    parse_cluster_args,
)
from gpu_exporter.choose.rank import (
    Filters,
    NotEnoughGpus,
    SortKey,
    Window,
    rank,
    sort_key,
)
from gpu_exporter.model import GpuSample

log = logging.getLogger(__name__)

URL_LABEL: Final = "gpu_exporter_url"
DEFAULT_EXPORTER_PORT: Final = 9400
WAIT_POLL_SECONDS: Final = 5.0  # with wait=, how often the fleet is read again
PROMETHEUS_QUERY_PATH: Final = "/api/v1/query"

# Per-GPU series → GpuSample field, and how to read the value.
VALUE_METRICS: Final[Mapping[str, tuple[str, type]]] = {
    "gpu_memory_free_bytes": ("memory_free_bytes", int),
    "gpu_memory_total_bytes": ("memory_total_bytes", int),
    "gpu_utilization_ratio": ("utilization_ratio", float),
    "gpu_memory_utilization_ratio": ("memory_utilization_ratio", float),
    "gpu_compute_processes": ("compute_processes", int),
    "gpu_power_draw_watts": ("power_draw_watts", float),
    "gpu_power_limit_watts": ("power_limit_watts", float),
}
# idle_for: (the filter that needs it, the field, the range function giving the worst value).
WINDOW_FIELDS: Final = (
    ("min_free_bytes", "memory_free_bytes", "min_over_time", "gpu_memory_free_bytes"),
    ("max_util_ratio", "utilization_ratio", "max_over_time", "gpu_utilization_ratio"),
    (
        "max_mem_util_ratio",
        "memory_utilization_ratio",
        "max_over_time",
        "gpu_memory_utilization_ratio",
    ),
    ("max_procs", "compute_processes", "max_over_time", "gpu_compute_processes"),
)


# -- the fleet -------------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class Candidate:
    """A host that can serve the request, with its qualifying GPUs best first."""

    host: Host
    qualified: tuple[GpuSample, ...]
    key: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class FleetRanking:
    candidates: tuple[Candidate, ...]  # best first
    passed_over: tuple[tuple[Host, str], ...]  # hosts that cannot serve it, and why


def exporter_url(labels: Mapping[str, str]) -> str:
    """The exporter behind a series: its ``gpu_exporter_url`` label, else ``http://<instance>``.

    >>> exporter_url({"instance": "node1:9400"}), exporter_url(
    ...     {"instance": "node1", "gpu_exporter_url": "https://node1.lab:9443/"}
    ... )
    ('http://node1:9400', 'https://node1.lab:9443')
    """
    url = labels.get(URL_LABEL) or labels.get("instance", "")
    return base_url(url)


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


def needed_metrics(filters: Filters, sort: str) -> tuple[str, ...]:
    """The series a choice with these filters and this order needs — and no others.

    The answer for 10,000 GPUs is megabytes of JSON (bench/cluster.py), so every series
    left out counts: ``gpu_info`` (name, PCI bus id) only for ``model`` or a bus-id selector.
    """
    names = [
        "gpu_up",
        "gpu_leased",
        "gpu_memory_free_bytes",
        "gpu_utilization_ratio",
        "gpu_exporter_nvml_up",
        "gpu_exporter_last_sample_timestamp_seconds",
    ]
    by_bus_id = any(":" in sel for sel in (*filters.include, *filters.exclude))
    if filters.model is not None or by_bus_id:  # the name and PCI bus id are on gpu_info
        names.append("gpu_info")
    if filters.min_total_bytes is not None or sort == "free_ratio":
        names.append("gpu_memory_total_bytes")
    if filters.max_mem_util_ratio is not None:
        names.append("gpu_memory_utilization_ratio")
    if filters.max_procs is not None:
        names.append("gpu_compute_processes")
    if sort == "power":
        names += ["gpu_power_draw_watts", "gpu_power_limit_watts"]
    return tuple(names)


_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_SELECTOR = re.compile(rf"^(?:{_MATCHER}(?:,{_MATCHER})*)?$")


def check_selector(selector: str) -> str:
    """Label matchers that narrow the fleet, e.g. ``job="gpu-shared"``; raises ValueError.

    Only matchers, never other PromQL, so a selector cannot turn into another query.

    >>> check_selector('job="gpu-shared", rack=~"r1|r2"')
    'job="gpu-shared", rack=~"r1|r2"'
    >>> check_selector('job="x"} or vector(1')
    Traceback (most recent call last):
    ValueError: expected label matchers such as job="gpu-shared", got 'job="x"} or vector(1'
    """
    if not _SELECTOR.match(selector):
        raise ValueError(f'expected label matchers such as job="gpu-shared", got {selector!r}')
    return selector.strip()


def fleet_queries(
    filters: Filters, sort: str, idle_for_seconds: float | None, selector: str = ""
) -> dict[str, str]:
    """The instant queries that read the fleet, by name; ``selector`` narrows every one.

    >>> sorted(fleet_queries(Filters(), "free", None))
    ['down', 'scraped', 'values']
    >>> fleet_queries(Filters(), "free", None, 'job="shared"')["down"]
    'up{job="shared"} == 0'
    """
    sel = check_selector(selector)
    braces = f"{{{sel}}}" if sel else ""
    names = "|".join(needed_metrics(filters, sort))
    queries = {
        "values": f'{{__name__=~"{names}"{", " + sel if sel else ""}}}',
        "scraped": f"timestamp(gpu_exporter_last_sample_timestamp_seconds{braces})",
        "down": f"up{braces} == 0",
    }
    if idle_for_seconds:
        queries["window"] = window_query(filters, idle_for_seconds, sel)
    return queries


def window_query(filters: Filters, seconds: float, selector: str = "") -> str:
    """One query for every worst-of-window figure idle_for needs, told apart by ``fleet_field``.

    ``gpu_up`` (min: down at any point) and the oldest exporter sample in the window (how far
    back the history reaches) are always asked for.
    """
    rng = (f"{{{selector}}}" if selector else "") + f"[{max(1, math.ceil(seconds))}s]"
    parts = [
        ("up", f"min_over_time(gpu_up{rng})"),
        ("oldest", f"min_over_time(gpu_exporter_last_sample_timestamp_seconds{rng})"),
    ]
    for flt, name, func, metric in WINDOW_FIELDS:
        if getattr(filters, flt) is not None:
            parts.append((name, f"{func}({metric}{rng})"))
    return " or ".join(
        f'label_replace({expr}, "fleet_field", "{name}", "__name__", ".*")' for name, expr in parts
    )


def _value(sample: Mapping[str, Any]) -> float | None:
    """An instant vector sample's value; NaN (and anything unreadable) is absent."""
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _gpu_key(labels: Mapping[str, str]) -> str | None:
    uuid = labels.get("uuid")
    if not uuid or uuid.startswith("MIG-"):  # whole cards only
        return None
    return uuid


def parse_fleet(
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    evaluated_at: float,
    max_age_seconds: float,
    idle_for_seconds: float | None = None,
) -> Fleet:
    """Build every host's GPUs from the queries' result vectors (``data.result``).

    Pure: the same answers give the same fleet. A host is passed over (``problem``) when its
    target is down, NVML is down there, or its figures are older than ``max_age_seconds``
    (or of unknown age).
    """
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}  # url → uuid → fields
    per_host: dict[str, dict[str, Any]] = {}  # url → instance, nvml_up, sampled_at
    for sample in results.get("values", ()):
        labels = sample.get("metric", {})
        url = exporter_url(labels)
        host = per_host.setdefault(url, {"instance": labels.get("instance", url)})
        name = labels.get("__name__")
        value = _value(sample)
        if name == "gpu_exporter_nvml_up":
            host["nvml_up"] = value
            continue
        if name == "gpu_exporter_last_sample_timestamp_seconds":
            host["sampled_at"] = value
            continue
        uuid = _gpu_key(labels)
        if uuid is None or not labels.get("gpu", "").isdigit():
            continue
        gpu = per_gpu.setdefault(url, {}).setdefault(uuid, {"index": int(labels["gpu"])})
        if name == "gpu_up":
            gpu["up"] = value == 1
        elif name == "gpu_leased":
            gpu["leased"] = value == 1
        elif name == "gpu_info":
            gpu["name"] = labels.get("name")
            gpu["pci_bus_id"] = labels.get("pci_bus_id")
        elif name in VALUE_METRICS and value is not None:
            field_name, kind = VALUE_METRICS[name]
            gpu[field_name] = kind(value)

    scraped = {exporter_url(s.get("metric", {})): _value(s) for s in results.get("scraped", ())}
    window = _parse_window(results.get("window", ())) if idle_for_seconds else {}

    hosts: list[Host] = []
    for url, info in sorted(per_host.items()):
        gpus = tuple(
            sorted(
                (_sample(uuid, values) for uuid, values in per_gpu.get(url, {}).items()),
                key=lambda g: g.index,
            )
        )
        leased = tuple(u for u, v in per_gpu.get(url, {}).items() if v.get("leased"))
        scraped_at = scraped.get(url)
        age = None if scraped_at is None else max(0.0, evaluated_at - scraped_at)
        problem = _host_problem(info, scraped_at, age, max_age_seconds, bool(gpus))
        host_window = None
        if idle_for_seconds and problem is None:
            host_window = _host_window(
                window.get(url, {}), gpus, idle_for_seconds, evaluated_at, max_age_seconds
            )
        hosts.append(
            Host(
                url=url,
                instance=str(info["instance"]),
                gpus=gpus,
                leased=leased,
                problem=problem,
                window=host_window,
                age_seconds=age,
            )
        )
    # Targets whose last scrape failed: passed over even if series of theirs are still
    # around (Prometheus stale-marks them, but remote or federated data is not).
    jobs = {s.get("metric", {}).get("job") for s in results.get("values", ())}
    down = "target down: Prometheus' last scrape failed (up 0)"
    by_url = {h.url: i for i, h in enumerate(hosts)}
    for sample in results.get("down", ()):
        labels = sample.get("metric", {})
        if labels.get("job") not in jobs:
            continue  # not a gpu-exporter target
        url = exporter_url(labels)
        if url in by_url:
            hosts[by_url[url]] = replace(hosts[by_url[url]], problem=down, window=None)
            continue
        by_url[url] = len(hosts)
        hosts.append(Host(url=url, instance=labels.get("instance", url), problem=down))
    return Fleet(tuple(hosts), "prometheus", evaluated_at, window_checked=bool(idle_for_seconds))


def _sample(uuid: str, values: Mapping[str, Any]) -> GpuSample:
    up = values.get("up")
    known = {f.name for f in fields(GpuSample)} - {"index", "uuid", "up", "error"}
    if not up:
        return GpuSample(
            index=values["index"],
            uuid=uuid,
            up=False,
            name=values.get("name"),
            pci_bus_id=values.get("pci_bus_id"),
            error="gpu_up 0" if up is False else "no gpu_up series",
        )
    return GpuSample(
        index=values["index"],
        uuid=uuid,
        up=True,
        **{k: v for k, v in values.items() if k in known},
    )


def _host_problem(
    info: Mapping[str, Any],
    scraped_at: float | None,
    age: float | None,
    max_age_seconds: float,
    has_gpus: bool,
) -> str | None:
    if age is None:
        return "the age of its figures is unknown (no gpu_exporter_last_sample_timestamp_seconds)"
    if age > max_age_seconds:
        return f"figures are {age:.0f} s old (max_age {max_age_seconds:g} s)"
    if info.get("nvml_up") == 0:
        return "NVML is down there (gpu_exporter_nvml_up 0)"
    sampled_at = info.get("sampled_at")
    lag = None if sampled_at is None or scraped_at is None else scraped_at - sampled_at
    if lag is not None and lag > max_age_seconds:
        # The exporter's sampler is stuck (its clock and Prometheus' may differ a little;
        # max_age is meant to be far larger than that).
        return (
            f"its exporter's last sample was {lag:.0f} s old when scraped "
            f"(max_age {max_age_seconds:g} s)"
        )
    if not has_gpus:
        return "no GPUs"
    return None


def _parse_window(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[Any, Any]]:
    """url → {"oldest": t, (uuid, field): worst value}."""
    out: dict[str, dict[Any, Any]] = {}
    for sample in samples:
        labels = sample.get("metric", {})
        kind = labels.get("fleet_field")
        value = _value(sample)
        host = out.setdefault(exporter_url(labels), {})
        if kind == "oldest":
            if value is not None:
                host["oldest"] = min(value, host.get("oldest", value))
            continue
        uuid = _gpu_key(labels)
        if uuid is not None and kind is not None and value is not None:
            host[(uuid, kind)] = value
    return out


def _host_window(
    worst: Mapping[Any, Any],
    gpus: Sequence[GpuSample],
    seconds: float,
    evaluated_at: float,
    max_age_seconds: float,
) -> Window:
    """idle_for as a :class:`~gpu_exporter.choose.rank.Window`: each GPU's worst figures.

    The window's first sample comes at most one scrape after its start, so a history that
    reaches back to within ``max_age_seconds`` of the start counts as covering it.
    """
    oldest = worst.get("oldest")
    covered = 0.0 if oldest is None else evaluated_at - oldest + max_age_seconds
    past = []
    for gpu in gpus:
        if (gpu.uuid, "up") not in worst:
            continue  # no figures for this GPU in the window: window_reasons says so
        if worst[(gpu.uuid, "up")] < 1:
            past.append(replace(gpu, up=False, error="down"))
            continue
        changes: dict[str, Any] = {}
        for _, name, _, _ in WINDOW_FIELDS:
            if (gpu.uuid, name) in worst:
                value = worst[(gpu.uuid, name)]
                changes[name] = (
                    int(value) if name in ("memory_free_bytes", "compute_processes") else value
                )
        past.append(replace(gpu, **changes))
    return Window(seconds, covered, ((seconds, tuple(past)),), worst_case=True)


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
    for host in fleet.hosts:
        if host.problem is not None:
            passed.append((host, host.problem))
            continue
        held = "leased (at the last scrape)" if fleet.source == "prometheus" else "leased"
        leased = {u: held for u in host.leased}
        ranking = rank(host.gpus, filters, sort=sort, window=host.window, leased=leased)
        needed = 1 if spread else n
        if len(ranking.qualified) < needed:
            passed.append((host, str(NotEnoughGpus(needed, ranking))))
            continue
        keys: tuple[SortKey, ...]
        if spread:
            keys = (sort_key(ranking.qualified[0], sort),)
        else:  # the weakest of the n picks decides, then the stronger ones
            keys = tuple(sort_key(g, sort) for g in reversed(ranking.qualified[:n]))
        candidates.append(Candidate(host, ranking.qualified, (keys, host.url)))
    candidates.sort(key=lambda c: c.key)
    return FleetRanking(tuple(candidates), tuple(passed))


# -- reading the fleet -----------------------------------------------------------------------


class SourceUnavailable(Exception):
    """Prometheus (or a host) could not be asked: unreachable, an error, or nonsense."""


Fetch = Callable[[str, float], Any]
"""GET a URL with a timeout and return its decoded JSON; raises :class:`SourceUnavailable`."""


def http_get_json(url: str, timeout: float) -> Any:
    """The default :data:`Fetch`: urllib, never through a proxy for loopback addresses."""
    split = urllib.parse.urlsplit(url)
    handlers: list[urllib.request.BaseHandler] = []
    if client.is_loopback(split.hostname):
        handlers.append(urllib.request.ProxyHandler({}))
    opener = urllib.request.build_opener(*handlers)
    req = urllib.request.Request(
        url, headers={"Accept": "application/json", "User-Agent": "gpu-exporter-cluster"}
    )
    try:
        with opener.open(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode("utf-8", "replace")
        exc.close()
        raise SourceUnavailable(f"HTTP {exc.code} from {split.netloc}: {detail}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceUnavailable(f"cannot reach {split.netloc}: {reason}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise SourceUnavailable(f"{split.netloc} did not answer JSON") from None


def query_prometheus(
    prometheus: str, queries: Mapping[str, str], at: float, *, fetch: Fetch, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Run the instant queries (concurrently), all evaluated at Unix time ``at``."""
    base = base_url(prometheus)

    def one(expr: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        doc = fetch(f"{base}{PROMETHEUS_QUERY_PATH}?{params}", timeout)
        if not isinstance(doc, dict) or doc.get("status") != "success":
            error = doc.get("error") if isinstance(doc, dict) else None
            raise SourceUnavailable(f"Prometheus refused {expr!r}: {error or doc!r}"[:500])
        data = doc.get("data") or {}
        if data.get("resultType") != "vector":
            raise SourceUnavailable(f"Prometheus answered {expr!r} with no instant vector")
        result: list[dict[str, Any]] = data.get("result") or []
        return result

    with ThreadPoolExecutor(max_workers=len(queries)) as pool:
        futures = {name: pool.submit(one, expr) for name, expr in queries.items()}
        return {name: future.result() for name, future in futures.items()}


def read_prometheus(
    prometheus: str,
    req: ClusterRequest,
    *,
    fetch: Fetch = http_get_json,
    timeout: float,
    now: float,
    selector: str = "",
) -> Fleet:
    c = req.choose
    queries = fleet_queries(c.filters, c.sort, c.idle_for_seconds, selector)
    results = query_prometheus(prometheus, queries, now, fetch=fetch, timeout=timeout)
    fleet = parse_fleet(
        results,
        evaluated_at=now,
        max_age_seconds=req.max_age_seconds,
        idle_for_seconds=c.idle_for_seconds,
    )
    if not fleet.hosts:
        raise SourceUnavailable(
            f"Prometheus at {base_url(prometheus)} has no gpu-exporter series"
            + (f" matching {selector}" if selector else "")
            + " (is it scraping the exporters?)"
        )
    return fleet


def read_hosts(
    hosts: Sequence[str],
    req: ClusterRequest,
    *,
    fetch: Fetch = http_get_json,
    timeout: float,
    now: float,
) -> Fleet:
    """The fleet from each named exporter's ``/gpus`` and ``/leases`` (asked concurrently)."""

    def one(name: str) -> Host:
        url = base_url(name, DEFAULT_EXPORTER_PORT)
        try:
            snapshot = fetch(url + "/gpus", timeout)
            held = fetch(url + "/leases", timeout)
            return host_from_snapshot(url, name, snapshot, held, req.max_age_seconds)
        except SourceUnavailable as exc:
            return Host(url=url, instance=name, problem=str(exc))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return Host(url=url, instance=name, problem=f"unexpected /gpus answer: {exc}")

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts)))) as pool:
        found = tuple(pool.map(one, hosts))
    return Fleet(found, "hosts", now)


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


# -- claiming --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterChoice:
    """Where the GPUs are: one :class:`~gpu_exporter.client.Choice` per host (one without
    ``spread``), each with ``host`` set and its lease held by that host's exporter."""

    placements: tuple[client.Choice, ...]
    source: str  # "prometheus", or "hosts" when the named hosts were asked directly
    passed_over: tuple[tuple[str, str, str], ...] = ()  # (host, url, reason)
    notes: tuple[str, ...] = ()  # e.g. "Prometheus unreachable; asked the hosts"
    spread: bool = False
    n: int = 1
    evaluated_at: float | None = None

    def text(self, fmt: str) -> str:
        """``uuid``: ``HOST GPU-a,GPU-b`` per host; ``index``: ``HOST 0,1``; ``env``: one
        ``export GPU_HOST=… GPU_EXPORTER_URL=… CUDA_VISIBLE_DEVICES=… GPU_LEASE=…`` line."""
        if fmt == "env":
            if len(self.placements) != 1:
                raise ValueError("format env names one host")
            env = self.placements[0].env()
            return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "\n"
        if fmt == "json":
            return json.dumps(self.to_json()) + "\n"
        lines = []
        for choice in self.placements:
            gpus = choice.uuids if fmt == "uuid" else tuple(str(i) for i in choice.indices)
            lines.append(f"{choice.host} {','.join(gpus)}\n")
        return "".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "spread": self.spread,
            "source": self.source,
            "evaluated_at": self.evaluated_at,
            "placements": [
                {
                    "host": c.host,
                    "url": c.url,
                    "uuids": list(c.uuids),
                    "indices": list(c.indices),
                    "lease": _lease_json(c.lease),
                    "chosen": list(c.details.get("chosen", ())),
                }
                for c in self.placements
            ],
            "passed_over": [
                {"host": host, "url": url, "reason": reason}
                for host, url, reason in self.passed_over
            ],
            "notes": list(self.notes),
        }


def _lease_json(lease: client.Lease | None) -> dict[str, Any] | None:
    if lease is None:
        return None
    return {
        "id": lease.id,
        "gpus": list(lease.gpus),
        "created_at": lease.created_at,
        "expires_at": lease.expires_at,
        "owner": lease.owner,
    }


Claim = Callable[[Host, int, tuple[str, ...]], client.Choice]
"""Claim ``n`` of these UUIDs on the host; raises :class:`~gpu_exporter.client.GpuExporterError`."""


def http_claimer(
    args: Mapping[str, str], req: ClusterRequest, fleet: Fleet, timeout: float
) -> Claim:
    """Claims through the host's own ``/choose``, re-checking the point filters there.

    ``idle_for`` goes to the host only when the fleet could not judge it (``--hosts``):
    Prometheus' history may reach further back than a host's own.
    """
    passed_on = {k: args[k] for k in POINT_FILTERS if k in args}
    if "idle_for" in args and not fleet.window_checked:
        passed_on["idle_for"] = args["idle_for"]
    if "sort" in args:
        passed_on["sort"] = args["sort"]

    def claim(host: Host, n: int, include: tuple[str, ...]) -> client.Choice:
        return client.choose(
            n,
            host.url,
            lease=args.get("lease", client.DEFAULT_LEASE),
            owner=req.choose.owner,
            timeout=timeout,
            include=include,
            **passed_on,
        )

    return claim


def place(
    ranking: FleetRanking, n: int, *, spread: bool, claim: Claim
) -> tuple[list[client.Choice], list[tuple[Host, str]]]:
    """Claim down the ranking until ``n`` GPUs are held; refusals move on to the next host.

    Returns the claims (empty unless all ``n`` were had: partial spread claims are released)
    and every host passed over with why.
    """
    passed = list(ranking.passed_over)
    placements: list[client.Choice] = []
    need = n
    for candidate in ranking.candidates:
        take = need if not spread else min(need, len(candidate.qualified))
        include = tuple(g.uuid for g in candidate.qualified)
        try:
            choice = claim(candidate.host, take, include)
        except client.ServerError as exc:
            if exc.status == 400:
                raise ApiError(400, exc.code or "invalid_parameter", str(exc), exc.param) from None
            passed.append((candidate.host, f"refused: {exc}"))
            continue
        except client.GpuExporterError as exc:
            passed.append((candidate.host, f"refused: {exc}"))
            continue
        placements.append(replace(choice, host=candidate.host.name))
        need -= len(choice.uuids)
        if need <= 0:
            return placements, passed
    for choice in placements:  # spread: not enough in all; give back what was taken
        try:
            client.release(choice)
        except client.GpuExporterError as exc:
            log.warning("could not release lease %s (it expires by itself): %s", choice, exc)
    return [], passed


def choose_fleet(
    args: Mapping[str, str],
    *,
    prometheus: str | None = None,
    hosts: Sequence[str] = (),
    selector: str = "",
    timeout: float = client.DEFAULT_TIMEOUT_SECONDS,
    fetch: Fetch = http_get_json,
    claimer: Callable[[Mapping[str, str], ClusterRequest, Fleet, float], Claim] = http_claimer,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ClusterChoice:
    """Choose and claim GPUs across the fleet; ``args`` are ``/cluster/choose``'s parameters.

    Reads the fleet from ``prometheus`` (only the targets ``selector`` matches, e.g.
    ``job="gpu-shared"``); if it cannot be asked (or knows no exporter) and ``hosts`` are
    named, from those hosts directly. Raises :class:`ApiError`: 400 for bad
    parameters, 503 ``not_enough_gpus`` (with every host's reason) or
    ``prometheus_unavailable``.
    """
    req = parse_cluster_args(args)
    if not prometheus and not hosts:
        raise ApiError(400, "invalid_parameter", "name a Prometheus or hosts to choose among")
    try:
        check_selector(selector)
    except ValueError as exc:
        raise ApiError(400, "invalid_parameter", str(exc), "selector") from None
    deadline = monotonic() + req.choose.wait_seconds
    while True:
        now = wall_clock()
        notes: list[str] = []
        fleet: Fleet | None = None
        if prometheus:
            try:
                fleet = read_prometheus(
                    prometheus, req, fetch=fetch, timeout=timeout, now=now, selector=selector
                )
            except SourceUnavailable as exc:
                if not hosts:
                    raise ApiError(503, "prometheus_unavailable", str(exc)) from None
                notes.append(f"{exc}; asked the hosts named instead")
        if fleet is None:
            fleet = read_hosts(hosts, req, fetch=fetch, timeout=timeout, now=now)
        c = req.choose
        ranking = rank_fleet(fleet, c.n, c.filters, sort=c.sort, spread=req.spread)
        claim = claimer(args, req, fleet, timeout)
        placements, passed = place(ranking, c.n, spread=req.spread, claim=claim)
        passed_over = tuple((h.name, h.url, why) for h, why in passed)
        if placements:
            return ClusterChoice(
                tuple(placements),
                fleet.source,
                passed_over,
                tuple(notes),
                spread=req.spread,
                n=c.n,
                evaluated_at=fleet.evaluated_at,
            )
        remaining = deadline - monotonic()
        if remaining <= 0:
            where = "on one host" if not req.spread else "in the fleet"
            details = "; ".join(f"{url}: {why}" for _, url, why in passed_over)
            message = f"no {c.n} GPUs qualify {where} ({len(fleet.hosts)} hosts"
            message += f"; {details})" if details else ")"
            raise ApiError(503, "not_enough_gpus", " ".join([*notes, message]))
        sleep(min(remaining, WAIT_POLL_SECONDS))


@dataclass(frozen=True, slots=True)
class ClusterService:
    """What ``GET /cluster/choose`` runs on an exporter started with ``--prometheus-url``."""

    prometheus: str
    selector: str = ""  # label matchers narrowing the fleet (--prometheus-selector)
    timeout: float = client.DEFAULT_TIMEOUT_SECONDS

    def choose(self, args: Mapping[str, str]) -> ClusterChoice:
        return choose_fleet(
            args, prometheus=self.prometheus, selector=self.selector, timeout=self.timeout
        )
