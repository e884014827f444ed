"""Reading the fleet: from Prometheus' query API (or any store that speaks it), or the hosts.

:func:`read_prometheus` runs the instant queries of
:func:`gpu_exporter.choose.promql.fleet_queries` (or, with a rule prefix, the one query of the
recorded view, :mod:`gpu_exporter.choose.fleetview`), all evaluated at one moment and asked
concurrently; :func:`read_hosts` asks each named exporter's ``/gpus`` and ``/leases``. Both
return a :class:`~gpu_exporter.choose.fleet.Fleet`; the choosing and claiming are
:mod:`gpu_exporter.client.fleet`'s.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from gpu_exporter.choose.fleet import Fleet, Host, base_url, host_from_snapshot
from gpu_exporter.choose.fleetpacked import (
    RECORDED_LAG_ABOVE,
    packable,
    packed_query,
    presence_query,
    recorded_problems_query,
)
from gpu_exporter.choose.fleetpacked import unpack as unpack_packed
from gpu_exporter.choose.fleetsieve import (
    DETAIL_UP_TO_HOSTS,
    Names,
    hosts_query,
    parse_sieve,
    problems_query,
    reasons_query,
    reasons_text,
    sievable,
    sieve_query,
)
from gpu_exporter.choose.fleetsieve import unpack as unpack_sieve
from gpu_exporter.choose.fleetview import from_view, view_query
from gpu_exporter.choose.promql import fleet_queries, parse_fleet, window_query
from gpu_exporter.choose.request import ClusterRequest
from gpu_exporter.client.transport import GpuExporterError, ServerUnreachable, send

log = logging.getLogger(__name__)

DEFAULT_EXPORTER_PORT: Final = 9400
PROMETHEUS_QUERY_PATH: Final = "/api/v1/query"
USER_AGENT: Final = "gpu-exporter-cluster"


class SourceUnavailable(Exception):
    """Prometheus (or a host) could not be asked: unreachable, an error, or nonsense."""


Fetch = Callable[[str, float], Any]
"""GET a URL with a timeout and return its decoded JSON; raises :class:`SourceUnavailable`."""


def http_get_json(url: str, timeout: float) -> Any:
    """The default :data:`Fetch`, through :func:`~gpu_exporter.client.transport.send`.

    No exporter credentials: Prometheus is not an exporter, and a host's ``/gpus`` needs none.
    """
    where = urllib.parse.urlsplit(url).netloc
    try:
        resp = send("GET", url, timeout=timeout, credentials=False, user_agent=USER_AGENT)
    except ServerUnreachable as exc:
        raise SourceUnavailable(f"cannot reach {where}: {exc.reason}") from None
    except (ValueError, GpuExporterError) as exc:  # not a URL urllib can ask, not HTTP(S)
        raise SourceUnavailable(f"cannot ask {where or url}: {exc}") from None
    if resp.status >= 400:
        detail = resp.body[:300].decode("utf-8", "replace")
        raise SourceUnavailable(f"HTTP {resp.status} from {where}: {detail}")
    try:
        return json.loads(resp.body)
    except ValueError:
        raise SourceUnavailable(f"{where} did not answer JSON") from None


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


_gc_lock = threading.Lock()
_gc_readers = 0  # reads in progress that paused the cyclic garbage collector
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a fleet's answers are decoded and parsed.

    At 100,000 GPUs they are millions of short-lived dicts and lists with no cycles, and each
    collection walks them all again: about 40 % of the chooser's CPU (bench/cluster.py
    --store). Reads that overlap share one pause; the last one out restores what it was.
    """
    global _gc_readers, _gc_was_enabled
    with _gc_lock:
        if _gc_readers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_readers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_readers -= 1
            if _gc_readers == 0 and _gc_was_enabled:
                gc.enable()


def read_prometheus(
    prometheus: str,
    req: ClusterRequest,
    *,
    fetch: Fetch = http_get_json,
    timeout: float,
    now: float,
    selector: str = "",
    rule_prefix: str = "",
    sieve: bool | None = None,
) -> Fleet:
    """The fleet from Prometheus (or any store with its query API).

    First every exporter's scrape time (which sizes the fleet); then, for a fleet of more
    than :data:`~gpu_exporter.choose.fleetsieve.DETAIL_UP_TO_HOSTS` exporters (``sieve``:
    True always, False never), only the GPUs that pass the request's filters
    (:mod:`gpu_exporter.choose.fleetsieve`), else every series. With ``rule_prefix``, from
    the recorded view (:mod:`gpu_exporter.choose.fleetview`), and only the GPUs that pass
    from the one packed series per GPU (:mod:`gpu_exporter.choose.fleetpacked`) where the
    request fits its packing; where the view or the packed series are absent (the rules are
    not loaded there), from the raw series as without it.
    """
    with gc_paused():
        return _read_prometheus(prometheus, req, fetch, timeout, now, selector, rule_prefix, sieve)


# (store, selector, rule prefix) whose last read found more than DETAIL_UP_TO_HOSTS exporters:
# a long-running chooser (/cluster/choose, a Python process) then reads the packed series
# together with the scrape times instead of after them.
_LARGE_FLEETS: set[tuple[str, str, str]] = set()


def _read_prometheus(
    prometheus: str,
    req: ClusterRequest,
    fetch: Fetch,
    timeout: float,
    now: float,
    selector: str,
    rule_prefix: str,
    sieve: bool | None,
) -> Fleet:
    c = req.choose

    def ask(queries: Mapping[str, str]) -> dict[str, list[dict[str, Any]]]:
        return query_prometheus(prometheus, queries, now, fetch=fetch, timeout=timeout)

    where = (base_url(prometheus), selector, rule_prefix)
    packing = bool(rule_prefix) and packable(c.filters, c.sort, c.idle_for_seconds)
    if packing and (sieve or (sieve is None and where in _LARGE_FLEETS)):
        view = Names(rule_prefix, selector)
        read = ask({"hosts": hosts_query(view), **_packed_queries(rule_prefix, view, req)})
        large = sieve or len(read["hosts"]) > DETAIL_UP_TO_HOSTS
        if not large:  # it shrank: every series again, for every GPU's reasons
            _LARGE_FLEETS.discard(where)
        elif read["hosts"] and _has_packed(ask, read, rule_prefix, selector):
            return _sieved(read, req, now, unpack_packed)
    names, hosts = Names("", selector), None
    if rule_prefix:
        view = Names(rule_prefix, selector)
        hosts = ask({"hosts": hosts_query(view)})["hosts"]
        if hosts:
            names = view
        else:
            log.info("no %s:host series at %s: reading the raw series", rule_prefix, prometheus)
    if not names.prefix:
        hosts = ask({"hosts": hosts_query(names)})["hosts"]
    assert hosts is not None
    if sieve is None:
        sieve = len(hosts) > DETAIL_UP_TO_HOSTS
        if sieve and len(_LARGE_FLEETS) < 64:
            _LARGE_FLEETS.add(where)
        elif not sieve:
            _LARGE_FLEETS.discard(where)
    if sieve and sievable(c.filters, c.sort, c.idle_for_seconds):
        answers: dict[str, list[dict[str, Any]]] | None = None
        if packing:  # one recorded series per GPU (fleetpacked): the store reads one metric
            answers = ask(_packed_queries(rule_prefix, names, req))
            if not _has_packed(ask, answers, rule_prefix, selector):
                log.info("no %s:packed series at %s: the sieve", rule_prefix, prometheus)
                answers = None
        if answers is None:
            problems = problems_query(names, req.max_age_seconds)
            answers = ask({"sieve": sieve_query(names, c.filters), "problems": problems})
            fleet = _sieved({**answers, "hosts": hosts}, req, now, unpack_sieve)
        else:
            fleet = _sieved({**answers, "hosts": hosts}, req, now, unpack_packed)
    else:
        fleet = _read_every_series(ask, req, names, hosts, now, selector)
    if not fleet.hosts:
        raise SourceUnavailable(
            f"Prometheus at {base_url(prometheus)} has no gpu-exporter series"
            + (f" matching {selector}" if selector else "")
            + " (is it scraping the exporters? VictoriaMetrics shows samples only after its "
            "-search.latencyOffset, 30 s by default)"
        )
    return fleet


def _packed_queries(prefix: str, names: Names, req: ClusterRequest) -> dict[str, str]:
    """The packed series' read and the exporters' problems (recorded by the same rule group
    where ``max_age`` allows: the few exporters with one, not four series per exporter)."""
    if req.max_age_seconds >= RECORDED_LAG_ABOVE:
        problems = recorded_problems_query(prefix, names.selector, req.max_age_seconds)
    else:
        problems = problems_query(names, req.max_age_seconds)
    return {"sieve": packed_query(prefix, req.choose.filters, names), "problems": problems}


def _has_packed(
    ask: Callable[[Mapping[str, str]], dict[str, list[dict[str, Any]]]],
    answers: Mapping[str, Any],
    prefix: str,
    selector: str,
) -> bool:
    """Whether the packed series answered: an empty answer may be no GPU passing."""
    return bool(answers["sieve"] or ask({"n": presence_query(prefix, selector)})["n"])


def _sieved(
    answers: Mapping[str, Any],
    req: ClusterRequest,
    now: float,
    unpack: Callable[[float], tuple[int, float]],
) -> Fleet:
    return parse_sieve(
        answers, evaluated_at=now, max_age_seconds=req.max_age_seconds, unpack=unpack
    )


def _read_every_series(
    ask: Callable[[Mapping[str, str]], dict[str, list[dict[str, Any]]]],
    req: ClusterRequest,
    names: Names,
    hosts: list[dict[str, Any]],
    now: float,
    selector: str,
) -> Fleet:
    """Every series this choice needs, per GPU: the detail behind every GPU's reasons."""
    c = req.choose
    results = None
    if names.prefix:
        queries = {"view": view_query(names.prefix, c.filters, c.sort, selector)}
        if c.idle_for_seconds:
            queries["window"] = window_query(c.filters, c.idle_for_seconds, selector)
        answers = ask(queries)
        if answers["view"]:
            results = {**from_view(answers["view"]), "window": answers.get("window", [])}
        else:
            log.info("no %s:gpu series: reading the raw series", names.prefix)
            hosts = ask({"hosts": hosts_query(Names("", selector))})["hosts"]
    if results is None:
        queries = fleet_queries(c.filters, c.sort, c.idle_for_seconds, selector)
        del queries["scraped"]  # read first
        results = {**ask(queries), "scraped": hosts}
    return parse_fleet(
        results,
        evaluated_at=now,
        max_age_seconds=req.max_age_seconds,
        idle_for_seconds=c.idle_for_seconds,
    )


def refusal_counts(
    prometheus: str,
    req: ClusterRequest,
    *,
    fetch: Fetch = http_get_json,
    timeout: float,
    now: float,
    selector: str = "",
    rule_prefix: str = "",
) -> str:
    """Why no host could serve a sieved fleet: how many GPUs fail each filter (one query)."""
    answer: list[dict[str, Any]] = []
    for prefix in dict.fromkeys((rule_prefix, "")):  # the raw series where the view has none
        query = {"reasons": reasons_query(Names(prefix, selector), req.choose.filters)}
        try:
            answers = query_prometheus(prometheus, query, now, fetch=fetch, timeout=timeout)
            answer = answers["reasons"]
        except SourceUnavailable as exc:
            return f"the store did not count the reasons: {exc}"
        if answer:
            break
    return reasons_text(answer, req.choose.filters)


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
