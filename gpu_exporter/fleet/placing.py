"""The claim loop across hosts: read the fleet, rank it, claim on the best host, and again
every few seconds with ``wait``.

The store is the fleet's view, each host's exporter the authority: the claim asks the chosen
host's ``/choose`` for ``n`` of the GPUs that qualified there, re-checked on its own fresh
sample; a refusal (taken meanwhile, down, stale, 429) moves on to the next host. How a claim
and a release are sent is the caller's (the client's HTTP calls): this room imports no client.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import ClusterRequest, parse_cluster_args
from gpu_exporter.fleet.inventory import Fleet, Host, check_sources, host_labels
from gpu_exporter.fleet.queries import check_selector
from gpu_exporter.fleet.ranking import FleetRanking, rank_fleet
from gpu_exporter.fleet.reading import (
    DEFAULT_EXPORTER_PORT,
    Check,
    Fetch,
    PrometheusReader,
    SourceUnavailable,
    get_json,
    read_hosts,
)
from gpu_exporter.units import plural

if TYPE_CHECKING:  # the client's answer type; this room never imports the client at run time
    from gpu_exporter.client.hostapi import Choice

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS: Final = 5.0  # with wait=, how often the fleet is read again


class ClaimRefused(Exception):
    """The host did not grant the claim (taken meanwhile, down, stale, 429): try the next."""


# Claim n of these UUIDs on the host; raises ClaimRefused (or ApiError 400, a bad parameter).
Claim = Callable[[Host, int, tuple[str, ...]], "Choice"]
# The Claim for one request: its args, the parsed request, the fleet read, a timeout.
Claimer = Callable[[Mapping[str, str], ClusterRequest, Fleet, float], Claim]
Release = Callable[["Choice"], None]  # give a claim back (spread short of n)


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
        """``uuid``: ``HOST GPU-a,GPU-b`` per host; ``index``: ``HOST 0,1``; ``list``: one
        ``HOST GPU-a`` a line; ``env``: one ``export GPU_HOST=… CUDA_VISIBLE_DEVICES=…`` line."""
        if fmt == "env":
            if len(self.placements) != 1:
                raise ValueError("format env names one host")
            env = self.placements[0].env()
            return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "\n"
        if fmt == "json":
            return json.dumps(self.to_json()) + "\n"
        labels = host_labels([c.url for c in self.placements], DEFAULT_EXPORTER_PORT)
        if fmt == "list":
            return "".join(f"{labels[c.url]} {u}\n" for c in self.placements for u in c.uuids)
        lines = []
        for choice in self.placements:
            gpus = choice.uuids if fmt == "uuid" else tuple(str(i) for i in choice.indices)
            lines.append(f"{labels[choice.url]} {','.join(gpus)}\n")
        return "".join(lines)

    def to_json(self) -> dict[str, Any]:
        def lease(c: Choice) -> dict[str, Any] | None:
            if c.lease is None:
                return None
            keys = ("id", "gpus", "created_at", "expires_at", "owner", "token")
            return {k: getattr(c.lease, k) for k in keys} | {"gpus": list(c.lease.gpus)}

        return {
            "n": self.n,
            "spread": self.spread,
            "source": self.source,
            "evaluated_at": self.evaluated_at,
            "placements": [  # the lease with its token: to the claimant only, as /choose's
                {
                    "host": c.host,
                    "url": c.url,
                    "uuids": list(c.uuids),
                    "indices": list(c.indices),
                    "lease": lease(c),
                    "chosen": list(c.details.get("chosen", ())),
                }
                for c in self.placements
            ],
            "passed_over": [{"host": h, "url": u, "reason": r} for h, u, r in self.passed_over],
            "notes": list(self.notes),
            "filters": dict(self.filters),
        }


def place(
    ranking: FleetRanking, n: int, *, spread: bool, claim: Claim, release: Release
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
        try:
            choice = claim(candidate.host, take, tuple(g.uuid for g in candidate.qualified))
        except ClaimRefused as exc:
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
        except Exception as exc:
            log.warning("could not release lease %s (it expires by itself): %s", choice, exc)
    return [], claimed_on + passed


def choose_fleet(
    args: Mapping[str, str],
    *,
    claimer: Claimer,
    release: Release,
    prometheus: str | PrometheusReader | None = None,
    hosts: Sequence[str] = (),
    selector: str = "",
    timeout: float = 10.0,
    fetch: Fetch = get_json,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    defaults: Mapping[str, str] = SHIPPED_DEFAULTS,
    check: Check | None = None,
) -> ClusterChoice:
    """Choose and claim GPUs across the fleet; ``args`` are ``/cluster/choose``'s parameters.

    Reads the fleet from ``prometheus`` (a URL, narrowed by ``selector``, or a
    :class:`PrometheusReader` the caller keeps); if it cannot be asked and ``hosts`` are named,
    from those hosts directly. ``defaults`` are the filters applied where ``args`` gives none;
    the chosen host applies its own again. ``check`` is asked while the store is read and
    may raise to give the choice up (its client left). Raises :class:`ApiError`: 400 for bad
    parameters, 503 ``not_enough_gpus`` (with every host's reason) or
    ``prometheus_unavailable`` (the store unreachable, refusing, too slow or too large).
    """
    watch: Check = check if check is not None else (lambda: None)
    req = parse_cluster_args(args, defaults=defaults)
    reader = prometheus
    if isinstance(prometheus, str) or prometheus is None:
        if not prometheus and not hosts:
            raise ApiError(400, "invalid_parameter", "name a Prometheus or hosts to choose among")
        try:
            check_selector(selector)
        except ValueError as exc:
            raise ApiError(400, "invalid_parameter", str(exc), "selector") from None
        reader = PrometheusReader(prometheus, selector, fetch, timeout) if prometheus else None
    assert not isinstance(reader, str)
    check_sources(reader.url if reader else None, hosts)
    c = req.choose
    deadline = monotonic() + c.wait_seconds
    while True:
        now = wall_clock()
        notes: list[str] = []
        fleet: Fleet | None = None
        if reader is not None:
            try:
                fleet = reader.read(req, now, watch)
            except SourceUnavailable as exc:
                if not hosts:
                    raise ApiError(503, "prometheus_unavailable", str(exc)) from None
                notes.append(f"{exc}; asked the hosts named instead")
        if fleet is None:
            fleet = read_hosts(hosts, req, fetch=fetch, timeout=timeout, now=now, check=watch)
        ranking = rank_fleet(fleet, c.n, c.filters, sort=c.sort, spread=req.spread)
        claim = claimer(args, req, fleet, timeout)
        placements, passed = place(ranking, c.n, spread=req.spread, claim=claim, release=release)
        passed_over = tuple((h.name, h.url, why) for h, why in passed)
        if placements:
            found = (tuple(placements), fleet.source, passed_over, tuple(notes), req.spread, c.n)
            return ClusterChoice(*found, fleet.evaluated_at, c.filters_json())
        remaining = deadline - monotonic()
        if remaining <= 0:
            where = "on one host" if not req.spread else "in the fleet"
            details = "; ".join(f"{url}: {why}" for _, url, why in passed_over)
            gpus = "no GPU qualifies" if c.n == 1 else f"no {c.n} GPUs qualify"
            message = f"{gpus} {where} ({plural(len(fleet.hosts), 'host')}"
            message += f"; {details})" if details else ")"
            if fleet.filtered and reader is not None:  # the store named no GPU's reasons
                message += "; " + reader.reasons(req, now, watch)
            raise ApiError(503, "not_enough_gpus", " ".join([*notes, message]))
        sleep(min(remaining, WAIT_POLL_SECONDS))
