"""Choosing GPUs across hosts, the I/O half: read the fleet, then claim on the chosen host.

Prometheus is the fleet view, each host's exporter the authority:

1. **Read the fleet** (:mod:`gpu_exporter.client.fleetread`) from the Prometheus HTTP API
   (:func:`read_prometheus`; any store that speaks it, VictoriaMetrics included), or, without
   Prometheus (or when it cannot be reached), from the named ``hosts``' own ``/gpus`` and
   ``/leases`` (:func:`read_hosts`).
2. **Rank** with :func:`gpu_exporter.choose.fleet.rank_fleet`: pure, the same functions
   ``/choose`` ranks with.
3. **Claim** on the chosen host's own ``/choose`` (:func:`http_claimer`, :func:`place`) with
   ``include=<the GPUs that qualified there>``, ``n`` and a lease; the host checks the point
   filters again on its own fresh sample and refuses if someone just took them. A refusal
   (taken, host down, stale, 429) moves on to the next host.

:func:`choose_fleet` runs the three, again every few seconds with ``wait``; its clocks, its
sleep, how it fetches and how it claims are parameters, so the server's ``/cluster/choose``
(:mod:`gpu_exporter.web.cluster`) and the tests supply their own. Every request goes through
:mod:`gpu_exporter.client.transport` (standard library only, no Flask).
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.fleet import (
    Fleet,
    FleetRanking,
    Host,
    check_sources,
    host_labels,
    rank_fleet,
)
from gpu_exporter.choose.fleetview import check_prefix
from gpu_exporter.choose.params import POINT_FILTERS, ApiError
from gpu_exporter.choose.promql import check_selector
from gpu_exporter.choose.request import ClusterRequest, parse_cluster_args
from gpu_exporter.client.fleetread import (  # re-exported: where callers have found them
    DEFAULT_EXPORTER_PORT,
    Fetch,
    SourceUnavailable,
    gc_paused,
    http_get_json,
    read_hosts,
    read_prometheus,
    refusal_counts,
)
from gpu_exporter.client.hostapi import DEFAULT_LEASE, Choice, LeaseInfo, choose_host, release
from gpu_exporter.client.transport import DEFAULT_TIMEOUT_SECONDS, GpuExporterError, ServerError
from gpu_exporter.units import plural

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS: Final = 5.0  # with wait=, how often the fleet is read again


# -- claiming --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterChoice:
    """Where the GPUs are: one :class:`~gpu_exporter.Choice` per host (one without
    ``spread``), each with ``host`` set and its lease held by that host's exporter."""

    placements: tuple[Choice, ...]
    source: str  # "prometheus", or "hosts" when the named hosts were asked directly
    passed_over: tuple[tuple[str, str, str], ...] = ()  # (host, url, reason)
    notes: tuple[str, ...] = ()  # e.g. "Prometheus unreachable; asked the hosts"
    spread: bool = False
    n: int = 1
    evaluated_at: float | None = None
    filters: Mapping[str, Any] = field(default_factory=dict)  # applied, and where from

    def text(self, fmt: str) -> str:
        """``uuid``: ``HOST GPU-a,GPU-b`` per host; ``index``: ``HOST 0,1``; ``env``: one
        ``export GPU_HOST=… GPU_EXPORTER_URL=… CUDA_VISIBLE_DEVICES=… GPU_LEASE=…`` line.
        HOST has the port where needed (:func:`~gpu_exporter.choose.fleet.host_labels`)."""
        if fmt == "env":
            if len(self.placements) != 1:
                raise ValueError("format env names one host")
            env = self.placements[0].env()
            return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "\n"
        if fmt == "json":
            return json.dumps(self.to_json()) + "\n"
        labels = host_labels([c.url for c in self.placements], DEFAULT_EXPORTER_PORT)
        if fmt == "list":  # one GPU per line: 'HOST GPU-a'
            return "".join(f"{labels[c.url]} {u}\n" for c in self.placements for u in c.uuids)
        lines = []
        for choice in self.placements:
            gpus = choice.uuids if fmt == "uuid" else tuple(str(i) for i in choice.indices)
            lines.append(f"{labels[choice.url]} {','.join(gpus)}\n")
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
            "filters": dict(self.filters),
        }


def _lease_json(lease: LeaseInfo | None) -> dict[str, Any] | None:
    if lease is None:
        return None
    return {
        "id": lease.id,
        "gpus": list(lease.gpus),
        "created_at": lease.created_at,
        "expires_at": lease.expires_at,
        "owner": lease.owner,
        "token": lease.token,  # to the claimant only, as /choose's own answer
    }


Claim = Callable[[Host, int, tuple[str, ...]], Choice]
"""Claim ``n`` of these UUIDs on the host; raises :class:`~gpu_exporter.GpuExporterError`."""


def http_claimer(
    args: Mapping[str, str],
    req: ClusterRequest,
    fleet: Fleet,
    timeout: float,
    *,
    choose_on_host: Callable[..., Choice] = choose_host,
) -> Claim:
    """Claims through the host's own ``/choose`` (``choose_on_host``), re-checking the point
    filters there.

    ``idle_for`` goes to the host only when the fleet could not judge it (``--hosts``):
    Prometheus' history may reach further back than a host's own.
    """
    passed_on = {k: args[k] for k in POINT_FILTERS if k in args}
    if "idle_for" in args and not fleet.window_checked:
        passed_on["idle_for"] = args["idle_for"]
    if "sort" in args:
        passed_on["sort"] = args["sort"]

    def claim(host: Host, n: int, include: tuple[str, ...]) -> Choice:
        return choose_on_host(
            n,
            host.url,
            lease=args.get("lease", DEFAULT_LEASE),
            wait=None,
            owner=req.choose.owner,
            timeout=timeout,
            include=include,
            **passed_on,
        )

    return claim


def place(
    ranking: FleetRanking, n: int, *, spread: bool, claim: Claim
) -> tuple[list[Choice], list[tuple[Host, str]]]:
    """Claim down the ranking until ``n`` GPUs are held; refusals move on to the next host.

    Returns the claims (empty unless all ``n`` were had: partial spread claims are released)
    and every host passed over with why (with ``spread``, how many qualified on each).
    """
    passed = list(ranking.passed_over)
    placements: list[Choice] = []
    claimed_on: list[tuple[Host, str]] = []
    need = n
    for candidate in ranking.candidates:
        take = need if not spread else min(need, len(candidate.qualified))
        include = tuple(g.uuid for g in candidate.qualified)
        try:
            choice = claim(candidate.host, take, include)
        except ServerError as exc:
            if exc.status == 400:
                raise ApiError(400, exc.code or "invalid_parameter", str(exc), exc.param) from None
            passed.append((candidate.host, f"refused: {exc}"))
            continue
        except GpuExporterError as exc:
            passed.append((candidate.host, f"refused: {exc}"))
            continue
        placements.append(replace(choice, host=candidate.host.name))
        claimed_on.append((candidate.host, candidate.shortfall))
        need -= len(choice.uuids)
        if need <= 0:
            return placements, passed
    for choice in placements:  # spread: not enough in all; give back what was taken
        try:
            release(choice)
        except GpuExporterError as exc:
            log.warning("could not release lease %s (it expires by itself): %s", choice, exc)
    return [], claimed_on + passed


def choose_fleet(
    args: Mapping[str, str],
    *,
    prometheus: str | None = None,
    hosts: Sequence[str] = (),
    selector: str = "",
    rule_prefix: str = "",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    fetch: Fetch = http_get_json,
    claimer: Callable[[Mapping[str, str], ClusterRequest, Fleet, float], Claim] = http_claimer,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    defaults: Mapping[str, str] = SHIPPED_DEFAULTS,
    sieve: bool | None = None,
) -> ClusterChoice:
    """Choose and claim GPUs across the fleet; ``args`` are ``/cluster/choose``'s parameters.

    Reads the fleet from ``prometheus`` (only the targets ``selector`` matches, e.g.
    ``job="gpu-shared"``; with ``rule_prefix``, from its recorded fleet view where it has
    one); if it cannot be asked (or knows no exporter) and ``hosts`` are
    named, from those hosts directly. ``defaults`` are the filters applied where ``args`` gives
    none (:mod:`gpu_exporter.choose.defaults`); only those ``args`` gives go to the chosen host,
    which applies its own defaults again. Raises :class:`ApiError`: 400 for bad
    parameters, 503 ``not_enough_gpus`` (with every host's reason) or
    ``prometheus_unavailable``. ``sieve``: whether the store filters the GPUs
    (:func:`~gpu_exporter.client.fleetread.read_prometheus`; None: past a fleet size).
    """
    req = parse_cluster_args(args, defaults=defaults)
    if not prometheus and not hosts:
        raise ApiError(400, "invalid_parameter", "name a Prometheus or hosts to choose among")
    check_sources(prometheus, hosts)
    try:
        check_selector(selector)
    except ValueError as exc:
        raise ApiError(400, "invalid_parameter", str(exc), "selector") from None
    if rule_prefix:
        try:
            check_prefix(rule_prefix)
        except ValueError as exc:
            raise ApiError(400, "invalid_parameter", str(exc), "fleet_rule_prefix") from None
    deadline = monotonic() + req.choose.wait_seconds
    while True:
        now = wall_clock()
        notes: list[str] = []
        # Reading and ranking make millions of short-lived objects at 100,000 GPUs, with no
        # cycles: the cyclic GC would walk them again and again (fleetread.gc_paused).
        with gc_paused():
            fleet: Fleet | None = None
            if prometheus:
                try:
                    fleet = read_prometheus(
                        prometheus,
                        req,
                        fetch=fetch,
                        timeout=timeout,
                        now=now,
                        selector=selector,
                        rule_prefix=rule_prefix,
                        sieve=sieve,
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
                filters=c.filters_json(),
            )
        remaining = deadline - monotonic()
        if remaining <= 0:
            where = "on one host" if not req.spread else "in the fleet"
            details = "; ".join(f"{url}: {why}" for _, url, why in passed_over)
            gpus = "no GPU qualifies" if c.n == 1 else f"no {c.n} GPUs qualify"
            message = f"{gpus} {where} ({plural(len(fleet.hosts), 'host')}"
            message += f"; {details})" if details else ")"
            if fleet.sieved and prometheus:  # the store named no GPU's reasons: count them
                where_from = {"selector": selector, "rule_prefix": rule_prefix}
                message += "; " + refusal_counts(
                    prometheus, req, fetch=fetch, timeout=timeout, now=now, **where_from
                )
            raise ApiError(503, "not_enough_gpus", " ".join([*notes, message]))
        sleep(min(remaining, WAIT_POLL_SECONDS))
