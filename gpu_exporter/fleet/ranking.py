"""Hosts ordered by what they can serve (pure), each host's GPUs through the same
:func:`gpu_exporter.choose.rank.rank` ``/choose`` uses.

By default all ``n`` GPUs must be on ONE host; hosts are ordered by their n-th best GPU (then
the better ones), so a host whose weakest pick is best wins. ``spread`` lets the GPUs come
from several hosts, filling the best host first. A host with a problem is passed over with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.rank import NotEnoughGpus, Ranking, how_many_qualify, rank, sort_key
from gpu_exporter.fleet.inventory import Fleet, Host
from gpu_exporter.model import GpuSample
from gpu_exporter.units import plural

SHORT_REASONS: Final = 3  # a host's shortfall names this many rejected GPUs, then counts the rest


@dataclass(frozen=True, slots=True)
class Candidate:
    """A host that can serve the request, with its qualifying GPUs best first."""

    host: Host
    qualified: tuple[GpuSample, ...]
    key: tuple[Any, ...]
    # How many qualify there and why not the others: formatted only when a spread refusal
    # shows it, not for each of a large fleet's candidates.
    why_not_others: Callable[[], str] = str

    @property
    def shortfall(self) -> str:
        return self.why_not_others()


@dataclass(frozen=True, slots=True)
class FleetRanking:
    candidates: tuple[Candidate, ...]  # best first
    passed_over: tuple[tuple[Host, str], ...]  # hosts that cannot serve it, and why


def rank_fleet(
    fleet: Fleet, n: int, filters: Filters, *, sort: str = "free", spread: bool = False
) -> FleetRanking:
    """Hosts that can serve ``n`` GPUs (any host with one, with ``spread``), best first; a GPU
    a lease held at the last scrape is passed over like a leased one on the host."""
    candidates: list[Candidate] = []
    passed: list[tuple[Host, str]] = []
    held = "leased (at the last scrape)" if fleet.source == "prometheus" else "leased"
    needed = 1 if spread else n
    may_pass = _quick_pass(filters)
    for host in fleet.hosts:
        if host.problem is not None:
            passed.append((host, host.problem))
            continue
        if fleet.filtered:  # every GPU passed the store's filters: only order them
            if len(host.gpus) < needed:
                passed.append((host, passing(len(host.gpus), needed)))
                continue
            qualified = tuple(sorted(host.gpus, key=partial(sort_key, sort=sort)))
            why: Callable[[], str] = partial(passing, len(qualified), 0)
        else:
            leased = {u: held for u in host.leased} | dict(host.allocated)
            ranked = partial(rank, filters=filters, sort=sort, window=host.window, leased=leased)
            # The GPUs that surely fail are left out first: formatting why costs a third of
            # ranking; every GPU is ranked again only for a message that shows it.
            maybe = list(filter(may_pass, host.gpus)) if filters.mig == "deny" else host.gpus
            qualified = ranked(maybe).qualified
            why = partial(_shortfall, ranked, host.gpus)
            if len(qualified) < needed:  # every rejected GPU's reasons
                passed.append((host, str(NotEnoughGpus(needed, ranked(host.gpus)))))
                continue
        # The weakest of the n picks decides, then the stronger ones (spread: the best).
        picks = qualified[:1] if spread else tuple(reversed(qualified[:n]))
        key = (tuple(sort_key(g, sort) for g in picks), host.url)
        candidates.append(Candidate(host, qualified, key, why))
    candidates.sort(key=lambda c: c.key)
    return FleetRanking(tuple(candidates), tuple(passed))


def _quick_pass(f: Filters) -> Callable[[GpuSample], bool]:
    """False only where the filters surely reject the GPU (down, or a known figure past a
    limit), without formatting why."""
    limits = [
        (
            b.limit.compared,
            b.limit.fallback.field if b.limit.fallback else "",
            b.value,
            not b.limit.most,
        )
        for b in f.limits
    ]

    def may_pass(gpu: GpuSample) -> bool:
        for field, fallback, limit, low in limits:
            x = getattr(gpu, field)
            if x is None and fallback:  # SM activity: utilization on a card without GPM
                x = getattr(gpu, fallback)
            if x is not None and (x < limit if low else x > limit):
                return False
        return gpu.up

    return may_pass


Ranked = Callable[[Sequence[GpuSample]], Ranking]


def _shortfall(ranked: Ranked, gpus: Sequence[GpuSample]) -> str:
    return shortfall(ranked(gpus))


def shortfall(ranking: Ranking) -> str:
    """How many GPUs qualify on a host and why the first few others do not, in one clause."""
    rejected = ranking.rejected
    why = [f"gpu {r.gpu.index}: {', '.join(r.reasons)}" for r in rejected[:SHORT_REASONS]]
    if len(rejected) > SHORT_REASONS:
        why.append(f"{len(rejected) - SHORT_REASONS} more")
    return how_many_qualify(ranking) + (f" ({'; '.join(why)})" if why else "")


def passing(qualifying: int, needed: int) -> str:
    """What a host of a packed read had (the store names no rejected GPU).

    >>> passing(0, 2), passing(1, 2)
    ('no GPU passes the filters there', '1 GPU passes the filters, 2 requested')
    """
    if not qualifying:
        return "no GPU passes the filters there"
    verb = "passes" if qualifying == 1 else "pass"
    return f"{plural(qualifying, 'GPU')} {verb} the filters" + (
        f", {needed} requested" if needed else ""
    )
